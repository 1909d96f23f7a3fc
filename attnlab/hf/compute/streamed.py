"""Streamed analysis of one masked window (causal, sliding-window, softcapped, grouped-query, padded):
every variant's row sums for the statistics, per layer and head group in tiles of query rows, never
a layer's (H, N, N) weights (docs/ANALYSIS.md §8).

Shapes: one window (B = 1) of N tokens; a layer's q (H, N, D) and k (H_kv, N, D), H = H_kv * R (R query
heads share one key head: grouped-query attention reads each k once per group of R heads). A tile is
R heads x T query rows x the keys [lo, hi) any of those rows may attend: causal layers skip the keys
after the tile's last row (about half the work), sliding-window layers also those before its window.

How each variant streams (:func:`stream_rule`, from its spec's normalizer):

- ``row``: a function of each row's logits alone (unas Eq. 1, sparsemax, softmax1): the tile's rows.
- ``column``: a row softmax after a column potential c_j (dnas Eq. 5, hnas Eq. 12 as a mix of the
  two, sinkhorn with one round): c_j = logsumexp_i s_ij over every valid query first (one extra pass
  over the tiles), or, in causal layers, the prefix c_j(i) of docs/VARIANTS.md carried from tile to
  tile (one pass).
- ``head``: anything else (Sinkhorn's later rounds on bidirectional masks, registered plugins): one
  head's (N, N) weights by the reference function, then its sums (bounded by one head, not a layer).

Tiles are sized to :data:`TILE_BYTES` (every live (R, T, N) buffer of a tile together); the torch ops
of a tile run on torch's threads. Weights are computed only when read, one (layer, head) at a time
(:class:`~attnlab.hf.compute.head_maps.HeadMaps`), by the same tile loop.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from attnlab.normalizers import attention_weights, variant_spec
from attnlab.normalizers import functions as fn
from attnlab.stats._checks import LN2
from attnlab.stats.engine import row_sums_dict

__all__ = ["TILE_BYTES", "LayerInputs", "StreamedWindow", "Tile", "stream_rule", "visit_tiles", "stream_sums",
           "stream_sink_sums", "head_weights"]

# Bytes of all live (R, T, keys) buffers of one tile together (scores, each variant's rows, the
# statistics' scratch): 96 MiB keeps a 12-head, 8,192-token layer's tile at >= 64 rows.
TILE_BYTES = 96 << 20
_LIVE = 6  # buffers of a tile's size alive at once besides each variant's rows

_ROW = {fn.unas, fn.sparsemax, fn.softmax1}
_COLUMN = {fn.dnas: "dnas", fn.hnas: "hnas"}


def stream_rule(variant: str, params: Mapping[str, Any], causal: bool) -> str:
    """"row", "column" or "head" (module docstring) for ``variant`` with its checked ``params``."""
    normalizer = variant_spec(variant).normalizer
    if normalizer in _ROW:
        return "row"
    if normalizer in _COLUMN or (normalizer is fn.sinkhorn and (causal or params.get("iters") == 1)):
        return "column"
    return "head"


@dataclass(frozen=True)
class LayerInputs:
    """What one layer's attention saw, for one window."""

    query: torch.Tensor  # (H, N, D) after projection and rotary embedding
    key: torch.Tensor  # (H_kv, N, D), grouped heads not repeated
    mask: torch.Tensor | None  # bool broadcastable to (N, N), True = may attend (None: see causal)
    causal: bool  # j <= i (already in mask when there is one)
    scale: float  # score scale
    softcap: float | None = None  # s -> softcap * tanh(s / softcap) before masking (Gemma 2)
    sliding_window: int | None = None  # with mask None: keys i - window < j only (transformers' rule)

    @property
    def group(self) -> int:
        """R: query heads per key head."""
        return self.query.shape[0] // self.key.shape[0]

    def span(self, i0: int, i1: int) -> tuple[int, int]:
        """[lo, hi): the keys rows i0..i1-1 may attend (a superset is fine: masked entries are -inf)."""
        n = self.key.shape[1]
        if self.mask is not None:
            rows = self.mask[..., i0:i1, :] if self.mask.shape[-2] > 1 else self.mask
            cols = rows.reshape(-1, rows.shape[-1]).any(0)
            idx = torch.nonzero(cols)
            if idx.numel() == 0:
                return 0, 0
            return int(idx[0]), int(idx[-1]) + 1
        hi = i1 if self.causal else n
        lo = max(0, i0 - self.sliding_window + 1) if self.sliding_window else 0
        return lo, hi

    def logits(self, heads: slice, i0: int, i1: int, lo: int, hi: int) -> torch.Tensor:
        """(R', T, hi - lo) float32 logits of query heads ``heads`` (one key group), -inf where masked."""
        g = heads.start // self.group
        s = torch.matmul(self.query[heads, i0:i1].float(), self.key[g, lo:hi].float().t()).mul_(self.scale)
        if self.softcap is not None:
            s = s.div_(self.softcap).tanh_().mul_(self.softcap)
        allowed = self._allowed(i0, i1, lo, hi, s.device)
        return s if allowed is None else s.masked_fill_(~allowed, float("-inf"))

    def _allowed(self, i0, i1, lo, hi, device) -> torch.Tensor | None:
        """bool (T, hi - lo) or None (everything allowed)."""
        if self.mask is not None:
            m = self.mask.reshape(-1, *self.mask.shape[-2:])
            if m.shape[0] != 1:
                raise ValueError(f"a per-head mask is not supported by the streamed analysis, got mask of "
                                 f"shape {tuple(self.mask.shape)}")
            rows = m[0, i0:i1] if m.shape[-2] > 1 else m[0].expand(i1 - i0, -1)
            return rows[:, lo:hi]
        if not self.causal and not self.sliding_window:
            return None
        i = torch.arange(i0, i1, device=device)[:, None]
        j = torch.arange(lo, hi, device=device)[None, :]
        ok = j <= i if self.causal else torch.ones((), dtype=torch.bool, device=device)
        if self.sliding_window:
            ok = ok & (i - j < self.sliding_window)
        return ok


