"""Row sums: the few per-row and per-column sums of L*H attention maps from which every statistic of
the tidy table follows, computed in cache-sized blocks, and the per-head statistics derived from them.

    RowSums.from_maps(weights (L, H, M, N), special=None, positions=None, reference=None) -> RowSums
    statistics_from_row_sums({variant: RowSums}, ...) -> {variant: {statistic: (L, H)}}

``attnlab.hf`` computes the same sums while it builds the weights (fused with the normalizers) and
hands them over as ``RowSums``; the table (``attnlab.stats.table``) turns them into a DataFrame.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch

from attnlab.normalizers.checks import scalar
from attnlab.stats._checks import (
    LN2,
    check_bool,
    check_number,
    check_unit_tensor,
    check_weights,
    distance_matrix,
)
from attnlab.stats.divergence import js2_rowsum
from attnlab.stats.maps import gini

# Relative tolerance of the "below the DNAS / HNAS floor" tests: float32 column sums are accurate to
# ~1e-6 relative, so a column exactly at the floor must not count as below it.
BOUND_RTOL = 1e-4
# Working set of one block of attention rows per torch thread: a thread's share of the block and of
# its two scratch copies fits a 2 MiB per-core L2 cache.
CHUNK_BYTES = 512 << 10
# The same on a GPU, where a block is one kernel launch per pass and memory is plentiful.
DEVICE_CHUNK_BYTES = 64 << 20


@dataclass(frozen=True, eq=False)
class RowSums:
    """Per-row and per-column sums of one variant's L*H maps (G = L*H, M rows, N keys).

    Immutable (a frozen dataclass; its tensors are never modified in place by attnlab, and must not
    be by callers). Built by :meth:`from_maps` or by ``attnlab.hf`` together with the weights.
    """

    shape: tuple[int, int, int, int]  # (L, H, M, N) of the maps that were summed
    cols: torch.Tensor  # (G, N) column masses m_j = sum_i pi_ij
    rowsum: torch.Tensor  # (G, M) sum_j pi_ij
    entropy: torch.Tensor  # (G, M) -sum_j pi_ij ln pi_ij (nats)
    distance: torch.Tensor  # (G, M) sum_j pi_ij |pos_i - pos_j|
    special: torch.Tensor | None = None  # (G, M, S) mass on each of S key masks (None: no masks)
    js: torch.Tensor | None = None  # (G, M) JS distance (base 2) to the reference rows (None: none)

    def __post_init__(self):
        shape = tuple(int(s) for s in self.shape) if isinstance(self.shape, (tuple, list)) else None
        if shape is None or len(shape) != 4 or min(shape) < 0:
            raise ValueError(f"RowSums.shape must be (L, H, M, N), got {self.shape!r}")
        object.__setattr__(self, "shape", shape)
        L, H, M, N = shape
        want = {"cols": (L * H, N), "rowsum": (L * H, M), "entropy": (L * H, M), "distance": (L * H, M),
                "js": (L * H, M)}
        for f in fields(self):
            t = getattr(self, f.name)
            if f.name == "shape" or (t is None and f.name in ("special", "js")):
                continue
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise ValueError(f"RowSums.{f.name} must be a floating tensor, got {type(t).__name__}")
            if f.name == "special":
                ok = t.dim() == 3 and tuple(t.shape[:2]) == (L * H, M)
            else:
                ok = tuple(t.shape) == want[f.name]
            if not ok:
                expected = f"({L * H}, {M}, S)" if f.name == "special" else str(want[f.name])
                raise ValueError(f"RowSums.{f.name} must have shape {expected} for maps of shape {shape}, "
                                 f"got {tuple(t.shape)}")

    @classmethod
    def from_maps(cls, weights: torch.Tensor, special: torch.Tensor | None = None,
                  positions: torch.Tensor | None = None, reference: torch.Tensor | None = None) -> RowSums:
        """The sums of weights (L, H, M, N). ``special``: bool (N,) or (N, S) key masks; ``positions``:
        (N,) token positions for the distances (square maps; default 0..M-1 / 0..N-1); ``reference``:
        maps of the same shape that ``js`` compares with (None: no ``js``)."""
        w = check_weights("weights", weights, min_dim=4)
        if w.dim() != 4:
            raise ValueError(f"weights must have shape (L, H, M, N), got {tuple(w.shape)}")
        L, H, M, N = w.shape
        spec = None
        if special is not None:
            spec = special[:, None] if isinstance(special, torch.Tensor) and special.dim() == 1 else special
            if not isinstance(spec, torch.Tensor) or spec.dim() != 2 or spec.shape[0] != N:
                seen = tuple(special.shape) if isinstance(special, torch.Tensor) else type(special).__name__
                raise ValueError(f"special must be a boolean tensor (N,) or (N, S) with N = {N}, got {seen}")
            check_bool("special", spec, spec.shape, "keys (N, S)")
        if positions is not None and (not isinstance(positions, torch.Tensor)
                                      or tuple(positions.shape) != (N,) or M != N):
            seen = tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__
            raise ValueError(f"positions must be a tensor ({N},) of square maps' token positions, got {seen}")
        ref = None
        if reference is not None:
            ref = check_weights("reference", reference, min_dim=4).to(w.dtype)
            if ref.shape != w.shape:
                raise ValueError(f"reference must have the weights' shape {tuple(w.shape)}, got "
                                 f"{tuple(ref.shape)}")
            ref = ref.reshape(L * H, M, N)
        dist = distance_matrix(M, N, w, positions)
        return cls(shape=(L, H, M, N), **row_sums_dict(w.reshape(L * H, M, N), spec, dist, ref))

    @classmethod
    def from_dict(cls, raw: Mapping, shape) -> RowSums:
        """From the dict layout of :func:`row_sums_dict` (cols, rowsum, entropy, distance, special, js)."""
        if isinstance(raw, RowSums):
            return raw
        if not isinstance(raw, Mapping):
            raise ValueError(f"row sums must be a RowSums or a dict of its fields, got {type(raw).__name__}")
        names = {f.name for f in fields(cls)} - {"shape"}
        unknown = set(raw) - names
        if unknown:
            raise ValueError(f"row sums have unknown keys {sorted(unknown)}; expected {sorted(names)}")
        return cls(shape=tuple(shape), **raw)

    def as_dict(self) -> dict:
        """The fields without ``shape``, in the layout of :func:`row_sums_dict`."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "shape"}


