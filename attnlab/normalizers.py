"""Normalizers: turn attention scores into attention weights, and the fused ``attend`` path.

Notation (DESIGN.md §1): queries i = 1..M, keys j = 1..N.

    q         (B, H, M, D)      k (B, H, N, D)      v (B, H, N, Dv)
    scores    (B, H, M, N)      s_ij = scale * q_i . k_j
    weights   (B, H, M, N)      pi_ij, every row sums to 1 (or is all zero when it has no valid key)
    mask      bool, broadcastable to (B, H, M, N); True = "query i may attend to key j"

Variants ("Attention that does not Explain Away", Eqs. 1, 5, 10, 12):

    unas      pi = softmax_j(s)                                       (Eq. 1)
    dnas      pi = softmax_j(s_ij - c_j), c_j = logsumexp_i s_ij      (Eq. 5, in log space)
    hnas      pi = u * pi_dnas + (1 - u) * pi_unas                    (Eq. 12)
    sinkhorn  ``iters`` alternating (column, row) normalizations      (Eq. 10)

Every variant is one pure function ``(logits, ctx) -> weights`` in ``REGISTRY``; adding a variant is
one function and one registry line. ``attend`` additionally has fused implementations (``FUSED``)
that never hold the (M, N) matrix; a variant without one is computed by materializing its weights.

Numerics: normalization runs in float32 (float64 when given float64) and the result is cast back.
Masked entries are -inf; a query row with no valid key gets zero weights and a zero output, a key
column with no valid query contributes nothing, and no NaN is produced in either direction.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

__all__ = [
    "REGISTRY",
    "FUSED",
    "VARIANTS",
    "NormalizerContext",
    "attention_weights",
    "attend",
    "column_logsumexp",
    "row_logsumexp",
    "sinkhorn_potentials",
    "unas",
    "dnas",
    "hnas",
    "sinkhorn",
]

NEG_INF = float("-inf")
# Stand-in for "logsumexp of an empty set": finite, so gradients stay NaN-free, and far below
# any real score, so logaddexp(real, FLOOR) == real exactly.
LSE_FLOOR = -1e30
# Key block of the blocked column-logsumexp fallback and its backward: (B, H, M, KEY_BLOCK) at a time.
KEY_BLOCK = 256
# Query block of the causal DNAS pass: (B, H, QUERY_BLOCK, N) at a time.
QUERY_BLOCK = 128
# Sinkhorn without gradients on CPU holds one head's (M, N) scores per thread while it iterates when
# that takes at most this many bytes in all (else it streams: one score product per half-step).
SINKHORN_HEAD_BYTES = 256 * 2**20
# Training-size problems (M * N up to this, with gradients) take one fused autograd function that
# keeps the weights for its backward, as PyTorch's own SDPA math backend does for a biased row pass.
SMALL_SCORES = 128 * 128


@dataclass(frozen=True)
class NormalizerContext:
    """What a normalizer may need beyond the logits."""

    causal: bool = False  # the mask already contains j <= i; DNAS then normalizes columns over prefixes
    u: float | torch.Tensor = 0.5  # HNAS hybrid weight, float or broadcastable to (B, H, 1, 1)
    iters: int = 1  # Sinkhorn iterations (column step, then row step)


# ----------------------------------------------------------------------------------------------
# Numerically safe building blocks (logits carry -inf at masked entries)
# ----------------------------------------------------------------------------------------------


def _safe_logsumexp(x: torch.Tensor, dim: int) -> torch.Tensor:
    """logsumexp over ``dim`` (keepdim) that returns 0 instead of -inf for an all -inf slice.

    Gradients are finite everywhere: the shift is detached and the log never sees 0.
    """
    m = x.amax(dim, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    total = torch.exp(x - m).sum(dim, keepdim=True)
    return torch.log(torch.where(total > 0, total, torch.ones_like(total))) + m


def _row_softmax(logits: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim; a row of -inf becomes all zeros (not NaN)."""
    return torch.exp(logits - _safe_logsumexp(logits, -1))


def _prefix_column_logsumexp(logits: torch.Tensor, carry: torch.Tensor | None = None) -> torch.Tensor:
    """c_j(i) = logsumexp over i' <= i of logits_{i' j}  (causal DNAS, DESIGN.md §2).

    logits (..., M, N); carry (..., 1, N) is the prefix of earlier query blocks (None = empty).
    Empty prefixes give LSE_FLOOR (finite), which keeps the backward pass NaN-free.
    """
    if carry is None:
        carry = logits.new_full((*logits.shape[:-2], 1, logits.shape[-1]), LSE_FLOOR)
    return torch.logcumsumexp(torch.cat([carry, logits], dim=-2), dim=-2)[..., 1:, :]


