"""One unmasked window of a bidirectional model whose variants are partly in the fused analysis and partly
not (softmax1, sparsemax, a plugin variant without an ``hf_kernel``): each part on its own path, so one
variant without a slot no longer sends every variant down the materialized path.

- the fused variants: their row sums from the fused analysis (in the capture forward when the
  kernel runs there, attnlab/hf/compute/fused_forward.py), their weights on first access
  (attnlab/hf/compute/lazy_weights.py) -- exactly as when they are analysed alone;
- the other variants: their row sums streamed over tiles with their reference functions
  (attnlab/hf/compute/streamed.py, ``stream_sums(..., wanted=...)``; unas' tiles as the Jensen-Shannon
  reference), never a layer's (H, N, N) at once; their weights on first access, computed by the
  generic path's own call (``attention_weights`` on the captured scores), so with today's values.

The result is one :class:`~attnlab.hf.compute.lazy_weights.LazyWeights` over every variant, in the
order asked for, and the row sums in that order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from attnlab.hf.compute import streamed
from attnlab.hf.compute.lazy_weights import LazyWeights
from attnlab.hf.compute.tiles import LayerInputs

__all__ = ["split_window"]


def split_window(variants: Sequence[str], plan: Mapping[str, str], layers: Callable[[], list[LayerInputs]],
                 params: Mapping[str, Mapping[str, Any]], specials: Sequence[torch.Tensor] | None,
                 fused: Callable[[], tuple[LazyWeights, dict | None]],
                 materialize: Callable[[tuple[str, ...]], dict[str, torch.Tensor]]
                 ) -> tuple[LazyWeights, dict | None]:
    """(weights {variant: (L, 1, H, N, N)} computed on first access, row sums by variant or None).

    Args:
        variants: every variant, in the order of the result.
        plan: variant -> its slot in the fused analysis, for the variants that have one (may be empty).
        layers: the window's :class:`LayerInputs` (B = 1), built on first use.
        params: checked parameters per variant.
        specials: S bool (N,) key masks of the statistics; None: no row sums (weights alone).
        fused: -> (the fused variants' LazyWeights, their row sums keyed by variant or None); called
            once, when ``plan`` is not empty.
        materialize: (names) -> {name: (L, 1, H, N, N)} the other variants' weights, by the generic
            path's call.
    """
    extras = tuple(v for v in variants if v not in plan)
    fused_weights, fused_sums = fused() if plan else ({}, {})
    sums = None
    if specials is not None:
        ref = ("unas",) if "unas" in variants else ()  # the js reference, streamed with the extras
        streamed_sums = streamed.stream_sums(layers(), [*ref, *(v for v in extras if v not in ref)], params,
                                             specials, wanted=extras)
        if fused_sums is not None:
            sums = {v: fused_sums[v] if v in plan else streamed_sums[v] for v in variants}

    def compute(names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        out = {n: fused_weights[n] for n in names if n in plan}
        rest = tuple(n for n in names if n not in plan)
        if rest:
            out.update(materialize(rest))
        return out

    return LazyWeights(variants, compute), sums
