"""The streamed analysis of one masked window (causal, sliding-window, softcapped, grouped-query, padded):
every variant's row sums for the statistics over the tiles of attnlab/hf/compute/tiles.py, the causal
layers through attnlab's kernel (attnlab/hf/compute/causal_kernel.py), never a layer's (H, N, N)
weights (docs/ANALYSIS.md §8); the sink statistics' sums the same way; :class:`StreamedWindow`, what a
window's weights on access and later passes are computed from.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch

from attnlab.hf.compute.causal_kernel import causal_kernel, kernel_layer, kernel_slots
from attnlab.hf.compute.tiles import LayerInputs, Tile, head_weights, visit_tiles
from attnlab.stats.engine import row_sums_dict

__all__ = ["new_sums", "key_masks", "stream_sums", "stream_sink_sums", "StreamedWindow", "streamed_window",
           "layer_inputs", "streamed_analysis"]

def new_sums(n_layers: int, n_heads: int, n: int, variants: Sequence[str], spec: torch.Tensor | None,
             device=None) -> dict:
    """Zeroed accumulators of :func:`stream_sums`' result for L*H maps of n rows and keys."""
    G = n_layers * n_heads
    ref = "unas" if "unas" in variants else None
    return {v: {"cols": torch.zeros(G, n, device=device),
                **{f: torch.zeros(G, n, device=device) for f in ("rowsum", "entropy", "distance")},
                "special": None if spec is None else torch.zeros(G, n, spec.shape[-1], device=device),
                "js": None if ref is None or v == ref else torch.zeros(G, n, device=device)}
            for v in variants}


def key_masks(specials: Sequence[torch.Tensor] | None, device=None) -> torch.Tensor | None:
    """(N, S) float32 key masks from S bool (N,) masks (None: none)."""
    return None if not specials else torch.stack([m.to(device, torch.float32) for m in specials], -1)


def stream_sums(layers: Sequence[LayerInputs], variants: Sequence[str],
                params: Mapping[str, Mapping[str, Any]], specials: Sequence[torch.Tensor] | None,
                progress: Callable[[int], None] | None = None, out: dict | None = None,
                done: Collection[int] = (), wanted: Collection[str] | None = None) -> dict:
    """Row sums of every variant over the window's L*H maps, streamed (module docstring).

    Args:
        layers: one :class:`LayerInputs` per layer (B = 1, N queries = N keys).
        variants: variant names; ``params[v]``: its checked parameters (``u`` a float or a tensor
            broadcastable to (L, H)).
        specials: S bool (N,) key masks for the special-mass statistics (None: none).
        progress: called with the number of layers done after each layer.
        out, done: accumulators (``new_sums``) in which the causal kernel already wrote the sums of
            its variants for the layers ``done`` (attnlab/hf/compute/causal_forward.py).
        wanted: the variants whose sums are streamed (None: all); the others are left as they are
            (unas then streams only as the Jensen-Shannon reference; attnlab/hf/compute/mixed.py).

    Returns:
        {variant: row sums in the layout of :func:`attnlab.stats.engine.row_sums_dict` over L*H maps
        (cols (L*H, N), rowsum/entropy/distance (L*H, N), special (L*H, N, S) or None, js (L*H, N) to
        unas or None when unas is not among the variants)}.
    """
    L, (H, N, _) = len(layers), layers[0].query.shape
    dev = layers[0].query.device
    spec = key_masks(specials, dev)  # (N, S)
    ref = "unas" if "unas" in variants else None
    out = new_sums(L, H, N, variants, spec, dev) if out is None else out
    parts: dict = {}  # the last tile's sums by variant (a variant with the very same weights reuses them)

    def visit(t: Tile) -> None:
        where = (t.maps.start, t.i0, t.lo)
        if t.same_as is not None and parts.get(t.same_as, (None,))[0] == where:
            part = parts[t.same_as][1]
        else:
            dist = (torch.arange(t.i0, t.i1, device=dev, dtype=torch.float32)[:, None]
                    - torch.arange(t.lo, t.hi, device=dev, dtype=torch.float32)[None, :]).abs_()
            part = row_sums_dict(t.weights, None if spec is None else spec[t.lo:t.hi], dist,
                                 None if t.variant == ref else t.reference)
        parts[t.variant] = (where, part)
        _add(out[t.variant], t.maps, t.i0, t.i1, t.lo, t.hi, part)

    wanted = set(variants) if wanted is None else set(wanted)
    slots = kernel_slots(variants, params, any(x.causal for x in layers))
    slots = {v: slot for v, slot in slots.items() if v in wanted}
    kernel = causal_kernel() if slots else None
    if kernel is None and not done:
        keep = [v for v in variants if v in wanted or v == ref]
        visit_tiles(layers, keep, params, functools.partial(_only, wanted, visit), progress)
        return out
    rest = [v for v in variants if v not in slots]
    for layer, inputs in enumerate(layers):
        ok = layer in done or (kernel is not None and kernel_layer(kernel, inputs, layer, slots, params, spec,
                                                                   out, H))
        todo = [v for v in (rest if ok else variants) if v in wanted]
        if todo:  # the other variants (and a layer the kernel left) stream in PyTorch
            keep = [*todo] if ref is None or ref in todo else [ref, *todo]
            visit_tiles([inputs], keep, params, functools.partial(_only, set(todo), visit), first_layer=layer)
        if progress is not None:
            progress(layer + 1)
    return out