# ----------------------------------------------------------------------------------------------
# The variants: pure functions (logits (B, H, M, N) with -inf where masked, ctx) -> weights
# ----------------------------------------------------------------------------------------------


def unas(logits: torch.Tensor, ctx: NormalizerContext) -> torch.Tensor:
    """Eq. (1): pi_ij = exp(s_ij) / sum_j' exp(s_ij'). Rows sum to 1."""
    return _row_softmax(logits)


def dnas(logits: torch.Tensor, ctx: NormalizerContext) -> torch.Tensor:
    """Eq. (5): normalize over queries i, then over keys j.

    In log space (DESIGN.md §2): pi_ij = softmax_j(s_ij - c_j) with c_j = logsumexp over valid i of
    s_ij. Every valid column then receives mass >= 1/N_valid. With ``ctx.causal`` the column sum runs
    over the prefix i' <= i only (c_j(i)), so a later query never changes an earlier row; this is an
    extension of the paper and puts logit 0 = s_ii - c_i(i) on the diagonal, the largest possible.
    """
    if ctx.causal:
        c = _prefix_column_logsumexp(logits)  # (B, H, M, N)
    else:
        c = _safe_logsumexp(logits, -2)  # (B, H, 1, N); gradients flow through c_j
    return _row_softmax(logits - c)


def hnas(logits: torch.Tensor, ctx: NormalizerContext) -> torch.Tensor:
    """Eq. (12): u * pi_dnas + (1 - u) * pi_unas, u in [0, 1] per head. Column mass >= u/N_valid."""
    return torch.lerp(unas(logits, ctx), dnas(logits, ctx), _as_weight(ctx.u, logits))


def sinkhorn(logits: torch.Tensor, ctx: NormalizerContext) -> torch.Tensor:
    """Eq. (10): ``iters`` rounds of (column, row) normalization in log space.

    ``iters=1`` is exactly DNAS; as iters grows every valid column's mass approaches M_valid/N_valid
    (doubly stochastic when M = N). Causal use allows only iters=1 (checked by the callers).
    """
    if ctx.causal or ctx.iters == 1:
        return dnas(logits, ctx)
    for _ in range(ctx.iters - 1):
        logits = logits - _safe_logsumexp(logits, -2)  # column step: sum_i = 1
        logits = logits - _safe_logsumexp(logits, -1)  # row step:    sum_j = 1
    return dnas(logits, ctx)  # the last (column, row) round


# The registry: name -> normalizer. Adding a variant = one function above + one line here.
REGISTRY: dict[str, Callable[[torch.Tensor, NormalizerContext], torch.Tensor]] = {
    "unas": unas,
    "dnas": dnas,
    "hnas": hnas,
    "sinkhorn": sinkhorn,
}
VARIANTS: tuple[str, ...] = tuple(REGISTRY)


# ----------------------------------------------------------------------------------------------
# Argument checking (errors name the argument, the expectation and what was seen)
# ----------------------------------------------------------------------------------------------


def _check_variant(variant: str) -> str:
    if not isinstance(variant, str) or variant not in REGISTRY:
        raise ValueError(f"variant must be one of {tuple(REGISTRY)}, got {variant!r}")
    return variant


def _check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")


def _check_mask(mask: torch.Tensor | None, shape: torch.Size) -> torch.Tensor | None:
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        seen = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"mask must be a boolean tensor (True = may attend), got {seen}")
    try:
        if torch.broadcast_shapes(mask.shape, shape) != shape:
            raise RuntimeError
    except RuntimeError:
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to the scores' shape {tuple(shape)}"
        ) from None
    while mask.dim() < len(shape):
        mask = mask.unsqueeze(0)
    return mask


def _check_u(u: float | torch.Tensor | None) -> float | torch.Tensor:
    if u is None:
        return 0.5  # sigmoid(theta_0 = 0)
    if isinstance(u, torch.Tensor):
        if not u.is_floating_point():
            raise ValueError(f"u must be a float or a floating tensor in [0, 1], got dtype {u.dtype}")
        if u.numel() and not torch.compiler.is_compiling():
            lo, hi = float(u.detach().min()), float(u.detach().max())
            if not (0.0 <= lo and hi <= 1.0):
                raise ValueError(f"u must lie in [0, 1], got values in [{lo:g}, {hi:g}]")
        return u
    if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 <= float(u) <= 1.0:
        raise ValueError(f"u must be a float in [0, 1] (or a tensor of them), got {u!r}")
    return float(u)


