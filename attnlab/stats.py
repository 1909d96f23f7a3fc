"""Explaining-away statistics of attention weights (DESIGN.md §4). Pure functions on tensors.

Notation: queries i = 1..M ("upper" neurons, rows), keys j = 1..N ("lower" neurons, columns).

    weights   (..., M, N)   pi_ij; typically (L, B, H, M, N) or (L, H, N, N); rows sum to 1
    mask      bool, broadcastable to ``weights``; True = valid (query, key) pair
    valid     bool (N,) per-token vector (True = real token); ``pair_mask(valid)`` turns it into a mask

A *valid row* is a query with at least one valid pair, a *valid key* a column with at least one valid
pair; M_valid and N_valid count them per (...) slice. Masked entries contribute 0 to every sum, means
run over valid rows or keys only, and a slice with no valid row or key gives 0 -- never NaN.

Statistics (formulas in docs/STATISTICS.md):

    column_mass               m_j = sum_i pi_ij                                  (..., N)
    relative_column_mass      m_j * N_valid / M_valid   (mean 1 over valid keys)   (..., N)
    explained_away_fraction   share of valid keys with m_j < eps                 (...,)
    dnas_bound / hnas_bound   1/N_valid and u/N_valid: DNAS / HNAS column-mass floors
    row_entropy               -sum_j pi_ij ln pi_ij, mean over valid rows (nats)  (...,)
    mean_attention_distance   sum_j pi_ij |i - j|, mean over valid rows          (...,)
    special_token_mass        sum_{j special} pi_ij, mean over valid rows        (...,)
    gini                      Gini coefficient of column mass over valid keys    (...,)
    doubly_stochastic_deviation  |m_j - M_valid/N_valid| (max, mean), |row sum - 1| (max)
    attention_rollout         prod over layers of rownorm(0.5 A + 0.5 I), heads averaged
    js_distance               Jensen-Shannon distance (base 2, in [0, 1]) of rows, mean over rows
    head_js_matrix / variant_js_matrix   pairwise JS distances (H x H, V x V)
    word_aggregate            token -> word weights: columns summed, rows averaged
    tidy_table                one row per (variant, layer, head, statistic) as a DataFrame

Computation runs in float32, or float64 when given float64 (half precision is upcast).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:  # pandas is imported where tables are built: the tensor statistics run without it
    import pandas as pd

__all__ = [
    "STATISTICS",
    "DoublyStochasticDeviation",
    "aggregate_windows",
    "attention_rollout",
    "column_mass",
    "dnas_bound",
    "doubly_stochastic_deviation",
    "explained_away_fraction",
    "gini",
    "head_js_matrix",
    "hnas_bound",
    "js_distance",
    "mean_attention_distance",
    "merge_tokens",
    "pair_mask",
    "relative_column_mass",
    "row_entropy",
    "special_token_mass",
    "tidy_table",
    "variant_js_matrix",
    "word_aggregate",
    "word_units",
]

LN2 = math.log(2.0)
# Relative tolerance of the "below the DNAS / HNAS floor" tests: float32 column sums are accurate to
# ~1e-6 relative, so a column exactly at the floor must not count as below it.
BOUND_RTOL = 1e-4
# Working set of one block of attention rows in ``tidy_table`` per torch thread: a thread's share of
# the block and of its two scratch copies fits a 2 MiB per-core L2 cache.
CHUNK_BYTES = 512 << 10
# The same on a GPU, where a block is one kernel launch per pass and memory is plentiful.
DEVICE_CHUNK_BYTES = 64 << 20

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
    "special_mass": "sum of pi_ij over special keys, mean over valid rows (only with `special`)",
    "ds_column_dev_max": "max_j |m_j - M_valid/N_valid| (deviation from doubly stochastic)",
    "ds_column_dev_mean": "mean_j |m_j - M_valid/N_valid|",
    "ds_row_dev_max": "max_i |sum_j pi_ij - 1| over valid rows",
    "js_to_<reference>": "Jensen-Shannon distance (base 2) of each row to the reference variant's row, "
    "mean over valid rows (only when the reference variant is present)",
}


# ----------------------------------------------------------------------------------------------
# Argument checking and masks
# ----------------------------------------------------------------------------------------------


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_weights(name: str, w, min_dim: int = 2) -> torch.Tensor:
    if not isinstance(w, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
    if not w.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {w.dtype}")
    if w.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dims, got shape {tuple(w.shape)}")
    return w.to(_work_dtype(w.dtype))


def _check_bool(name: str, t, shape: torch.Size, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.bool:
        seen = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a boolean tensor ({what}), got {seen}")
    try:
        ok = torch.broadcast_shapes(t.shape, shape) == shape
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"{name} of shape {tuple(t.shape)} does not broadcast to {what} {tuple(shape)}")
    return t


def pair_mask(valid_q: torch.Tensor, valid_k: torch.Tensor | None = None) -> torch.Tensor:
    """(..., M, N) pair mask from per-token validity: valid_q[..., i] & valid_k[..., j].

    valid_q (..., M) bool; valid_k (..., N) bool, default ``valid_q`` (self-attention).
    """
    valid_k = valid_q if valid_k is None else valid_k
    for name, t in (("valid_q", valid_q), ("valid_k", valid_k)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.bool:
            raise ValueError(f"{name} must be a boolean tensor (True = real token)")
    return valid_q[..., :, None] & valid_k[..., None, :]


def _masked(weights: torch.Tensor, mask: torch.Tensor | None):
    """(weights with masked entries set to 0, row_valid (..., M) or None, key_valid (..., N) or None).

    row_valid / key_valid have the mask's leading shape (broadcastable to the weights' batch shape).
    """
    if mask is None:
        return weights, None, None
    mask = _check_bool("mask", mask, weights.shape, "the weights' shape")
    w = torch.where(mask, weights, weights.new_zeros(()))
    return w, mask.any(-1), mask.any(-2)


def _count(valid: torch.Tensor | None, size: int, like: torch.Tensor) -> torch.Tensor:
    """Number of valid entries along the last dim, as a float tensor broadcastable to like[..., 0]."""
    if valid is None:
        return like.new_full((), float(size))
    return valid.sum(-1).to(like.dtype)


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den, and 0 where den == 0 (empty slices)."""
    den = torch.as_tensor(den, dtype=num.dtype, device=num.device)
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), num.new_zeros(()))


