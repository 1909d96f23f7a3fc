"""Contribution norms of an analysed window: recording the values during the analysis forward and the
properties of :class:`attnlab.hf.analysis.pipeline.WindowResult` built on them (``value_norms``,
``contribution_mass``, ``layer_contribution_norms``, the contribution rows of ``table()``).

Recompute mode runs the model's own forward once: every variant's contributions use its values.
Swap mode runs one forward per variant: each variant has its own values (later layers change too).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from attnlab import contributions
from attnlab.hf.capture.values import record_values, value_paths, window_summaries
from attnlab.hf.compute import lazy_weights
from attnlab.normalizers.checks import scalar

__all__ = ["check_flag", "recording", "value_norms", "contribution_mass", "layer_norms", "with_contributions"]


def check_flag(flag, loaded) -> bool:
    """``contributions`` as a bool; True fails now (a worded UnsupportedModelError) for a model whose
    value path attnlab cannot read."""
    if not isinstance(flag, bool):
        raise ValueError(f"contributions must be True or False, got {flag!r}")
    if flag:
        with loaded.lock:  # a model of no known naming scheme is traced once: a forward of its own
            value_paths(loaded.model)
    return flag


class _Record:
    def __init__(self, forwards=None, paths=None, variants=(), mode="recompute"):
        self.forwards, self.paths, self.variants, self.mode = forwards, paths, variants, mode

    def values(self):
        if self.forwards is None:
            return None
        return window_summaries(self.forwards, self.paths, self.variants, self.mode)


@contextlib.contextmanager
def recording(stream) -> Iterator[_Record]:
    """Record the values of the forwards in the block when ``stream.contributions``."""
    if not stream.contributions:
        yield _Record()
        return
    loaded = stream.loaded
    with loaded.lock:  # no other thread's forward (nor the trace of value_paths)
        paths = getattr(stream, "_value_paths", None)
        if paths is None:  # once per stream: the output projections' per-head Gram matrices
            paths = stream._value_paths = value_paths(loaded.model)
        with record_values(loaded.model, paths) as forwards:
            yield _Record(forwards, paths, stream.variants, stream.mode)


def _values(w) -> dict:
    if w.values is None:
        raise ValueError("this window has no value vectors: analyse with contributions=True "
                         "(hf.analyze(..., contributions=True) or attnlab analyze --contributions)")
    return w.values


def value_norms(w) -> torch.Tensor:
    """(L, H, N) value norms; in swap mode only when a single variant was analysed."""
    values = _values(w)
    distinct = {id(s): s for s in values.values()}
    if len(distinct) != 1:
        raise ValueError("in swap mode each variant runs its own forward and has its own value norms: "
                         "use .values[variant].norms (or .contribution_mass[variant])")
    return next(iter(distinct.values())).norms


def contribution_mass(w) -> dict[str, torch.Tensor]:
    values = _values(w)
    # c_j = m_j ||f(x_j)|| on a streamed window (no lazy variant computed to find out)
    if any(getattr(wt, "streamed_window", False) for wt in lazy_weights.stored(w.weights)):
        return {v: m * values[v].norms.to(m.dtype) for v, m in w.column_masses().items()}
    return {v: contributions.contribution_mass(wt, values[v].norms) for v, wt in w.weights.items()}


def layer_norms(w, variant: str, layer: int) -> torch.Tensor:
    values = _values(w)
    if variant not in w.weights:
        raise ValueError(f"variant must be one of the analysed variants {list(w.weights)}, got {variant!r}")
    L = w.weights[variant].shape[0]
    layer = scalar(layer)  # numpy and 0-d tensor numbers as Python ones
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < L:
        raise ValueError(f"layer must be an integer in [0, {L - 1}], got {layer!r}")
    return contributions.layer_contribution_norms(w.weights[variant][layer], values[variant].gram(layer))


def with_contributions(w, kwargs: dict, frame):
    """``frame`` (the window's tidy table) with the contribution statistics appended, when recorded."""
    if w.values is None:
        return frame
    import pandas as pd

    extra = contributions.contribution_table(
        w.weights, {v: s.norms for v, s in w.values.items()}, eps=kwargs.get("eps", 0.01),
        eps_relative=kwargs.get("eps_relative", 0.1), window=w.index,
    )
    return pd.concat([frame, extra], ignore_index=True)