def _check_iters(iters: int | None, variant: str, causal: bool) -> int:
    if iters is None:
        return 1
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be an integer >= 1, got {iters!r}")
    if variant == "sinkhorn" and causal and iters > 1:
        raise ValueError(
            f"causal sinkhorn needs iters=1 (got iters={iters}): with a causal mask the alternating "
            "normalizations degenerate toward the identity; use iters=1 (= causal dnas) or causal=False"
        )
    return iters


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _as_weight(u: float | torch.Tensor, like: torch.Tensor) -> float | torch.Tensor:
    return u.to(like.dtype) if isinstance(u, torch.Tensor) else u


def _causal_mask(m: int, n: int, device: torch.device) -> torch.Tensor:
    """(M, N) bool, True where j <= i."""
    return torch.ones(m, n, dtype=torch.bool, device=device).tril()


def _combine_masks(mask: torch.Tensor | None, causal: bool, m: int, n: int, device) -> torch.Tensor | None:
    if not causal:
        return mask
    tri = _causal_mask(m, n, device)
    return tri if mask is None else mask & tri


# ----------------------------------------------------------------------------------------------
# Public: weights from scores
# ----------------------------------------------------------------------------------------------


def attention_weights(
    scores: torch.Tensor,
    variant: str,
    *,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    u: float | torch.Tensor | None = None,
    iters: int | None = None,
) -> torch.Tensor:
    """Attention weights of one variant from scores.

    Args:
        scores: (..., M, N) floating, typically (B, H, M, N) with s_ij = scale * q_i . k_j.
        variant: one of ``VARIANTS``.
        mask: bool broadcastable to ``scores.shape``; True = may attend. Padded queries are rows of
            False and are excluded from DNAS's column normalization.
        causal: also require j <= i.
        u: HNAS hybrid weight in [0, 1], float or tensor broadcastable to (B, H, 1, 1); default 0.5.
        iters: Sinkhorn iterations (>= 1, default 1; causal allows only 1).

    Returns:
        weights (..., M, N) in ``scores.dtype``; valid rows sum to 1, rows without a valid key are 0.
    """
    _check_variant(variant)
    _check_float("scores", scores)
    if scores.dim() < 2:
        raise ValueError(f"scores must have at least 2 dims (..., M, N), got shape {tuple(scores.shape)}")
    mask = _check_mask(mask, scores.shape)
    ctx = NormalizerContext(causal=causal, u=_check_u(u), iters=_check_iters(iters, variant, causal))
    return _normalize(scores, variant, mask, ctx)


def _normalize(scores, variant, mask, ctx: NormalizerContext) -> torch.Tensor:
    """The one materialized pipeline, on checked arguments: mask (+ causal) -> -inf, normalize in
    float32/float64, cast back."""
    m, n = scores.shape[-2:]
    mask = _combine_masks(mask, ctx.causal, m, n, scores.device)
    logits = scores.to(_compute_dtype(scores.dtype))
    if mask is not None:
        logits = logits.masked_fill(~mask, NEG_INF)
    return REGISTRY[variant](logits, ctx).to(scores.dtype)


# ----------------------------------------------------------------------------------------------
# Log-sum-exp over queries without the (M, N) matrix: c_j = logsumexp_i (s_ij + b_i)
# ----------------------------------------------------------------------------------------------


def _flash_lse_available(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)


def _cpu_ops():
    """attnlab's CPU kernels (attnlab/kernels.py) or None; imported here so that importing attnlab
    builds nothing."""
    from attnlab import kernels  # noqa: PLC0415

    return kernels.cpu_ops()


def _heads_flat(t: torch.Tensor) -> torch.Tensor:
    """(B, H, L, D) -> (B*H, L, D) with a contiguous last dimension, as the CPU kernels take it."""
    t = t.reshape(t.shape[0] * t.shape[1], *t.shape[-2:])
    return t if t.stride(-1) == 1 else t.contiguous()


def _kernel_shapes(q: torch.Tensor, k: torch.Tensor) -> bool:
    """The CPU kernels take q (B, H, M, D), k (B, H, N, D) with the same B, H and nothing empty."""
    return q.shape[:2] == k.shape[:2] and q.numel() > 0 and k.numel() > 0


def _separable(mask: torch.Tensor | None) -> bool:
    """True when the mask depends on the query alone (..., M, 1) or on the key alone (..., 1, N)."""
    return mask is None or mask.shape[-1] == 1 or mask.shape[-2] == 1


