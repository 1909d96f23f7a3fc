"""The public entry points: weights from scores (``attention_weights``) and outputs from q, k, v
(``attend``), for every registered variant. Shapes: q (B, H, M, D), k (B, H, N, D), v (B, H, N, Dv),
scores and weights (B, H, M, N) (or any (..., M, N) for ``attention_weights``).

Every argument is checked once here (attnlab/normalizers/checks.py, the specs' parameters); the fast
paths then run on checked, contiguous tensors. Any view (sliced, transposed, expanded, strided) gives
what its ``.contiguous()`` copy gives.
"""

from __future__ import annotations

import math
import warnings

import torch

from attnlab.normalizers.checks import check_float_tensor, check_head_shape, check_mask, check_scale
from attnlab.normalizers.contract import check_output, check_shape
from attnlab.normalizers.functions import NEG_INF, NormalizerContext
from attnlab.normalizers.fused import combine_masks
from attnlab.normalizers.lse import all_finite
from attnlab.normalizers.specs import check_params, variant_spec

__all__ = ["attention_weights", "attend", "normalize", "context"]

_noted: set[str] = set()


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def context(variant: str, params: dict, causal: bool, head_shape: tuple[int, ...] | None,
            what: str = "(B, H, 1, 1)") -> NormalizerContext:
    """The validated NormalizerContext of ``variant`` for the given (possibly None) parameters; a
    per-head tensor parameter must broadcast to ``head_shape``."""
    checked = check_params(variant, params, causal=causal)
    spec = variant_spec(variant)
    if head_shape is not None:
        for p in spec.params:
            if p.per_head:
                check_head_shape(p.name, checked[p.name], head_shape, what)
    return NormalizerContext(causal=causal, params=checked)


def normalize(scores: torch.Tensor, variant: str, mask: torch.Tensor | None,
              ctx: NormalizerContext) -> torch.Tensor:
    """The one materialized pipeline, on checked arguments: mask (+ causal) -> -inf, the variant's
    normalizer in float32/float64, cast back to ``scores.dtype``. A registered (not built-in)
    variant's output is held to its spec (attnlab/normalizers/contract.py): its shape on every call,
    its values on the first call with finite scores."""
    m, n = scores.shape[-2:]
    mask = combine_masks(mask, ctx.causal, m, n, scores.device)
    logits = scores.to(compute_dtype(scores.dtype))
    if mask is not None:
        logits = logits.masked_fill(~mask, NEG_INF)
    spec = variant_spec(variant)
    weights = spec.normalizer(logits, ctx)
    if not spec.builtin:
        check_shape(spec, logits, weights)
    if mask is not None:  # a masked entry's weight is 0, even in a row that a NaN score made NaN
        weights = weights.masked_fill(~mask, 0.0)
    if not spec.builtin:
        check_output(spec, logits, weights)
    return weights.to(scores.dtype)


def attention_weights(
    scores: torch.Tensor,
    variant: str,
    *,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    **params,
) -> torch.Tensor:
    """Attention weights of one variant from scores.

    Args:
        scores: (..., M, N) floating, typically (B, H, M, N) with s_ij = scale * q_i . k_j.
        variant: one of ``attnlab.VARIANTS``.
        mask: bool broadcastable to ``scores.shape``; True = may attend. Padded queries are rows of
            False and are excluded from DNAS's column normalization.
        causal: also require j <= i.
        **params: the variant's parameters (``attnlab.variant_spec(variant).params``), e.g. ``u``
            (HNAS hybrid weight in [0, 1], float or tensor broadcastable to (..., 1, 1); default 0.5),
            ``iters`` (Sinkhorn rounds, default 3; causal allows only 1 and defaults to it), ``tol``.

    Returns:
        weights (..., M, N) in ``scores.dtype``. NaN or +inf scores make the weights they influence
        NaN (as torch.softmax); -inf is a masked entry.
    """
    check_float_tensor("scores", scores)
    if scores.dim() < 2:
        raise ValueError(f"scores must have at least 2 dims (..., M, N), got shape {tuple(scores.shape)}")
    if scores.device.type == "meta":
        raise ValueError("scores must be a tensor with data (not on the meta device)")
    mask = check_mask(mask, scores.shape)
    head = (*scores.shape[:-2], 1, 1)
    ctx = context(variant, params, bool(causal), head, "(..., 1, 1)")
    if isinstance(ctx.params.get("u"), torch.Tensor):
        ctx = ctx.with_params(u=ctx.u.to(scores.device))
    return normalize(scores, variant, mask, ctx)