# From this many tokens on, ATTNLAB_BOUNDED_MALLOC=1 fixes glibc's mmap threshold (see bound_allocator).
MALLOC_FROM_TOKENS = 2048
_MALLOC = {"set": False}


def bound_allocator(n_tokens: int) -> None:
    """With ``ATTNLAB_BOUNDED_MALLOC=1``: keep a long forward's transient buffers from staying in the heap.
    glibc raises its mmap threshold each time a large buffer is freed (up to 32 MiB), after which the
    per-layer buffers of a long window (values, outputs, tiles: 25 MB each at 8,192 tokens) come from
    the heap and are not returned. Fixing the mmap and trim thresholds at 1 MiB (mallopt, once per
    process, Linux/glibc, windows from MALLOC_FROM_TOKENS tokens on) returns them: peak RSS growth 1.0
    instead of 1.7 GiB for the 12-layer MHA shape at 8,192 tokens -- but every large buffer is then
    mapped and zeroed anew, which made the plain forward ~1.5x slower at 2,048 tokens (docs/BENCHMARKS.md),
    hence off by default."""
    if _MALLOC["set"] or n_tokens < MALLOC_FROM_TOKENS or not sys.platform.startswith("linux"):
        return
    _MALLOC["set"] = True
    if os.environ.get("ATTNLAB_BOUNDED_MALLOC", "0") != "1":
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 20)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to fix
        pass


_PLAIN: dict = {}  # (id(mask), window) -> (mask, bool): masks checked to be plain causal (+ window)


def plain_causal(inputs: LayerInputs) -> bool:
    """Whether the layer's allowed keys are exactly j <= i (and i - j < sliding_window when it has one),
    with no other mask: what the causal analysis kernel computes. A mask tensor is compared once per
    object (transformers shares one between layers)."""
    if not inputs.causal or inputs.query.shape[1] != inputs.key.shape[1]:
        return False
    if inputs.mask is None:
        return True
    key = (id(inputs.mask), inputs.sliding_window)
    hit = _PLAIN.get(key)
    if hit is None or hit[0] is not inputs.mask:
        m = inputs.mask.reshape(-1, *inputs.mask.shape[-2:])
        n = inputs.key.shape[1]
        ok = m.shape[0] == 1 and tuple(m.shape[-2:]) == (n, n)
        if ok:
            i, j = torch.arange(n, device=m.device)[:, None], torch.arange(n, device=m.device)[None, :]
            want = j <= i
            if inputs.sliding_window:
                want &= i - j < inputs.sliding_window
            ok = bool(torch.equal(m[0], want))
        if len(_PLAIN) > 8:
            _PLAIN.clear()
        hit = _PLAIN[key] = (inputs.mask, ok)
    return hit[1]