def _lse_kernel(q, k, bias, mask, scale):
    """Column LSE (B, H, N) through attnlab's CPU kernel (kernels.col_lse), or None where it does not
    apply (not built, a mask that depends on both i and j). An invalid query enters as bias -inf; a
    key-only mask changes nothing here (the caller zeroes columns without a valid query)."""
    ops = _cpu_ops()
    if ops is None or not _separable(mask) or not _kernel_shapes(q, k):
        return None
    B, H, M, _ = q.shape
    rb = None if bias is None else bias.expand(B, H, M)
    if mask is not None and mask.shape[-1] == 1:
        rows = mask[..., 0].expand(B, H, M)
        rb = (torch.zeros((), dtype=q.dtype) if rb is None else rb).masked_fill(~rows, NEG_INF)
    rb = None if rb is None else rb.reshape(B * H, M).to(q.dtype).contiguous()
    return ops.col_lse(_heads_flat(q), _heads_flat(k), rb, scale).view(B, H, k.shape[-2])


def _lse_fused(q, k, bias, mask, scale):
    """The column LSE is the row LSE of the transposed problem (keys attend to queries): one pass of
    attnlab's CPU kernel (a score panel per task, no value product) or, where that does not apply,
    of PyTorch's CPU flash-attention kernel, which returns that log-sum-exp. bias (B, H, M) or None."""
    c = _lse_kernel(q, k, bias, mask, scale)
    if c is not None:
        return c
    add = None if bias is None else bias[..., None, :]  # (B, H, 1, M) of the transposed problem
    if mask is not None:
        mt = mask.transpose(-1, -2)  # (b, h, N, M)
        base = torch.zeros((), dtype=q.dtype, device=q.device) if add is None else add
        add = base.masked_fill(~mt, NEG_INF)
    if add is not None:
        add = add.contiguous()
    _, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(k, q, q, attn_mask=add, scale=scale)
    return lse  # (B, H, N)


def _lse_cuda(q, k, bias, mask, scale):
    """Column LSE (B, H, N) on CUDA: the row LSE of the transposed problem from PyTorch's
    memory-efficient attention kernel, which returns it (float32/half); None where that kernel
    refuses the problem (float64, a head size it does not take), and the key-block loop runs instead.
    The additive mask is (B, H, 1 or N, M), padded to a multiple of 16 keys as the kernel wants."""
    if q.dtype == torch.float64:
        return None
    B, H, M, _ = q.shape
    N = k.shape[-2]
    add = None
    if bias is not None or mask is not None:
        rows = N if mask is not None and mask.shape[-1] != 1 else 1
        pad = -(-M // 16) * 16
        add = torch.zeros(B, H, rows, pad, dtype=q.dtype, device=q.device)[..., :M]
        if bias is not None:
            add.copy_(bias[..., None, :].expand(B, H, rows, M))
        if mask is not None:
            add.masked_fill_(~mask.transpose(-1, -2).expand(B, H, rows, M), NEG_INF)
        add = add.expand(B, H, N, M)
    try:
        _, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            k, q, q, add, True, 0.0, False, scale=scale)
    except RuntimeError:
        return None
    return lse[..., :N].to(q.dtype)


def _mask_block(mask: torch.Tensor | None, j0: int, j1: int) -> torch.Tensor | None:
    if mask is None or mask.shape[-1] == 1:
        return mask
    return mask[..., j0:j1]


def _score_blocks(q, k, bias, mask, scale, block=None):
    """Yield (j0, j1, s) with s = scale * q k_block^T + b_i, masked to -inf: (B, H, M, block)."""
    block = block or KEY_BLOCK
    for j0 in range(0, k.shape[-2], block):
        j1 = min(j0 + block, k.shape[-2])
        s = torch.matmul(q, k[..., j0:j1, :].transpose(-1, -2)).mul_(scale)
        if bias is not None:
            s.add_(bias[..., :, None])
        mb = _mask_block(mask, j0, j1)
        if mb is not None:
            s.masked_fill_(~mb, NEG_INF)
        yield j0, j1, s