def _only(wanted: set, visit: Callable[[Tile], None], t: Tile) -> None:
    if t.variant in wanted:
        visit(t)


def _add(acc: dict, maps: slice, i0: int, i1: int, lo: int, hi: int, part: dict) -> None:
    """Place one tile's row sums (R', T) and column sums (R', W) into the accumulators."""
    acc["cols"][maps, lo:hi] += part["cols"]
    for name in ("rowsum", "entropy", "distance", "js"):
        if acc[name] is not None:
            acc[name][maps, i0:i1] = part[name]
    if acc["special"] is not None:
        acc["special"][maps, i0:i1] = part["special"]


def stream_sink_sums(layers: Sequence[LayerInputs], variants: Sequence[str],
                     params: Mapping[str, Mapping[str, Any]], keys: torch.Tensor,
                     special: torch.Tensor | None) -> dict:
    """What :func:`attnlab.sinks.sink_statistics` needs, streamed: {variant: {"first" (L*H,) mean row
    mass on position 0, "special" (L*H,) on ``special``, "sink" (L*H, M) each row's mass s_i on the
    sink ``keys``, "excluded" (L*H, N) sum_i pi_ij / (1 - s_i) over kept rows (0 on sink keys),
    "kept" (L*H, M) bool}} (attnlab/sinks.py's definitions)."""
    from attnlab.sinks import ROW_FLOOR

    L, (H, M, _) = len(layers), layers[0].query.shape
    N = layers[0].key.shape[1]
    dev = layers[0].query.device
    keys_f = keys.to(dev, torch.float32)
    spec_f = None if special is None else special.to(dev, torch.float32)
    out = {v: {"sink": torch.zeros(L * H, M, device=dev), "special": torch.zeros(L * H, M, device=dev),
               "total": torch.zeros(L * H, M, device=dev), "excluded": torch.zeros(L * H, N, device=dev),
               "first": torch.zeros(L * H, device=dev)} for v in variants}
    # s_i needs a whole row: tiles hold whole rows (every key a row may attend), so it is known per tile
    def visit(t: Tile) -> None:
        acc, w = out[t.variant], t.weights  # (R', T, W)
        s = w @ keys_f[t.lo:t.hi]  # (R', T)
        total = w.sum(-1)
        acc["sink"][t.maps, t.i0:t.i1] = s
        acc["total"][t.maps, t.i0:t.i1] = total
        if spec_f is not None:
            acc["special"][t.maps, t.i0:t.i1] = w @ spec_f[t.lo:t.hi]
        if t.lo == 0:
            acc["first"][t.maps] += w[..., 0].sum(-1)
        r = total - s
        kept = r > ROW_FLOOR * torch.where(total > 0, total, 1.0)
        scale = torch.where(kept, 1.0 / torch.where(kept, r, 1.0), torch.zeros_like(r))  # (R', T)
        acc["excluded"][t.maps, t.lo:t.hi] += torch.einsum("rt,rtn->rn", scale, w)

    visit_tiles(layers, variants, params, visit)
    for acc in out.values():
        acc["excluded"] *= 1.0 - keys_f
        r = acc["total"] - acc["sink"]
        acc["kept"] = r > ROW_FLOOR * torch.where(acc["total"] > 0, acc["total"], 1.0)
        acc["first"] /= max(M, 1)
    return out


