"""Argument checks, masks and the masked reductions every statistic shares (no statistics here).

Rules (docs/STATISTICS.md): a ``ValueError`` names the argument, what was expected and what was seen;
numpy scalars are ordinary numbers; masks broadcast to the weights' shape, including key-only (N,) and
query-only (M, 1) masks; empty dims give empty or 0 results, never NaN; NaN in the weights propagates
to every statistic it enters.
"""

from __future__ import annotations

import math

import torch

from attnlab.normalizers.checks import check_number as _check_number
from attnlab.normalizers.specs import check_param

LN2 = math.log(2.0)


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else is computed in float32 (half precision is upcast)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def is_lazy_maps(w) -> bool:
    """Whether ``w`` is a lazy (L, H, N, N) of per-head maps (attnlab.hf.compute.head_maps.HeadMaps,
    duck-typed: stats imports nothing from hf): ``w.layer(l)`` -> (H, N, N), ``w.materialize()``."""
    return (not isinstance(w, torch.Tensor) and getattr(w, "streamed_window", False) is True
            and callable(getattr(w, "layer", None)) and callable(getattr(w, "materialize", None)))


def check_weights(name: str, w, min_dim: int = 2) -> torch.Tensor:
    """A floating tensor of at least ``min_dim`` dims, in its work dtype. Lazy per-head maps
    (:func:`is_lazy_maps`) are materialized, or refused with a ValueError naming their size."""
    if is_lazy_maps(w):
        w = w.materialize()
    if not isinstance(w, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
    if not w.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {w.dtype}")
    if w.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dims, got shape {tuple(w.shape)}")
    if w.is_meta:
        raise ValueError(f"{name} must hold data (a CPU or CUDA tensor), got a meta tensor")
    return w.to(work_dtype(w.dtype))


def layer_head_means(maps, dtype: torch.dtype, mask: torch.Tensor | None = None,
                     each=None) -> torch.Tensor:
    """(L, N, N) head-averaged maps of lazy (L, H, N, N) weights (:func:`is_lazy_maps`), read one
    layer's (H, N, N) at a time (never the whole); ``mask`` (bool, broadcastable to (L, H, N, N)) zeroes
    entries before the mean; ``each(layer_maps)`` sees every layer's (H, N, N) in ``dtype`` first."""
    if mask is not None:
        mask = check_bool("mask", mask, maps.shape, "the weights' shape").expand(maps.shape)
    out = []
    for layer in range(maps.shape[0]):
        w = maps.layer(layer).to(dtype)  # (H, N, N)
        if each is not None:
            each(w)
        if mask is not None:
            w = torch.where(mask[layer], w, w.new_zeros(()))
        out.append(w.mean(0))  # (N, N)
    return torch.stack(out)  # (L, N, N)


def check_bool(name: str, t, shape: torch.Size, what: str) -> torch.Tensor:
    """A boolean tensor broadcastable to ``shape`` (``what`` describes the shape in messages)."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.bool:
        seen = f"dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a boolean tensor ({what}), got {seen}")
    try:
        ok = torch.broadcast_shapes(t.shape, shape) == shape
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"{name} of shape {tuple(t.shape)} does not broadcast to {what} {tuple(shape)}")
    return t


def check_number(name: str, value, *, low: float | None = None, high: float | None = None,
                 integer: bool = False) -> float | int:
    """A real (or integral) Python / numpy / 0-d tensor number in [low, high] -> float (int); NaN is
    refused. The one number check of attnlab (attnlab.normalizers.checks)."""
    return _check_number(name, value, kind=int if integer else float, low=low, high=high)


def check_eps(name: str, eps) -> float:
    """A threshold >= 0 (inf allowed: every key counts)."""
    return check_number(name, eps, low=0.0)


def check_unit_tensor(name: str, u: torch.Tensor) -> torch.Tensor:
    """HNAS hybrid weights: the declaration of ``u`` (attnlab.normalizers, one check per parameter),
    detached. ``name`` is kept for the callers' signatures; the parameter is always u."""
    return check_param("u", u).detach()


def pair_mask(valid_q: torch.Tensor, valid_k: torch.Tensor | None = None) -> torch.Tensor:
    """(..., M, N) pair mask from per-token validity: valid_q[..., i] & valid_k[..., j].

    valid_q (..., M) bool; valid_k (..., N) bool, default ``valid_q`` (self-attention).
    """
    valid_k = valid_q if valid_k is None else valid_k
    for name, t in (("valid_q", valid_q), ("valid_k", valid_k)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.bool:
            seen = f"dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a boolean tensor (..., tokens) (True = real token), got {seen}")
        if t.dim() < 1:
            raise ValueError(f"{name} must have at least 1 dim (..., tokens), got a 0-dim tensor")
    try:
        return valid_q[..., :, None] & valid_k[..., None, :]
    except RuntimeError:
        raise ValueError(f"valid_q {tuple(valid_q.shape)} and valid_k {tuple(valid_k.shape)} must have "
                         "broadcastable leading dims") from None


def masked(weights: torch.Tensor, mask: torch.Tensor | None):
    """(weights with masked entries set to 0, row_valid (..., M) or None, key_valid (..., N) or None).

    ``mask`` broadcasts to the weights (a key-only (N,) mask, a query-only (M, 1) mask, (B, 1, 1, N)
    key padding, ...). row_valid / key_valid keep the mask's leading shape (broadcastable to the
    weights' batch shape) but always span all M rows / N keys, so that counts over them are right.
    """
    if mask is None:
        return weights, None, None
    mask = check_bool("mask", mask, weights.shape, "the weights' shape")
    M, N = weights.shape[-2:]
    lead = mask.shape[:-2] if mask.dim() >= 2 else ()
    full = mask.expand(*lead, M, N)  # a view: (..., M, N) with the mask's leading dims
    w = torch.where(mask, weights, weights.new_zeros(()))
    return w, full.any(-1), full.any(-2)


def count(valid: torch.Tensor | None, size: int, like: torch.Tensor) -> torch.Tensor:
    """Number of valid entries along the last dim, as a float tensor broadcastable to like[..., 0]."""
    if valid is None:
        return like.new_full((), float(size))
    return valid.sum(-1).to(like.dtype)


def safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den, and 0 where den == 0 (empty slices)."""
    den = torch.as_tensor(den, dtype=num.dtype, device=num.device)
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), num.new_zeros(()))


def valid_mean(x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """Mean of x (..., K) over the last dim restricted to ``valid`` (..., K); 0 when none is valid."""
    if valid is None:
        return x.mean(-1) if x.shape[-1] else x.new_zeros(x.shape[:-1])
    x = torch.where(valid, x, x.new_zeros(()))
    return safe_div(x.sum(-1), valid.sum(-1))


def valid_max(x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """Max of nonnegative x over the last dim restricted to valid; 0 when empty (NaN propagates)."""
    if valid is not None:
        x = torch.where(valid, x, x.new_zeros(()))
    if x.shape[-1] == 0:
        return x.new_zeros(x.shape[:-1])
    return x.amax(-1)


def share_below(m: torch.Tensor, threshold, valid: torch.Tensor | None) -> torch.Tensor:
    """Share of valid entries of m (..., K) with m < threshold (..., 1) or scalar; NaN when a valid
    entry is NaN (a NaN mass is neither below nor above), 0 for an empty slice."""
    below = (m < threshold).to(m.dtype)
    below = torch.where(m.isnan(), m, below)  # NaN propagates into the share
    return valid_mean(below, valid)


def distance_matrix(m: int, n: int, like: torch.Tensor, positions: torch.Tensor | None = None):
    """(M, N) |pos_i - pos_j| in like's dtype; positions default to 0..M-1 (queries), 0..N-1 (keys)."""
    if positions is None:
        qi = torch.arange(m, device=like.device, dtype=like.dtype)
        kj = torch.arange(n, device=like.device, dtype=like.dtype)
    else:
        qi = kj = positions.to(device=like.device, dtype=like.dtype)
    return (qi[:, None] - kj[None, :]).abs()


def xlogx_rowsum(w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """sum_j w_ij ln w_ij (..., M), with 0 ln 0 = 0. ``out`` is an optional scratch like ``w``."""
    log_tiny = math.log(torch.finfo(w.dtype).tiny)  # ln 0 = -inf is clamped: 0 * ln(tiny) = 0
    return torch.log(w, out=out).clamp_min_(log_tiny).mul_(w).sum(-1)