def _check_qkv(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, H, length, dim), got shape {tuple(t.shape)}")
        if t.device.type == "meta":
            raise ValueError(f"{name} must be a tensor with data (not on the meta device)")
    if k.shape[-1] != q.shape[-1] or k.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"k must be (B, H, N, D) matching q (B, H, M, D) in B, H and D; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}"
        )
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"v must be (B, H, N, Dv) matching k (B, H, N, D) in B, H and N; got k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def _note_materialized(variant: str) -> None:
    if variant not in _noted:
        _noted.add(variant)
        warnings.warn(f"attnlab: variant {variant!r} has no fused attend path; its (M, N) weights are "
                      "materialized", stacklevel=3)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    variant: str,
    *,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    return_weights: bool = False,
    **params,
):
    """Attention output of one variant: ``weights @ v``.

    Args:
        q: (B, H, M, D) queries; k: (B, H, N, D) keys; v: (B, H, N, Dv) values (floating).
        variant, mask, causal, **params: as in :func:`attention_weights` (per-head tensor
            parameters broadcast to (B, H, 1, 1)).
        scale: score scale, a finite number > 0; default 1/sqrt(D).
        return_weights: also return the (B, H, M, N) weights (materialized).

    Returns:
        out (B, H, M, Dv) in ``q.dtype``, or ``(out, weights)``. Rows without a valid key give 0.

    Without ``return_weights``, a variant with a fused path (its spec's ``fused``) never holds the
    (M, N) matrix. Half-precision inputs are computed in float32. Non-finite q or k take the
    materialized path (its NaN rule, as torch.softmax); this check is one reduction over q and k.
    """
    _check_qkv(q, k, v)
    B, H, M, D = q.shape
    N = k.shape[-2]
    mask = check_mask(mask, torch.Size((B, H, M, N)))
    ctx = context(variant, params, bool(causal), (B, H, 1, 1))
    scale = check_scale(scale, 1.0 / math.sqrt(D) if D else 1.0)

    out_dtype = q.dtype
    if M == 0 or N == 0:  # nobody asking or nothing to attend to: zero rows (every path agrees)
        out = q.new_zeros(B, H, M, v.shape[-1])
        return (out, q.new_zeros(B, H, M, N)) if return_weights else out
    spec = variant_spec(variant)
    if q.device.type == "cuda" and spec.gpu is not None and not return_weights and all_finite(q, k):
        # the Triton kernels take the caller's dtypes (bf16/fp16 accumulate in float32) and strides
        with torch.autocast(device_type="cuda", enabled=False):
            out = spec.gpu(q, k, v, variant, mask, scale, ctx)
        if out is not None:
            return out.to(out_dtype)
    dt = compute_dtype(torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype))
    q, k, v = (t.to(dt).contiguous() for t in (q, k, v))
    if isinstance(ctx.params.get("u"), torch.Tensor):
        ctx = ctx.with_params(u=ctx.u.to(q.device))

    # Under torch.autocast the products would run in half precision again (and HNAS would mix half
    # weights with a float32 u): attention is computed in float32 here whatever the caller's autocast.
    with torch.autocast(device_type=q.device.type, enabled=False):
        fused = spec.fused
        if not return_weights and fused is None:
            _note_materialized(variant)
        if not return_weights and fused is not None and all_finite(q, k):
            out = fused(q, k, v, mask, scale, ctx)
            if out is not None:
                return out.to(out_dtype)

        scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)  # (B, H, M, N)
        weights = normalize(scores, variant, mask, ctx)
        out = torch.matmul(weights, v).to(out_dtype)
    return (out, weights.to(out_dtype)) if return_weights else out