def _tile_rows(inputs: LayerInputs, heads: int, n_buffers: int) -> int:
    """T: query rows per tile, so that ``n_buffers`` (heads, T, N) float32 buffers fit TILE_BYTES."""
    n = max(1, inputs.key.shape[1])
    rows = TILE_BYTES // (4 * heads * n * n_buffers)
    return int(max(16, min(inputs.query.shape[1], rows)))


def _column_lse(inputs: LayerInputs, heads: slice, rows: int) -> torch.Tensor:
    """(R', 1, N) c_j = logsumexp over every valid query of s_ij (0 for a column nobody attends), the
    column potential of bidirectional DNAS (Eq. 5)."""
    n_q, n = inputs.query.shape[1], inputs.key.shape[1]
    c = torch.full((heads.stop - heads.start, 1, n), float("-inf"), device=inputs.query.device)
    for i0 in range(0, n_q, rows):
        i1 = min(n_q, i0 + rows)
        lo, hi = inputs.span(i0, i1)
        if hi > lo:
            part = inputs.logits(heads, i0, i1, lo, hi).logsumexp(-2, keepdim=True)
            c[..., lo:hi] = torch.logaddexp(c[..., lo:hi], part)
    return c.masked_fill_(torch.isneginf(c), 0.0)


def _tiles(inputs: LayerInputs, heads: slice, variants: Sequence[str], rules: Mapping[str, str],
           params: Mapping[str, Mapping[str, Any]], u: torch.Tensor | None, rows: int):
    """Yield (i0, i1, lo, hi, {variant: (R', T, hi - lo) weights}) over the query rows of ``heads``.

    ``u``: (R', 1, 1) HNAS weights of these heads (None without an HNAS-like variant)."""
    n_q, n = inputs.query.shape[1], inputs.key.shape[1]
    columns = [v for v in variants if rules[v] == "column"]
    carry = potential = None
    if columns and inputs.causal:
        carry = torch.full((heads.stop - heads.start, 1, n), fn.LSE_FLOOR, device=inputs.query.device)
    elif columns:
        potential = _column_lse(inputs, heads, rows)
    for i0 in range(0, n_q, rows):
        i1 = min(n_q, i0 + rows)
        lo, hi = inputs.span(i0, i1)
        if hi <= lo:
            yield i0, i1, lo, lo, {}
            continue
        s = inputs.logits(heads, i0, i1, lo, hi)  # (R', T, W)
        out: dict[str, torch.Tensor] = {}
        unas = dnas = None
        if any(rules[v] == "column" or variant_spec(v).normalizer is fn.unas for v in variants):
            unas = fn.row_softmax(s)
        if columns:
            if carry is not None:  # causal: c_j(i) over the prefix, continued from the tiles above
                c = fn.prefix_column_logsumexp(s, carry[..., lo:hi])
                carry[..., lo:hi] = c[..., -1:, :]
            else:
                c = potential[..., lo:hi]
            dnas = fn.row_softmax(fn.shift(s, c))
        for v in variants:
            normalizer = variant_spec(v).normalizer
            if normalizer is fn.unas:
                out[v] = unas
            elif rules[v] == "row":
                out[v] = normalizer(s, fn.NormalizerContext(causal=inputs.causal, params=dict(params[v])))
            elif normalizer is fn.hnas:
                out[v] = torch.lerp(unas, dnas, u)
            elif rules[v] == "column":
                out[v] = dnas
        yield i0, i1, lo, hi, out