class _QueryLogSumExp(torch.autograd.Function):
    """c (B, H, N) = logsumexp over valid i of (scale * q_i . k_j + b_i); backward by key blocks.

    dc_j/ds_ij = P_ij = exp(s_ij + b_i - c_j) (the column softmax), so with G = g_j P_ij:
    grad_q = scale * G k, grad_k = scale * G^T q, grad_b = sum_j G_ij; one (B, H, M, block) at a time.
    """

    @staticmethod
    def forward(ctx, q, k, bias, mask, scale):
        # CUDA: memory-efficient SDPA's LSE; CPU: attnlab's kernel or the flash kernel; else key blocks
        c = _lse_cuda(q, k, bias, mask, scale) if q.device.type == "cuda" else None
        if c is None and _flash_lse_available(q):
            c = _lse_fused(q, k, bias, mask, scale)
        if c is None:
            blocks = _score_blocks(q, k, bias, mask, scale)
            c = torch.cat([_safe_logsumexp(s, -2).squeeze(-2) for _, _, s in blocks], dim=-1)
        if mask is not None:  # empty columns: 0 (finite); they are masked wherever they appear
            c = torch.where(mask.any(-2).expand_as(c), c, torch.zeros_like(c))
        ctx.save_for_backward(q, k, bias, c, mask)
        ctx.scale = scale
        return c

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_c):
        q, k, bias, c, mask = ctx.saved_tensors
        grad_q, grad_k = torch.zeros_like(q), torch.empty_like(k)
        grad_b = None if bias is None else torch.zeros_like(bias)
        for j0, j1, s in _score_blocks(q, k, bias, mask, ctx.scale):
            g = torch.exp(s - c[..., None, j0:j1]).mul_(grad_c[..., None, j0:j1])  # (B, H, M, b)
            grad_q.add_(torch.matmul(g, k[..., j0:j1, :]), alpha=ctx.scale)
            grad_k[..., j0:j1, :] = torch.matmul(g.transpose(-1, -2), q).mul_(ctx.scale)
            if grad_b is not None:
                grad_b.add_(g.sum(-1))
        return grad_q, grad_k, grad_b, None, None


def column_logsumexp(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    query_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """c_j = logsumexp over valid i of (scale * q_i . k_j + query_bias_i), as (B, H, N), differentiable.

    Never holds the (M, N) matrix: a fused flash pass on CPU, key blocks elsewhere. Columns with no
    valid query get 0. ``mask`` is bool broadcastable to (B, H, M, N); ``query_bias`` is (B, H, M).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if q.shape[-2] == 0 or k.shape[-2] == 0:  # no query (every column empty: 0) or no key
        return torch.zeros(*torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]), k.shape[-2],
                           dtype=q.dtype, device=q.device)
    return _QueryLogSumExp.apply(q, k, query_bias, mask, scale)


def row_logsumexp(q, k, mask=None, scale=None, key_bias=None) -> torch.Tensor:
    """r_i = logsumexp over valid j of (scale * q_i . k_j + key_bias_j), as (B, H, M)."""
    mt = None if mask is None else mask.transpose(-1, -2)
    return column_logsumexp(k, q, mt, scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]), key_bias)


# ----------------------------------------------------------------------------------------------
# Fused attend paths: out (B, H, M, Dv) without the (M, N) matrix
# ----------------------------------------------------------------------------------------------


def _row_valid(mask: torch.Tensor | None) -> torch.Tensor | None:
    return None if mask is None else mask.any(-1, keepdim=True)  # (b, h, m, 1)


def _sdpa(q, k, v, mask, scale, key_bias=None, causal=False):
    """softmax_j(s_ij + key_bias_j) @ v through torch SDPA; masked -> -inf; empty rows -> 0.

    key_bias (B, H, N) enters as a contiguous additive (B, H, 1, N) mask (fully materialized only
    when ``mask`` itself depends on the query). ``causal`` without a mask uses SDPA's is_causal."""
    if causal and (mask is not None or key_bias is not None):
        mask = _combine_masks(mask, True, q.shape[-2], k.shape[-2], q.device)
        causal = False
    rows = _row_valid(mask)
    # empty rows see every key (then zeroed); a query-only mask (..., M, 1) thus keeps every entry
    keep = None if mask is None or mask.shape[-1] == 1 else mask | ~rows
    attn = keep
    if key_bias is not None:
        attn = key_bias[..., None, :]  # (B, H, 1, N)
        if keep is not None:
            attn = attn.masked_fill(~keep, NEG_INF)
        attn = attn.contiguous()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn, scale=scale, is_causal=causal)
    return out if rows is None else out.masked_fill(~rows, 0.0)


def _causal_dnas_blocked(q, k, v, mask, scale):
    """Causal DNAS by query blocks, carrying each column's prefix log-sum-exp (B, H, 1, N)."""
    m, n = q.shape[-2], k.shape[-2]
    carry, outs = None, []
    kt = k.transpose(-1, -2)
    for i0 in range(0, m, QUERY_BLOCK):
        i1 = min(i0 + QUERY_BLOCK, m)
        s = torch.matmul(q[..., i0:i1, :], kt).mul_(scale)  # (B, H, b, N)
        valid = torch.ones(i1 - i0, n, dtype=torch.bool, device=q.device).tril(i0)  # j <= i
        if mask is not None:
            valid = valid & (mask if mask.shape[-2] == 1 else mask[..., i0:i1, :])
        s = s.masked_fill(~valid, NEG_INF)
        c = _prefix_column_logsumexp(s, carry)  # (B, H, b, N)
        carry = c[..., -1:, :]
        outs.append(torch.matmul(_row_softmax(s - c), v))
    return torch.cat(outs, dim=-2)