def blocks(maps: int, m: int, n: int, itemsize: int, device: torch.device | None = None):
    """(g0, g1, i0, i1) blocks of about CHUNK_BYTES per thread over (maps, m rows) of (m, n) maps (on a
    GPU: blocks of DEVICE_CHUNK_BYTES)."""
    on_cpu = device is None or device.type == "cpu"
    chunk = CHUNK_BYTES * max(1, torch.get_num_threads()) if on_cpu else DEVICE_CHUNK_BYTES
    row_bytes = max(1, n * itemsize)
    if m * row_bytes <= chunk:
        g, r = max(1, chunk // max(1, m * row_bytes)), max(1, m)
    else:
        g, r = 1, max(1, chunk // row_bytes)
    for g0 in range(0, maps, g):
        for i0 in range(0, m, r):
            yield g0, min(g0 + g, maps), i0, min(i0 + r, m)


def row_sums_dict(maps, spec, dist, ref) -> dict:
    """Per-row and per-column sums of (G, M, N) maps as a dict of :class:`RowSums`' fields.

    ``spec``: (N, S) key masks (None without); ``dist``: (M, N) |pos_i - pos_j|; ``ref``: None, or the
    reference maps of the same shape (any view reshapeable to (G, M, N)). The G*M rows are processed
    in blocks of about CHUNK_BYTES per torch thread, vectorized over the maps and rows of a block:
    every pass over a block then runs in the CPUs' L2 caches, several times faster than streaming
    whole tensors through memory once per statistic.
    """
    G, M, N = maps.shape
    spec = None if spec is None else spec.to(maps.dtype)
    js = ref is not None
    ref_maps = ref.reshape(G, M, N) if js else None
    log_tiny = math.log(torch.finfo(maps.dtype).tiny)  # ln 0 -> ln tiny, so that 0 ln 0 = 0
    cols = maps.new_zeros(G, N)
    # per row: sum_j x ln x, sum_j x, sum_j x |i - j|, 2 JSD to the reference (nats); special masses
    xlogx, rowsum, distance, js2 = (maps.new_zeros(G, M) for _ in range(4))
    special_mass = None if spec is None else maps.new_zeros(G, M, spec.shape[-1])
    todo = list(blocks(G, M, N, maps.element_size(), maps.device)) if G and M and N else []
    if todo:
        g, r = todo[0][1] - todo[0][0], todo[0][3] - todo[0][2]
        s1 = torch.empty((g, r, N), dtype=maps.dtype, device=maps.device)
        s2 = torch.empty_like(s1) if js else None
    for g0, g1, i0, i1 in todo:  # few torch ops per block: the loop runs ~G*M*N*4/CHUNK_BYTES times
        x = maps[g0:g1, i0:i1]  # (g, r, N)
        a = s1[: g1 - g0, : i1 - i0]
        if i1 - i0 == M:
            torch.sum(x, -2, out=cols[g0:g1])
        else:
            cols[g0:g1] += x.sum(-2)
        torch.sum(x, -1, out=rowsum[g0:g1, i0:i1])
        torch.log(x, out=a).clamp_min_(log_tiny).mul_(x)
        torch.sum(a, -1, out=xlogx[g0:g1, i0:i1])
        torch.sum(torch.mul(x, dist[i0:i1], out=a), -1, out=distance[g0:g1, i0:i1])
        if spec is not None:
            special_mass[g0:g1, i0:i1] = torch.matmul(x, spec)
        if js:
            js2_rowsum(x, ref_maps[g0:g1, i0:i1], a, s2[: g1 - g0, : i1 - i0], out=js2[g0:g1, i0:i1])
    entropy = xlogx.neg_()  # (G, M)
    js_d = None
    if js:  # JSD in bits = (2 JSD in nats) / (2 ln 2); distance = sqrt(JSD), as in js_rows
        js_d = js2.div_(2.0 * LN2).clamp_(0.0, 1.0).sqrt_()
    return {"cols": cols, "rowsum": rowsum, "entropy": entropy, "distance": distance,
            "special": special_mass, "js": js_d}


def column_statistics(col: torch.Tensor, n: int, m: int, eps: float, eps_relative: float, u) -> dict:
    """Per-head statistics from dense column masses (..., n) of m valid rows (all keys valid); ``u``
    (...,) the HNAS weights of ``below_hnas_bound``. A share is a count of keys over n (exact in the
    masses' dtype); a head with a NaN mass gets NaN shares."""
    nan = col.isnan().any(-1)  # (...,)

    def share(below: torch.Tensor) -> torch.Tensor:  # (..., n) bool -> (...,)
        return below.sum(-1).to(col.dtype).div_(n).masked_fill_(nan, math.nan)

    low, high = col.amin(-1), col.amax(-1)
    bound = 1.0 / n
    below = lambda floor: share(col < floor * (1.0 - BOUND_RTOL))  # noqa: E731  at a floor is not below
    dev = (col - m / n).abs_()
    return {
        "column_mass_min": low,
        "column_mass_max": high,
        "column_mass_min_over_bound": low * n,
        "explained_away": share(col < eps),
        "explained_away_relative": share(col * (n / m) < eps_relative),
        "below_dnas_bound": below(bound),
        "below_hnas_bound": below(u[..., None] * bound),
        "gini": gini(col),
        "ds_column_dev_max": dev.amax(-1),
        "ds_column_dev_mean": dev.mean(-1),
    }


def row_statistics(raw: RowSums, reference, special_index, punctuation_index=None) -> dict:
    """{statistic: (L, H)} of the rows (means over the M valid rows, and ``ds_row_dev_max``) in their
    table order; arguments as in :func:`summarize`."""
    L, H = raw.shape[:2]
    per_head = lambda t: t.mean(-1).reshape(L, H)  # noqa: E731  mean over the M rows
    out = {"row_entropy": per_head(raw.entropy), "attention_distance": per_head(raw.distance)}
    if special_index is not None:
        out["special_mass"] = per_head(raw.special[..., special_index])
    if punctuation_index is not None:
        out["punctuation_mass"] = per_head(raw.special[..., punctuation_index])
    out["ds_row_dev_max"] = (raw.rowsum - 1.0).abs_().amax(-1).reshape(L, H)
    if reference is not None:  # 0 for the reference itself
        out[f"js_to_{reference}"] = per_head(raw.js) if raw.js is not None else raw.cols.new_zeros(L, H)
    return out


def summarize(raw: RowSums, u, eps, eps_relative, reference, special_index, punctuation_index=None) -> dict:
    """{statistic: (L, H)} from the row sums of L*H maps whose M rows and N keys are all valid;
    ``special_index`` picks the key mask of ``special_mass`` (None: no special_mass), and
    ``punctuation_index`` that of ``punctuation_mass`` (None: none); ``reference``: the name in
    ``js_to_<reference>`` (None: no JS statistic)."""
    L, H, M, N = raw.shape
    cols = raw.cols
    out = column_statistics(cols.reshape(L, H, N), N, M, eps, eps_relative, u.to(cols.device, cols.dtype))
    return {**out, **row_statistics(raw, reference, special_index, punctuation_index)}


def u_table(u, L: int, H: int) -> torch.Tensor:
    """u (number or tensor broadcastable to (L, H), values in [0, 1]) -> float64 (L, H)."""
    if isinstance(u, torch.Tensor) and u.dim() > 0:
        u = check_unit_tensor("u", u)
        try:
            return torch.broadcast_to(u.double().cpu(), (L, H))
        except RuntimeError:
            raise ValueError(f"u must be a number or broadcastable to (L, H) = ({L}, {H}), got shape "
                             f"{tuple(u.shape)}") from None
    return torch.full((L, H), check_number("u", u, low=0.0, high=1.0), dtype=torch.float64)


# The statistics of ``tidy_table`` (name -> meaning); every value is per (variant, layer, head).
STATISTICS: dict[str, str] = {
    "column_mass_min": "min_j m_j over valid keys (m_j = sum_i pi_ij)",
    "column_mass_max": "max_j m_j over valid keys",
    "column_mass_min_over_bound": "N_valid * min_j m_j: >= 1 for DNAS, >= u for HNAS",
    "explained_away": "share of valid keys with m_j < eps (absolute eps)",
    "explained_away_relative": "share of valid keys with m_j * N_valid / M_valid < eps_relative",
    "below_dnas_bound": "share of valid keys with m_j < 1/N_valid (0 for DNAS)",
    "below_hnas_bound": "share of valid keys with m_j < u/N_valid (0 for HNAS with that u)",
    "gini": "Gini coefficient of the column masses (0 = uniform, -> 1 = one key takes all)",
    "row_entropy": "-sum_j pi_ij ln pi_ij, mean over valid rows (nats)",
    "attention_distance": "sum_j pi_ij |i - j|, mean over valid rows (tokens)",
    "special_mass": "sum of pi_ij over the special keys ([CLS], [SEP], <s>, ...; punctuation not included), "
    "mean over valid rows (only with `special`)",
    "punctuation_mass": "sum of pi_ij over the punctuation keys, mean over valid rows "
    "(only with `punctuation`)",
    "ds_column_dev_max": "max_j |m_j - M_valid/N_valid| (deviation from doubly stochastic)",
    "ds_column_dev_mean": "mean_j |m_j - M_valid/N_valid|",
    "ds_row_dev_max": "max_i |sum_j pi_ij - 1| over valid rows",
    "js_to_<reference>": "Jensen-Shannon distance (base 2) of each row to the reference variant's row, "
    "mean over valid rows (only when the reference variant is present)",
}

# The statistics in their table order (the row order within one (variant, layer, head)).
BASE_ORDER = [k for k in STATISTICS if not k.startswith("js_to_")]


def empty_statistics(names, reference, with_special: bool, L, H, with_punctuation: bool = False):
    """No valid token: every statistic is 0."""
    given = {"special_mass": with_special, "punctuation_mass": with_punctuation}
    skip = {k for k, g in given.items() if not g}
    keys = [k for k in BASE_ORDER if k not in skip]
    if reference is not None:
        keys.append(f"js_to_{reference}")
    return {name: {k: torch.zeros(L, H, dtype=torch.float64) for k in keys} for name in names}


def statistics_from_row_sums(
    sums: Mapping[str, RowSums], *, special_index: int | None = None, u=0.5, eps=0.01,
    eps_relative=0.1, reference: str | None = "unas", punctuation_index: int | None = None,
) -> dict[str, dict[str, torch.Tensor]]:
    """{variant: {statistic: (L, H)}} of the tidy table from each variant's row sums (all one shape).

    ``special_index``: which of the S key masks of ``RowSums.special`` is ``special_mass`` (None: no
    special_mass); ``punctuation_index`` the same for ``punctuation_mass``; ``reference``: the variant
    of ``js_to_<reference>`` (skipped if absent).
    """
    from attnlab.stats._checks import check_eps

    if not isinstance(sums, Mapping) or not sums:
        raise ValueError("sums must be a non-empty dict {variant name: RowSums}")
    bad = {n: type(s).__name__ for n, s in sums.items() if not isinstance(s, RowSums)}
    if bad:
        raise ValueError(f"sums must map variant names to RowSums, got {bad}")
    shapes = {n: s.shape for n, s in sums.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"every variant's row sums must be of one shape (L, H, M, N), got {shapes}")
    L, H, M, N = next(iter(shapes.values()))
    eps, eps_relative = check_eps("eps", eps), check_eps("eps_relative", eps_relative)
    u = u_table(u, L, H)
    names = list(sums)
    if reference not in sums:
        reference = None
    masks = {n: 0 if s.special is None else s.special.shape[-1] for n, s in sums.items()}
    if len(set(masks.values())) != 1:
        raise ValueError(f"every variant's row sums must have the same key masks (special (L*H, M, S)), got "
                         f"S = {masks}")
    S = masks[names[0]]
    special_index, punctuation_index = scalar(special_index), scalar(punctuation_index)  # numpy: Python
    for label, index in (("special_index", special_index), ("punctuation_index", punctuation_index)):
        if index is not None and (isinstance(index, bool) or not isinstance(index, int)
                                  or not 0 <= index < S):
            raise ValueError(f"{label} must be None or an int in [0, {S}) (the row sums' key masks), "
                             f"got {index!r}")
    if not (L and H and M and N):
        return empty_statistics(names, reference, special_index is not None, L, H,
                                punctuation_index is not None)
    # every variant's column masses at once, (V * L, H, N); the row statistics per variant (small)
    cols = torch.cat([sums[n].cols for n in names]).reshape(len(names) * L, H, N)
    uu = u.repeat(len(names), 1).to(cols.device, cols.dtype)
    columns = column_statistics(cols, N, M, eps, eps_relative, uu)
    out = {}
    for i, name in enumerate(names):
        rows = row_statistics(sums[name], reference, special_index, punctuation_index)
        out[name] = {**{k: t[i * L : (i + 1) * L] for k, t in columns.items()}, **rows}
    return out