def _head_reference(inputs: LayerInputs, h: int, variant: str, params: Mapping[str, Any]) -> torch.Tensor:
    """(N, N) weights of query head ``h`` by the variant's reference function (the ``head`` rule)."""
    n = inputs.key.shape[1]
    s = inputs.logits(slice(h, h + 1), 0, inputs.query.shape[1], 0, n)  # (1, N, N), -inf where masked
    valid = torch.isfinite(s) | torch.isnan(s) | torch.isposinf(s)
    return attention_weights(s.masked_fill(~valid, 0.0)[None], variant, mask=valid[None],
                             causal=inputs.causal, **params)[0, 0]


def _layer_u(u, layer: int, n_heads: int) -> torch.Tensor:
    """(H, 1, 1) HNAS weights of one layer from a float or an (L, H)-broadcastable tensor."""
    if not isinstance(u, torch.Tensor):
        return torch.full((n_heads, 1, 1), float(u))
    table = u.float().reshape(-1, u.shape[-1]) if u.dim() else u.float().reshape(1, 1)
    row = table[layer] if table.shape[0] > 1 else table[0]
    return torch.broadcast_to(row, (n_heads,)).reshape(n_heads, 1, 1).clone()


def _per_head(params: Mapping[str, Any], layer: int, head: int) -> dict:
    """One head's parameters: per-head tensors (broadcastable to (L, H)) reduced to that head's number."""
    out = {}
    for name, value in params.items():
        if isinstance(value, torch.Tensor) and value.numel() > 1:
            table = value.reshape(-1, value.shape[-1]) if value.dim() > 1 else value.reshape(1, -1)
            row = table[layer] if table.shape[0] > 1 else table[0]
            value = row[head] if row.numel() > 1 else row[0]
        out[name] = value
    return out


@dataclass(frozen=True)
class Tile:
    """One tile of one variant's weights: maps ``maps`` of the window's L*H (layer-major), query rows
    [i0, i1), keys [lo, hi); ``weights`` (R', T, hi - lo); ``reference`` the unas weights of the same
    tile (None when unas is not analysed); ``same_as``: a variant visited before whose weights are
    this very tensor (causal Sinkhorn is DNAS), or None."""

    variant: str
    layer: int
    maps: slice
    i0: int
    i1: int
    lo: int
    hi: int
    weights: torch.Tensor
    reference: torch.Tensor | None
    same_as: str | None = None