# Fused implementations: (q, k, v, mask, scale, ctx) -> out (B, H, M, Dv), where ``mask`` excludes
# the causal part (ctx.causal says). Returning None falls back to materializing the weights, and a
# new variant needs no entry here.


def _fused_unas(q, k, v, mask, scale, ctx):
    return _sdpa(q, k, v, mask, scale, causal=ctx.causal)


class _SmallDoublyNormalized(torch.autograd.Function):
    """DNAS (Eq. 5) or HNAS (Eq. 12) attention for small problems under autograd, with the backward
    written out (fewer passes than autograd through the LSE pass and a biased SDPA).

    Forward: s = scale q k^T (masked), c_j = logsumexp_i s_ij, P = exp(s - c) (column softmax),
    pi_d = softmax_j(s - c), pi_u = softmax_j(s), pi = lerp(pi_u, pi_d, u), out = pi v.
    Backward, with dpi = g v^T: dl = pi_d o (u dpi - rowsum(u dpi o pi_d)), and likewise ds_u for
    pi_u with (1 - u); ds = ds_u + dl - P o colsum(dl) (c_j depends on column j); grad_q = scale ds k,
    grad_k = scale ds^T q, grad_v = pi^T g, grad_u = sum dpi o (pi_d - pi_u).
    """

    @staticmethod
    def forward(ctx, q, k, v, u, mask, scale, hybrid):
        s = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)  # (B, H, M, N)
        if mask is not None:
            s.masked_fill_(~mask, NEG_INF)
        c = _safe_logsumexp(s, -2)  # (B, H, 1, N)
        p_col = torch.exp(s - c)
        p_d = _row_softmax(s - c)
        p_u = _row_softmax(s) if hybrid else None
        p = torch.lerp(p_u, p_d, u) if hybrid else p_d
        ctx.save_for_backward(q, k, v, u if isinstance(u, torch.Tensor) else None, p_col, p_d, p_u, p)
        ctx.scale, ctx.hybrid = scale, hybrid
        ctx.u_float = None if isinstance(u, torch.Tensor) else float(u)
        return torch.matmul(p, v)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        q, k, v, u_t, p_col, p_d, p_u, p = ctx.saved_tensors
        u = u_t if ctx.u_float is None else ctx.u_float

        def softmax_backward(pi, d):
            return pi * (d - (d * pi).sum(-1, keepdim=True))

        grad_v = torch.matmul(p.transpose(-1, -2), g)
        dp = torch.matmul(g, v.transpose(-1, -2))  # (B, H, M, N)
        dl = softmax_backward(p_d, dp * u if ctx.hybrid else dp)
        ds = dl - p_col * dl.sum(-2, keepdim=True)
        if ctx.hybrid:
            ds = ds + softmax_backward(p_u, dp * (1 - u))
        grad_q = torch.matmul(ds, k).mul_(ctx.scale)
        grad_k = torch.matmul(ds.transpose(-1, -2), q).mul_(ctx.scale)
        grad_u = None
        if u_t is not None and ctx.needs_input_grad[3]:
            grad_u = (dp * (p_d - p_u)).sum((-1, -2), keepdim=True)  # (B, H, 1, 1)
            grad_u = grad_u.sum_to_size(u_t.shape)
        return grad_q, grad_k, grad_v, grad_u, None, None, None


def _needs_grad(q, k, v, ctx) -> bool:
    return torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad
        or (isinstance(ctx.u, torch.Tensor) and ctx.u.requires_grad)
    )


def _small_with_grad(q, k, v, ctx) -> bool:
    return _needs_grad(q, k, v, ctx) and not ctx.causal and q.shape[-2] * k.shape[-2] <= SMALL_SCORES


def _head_weights(u, q) -> torch.Tensor | None:
    """u as one weight per (batch, head), (B*H,), or None when it varies within a head."""
    B, H = q.shape[:2]
    if not isinstance(u, torch.Tensor):
        return torch.full((B * H,), float(u), dtype=q.dtype)
    if u.dim() > 4 or (u.dim() >= 2 and u.shape[-2:] != (1, 1)) or (u.dim() < 2 and u.numel() != 1):
        return None
    u = u.reshape(*u.shape[:-2]) if u.dim() >= 2 else u.reshape(())
    return u.detach().to(q.dtype).expand(B, H).reshape(B * H).contiguous()


