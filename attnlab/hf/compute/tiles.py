"""The tiles of the streamed analysis of one masked window (causal, sliding-window, softcapped,
grouped-query, padded): every variant's weights per layer and head group in tiles of query rows, never
a layer's (H, N, N) (docs/ANALYSIS.md §8; their row sums: attnlab/hf/compute/streamed.py).

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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from attnlab.normalizers import attention_weights, variant_spec
from attnlab.normalizers import functions as fn

__all__ = ["TILE_BYTES", "LayerInputs", "Tile", "stream_rule", "visit_tiles", "head_weights", "head_block"]

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


def head_block(inputs: LayerInputs, layer: int, h: int, variant: str, params: Mapping[str, Mapping[str, Any]],
               lo: int, hi: int) -> torch.Tensor:
    """(hi - lo, hi - lo) float32: ``head_weights(...)[lo:hi, lo:hi]`` (queries and keys [lo, hi)), bit for
    bit, from the tiles that hold it. A variant normalized by rows (unas, sparsemax, softmax1) computes
    only the tiles of rows [lo, hi); one normalized by columns (causal dnas, hnas, one-round Sinkhorn)
    the tiles above them too (its prefix column potential carries from tile to tile), never those
    below. A variant streamed by whole heads is computed whole and sliced. The app's head view over a
    long text (129 tokens around the focus) costs a tile or two per head instead of an (N, N) map."""
    rule = stream_rule(variant, params[variant], inputs.causal)
    if rule == "head":
        return head_weights(inputs, layer, h, variant, params)[lo:hi, lo:hi].clone()
    normalizer = variant_spec(variant).normalizer
    rows = _tile_rows(inputs, 1, _LIVE + 1)  # head_weights' tiles: the same rows, the same values
    out = torch.zeros(hi - lo, hi - lo, device=inputs.query.device)

    def put(i0: int, i1: int, k0: int, k1: int, tile: torch.Tensor) -> None:  # tile (1, i1 - i0, k1 - k0)
        r0, r1, c0, c1 = max(i0, lo), min(i1, hi), max(k0, lo), min(k1, hi)
        if r1 > r0 and c1 > c0:
            out[r0 - lo:r1 - lo, c0 - lo:c1 - lo] = tile[0, r0 - i0:r1 - i0, c0 - k0:c1 - k0]

    one = slice(h, h + 1)
    if rule == "row":  # each tile alone, as _tiles computes a row rule's
        for i0 in range(0, inputs.query.shape[1], rows):
            i1 = min(inputs.query.shape[1], i0 + rows)
            if i0 >= hi:
                break
            k0, k1 = inputs.span(i0, i1)
            if i1 > lo and k1 > k0:
                s = inputs.logits(one, i0, i1, k0, k1)
                w = fn.row_softmax(s) if normalizer is fn.unas else normalizer(
                    s, fn.NormalizerContext(causal=inputs.causal, params=dict(params[variant])))
                put(i0, i1, k0, k1, w)
        return out
    u = None
    if normalizer is fn.hnas:
        u = _layer_u(params[variant]["u"], layer, inputs.query.shape[0])[h:h + 1].to(out.device)
    for i0, i1, k0, k1, tile in _tiles(inputs, one, [variant], {variant: rule}, params, u, rows):
        if k1 > k0 and i1 > lo:
            put(i0, i1, k0, k1, tile[variant])
        if i1 >= hi:  # the tiles below the span are never computed
            break
    return out