def _valid_mean(x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """Mean of x (..., K) over the last dim restricted to ``valid`` (..., K); 0 when none is valid."""
    if valid is None:
        return x.mean(-1) if x.shape[-1] else x.new_zeros(x.shape[:-1])
    x = torch.where(valid, x, x.new_zeros(()))
    return _safe_div(x.sum(-1), valid.sum(-1))


# ----------------------------------------------------------------------------------------------
# Column mass and explaining away (DESIGN.md §4)
# ----------------------------------------------------------------------------------------------


def column_mass(weights: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """m_j = sum_i pi_ij over valid rows: the attention key j ("lower neuron") receives.

    weights (..., M, N); mask bool broadcastable to weights. Returns (..., N); masked pairs add 0, so
    an invalid key gets 0. Over valid keys the masses sum to M_valid (rows sum to 1).
    """
    w, _, _ = _masked(_check_weights("weights", weights), mask)
    return w.sum(-2)  # (..., N)


def relative_column_mass(weights: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """m_j * N_valid / M_valid (..., N): mean 1 over valid keys, comparable across lengths.

    Invalid keys get 0; a slice without valid rows gets 0 everywhere.
    """
    w, row_valid, key_valid = _masked(_check_weights("weights", weights), mask)
    m = w.sum(-2)  # (..., N)
    n_valid = _count(key_valid, w.shape[-1], m)
    m_valid = _count(row_valid, w.shape[-2], m)
    return m * _safe_div(n_valid, m_valid)[..., None]


def explained_away_fraction(
    weights: torch.Tensor, eps: float, mask: torch.Tensor | None = None, relative: bool = False
) -> torch.Tensor:
    """Share of valid keys that are eps-explained away: m_j < eps (..., M, N) -> (...,).

    With ``relative=True`` the relative column mass m_j * N_valid / M_valid is compared to eps (so
    eps=0.1 means "less than a tenth of the average key"). A slice without valid keys gives 0.
    """
    eps = _check_eps("eps", eps)
    w, row_valid, key_valid = _masked(_check_weights("weights", weights), mask)
    m = w.sum(-2)  # (..., N)
    if relative:
        m = m * _safe_div(_count(key_valid, w.shape[-1], m), _count(row_valid, w.shape[-2], m))[..., None]
    return _valid_mean((m < eps).to(m.dtype), key_valid)


def dnas_bound(n_valid: int | torch.Tensor) -> float | torch.Tensor:
    """1 / N_valid: DNAS gives every valid key at least this column mass (0 when N_valid = 0)."""
    if isinstance(n_valid, torch.Tensor):
        n = n_valid.to(torch.float64 if n_valid.dtype == torch.float64 else torch.float32)
        return _safe_div(torch.ones_like(n), n)
    if isinstance(n_valid, bool) or not isinstance(n_valid, int) or n_valid < 0:
        raise ValueError(f"n_valid must be an integer >= 0 (or a tensor of them), got {n_valid!r}")
    return 1.0 / n_valid if n_valid else 0.0


def hnas_bound(u: float | torch.Tensor, n_valid: int | torch.Tensor) -> float | torch.Tensor:
    """u / N_valid: HNAS (u * DNAS + (1 - u) * UNAS) gives every valid key at least this mass."""
    if isinstance(u, torch.Tensor):
        return u * dnas_bound(n_valid)
    if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 <= u <= 1.0:
        raise ValueError(f"u must be a float in [0, 1] (or a tensor of them), got {u!r}")
    return u * dnas_bound(n_valid)


# ----------------------------------------------------------------------------------------------
# Row statistics
# ----------------------------------------------------------------------------------------------


def _xlogx_rowsum(w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """sum_j w_ij ln w_ij (..., M), with 0 ln 0 = 0. ``out`` is an optional scratch like ``w``."""
    log_tiny = math.log(torch.finfo(w.dtype).tiny)  # ln 0 = -inf is clamped: 0 * ln(tiny) = 0
    return torch.log(w, out=out).clamp_min_(log_tiny).mul_(w).sum(-1)


def row_entropy(weights: torch.Tensor, mask: torch.Tensor | None = None, reduce: bool = True) -> torch.Tensor:
    """H_i = -sum_j pi_ij ln pi_ij in nats (..., M, N) -> mean over valid rows (...,).

    ``reduce=False`` returns the per-row entropies (..., M), 0 on invalid rows.
    Divide by ln N_valid for a normalized entropy in [0, 1].
    """
    w, row_valid, _ = _masked(_check_weights("weights", weights), mask)
    h = -_xlogx_rowsum(w)  # (..., M)
    if not reduce:
        return h if row_valid is None else torch.where(row_valid, h, h.new_zeros(()))
    return _valid_mean(h, row_valid)


def _distance_matrix(m: int, n: int, like: torch.Tensor, positions: torch.Tensor | None = None):
    """(M, N) |pos_i - pos_j| in like's dtype; positions default to 0..M-1 (queries), 0..N-1 (keys)."""
    if positions is None:
        qi = torch.arange(m, device=like.device, dtype=like.dtype)
        kj = torch.arange(n, device=like.device, dtype=like.dtype)
    else:
        qi = kj = positions.to(device=like.device, dtype=like.dtype)
    return (qi[:, None] - kj[None, :]).abs()


def mean_attention_distance(
    weights: torch.Tensor, mask: torch.Tensor | None = None, reduce: bool = True
) -> torch.Tensor:
    """d_i = sum_j pi_ij |i - j| (in tokens) (..., M, N) -> mean over valid rows (...,).

    Query i and key j are indexed from 0 on both axes. ``reduce=False`` gives (..., M).
    """
    w, row_valid, _ = _masked(_check_weights("weights", weights), mask)
    d = torch.linalg.vecdot(w, _distance_matrix(w.shape[-2], w.shape[-1], w))  # (..., M)
    if not reduce:
        return d if row_valid is None else torch.where(row_valid, d, d.new_zeros(()))
    return _valid_mean(d, row_valid)


def special_token_mass(
    weights: torch.Tensor, special: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """s = sum_{j: special_j} pi_ij, mean over valid rows (..., M, N) -> (...,).

    special: bool per key, (N,) or broadcastable to (..., N) -- e.g. [CLS]/[SEP] or punctuation flags.
    """
    w, row_valid, _ = _masked(_check_weights("weights", weights), mask)
    special = _check_bool("special", special, torch.Size((*w.shape[:-2], w.shape[-1])), "keys (..., N)")
    s = (w * special[..., None, :].to(w.dtype)).sum(-1)  # (..., M)
    return _valid_mean(s, row_valid)


# ----------------------------------------------------------------------------------------------
# Column-mass shape: Gini and doubly stochastic deviation
# ----------------------------------------------------------------------------------------------


def _sorted(x: torch.Tensor) -> torch.Tensor:
    """x sorted ascending along the last dim (NaN last). On the CPU through numpy, whose sort of many
    short rows is ~50x faster than torch's (0.2 ms against 12 ms for 288 rows of 512)."""
    if x.device.type != "cpu" or x.requires_grad:
        return x.sort(-1).values
    return torch.from_numpy(np.sort(x.numpy(), axis=-1))


def gini(column_mass: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Gini coefficient of nonnegative masses over the last dim (..., N) -> (...,).

    G = sum_ab |x_a - x_b| / (2 n^2 mean x), computed from the ascending sort as
    G = 2 sum_k k x_(k) / (n sum x) - (n + 1) / n (k = 1..n). 0 for equal masses, (n-1)/n when one
    key takes everything. ``valid`` (bool, broadcastable to column_mass) restricts to valid keys;
    fewer than one valid key or zero total mass gives 0.
    """
    x = _check_weights("column_mass", column_mass, min_dim=1)
    if valid is None:
        xs = _sorted(x)
        n = x.new_full((), float(x.shape[-1]))
        ranks = torch.arange(1, x.shape[-1] + 1, device=x.device, dtype=x.dtype)
        weighted = (xs * ranks).sum(-1)
        total = x.sum(-1)
    else:
        valid = _check_bool("valid", valid, x.shape, "the masses' shape").expand_as(x)
        xs = _sorted(torch.where(valid, x, torch.full_like(x, math.inf)))  # invalid last
        n = valid.sum(-1).to(x.dtype)
        ranks = torch.arange(1, x.shape[-1] + 1, device=x.device, dtype=x.dtype)
        keep = ranks <= n[..., None]
        weighted = torch.where(keep, xs * ranks, x.new_zeros(())).sum(-1)
        total = torch.where(valid, x, x.new_zeros(())).sum(-1)
    g = _safe_div(2.0 * weighted, n * total) - _safe_div(n + 1.0, n)
    return torch.where(total > 0, g, x.new_zeros(()))


@dataclass(frozen=True)
class DoublyStochasticDeviation:
    """How far weights are from doubly stochastic (columns at M_valid/N_valid, rows at 1); (...,)."""

    column_max: torch.Tensor  # max_j |m_j - M_valid/N_valid| over valid keys
    column_mean: torch.Tensor  # mean_j |m_j - M_valid/N_valid| over valid keys
    row_max: torch.Tensor  # max_i |sum_j pi_ij - 1| over valid rows


def doubly_stochastic_deviation(
    weights: torch.Tensor, mask: torch.Tensor | None = None
) -> DoublyStochasticDeviation:
    """Deviation of (..., M, N) weights from double stochasticity (the Sinkhorn limit), per slice.

    The column target is M_valid/N_valid (1 for square attention), the mean column mass of row-
    stochastic weights; Sinkhorn iterations drive ``column_max`` to 0.
    """
    w, row_valid, key_valid = _masked(_check_weights("weights", weights), mask)
    m = w.sum(-2)  # (..., N)
    target = _safe_div(_count(row_valid, w.shape[-2], m), _count(key_valid, w.shape[-1], m))
    col_dev = (m - target[..., None]).abs()
    row_dev = (w.sum(-1) - 1.0).abs()  # (..., M)
    return DoublyStochasticDeviation(
        column_max=_valid_max(col_dev, key_valid),
        column_mean=_valid_mean(col_dev, key_valid),
        row_max=_valid_max(row_dev, row_valid),
    )


def _valid_max(x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """Max of nonnegative x over the last dim restricted to valid; 0 when empty."""
    if x.shape[-1] == 0:
        return x.new_zeros(x.shape[:-1])
    if valid is not None:
        x = torch.where(valid, x, x.new_zeros(()))
    return x.amax(-1)


# ----------------------------------------------------------------------------------------------
# Attention rollout (Abnar & Zuidema, 2020)
# ----------------------------------------------------------------------------------------------


def attention_rollout(
    weights: torch.Tensor,
    add_residual: bool = True,
    mask: torch.Tensor | None = None,
    all_layers: bool = False,
) -> torch.Tensor:
    """Attention rollout: R = A_L ... A_2 A_1 with A_l = rownorm(0.5 W_l + 0.5 I), heads averaged.

    weights: (L, ..., N, N); when it has >= 4 dims the heads are dim -3 ((L, H, N, N) or
    (L, B, H, N, N)) and are averaged; (L, N, N) is taken as already head-averaged.
    mask: bool broadcastable to ``weights`` (e.g. (N, N) for every layer); masked entries are zeroed, so a
    padded token's row becomes the identity row (with the residual) and no NaN appears.
    Returns (..., N, N) without the head dim (R_ij: how much token j flows into position i at the
    top), or every layer's cumulative rollout (L, ..., N, N) with ``all_layers=True``.
    """
    w = _check_weights("weights", weights, min_dim=3)
    L, N = w.shape[0], w.shape[-1]
    if w.shape[-2] != N:
        raise ValueError(f"attention_rollout needs square (N, N) maps, got shape {tuple(w.shape)}")
    if mask is not None:
        mask = _check_bool("mask", mask, w.shape, "the weights' shape")
        w = torch.where(mask, w, w.new_zeros(()))
    if w.dim() >= 4:
        w = w.mean(-3)  # heads averaged: (L, ..., N, N)
    eye = torch.eye(N, dtype=w.dtype, device=w.device)
    if add_residual:
        w = 0.5 * w + 0.5 * eye
    w = w / torch.where(w.sum(-1, keepdim=True) > 0, w.sum(-1, keepdim=True), 1.0)  # rows sum to 1
    out, r = [], w[0]
    out.append(r)
    for layer in range(1, L):
        r = w[layer] @ r  # (..., N, N)
        out.append(r)
    return torch.stack(out) if all_layers else r


# ----------------------------------------------------------------------------------------------
# Jensen-Shannon distance
# ----------------------------------------------------------------------------------------------


def _js_rows(p, q, hp, hq, mix_out=None, log_out=None) -> torch.Tensor:
    """Per-row JS distance (base 2) from rows p, q (..., M, N) and their entropies hp, hq (..., M).

    JSD = H((p + q)/2) - (H(p) + H(q))/2 in bits, clamped to [0, 1]; distance = sqrt(JSD).
    Symmetric bit for bit, and exactly 0 for identical rows ((p + p)/2 == p in floating point).
    ``mix_out`` / ``log_out`` are optional scratch tensors shaped like p.
    """
    mix = torch.add(p, q, out=mix_out).mul_(0.5)
    hm = -_xlogx_rowsum(mix, out=log_out)  # (..., M)
    jsd = (hm - 0.5 * (hp + hq)) / LN2
    return jsd.clamp_(0.0, 1.0).sqrt_()


def js_distance(
    p: torch.Tensor, q: torch.Tensor, mask: torch.Tensor | None = None, reduce: bool = True
) -> torch.Tensor:
    """Jensen-Shannon distance between the rows of p and q (..., M, N) -> mean over valid rows (...,).

    Base 2, so each row's distance lies in [0, 1]: 0 for identical rows, 1 for disjoint supports.
    It is sqrt(JSD), a metric. ``reduce=False`` returns (..., M) (0 on invalid rows).
    In float32 distances below ~1e-3 are at rounding level (sqrt of ~1e-7); pass float64 for more.
    """
    p = _check_weights("p", p)
    q = _check_weights("q", q)
    if p.shape != q.shape:
        raise ValueError(f"p and q must have the same shape, got {tuple(p.shape)} and {tuple(q.shape)}")
    dt = torch.promote_types(p.dtype, q.dtype)
    p, row_valid, _ = _masked(p.to(dt), mask)
    q, _, _ = _masked(q.to(dt), mask)
    d = _js_rows(p, q, -_xlogx_rowsum(p), -_xlogx_rowsum(q))  # (..., M)
    if not reduce:
        return d if row_valid is None else torch.where(row_valid, d, d.new_zeros(()))
    return _valid_mean(d, row_valid)


def head_js_matrix(weights: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """JS distance between every pair of heads: (..., H, M, N) -> (..., H, H), symmetric, 0 diagonal.

    Entry (a, b) is ``js_distance(weights[..., a, :, :], weights[..., b, :, :])``. One vectorized pass
    per head offset (H - 1 passes over the weights); ``mask`` broadcastable to the weights.
    """
    w = _check_weights("weights", weights, min_dim=3)
    w, row_valid, _ = _masked(w, mask)
    H = w.shape[-3]
    h = -_xlogx_rowsum(w)  # (..., H, M)
    out = w.new_zeros((*w.shape[:-3], H, H))
    rv = None if row_valid is None else row_valid.expand(*w.shape[:-1])  # (..., H, M)
    for k in range(1, H):  # head pairs (a, a + k) for every a at once
        d = _js_rows(w[..., :-k, :, :], w[..., k:, :, :], h[..., :-k, :], h[..., k:, :])  # (..., H-k, M)
        d = _valid_mean(d, None if rv is None else rv[..., :-k, :] & rv[..., k:, :])
        idx = torch.arange(H - k, device=w.device)
        out[..., idx, idx + k] = d
        out[..., idx + k, idx] = d
    return out


def variant_js_matrix(weights: Mapping[str, torch.Tensor], mask: torch.Tensor | None = None) -> torch.Tensor:
    """JS distance between every pair of variants: {name: (..., M, N)} -> (V, V, ...), in dict order.

    Entry (a, b) is ``js_distance(weights[a], weights[b], mask)`` (mean over valid rows per slice).
    """
    names = list(weights)
    if not names:
        raise ValueError("weights must map at least one variant name to a tensor, got an empty mapping")
    ws = {n: _masked(_check_weights(f"weights[{n!r}]", weights[n]), mask) for n in names}
    shapes = {n: tuple(t[0].shape) for n, t in ws.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"every variant's weights must have one shape, got {shapes}")
    ents = {n: -_xlogx_rowsum(t[0]) for n, t in ws.items()}
    row_valid = ws[names[0]][1]
    first = ws[names[0]][0]
    out = first.new_zeros((len(names), len(names), *first.shape[:-2]))
    for a in range(len(names)):
        for b in range(a + 1, len(names)):
            pa, pb = ws[names[a]][0], ws[names[b]][0]
            d = _valid_mean(_js_rows(pa, pb, ents[names[a]], ents[names[b]]), row_valid)
            out[a, b] = out[b, a] = d
    return out


# ----------------------------------------------------------------------------------------------
# Word-level aggregation (WordPiece "##", byte-level BPE "Ġ", SentencePiece "▁")
# ----------------------------------------------------------------------------------------------


def word_units(word_ids: Sequence[int | None]) -> list[list[int]]:
    """Token indices of each unit: a word's pieces (in order of the word's first token), or one
    special token (word id None) on its own."""
    units: list[list[int]] = []
    seen: dict[int, int] = {}
    for t, wid in enumerate(word_ids):
        if wid is None:
            units.append([t])
        elif wid in seen:
            units[seen[wid]].append(t)
        else:
            seen[wid] = len(units)
            units.append([t])
    return units


def word_aggregate(weights: torch.Tensor, word_ids: Sequence[int | None]) -> torch.Tensor:
    """Token-level (..., N, N) weights -> word-level (..., U, U), U = len(word_units(word_ids)).

    Convention (Clark et al., 2019): attention *received* by a word is the sum over its pieces
    (columns summed), attention *given* by a word is the mean over its pieces (rows averaged). Rows
    that summed to 1 still sum to 1. Special tokens (word id None) stay units of their own; padding
    should be removed before aggregating (it would otherwise become units too).
    """
    w = _check_weights("weights", weights)
    N = w.shape[-1]
    if w.shape[-2] != N or len(word_ids) != N:
        raise ValueError(
            f"word_aggregate needs (..., N, N) weights and len(word_ids) == N; got weights "
            f"{tuple(w.shape)} and {len(word_ids)} word ids"
        )
    units = word_units(word_ids)
    assign = w.new_zeros(len(units), N)  # (U, N) one-hot: token t belongs to unit u
    for u, toks in enumerate(units):
        assign[u, toks] = 1.0
    rows = assign / assign.sum(-1, keepdim=True)  # averaging over a unit's tokens
    return rows @ w @ assign.T  # (..., U, U)


_WORD_START = ("Ġ", "▁")  # byte-level BPE (GPT-2, RoBERTa) and SentencePiece word-start markers


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (byte-level BPE alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, map(chr, cs), strict=True))


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def _decode_byte_level(text: str) -> str:
    if all(c in _UNICODE_TO_BYTE for c in text):
        return bytes(_UNICODE_TO_BYTE[c] for c in text).decode("utf-8", errors="replace")
    return text


def merge_tokens(
    tokens: Sequence[str], word_ids: Sequence[int | None], byte_level: bool | None = None
) -> list[str]:
    """One label per unit of ``word_units(word_ids)``: the unit's pieces joined into a word.

    WordPiece continuation markers "##" and word-start markers "Ġ" / "▁" are removed; special tokens
    are kept as they are. ``byte_level`` (default: auto, True when a token starts with "Ġ") decodes
    GPT-2 byte-level pieces back to UTF-8 text (e.g. "Ã©" -> "é").
    """
    if len(tokens) != len(word_ids):
        raise ValueError(f"tokens and word_ids must have one length, got {len(tokens)} and {len(word_ids)}")
    if byte_level is None:
        byte_level = any(t.startswith("Ġ") for t in tokens)
    labels = []
    for toks in word_units(word_ids):
        if word_ids[toks[0]] is None:
            labels.append(tokens[toks[0]])
            continue
        pieces = []
        for t in (tokens[i] for i in toks):
            if t.startswith("##"):
                t = t[2:]
            elif t.startswith(_WORD_START):
                t = t[1:]
            pieces.append(t)
        word = "".join(pieces)
        labels.append(_decode_byte_level(word) if byte_level else word)
    return labels


# ----------------------------------------------------------------------------------------------
# Tidy table: every per-head statistic, vectorized over layers and heads
# ----------------------------------------------------------------------------------------------


def _column_statistics(col: torch.Tensor, n: int, m: int, eps: float, eps_relative: float, u) -> dict:
    """Per-head statistics from dense column masses (..., n) of m valid rows (all keys valid)."""
    rel = col * (n / m)
    bound = 1.0 / n
    below = lambda floor: (col < floor * (1.0 - BOUND_RTOL)).to(col.dtype).mean(-1)  # noqa: E731
    dev = (col - m / n).abs()
    return {
        "column_mass_min": col.amin(-1),
        "column_mass_max": col.amax(-1),
        "column_mass_min_over_bound": col.amin(-1) * n,
        "explained_away": (col < eps).to(col.dtype).mean(-1),
        "explained_away_relative": (rel < eps_relative).to(col.dtype).mean(-1),
        "below_dnas_bound": below(bound),
        "below_hnas_bound": below(u[..., None] * bound),
        "gini": gini(col),
        "ds_column_dev_max": dev.amax(-1),
        "ds_column_dev_mean": dev.mean(-1),
    }


def _check_eps(name: str, eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"{name} must be a number >= 0, got {eps!r}")
    return float(eps)


def _check_table_args(weights, valid, special, u):
    if not isinstance(weights, Mapping) or not weights:
        raise ValueError("weights must be a non-empty dict {variant name: tensor (L, H, M, N)}")
    ws = {name: _check_weights(f"weights[{name!r}]", w, min_dim=4).detach() for name, w in weights.items()}
    shapes = {name: tuple(w.shape) for name, w in ws.items()}
    if any(len(s) != 4 for s in shapes.values()) or len(set(shapes.values())) != 1:
        raise ValueError(f"every variant's weights must be one shape (L, H, M, N), got {shapes}")
    L, H, M, N = next(iter(shapes.values()))
    if valid is not None:
        if M != N:
            raise ValueError(f"valid (per-token, (N,)) needs square weights, got (M, N) = ({M}, {N})")
        _check_bool("valid", valid, torch.Size((N,)), "tokens (N,)")
        if valid.shape != (N,):
            raise ValueError(f"valid must have shape ({N},), got {tuple(valid.shape)}")
    if special is not None:
        _check_bool("special", special, torch.Size((N,)), "keys (N,)")
        if special.shape != (N,):
            raise ValueError(f"special must have shape ({N},), got {tuple(special.shape)}")
    return ws, (L, H, M, N), _u_table(u, L, H)


def _u_table(u, L: int, H: int) -> torch.Tensor:
    """u (float or tensor broadcastable to (L, H)) -> float64 (L, H); ValueError if it is not."""
    if isinstance(u, torch.Tensor):
        try:
            return torch.broadcast_to(u.detach().double(), (L, H))
        except RuntimeError:
            raise ValueError(f"u must be a float or broadcastable to (L, H) = ({L}, {H}), got shape "
                             f"{tuple(u.shape)}") from None
    hnas_bound(u, 1)  # validates u
    return torch.full((L, H), float(u), dtype=torch.float64)


def _tidy_from_row_sums(
    raw: Mapping[str, dict], shape: tuple[int, int, int, int], *, special_index: int | None, u, eps,
    eps_relative, reference: str | None, window=None,
) -> pd.DataFrame:
    """``tidy_table`` from row sums already computed (``_row_sums`` layout, one dict per variant over
    L*H maps; the reference's ``js`` is None): what ``attnlab.hf`` computes while it builds the
    weights. Same rows, columns and values as ``tidy_table`` on those weights."""
    L, H = shape[:2]
    stats = _statistics_from_row_sums(raw, shape, special_index=special_index, u=u, eps=eps,
                                      eps_relative=eps_relative, reference=reference)
    return _to_frame(stats, list(raw), L, H, window)


def _statistics_from_row_sums(
    raw: Mapping[str, dict], shape: tuple[int, int, int, int], *, special_index: int | None, u, eps,
    eps_relative, reference: str | None,
) -> dict[str, dict[str, torch.Tensor]]:
    """{variant: {statistic: (L, H)}} of :func:`_tidy_from_row_sums` as tensors (no pandas)."""
    L, H, M, N = shape
    eps, eps_relative = _check_eps("eps", eps), _check_eps("eps_relative", eps_relative)
    u = _u_table(u, L, H)
    names = list(raw)
    if reference not in raw:
        reference = None
    if not (M and N):
        return _empty_statistics(names, reference, special_index, L, H)
    V = len(names)  # every variant at once: (V * L, H) "layers"
    first = raw[names[0]]
    stacked = {
        key: None if first[key] is None and key != "js" else torch.stack(
            [raw[n][key] if raw[n][key] is not None else first["entropy"].new_zeros(first["entropy"].shape)
             for n in names]
        ).flatten(0, 1)
        for key in first
    }
    both = _summarize(stacked, V * L, H, M, N, u.repeat(V, 1), eps, eps_relative, reference, special_index)
    return {name: {k: t[i * L : (i + 1) * L] for k, t in both.items()} for i, name in enumerate(names)}


@torch.no_grad()
def tidy_table(
    weights: Mapping[str, torch.Tensor],
    *,
    valid: torch.Tensor | None = None,
    special: torch.Tensor | None = None,
    u: float | torch.Tensor = 0.5,
    eps: float = 0.01,
    eps_relative: float = 0.1,
    reference: str | None = "unas",
    window: int | str | None = None,
) -> pd.DataFrame:
    """Every per-head statistic of every variant as one tidy DataFrame.

    Args:
        weights: {variant: (L, H, M, N)} weights of one example (one window), all the same shape.
        valid: bool (N,) real tokens (square weights only); invalid tokens are dropped as queries and
            keys before anything is computed, distances keep the original positions.
        special: bool (N,) keys whose received mass is reported as ``special_mass``.
        u: HNAS hybrid weight for ``below_hnas_bound``, float or tensor broadcastable to (L, H).
        eps: absolute threshold of ``explained_away``; eps_relative: of ``explained_away_relative``.
        reference: variant that ``js_to_<reference>`` compares every variant with (skipped if absent).
        window: when given, a ``window`` column with this value (see ``aggregate_windows``).

    Returns:
        DataFrame with columns ``variant, layer, head, statistic, value`` (+ ``window``), one row per
        (variant, layer, head, statistic) in that order; ``STATISTICS`` describes each statistic.
        Layers and heads count from 0. Values are float64 and never NaN.
    """
    ws, (L, H, M, N), u = _check_table_args(weights, valid, special, u)
    eps, eps_relative = _check_eps("eps", eps), _check_eps("eps_relative", eps_relative)
    names = list(ws)
    positions = None
    if valid is not None and not bool(valid.all()):
        keep = valid.nonzero().squeeze(-1)  # drop padding once: every later pass is dense
        ws = {k: w.index_select(-2, keep).index_select(-1, keep) for k, w in ws.items()}
        special = None if special is None else special[keep]
        positions = keep
        M = N = int(keep.numel())
    if reference not in ws:
        reference = None
    if not (M and N):
        return _to_frame(_empty_statistics(names, reference, special, L, H), names, L, H, window)
    spec = None if special is None else special[:, None]  # (N, 1)
    dist = None
    raw = {}
    for name in names:
        w = ws[name]
        dist = _distance_matrix(M, N, w, positions) if dist is None or dist.dtype != w.dtype else dist
        js_ref = None if reference is None or name == reference else ws[reference]
        raw[name] = _row_sums(w.reshape(L * H, M, N), spec, dist, js_ref)
    index = None if spec is None else 0
    per_variant = {
        name: _summarize(raw[name], L, H, M, N, u, eps, eps_relative, reference, index) for name in names
    }
    return _to_frame(per_variant, names, L, H, window)


def _blocks(maps: int, m: int, n: int, itemsize: int, device: torch.device | None = None):
    """(g0, g1, i0, i1) blocks of about CHUNK_BYTES per thread over (maps, m rows) of (m, n) maps (on a
    GPU: blocks of DEVICE_CHUNK_BYTES)."""
    on_cpu = device is None or device.type == "cpu"
    chunk = CHUNK_BYTES * max(1, torch.get_num_threads()) if on_cpu else DEVICE_CHUNK_BYTES
    row_bytes = max(1, n * itemsize)
    if m * row_bytes <= chunk:
        g, r = max(1, chunk // (m * row_bytes)), m
    else:
        g, r = 1, max(1, chunk // row_bytes)
    for g0 in range(0, maps, g):
        for i0 in range(0, m, r):
            yield g0, min(g0 + g, maps), i0, min(i0 + r, m)


def _js2_rowsum(p, q, a, b, out=None, positive: bool = False) -> torch.Tensor:
    """sum_j p ln(2p / (p + q)) + q ln(2q / (p + q)) over the last dim: twice the Jensen-Shannon
    divergence (nats) of rows p and q (..., N) (a, b: scratch like p).

    The logarithms are log1p(+-d) with d = (p - q) / (p + q): no cancellation for close rows, where
    H((p + q)/2) - (H(p) + H(q))/2 in float32 loses the divergence to rounding (its square root, the
    distance, amplifies that). Zeros contribute 0 (0 ln 0); exactly 0 for identical rows.
    ``positive``: every entry of p and q is > 0 (skips the guards for zeros).
    """
    d = torch.sub(p, q, out=a).div_(torch.add(p, q, out=b))
    if positive:
        t = torch.log1p(d, out=b).mul_(p)
        return torch.sum(t.add_(d.neg_().log1p_().mul_(q)), -1, out=out)
    log_tiny = math.log(torch.finfo(p.dtype).tiny)
    d.nan_to_num_(0.0)  # 0 / 0 -> 0
    t = torch.log1p(d, out=b).clamp_min_(log_tiny).mul_(p)
    t.add_(d.neg_().log1p_().clamp_min_(log_tiny).mul_(q))
    return torch.sum(t, -1, out=out)


def _row_sums(maps, spec, dist, ref) -> dict:
    """Per-row and per-column sums of (G, M, N) maps, from which ``_summarize`` derives every statistic.

    -> {"cols": (G, N) column masses, "rowsum": (G, M), "entropy": (G, M) -sum_j x ln x (nats),
    "distance": (G, M) sum_j x |i - j|, "special": (G, M, S) mass on each of the S key masks in
    ``spec`` (N, S) (None without), "js": (G, M) Jensen-Shannon distance (base 2) to the reference
    rows (None for the reference itself; :func:`_js2_rowsum`)}. ``dist``: (M, N) |pos_i - pos_j|;
    ``ref``: None, or the reference maps of the same shape (any view reshapeable to (G, M, N)).

    The G*M rows are processed in blocks of about CHUNK_BYTES per torch thread, vectorized over the
    maps and rows of a block: every pass over a block then runs in the CPUs' L2 caches, several times
    faster than streaming whole tensors through memory once per statistic.
    """
    G, M, N = maps.shape
    spec = None if spec is None else spec.to(maps.dtype)
    js = ref is not None
    ref_maps = ref.reshape(G, M, N) if js else None
    log_tiny = math.log(torch.finfo(maps.dtype).tiny)  # ln 0 -> ln tiny, so that 0 ln 0 = 0
    blocks = list(_blocks(G, M, N, maps.element_size(), maps.device))
    g, r = blocks[0][1] - blocks[0][0], blocks[0][3] - blocks[0][2]
    s1 = torch.empty((g, r, N), dtype=maps.dtype, device=maps.device)
    s2 = torch.empty_like(s1) if js else None
    cols = maps.new_zeros(G, N)
    # per row: sum_j x ln x, sum_j x, sum_j x |i - j|, 2 JSD to the reference (nats); special masses
    xlogx, rowsum, distance, js2 = (maps.new_zeros(G, M) for _ in range(4))
    special_mass = None if spec is None else maps.new_zeros(G, M, spec.shape[-1])
    for g0, g1, i0, i1 in blocks:  # few torch ops per block: the loop runs ~G*M*N*4/CHUNK_BYTES times
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
            _js2_rowsum(x, ref_maps[g0:g1, i0:i1], a, s2[: g1 - g0, : i1 - i0], out=js2[g0:g1, i0:i1])
    entropy = xlogx.neg_()  # (G, M)
    js_d = None
    if js:  # JSD in bits = (2 JSD in nats) / (2 ln 2); distance = sqrt(JSD), as in _js_rows
        js_d = js2.div_(2.0 * LN2).clamp_(0.0, 1.0).sqrt_()
    return {"cols": cols, "rowsum": rowsum, "entropy": entropy, "distance": distance,
            "special": special_mass, "js": js_d}


def _summarize(raw: dict, L, H, M, N, u, eps, eps_relative, reference, special_index) -> dict:
    """{statistic: (L, H)} from the row sums of ``_row_sums`` for L*H maps of M valid rows and N valid
    keys; ``special_index`` picks the key mask of ``special_mass`` (None: no special_mass);
    ``reference``: the name in ``js_to_<reference>`` (None: no JS statistic)."""
    cols = raw["cols"]
    per_head = lambda t: t.mean(-1).reshape(L, H)  # noqa: E731  mean over the M rows
    out = _column_statistics(cols.reshape(L, H, N), N, M, eps, eps_relative, u.to(cols.device, cols.dtype))
    out["row_entropy"] = per_head(raw["entropy"])
    out["attention_distance"] = per_head(raw["distance"])
    if special_index is not None:
        out["special_mass"] = per_head(raw["special"][..., special_index])
    out["ds_row_dev_max"] = (raw["rowsum"] - 1.0).abs().amax(-1).reshape(L, H)
    if reference is not None:  # 0 for the reference itself
        js = raw["js"]
        out[f"js_to_{reference}"] = per_head(js) if js is not None else cols.new_zeros(L, H)
    return out


def _empty_statistics(names, reference, special, L, H):
    """No valid token: every statistic is 0."""
    keys = [k for k in _ORDER if k != "special_mass" or special is not None]
    if reference is not None:
        keys.append(f"js_to_{reference}")
    return {name: {k: torch.zeros(L, H, dtype=torch.float64) for k in keys} for name in names}


# Column order of the statistics in the table (the row order within one (variant, layer, head)).
_ORDER = [k for k in STATISTICS if not k.startswith("js_to_")]


def _to_frame(stats: dict, names: list[str], L: int, H: int, window) -> pd.DataFrame:
    import pandas as pd

    keys = [k for k in _ORDER if k in stats[names[0]]]
    keys += [k for k in stats[names[0]] if k not in keys]
    S, V = len(keys), len(names)
    values = np.stack([
        torch.stack([stats[n][k].to("cpu", torch.float64) for k in keys], -1).numpy() for n in names
    ])  # (V, L, H, S)
    frame = pd.DataFrame({
        "variant": np.repeat(np.asarray(names, dtype=object), L * H * S),
        "layer": np.tile(np.repeat(np.arange(L), H * S), V),
        "head": np.tile(np.repeat(np.arange(H), S), V * L),
        "statistic": np.tile(np.asarray(keys, dtype=object), V * L * H),
        "value": values.reshape(-1),
    })
    if window is not None:
        frame["window"] = window
    return frame


_KEYS = ["variant", "layer", "head", "statistic"]


def aggregate_windows(
    tables: Iterable[pd.DataFrame], weights: Iterable[float] | None = None
) -> pd.DataFrame:
    """Combine per-window ``tidy_table`` results: mean over windows per (variant, layer, head, statistic).

    ``tables`` may be a generator (windows streamed: only running sums are held). ``weights`` gives
    one weight per window (e.g. its number of tokens) for a weighted mean; default: every window
    counts equally. Returns columns ``variant, layer, head, statistic, value, std, n_windows``: value
    is the (weighted) mean, std the (weighted) population standard deviation over windows (0 for one
    window), n_windows how many windows had that statistic.
    """
    import pandas as pd

    weight_iter = iter(weights) if weights is not None else None
    acc = None  # per key: total weight w, weighted mean, M2 = sum of w (v - mean)^2, window count n
    for table in tables:
        wt = 1.0 if weight_iter is None else float(next(weight_iter))
        missing = [c for c in (*_KEYS, "value") if c not in table.columns]
        if missing:
            raise ValueError(f"every table needs the columns {[*_KEYS, 'value']}; missing {missing}")
        v = table.set_index(_KEYS)["value"].astype(np.float64)
        groups = v.groupby(level=_KEYS, sort=False)  # a table may hold several windows
        mean = groups.mean()
        part = pd.DataFrame({
            "w": wt * groups.size().astype(np.float64),
            "mean": mean,
            "m2": wt * ((v - groups.transform("mean")) ** 2).groupby(level=_KEYS, sort=False).sum(),
            "n": groups.size().astype(np.float64),
        })
        acc = part if acc is None else _combine_moments(acc, part)
    if acc is None:
        raise ValueError("tables is empty: nothing to aggregate")
    var = (acc["m2"] / acc["w"].where(acc["w"] > 0, 1.0)).clip(lower=0.0)
    out = pd.DataFrame({"value": acc["mean"], "std": np.sqrt(var), "n_windows": acc["n"].astype(np.int64)})
    return out.reset_index()


def _combine_moments(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """Merge two sets of (weight, mean, M2, count) per key (Chan et al.'s parallel update, weighted):
    numerically stable, so one window gives std exactly 0."""
    import pandas as pd

    a, b = a.align(b, join="outer")
    a, b = a.fillna(0.0), b.fillna(0.0)  # a key missing on one side has weight 0 there
    w = a["w"] + b["w"]
    safe = w.where(w > 0, 1.0)
    delta = b["mean"] - a["mean"]
    return pd.DataFrame({
        "w": w,
        "mean": a["mean"] + delta * b["w"] / safe,
        "m2": a["m2"] + b["m2"] + delta * delta * a["w"] * b["w"] / safe,
        "n": a["n"] + b["n"],
    })