def visit_tiles(layers: Sequence[LayerInputs], variants: Sequence[str],
                params: Mapping[str, Mapping[str, Any]],
                visit: Callable[[Tile], None], progress: Callable[[int], None] | None = None,
                first_layer: int = 0) -> None:
    """Call ``visit`` on every tile of every variant's weights over the window's layers and heads, in
    bounded memory (module docstring); ``progress(layers done)`` after each layer. ``layers`` are the
    window's layers from ``first_layer`` on (their maps, per-layer parameters and tiles numbered so)."""
    H, N = layers[0].query.shape[0], layers[0].key.shape[1]
    causal = any(x.causal for x in layers)
    rules = {v: stream_rule(v, params[v], causal) for v in variants}
    ref = "unas" if "unas" in variants else None
    tiled = [v for v in variants if rules[v] != "head"]
    if ref is not None and ref not in tiled:
        tiled.insert(0, ref)
    mixed = [v for v in variants if variant_spec(v).normalizer is fn.hnas]
    for layer, inputs in enumerate(layers, start=first_layer):
        R = inputs.group
        u = _layer_u(params[mixed[0]]["u"], layer, H).to(inputs.query.device) if mixed else None
        rows = _tile_rows(inputs, R, _LIVE + len(tiled))
        for g in range(inputs.key.shape[0]):
            heads = slice(g * R, (g + 1) * R)
            maps = slice(layer * H + heads.start, layer * H + heads.stop)
            for i0, i1, lo, hi, tile in _tiles(inputs, heads, tiled, rules, params,
                                               None if u is None else u[heads], rows):
                if hi <= lo:
                    continue
                seen: dict[int, str] = {}
                for v in variants:
                    if rules[v] == "head":
                        continue
                    w = tile[v]
                    visit(Tile(v, layer, maps, i0, i1, lo, hi, w, None if ref is None else tile[ref],
                               seen.get(id(w))))
                    seen.setdefault(id(w), v)
        for v in variants:
            if rules[v] != "head":
                continue
            for h in range(H):
                w = _head_reference(inputs, h, v, _per_head(params[v], layer, h))[None]  # (1, N, N)
                r = None if ref is None else head_weights(inputs, layer, h, ref, params)[None]
                visit(Tile(v, layer, slice(layer * H + h, layer * H + h + 1), 0, N, 0, N, w, r))
        if progress is not None:
            progress(layer + 1 - first_layer)


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
                done: Collection[int] = ()) -> dict:
    """Row sums of every variant over the window's L*H maps, streamed (module docstring).

    Args:
        layers: one :class:`LayerInputs` per layer (B = 1, N queries = N keys).
        variants: variant names; ``params[v]``: its checked parameters (``u`` a float or a tensor
            broadcastable to (L, H)).
        specials: S bool (N,) key masks for the special-mass statistics (None: none).
        progress: called with the number of layers done after each layer.
        out, done: accumulators (``new_sums``) in which the causal kernel already wrote the sums of
            its variants for the layers ``done`` (attnlab/hf/compute/causal_forward.py).

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

    slots = kernel_slots(variants, params, any(x.causal for x in layers))
    kernel = causal_kernel() if slots else None
    if kernel is None and not done:
        visit_tiles(layers, variants, params, visit, progress)
        return out
    rest = [v for v in variants if v not in slots]
    for layer, inputs in enumerate(layers):
        ok = layer in done or (kernel is not None and kernel_layer(kernel, inputs, layer, slots, params, spec,
                                                                   out, H))
        todo = rest if ok else list(variants)
        if todo:  # the other variants (and a layer the kernel left) stream in PyTorch
            keep = [*todo] if ref is None or ref in todo else [ref, *todo]
            visit_tiles([inputs], keep, params, functools.partial(_only, set(todo), visit), first_layer=layer)
        if progress is not None:
            progress(layer + 1)
    return out


def _only(wanted: set, visit: Callable[[Tile], None], t: Tile) -> None:
    if t.variant in wanted:
        visit(t)


def causal_kernel():
    """attnlab's causal analysis op (``torch.ops.attnlab_hf.causal_heads``), or None (kernels off or
    not built, no AVX-512, or ``_USE_KERNEL`` False)."""
    if not _USE_KERNEL:
        return None
    from attnlab import kernels

    ops = kernels.analysis_ops()
    return getattr(ops, "causal_heads", None) if ops is not None else None


_USE_KERNEL = True  # tests switch it off to compare with the PyTorch tiles

# The kernel's slots: unas, causal dnas (and one-round Sinkhorn, the same weights), hnas.
_SLOT = {fn.unas: 0, fn.dnas: 1, fn.sinkhorn: 1, fn.hnas: 2}


def kernel_slots(variants, params, causal: bool) -> dict[str, int]:
    """variant -> its slot in the causal kernel, for the variants it computes (at most one HNAS)."""
    if not causal:
        return {}
    out, hnas = {}, 0
    for v in variants:
        normalizer = variant_spec(v).normalizer
        slot = _SLOT.get(normalizer)
        if slot == 2:
            hnas += 1
            if hnas > 1:
                continue
        if slot is not None:
            out[v] = slot
    return out


def kernel_layer(kernel, inputs: LayerInputs, layer: int, slots: Mapping[str, int], params, spec, out,
                 H: int, v: torch.Tensor | None = None, out_attn: torch.Tensor | None = None) -> bool:
    """One layer's row sums of the ``slots`` variants by the causal kernel, into ``out``; False when the
    layer is not one it computes (not a plain causal or sliding-window mask, not float32 on the CPU,
    more than 8 key masks) or some head needs the exact path (then nothing is written). With ``v``
    (H_kv, N, Dv), also unas' attention output into ``out_attn`` (N, H, Dv)."""
    q, k = inputs.query, inputs.key
    if (q.device.type != "cpu" or q.dtype != torch.float32 or k.dtype != torch.float32
            or not plain_causal(inputs) or (spec is not None and spec.shape[-1] > 8)):
        return False
    N = k.shape[1]
    S = 0 if spec is None else spec.shape[-1]
    mixed = [v for v, s in slots.items() if s == 2]
    u = _layer_u(params[mixed[0]]["u"], layer, H).reshape(H).float().contiguous() if mixed else torch.zeros(H)
    spec_t = torch.zeros(0, N) if spec is None else spec.t().float().contiguous()
    cols, rowsum, entropy, distance = (torch.zeros(3, H, N) for _ in range(4))
    special, js = torch.zeros(3, H, N, S), torch.zeros(2, H, N)
    redo = kernel(q.contiguous(), k.contiguous(), float(inputs.scale), float(inputs.softcap or 0.0),
                  int(inputs.sliding_window or 0), u, spec_t, cols, rowsum, entropy, distance, special, js,
                  v, out_attn)
    if bool(redo.any()):
        return False
    maps = slice(layer * H, (layer + 1) * H)
    for v, slot in slots.items():
        acc = out[v]
        acc["cols"][maps] = cols[slot]
        acc["rowsum"][maps], acc["entropy"][maps] = rowsum[slot], entropy[slot]
        acc["distance"][maps] = distance[slot]
        if acc["special"] is not None:
            acc["special"][maps] = special[slot]
        if acc["js"] is not None:
            if slot == 0:
                acc["js"][maps] = 0.0
            else:  # twice the JS divergence in nats -> the JS distance in bits, as row_sums_dict
                acc["js"][maps] = js[slot - 1].div(2.0 * LN2).clamp_(0.0, 1.0).sqrt_()
    return True


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