class StreamedWindow:
    """One streamed window's layer inputs and variant parameters: what its weights (per head, on access)
    and its sink statistics (another pass over the tiles, on request) are computed from."""

    def __init__(self, layers: Sequence[LayerInputs], variants: Sequence[str],
                 params: Mapping[str, Mapping[str, Any]]):
        self.layers = layers if isinstance(layers, MappedLayers) else list(layers)
        self.variants, self.params = tuple(variants), dict(params)
        self._sinks: dict = {}  # sink parts by (keys, special), and "cols": the column masses

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(L, H, M, N)."""
        H, M, _ = self.layers[0].query.shape
        return len(self.layers), H, M, self.layers[0].key.shape[1]

    def head(self, variant: str, layer: int, h: int) -> torch.Tensor:
        """(N, N) weights of one head (computed now)."""
        return head_weights(self.layers[layer], layer, h, variant, self.params)

    def sink_parts(self, keys: torch.Tensor, special: torch.Tensor | None) -> dict:
        """{variant: the parts of :func:`attnlab.sinks.statistics_from_parts`} for sink ``keys`` (N,),
        streamed once per (keys, special) and kept."""
        from attnlab.sinks import queries_per_key

        key = (keys.cpu().numpy().tobytes(), None if special is None else special.cpu().numpy().tobytes())
        if key not in self._sinks:
            L, H, M, N = self.shape
            raw = stream_sink_sums(self.layers, self.variants, self.params, keys.bool(),
                                   None if special is None else special.bool())
            x = self.layers[0]
            count0 = float(queries_per_key(M, N, x.causal, x.mask, x.sliding_window)[0])
            self._sinks[key] = {v: {
                "first": r["first"].reshape(L, H).cpu(),
                "special": r["special"].mean(-1).reshape(L, H).cpu(),
                "sink": r["sink"].mean(-1).reshape(L, H).cpu(),
                "excluded": r["excluded"][:, ~keys.bool().to(r["excluded"].device)].reshape(L, H, -1).cpu(),
                "kept": r["kept"].reshape(L, H, M).cpu(),
                "importance_first": (r["first"] * M / max(count0, 1.0)).reshape(L, H).cpu(),
            } for v, r in raw.items()}
        return self._sinks[key]

    def counts(self) -> torch.Tensor:
        """(L, N) how many queries may attend each key, per layer (masks, causality, windows)."""
        from attnlab.sinks import queries_per_key

        L, _, M, N = self.shape
        return torch.stack([queries_per_key(M, N, x.causal, None if x.mask is None else x.mask.cpu(),
                                            x.sliding_window) for x in self.layers])

    def column_masses(self) -> dict[str, torch.Tensor]:
        """{variant: (L, H, N)} column masses, streamed (no weights held)."""
        if "cols" not in self._sinks:  # one pass over the tiles, kept for every later reader
            L, H, _, N = self.shape
            sums = stream_sums(self.layers, self.variants, self.params, None)
            self._sinks["cols"] = {v: s["cols"].reshape(L, H, N).cpu() for v, s in sums.items()}
        return dict(self._sinks["cols"])


def streamed_window(captured, valid) -> bool:
    """Whether one window takes the streamed analysis (attnlab/hf/compute/streamed.py): B = 1 and some
    layer masks (causal, sliding window, a mask) or softcaps; unmasked bidirectional windows keep the
    fused analysis."""
    if valid.shape[0] != 1 or not bool(valid.all()):
        return False
    return any(c.causal or c.mask is not None or c.softcap is not None for c in captured)


def layer_inputs(captured) -> Sequence[LayerInputs]:
    """One window's captured layers as the streamed analysis' inputs (batch item 0): a list, or, when
    the capture spilled q and k to a file (attnlab/hf/capture/spill.py), a :class:`MappedLayers`."""
    if any(c.reload is not None for c in captured):
        return MappedLayers(captured)
    return [_inputs(c, c.query, c.key_heads) for c in captured]


def _inputs(c, query: torch.Tensor, key_heads: torch.Tensor) -> LayerInputs:
    mask = None if c.mask is None or bool(c.mask.all()) else c.mask[0]
    return LayerInputs(query=query[0], key=key_heads[0], mask=mask, causal=c.causal, scale=c.scaling,
                       softcap=c.softcap, sliding_window=c.sliding_window)


class MappedLayers(Sequence):
    """The layers of a spilled capture: each item is a :class:`LayerInputs` whose q and k map the spill
    file afresh, so a pass over the layers holds one layer's q and k (its pages are read as the tiles
    read them and leave with the item). Shapes and masks cost nothing."""

    def __init__(self, captured):
        self._captured = list(captured)

    def __len__(self) -> int:
        return len(self._captured)

    def __getitem__(self, layer: int) -> LayerInputs:
        if not isinstance(layer, int):
            raise TypeError(f"MappedLayers takes one layer index, got {type(layer).__name__}")
        c = self._captured[layer]  # IndexError ends iteration
        return _inputs(c, *c.reload()) if c.reload is not None else _inputs(c, c.query, c.key_heads)


def streamed_analysis(captured, variants, params, specials, hook=None):
    """(weights {variant: HeadMaps (L, H, N, N), per head on access}, row sums or None) of one window,
    streamed: no layer's (H, N, N) is held (docs/ANALYSIS.md §8)."""
    window = StreamedWindow(layer_inputs(captured), variants, params)
    from attnlab.hf.compute.causal_forward import CausalLayerwise
    from attnlab.hf.compute.head_maps import HeadMaps

    # the layers whose kernel sums the capture forward took (attnlab/hf/compute/causal_forward.py)
    done = hook.done if isinstance(hook, CausalLayerwise) else ()
    sums = None if specials is None else stream_sums(
        window.layers, variants, params, specials, out=hook.out if done else None, done=done)
    if sums is not None:  # the column masses are among the row sums: column_masses() needs no second pass
        L, H, _, N = window.shape
        window._sinks["cols"] = {v: s["cols"].reshape(L, H, N).cpu().clone() for v, s in sums.items()}

    def head(variant):
        return lambda layer, h: window.head(variant, layer, h)

    weights = {v: HeadMaps(v, window.shape, head(v), sinks=window.sink_parts, window=window)
               for v in variants}
    return weights, sums