def _mixed_kernel(q, k, v, mask, scale, ctx):
    """(1 - u) softmax_j(s) v + u softmax_j(s - c_j) v (Eq. 12 with V entering linearly) from one score
    panel per task through attnlab's CPU kernel (kernels.mix_attend); None where it does not apply
    (not built, not CPU float32/64, gradients needed, a mask that depends on both i and j, u not one
    weight per (batch, head))."""
    if ctx.causal or _needs_grad(q, k, v, ctx) or not _flash_lse_available(q) or not _separable(mask):
        return None
    ops = _cpu_ops()
    weights = _head_weights(ctx.u, q)
    if ops is None or weights is None or not _kernel_shapes(q, k):
        return None
    B, H, M, _ = q.shape
    N = k.shape[-2]
    c = column_logsumexp(q, k, mask, scale)  # (B, H, N)
    key_bias, _ = _separable_biases(q, k, mask)  # invalid queries: their rows are zeroed below
    out = ops.mix_attend(_heads_flat(q), _heads_flat(k), _heads_flat(v), key_bias,
                         (-c).reshape(B * H, N).contiguous(), weights, scale)
    out = out.view(B, H, M, v.shape[-1])
    rows = _row_valid(mask)
    return out if rows is None else out.masked_fill(~rows, 0.0)


def _fused_dnas(q, k, v, mask, scale, ctx):
    if ctx.causal:
        return _causal_dnas_blocked(q, k, v, mask, scale)
    if _small_with_grad(q, k, v, ctx):
        return _SmallDoublyNormalized.apply(q, k, v, 1.0, mask, scale, False)
    c = column_logsumexp(q, k, mask, scale)  # (B, H, N)
    return _sdpa(q, k, v, mask, scale, key_bias=-c)


def _fused_hnas(q, k, v, mask, scale, ctx):
    # Eq. (12) with V entering linearly: u * (pi_dnas V) + (1 - u) * (pi_unas V)
    if _small_with_grad(q, k, v, ctx):
        return _SmallDoublyNormalized.apply(q, k, v, _as_weight(ctx.u, q), mask, scale, True)
    out = _mixed_kernel(q, k, v, mask, scale, ctx)
    if out is not None:
        return out
    out_unas = _fused_unas(q, k, v, mask, scale, ctx)
    return torch.lerp(out_unas, _fused_dnas(q, k, v, mask, scale, ctx), _as_weight(ctx.u, q))


def sinkhorn_potentials(q, k, mask=None, scale=None, iters: int = 1) -> torch.Tensor:
    """Column potentials c (B, H, N) of Sinkhorn (Eq. 10): pi = softmax_j(s_ij - c_j) after ``iters``
    (column, row) rounds, without the (M, N) matrix.

    With pi_ij = exp(s_ij - c_j - r_i), each half-step is one LSE pass: c_j = logsumexp_i (s_ij - r_i),
    r_i = logsumexp_j (s_ij - c_j); the last row step is the final softmax. iters=1 gives DNAS's c.
    Without gradients on CPU, each later round (row step, then column step) is one pass of attnlab's
    kernel (kernels.sinkhorn_round) instead of two.
    """
    c = column_logsumexp(q, k, mask, scale)  # (B, H, N)
    for _ in range(iters - 1):
        nxt = _sinkhorn_round_kernel(q, k, c, mask, scale)
        if nxt is None:
            r = row_logsumexp(q, k, mask, scale, key_bias=-c)  # (B, H, M)
            nxt = column_logsumexp(q, k, mask, scale, query_bias=-r)
        c = nxt
    return c


def _sinkhorn_round_kernel(q, k, c, mask, scale):
    """c' (B, H, N) from c through kernels.sinkhorn_round, or None where it does not apply (gradients,
    not built, not CPU float32/64, a mask that depends on both i and j)."""
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    if grad or not _flash_lse_available(q) or not _separable(mask) or not _kernel_shapes(q, k):
        return None
    ops = _cpu_ops()
    if ops is None:
        return None
    B, H, M, _ = q.shape
    N = k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    key_bias, row_bias = _separable_biases(q, k, mask)
    nxt = ops.sinkhorn_round(_heads_flat(q), _heads_flat(k), c.reshape(B * H, N).contiguous(), key_bias,
                             row_bias, scale).view(B, H, N)
    return torch.where(torch.isneginf(nxt), torch.zeros((), dtype=nxt.dtype), nxt)  # empty columns: 0