def _add(acc: dict, maps: slice, i0: int, i1: int, lo: int, hi: int, part: dict) -> None:
    """Place one tile's row sums (R', T) and column sums (R', W) into the accumulators."""
    acc["cols"][maps, lo:hi] += part["cols"]
    for name in ("rowsum", "entropy", "distance", "js"):
        if acc[name] is not None:
            acc[name][maps, i0:i1] = part[name]
    if acc["special"] is not None:
        acc["special"][maps, i0:i1] = part["special"]


def head_weights(inputs: LayerInputs, layer: int, h: int, variant: str,
                 params: Mapping[str, Mapping[str, Any]]) -> torch.Tensor:
    """(N, N) float32 weights of query head ``h`` of one layer, by the same tiles as :func:`stream_sums`."""
    n_q, n = inputs.query.shape[1], inputs.key.shape[1]
    rule = stream_rule(variant, params[variant], inputs.causal)
    if rule == "head":
        return _head_reference(inputs, h, variant, _per_head(params[variant], layer, h))
    out = torch.zeros(n_q, n, device=inputs.query.device)
    u = None
    if variant_spec(variant).normalizer is fn.hnas:
        u = _layer_u(params[variant]["u"], layer, inputs.query.shape[0])[h:h + 1].to(out.device)
    rows = _tile_rows(inputs, 1, _LIVE + 1)
    for i0, i1, lo, hi, tile in _tiles(inputs, slice(h, h + 1), [variant], {variant: rule}, params, u, rows):
        if hi > lo:
            out[i0:i1, lo:hi] = tile[variant][0]
    return out


def weights_bytes(n_layers: int, n_heads: int, n: int) -> int:
    """Bytes of one variant's materialized (L, H, N, N) float32 weights."""
    return 4 * n_layers * n_heads * n * n


def describe_bytes(b: int) -> str:
    return f"{b / 2**30:.1f} GiB" if b >= 2**30 else f"{b / 2**20:.0f} MiB" if b >= 2**20 else f"{b} bytes"


class StreamedWindow:
    """One streamed window's layer inputs and variant parameters: what its weights (per head, on access)
    and its sink statistics (another pass over the tiles, on request) are computed from."""

    def __init__(self, layers: Sequence[LayerInputs], variants: Sequence[str],
                 params: Mapping[str, Mapping[str, Any]]):
        self.layers, self.variants, self.params = list(layers), tuple(variants), dict(params)
        self._sinks: dict = {}

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
        L, H, _, N = self.shape
        sums = stream_sums(self.layers, self.variants, self.params, None)
        return {v: s["cols"].reshape(L, H, N).cpu() for v, s in sums.items()}