def _separable_biases(q, k, mask):
    """A query-only or key-only mask as the kernels' additive biases: key_bias (B*H, N) and row_bias
    (B*H, M), 0 or -inf, each None when the mask does not restrict that side."""
    B, H, M, _ = q.shape
    N = k.shape[-2]
    key_bias = row_bias = None
    if mask is not None and mask.shape[-2] == 1:
        key_bias = torch.zeros((), dtype=q.dtype).masked_fill(~mask[..., 0, :], NEG_INF)
        key_bias = key_bias.expand(B, H, N).reshape(B * H, N).contiguous()
    if mask is not None and mask.shape[-1] == 1:
        row_bias = torch.zeros((), dtype=q.dtype).masked_fill(~mask[..., 0], NEG_INF)
        row_bias = row_bias.expand(B, H, M).reshape(B * H, M).contiguous()
    return key_bias, row_bias


def _sinkhorn_heads_kernel(q, k, v, mask, scale, ctx):
    """Sinkhorn attention through kernels.sinkhorn_attend: each head's (M, N) scores held once by its
    thread (threads x M x N at most SINKHORN_HEAD_BYTES), one score product per head instead of one
    per half-step; None where it does not apply (gradients, causal, not CPU float32/64, a mask that
    depends on both i and j, too large)."""
    if ctx.causal or _needs_grad(q, k, v, ctx) or not _flash_lse_available(q) or not _separable(mask):
        return None
    if not _kernel_shapes(q, k):
        return None
    B, H, M, _ = q.shape
    N = k.shape[-2]
    if min(torch.get_num_threads(), B * H) * M * N * q.element_size() > SINKHORN_HEAD_BYTES:
        return None
    ops = _cpu_ops()
    if ops is None:
        return None
    key_bias, row_bias = _separable_biases(q, k, mask)
    out = ops.sinkhorn_attend(_heads_flat(q), _heads_flat(k), _heads_flat(v), key_bias, row_bias, ctx.iters,
                              scale)
    return out.view(B, H, M, v.shape[-1])


def _fused_sinkhorn(q, k, v, mask, scale, ctx):
    if ctx.causal or ctx.iters == 1:
        return _fused_dnas(q, k, v, mask, scale, ctx)
    out = _sinkhorn_heads_kernel(q, k, v, mask, scale, ctx)
    if out is not None:
        return out
    return _sdpa(q, k, v, mask, scale, key_bias=-sinkhorn_potentials(q, k, mask, scale, ctx.iters))


FUSED: dict[str, Callable] = {
    "unas": _fused_unas,
    "dnas": _fused_dnas,
    "hnas": _fused_hnas,
    "sinkhorn": _fused_sinkhorn,
}


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    variant: str,
    *,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    u: float | torch.Tensor | None = None,
    iters: int | None = None,
    scale: float | None = None,
    return_weights: bool = False,
):
    """Attention output of one variant: ``weights @ v``.

    Args:
        q: (B, H, M, D) queries; k: (B, H, N, D) keys; v: (B, H, N, Dv) values (floating).
        variant, mask, causal, u, iters: as in :func:`attention_weights`.
        scale: score scale, default 1/sqrt(D).
        return_weights: also return the (B, H, M, N) weights (materialized).

    Returns:
        out (B, H, M, Dv) in ``q.dtype``, or ``(out, weights)``. Rows without a valid key give 0.

    Without ``return_weights``, unas/dnas/hnas (and sinkhorn with iters=1) never hold the (M, N)
    matrix: DNAS's column log-sum-exp comes from a fused pass over the transposed problem and the row
    pass is torch SDPA with the per-key bias -c_j. Half-precision inputs are computed in float32.
    """
    _check_variant(variant)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_float(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, H, length, dim), got shape {tuple(t.shape)}")
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
    B, H, M, D = q.shape
    N = k.shape[-2]
    mask = _check_mask(mask, torch.Size((B, H, M, N)))
    ctx = NormalizerContext(causal=causal, u=_check_u(u), iters=_check_iters(iters, variant, causal))
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)

    out_dtype = q.dtype
    dt = _compute_dtype(torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype))
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    if isinstance(ctx.u, torch.Tensor) and ctx.u.device != q.device:
        ctx = NormalizerContext(causal=ctx.causal, u=ctx.u.to(q.device), iters=ctx.iters)

    # Under torch.autocast the products would run in half precision again (and HNAS would mix half
    # weights with a float32 u): attention is computed in float32 here whatever the caller's autocast.
    with torch.autocast(device_type=q.device.type, enabled=False):
        if not return_weights and variant in FUSED:
            out = FUSED[variant](q, k, v, mask, scale, ctx)
            if out is not None:
                return out.to(out_dtype)

        scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)  # (B, H, M, N)
        weights = _normalize(scores, variant, mask, ctx)  # arguments already checked above
        out = torch.matmul(weights, v).to(out_dtype)
    return (out, weights.to(out_dtype)) if return_weights else out

