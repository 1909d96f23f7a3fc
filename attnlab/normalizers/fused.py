"""Fused ``attend`` paths: out (B, H, M, Dv) without the (M, N) matrix, one per variant that has one
(declared as the spec's ``fused`` fast path, attnlab/normalizers/builtin.py).

Each takes checked, contiguous arguments ``(q, k, v, mask, scale, ctx)`` where ``mask`` excludes the
causal part (``ctx.causal`` says) and returns the output, or None to fall back to materializing the
weights. DNAS = SDPA with the per-key bias -c_j (c from attnlab/normalizers/lse.py); HNAS mixes the
UNAS and DNAS outputs (V enters linearly, Eq. 12); Sinkhorn = SDPA with its potentials' bias.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from attnlab.normalizers import kernel_paths as kp
from attnlab.normalizers.functions import (
    NEG_INF,
    as_weight,
    prefix_column_logsumexp,
    row_softmax,
    safe_logsumexp,
)
from attnlab.normalizers.lse import potentials, query_lse

# Query block of the causal DNAS pass: (B, H, QUERY_BLOCK, N) at a time.
QUERY_BLOCK = 128
# Training-size problems (M * N up to this, with gradients) take one fused autograd function that
# keeps the weights for its backward, as PyTorch's own SDPA math backend does for a biased row pass.
SMALL_SCORES = 128 * 128


def causal_mask(m: int, n: int, device: torch.device) -> torch.Tensor:
    """(M, N) bool, True where j <= i."""
    return torch.ones(m, n, dtype=torch.bool, device=device).tril()


def combine_masks(mask: torch.Tensor | None, causal: bool, m: int, n: int, device) -> torch.Tensor | None:
    if not causal:
        return mask
    tri = causal_mask(m, n, device)
    return tri if mask is None else mask & tri


def _row_valid(mask: torch.Tensor | None) -> torch.Tensor | None:
    return None if mask is None else mask.any(-1, keepdim=True)  # (b, h, m, 1)


def _sdpa(q, k, v, mask, scale, key_bias=None, causal=False):
    """softmax_j(s_ij + key_bias_j) @ v through torch SDPA; masked -> -inf; empty rows -> 0.

    key_bias (B, H, N) enters as a contiguous additive (B, H, 1, N) mask (fully materialized only
    when ``mask`` itself depends on the query). ``causal`` without a mask uses SDPA's is_causal."""
    if causal and (mask is not None or key_bias is not None):
        mask = combine_masks(mask, True, q.shape[-2], k.shape[-2], q.device)
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
        c = prefix_column_logsumexp(s, carry)  # (B, H, b, N)
        carry = c[..., -1:, :]
        outs.append(torch.matmul(row_softmax(s - c), v))
    return torch.cat(outs, dim=-2)


# Fused implementations: (q, k, v, mask, scale, ctx) -> out (B, H, M, Dv), where ``mask`` excludes
# the causal part (ctx.causal says). Returning None falls back to materializing the weights, and a
# new variant needs no entry here.


def fused_unas(q, k, v, mask, scale, ctx):
    return _sdpa(q, k, v, mask, scale, causal=ctx.causal)


class _SmallDoublyNormalized(torch.autograd.Function):
    """DNAS (Eq. 5) or HNAS (Eq. 12) attention for small problems under autograd, with the backward
    written out (fewer passes than autograd through the LSE pass and a biased SDPA).

    Forward: s = scale q k^T (masked), c_j = logsumexp_i s_ij, P = exp(s - c) (column softmax),
    pi_d = softmax_j(s - c), pi_u = softmax_j(s), pi = lerp(pi_u, pi_d, u), out = pi v.
    Backward, with dpi = g v^T: dl = pi_d o (u dpi - rowsum(u dpi o pi_d)), and likewise ds_u for
    pi_u with (1 - u); ds = ds_u + dl - P o colsum(dl) (c_j depends on column j); grad_q = scale ds k,
    grad_k = scale ds^T q, grad_v = pi^T g, grad_u = sum dpi o (pi_d - pi_u).

    On CPU (float32/64, u one weight per (batch, head)) each pass is one of attnlab's C++ kernels
    (kernel_paths.train_forward / train_backward: one task per head, its panels in cache, the matrix
    products by BLAS in the task, P kept as row factors e_i, P = e_i pi_d); elsewhere the PyTorch
    code below.
    """

    @staticmethod
    def forward(ctx, q, k, v, u, mask, scale, hybrid):
        ctx.scale, ctx.hybrid = scale, hybrid
        ctx.u_float = None if isinstance(u, torch.Tensor) else float(u)
        u_t = u if isinstance(u, torch.Tensor) else None
        res = kp.train_forward(q, k, v, mask, u if hybrid else None, scale)
        ctx.kernel = res is not None
        if res is not None:
            out, p_d, p_u, e, weights = res
            ctx.save_for_backward(q, k, v, u_t, p_d, p_u, e, weights)
            return out
        s = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)  # (B, H, M, N)
        if mask is not None:
            s.masked_fill_(~mask, NEG_INF)
        c = safe_logsumexp(s, -2)  # (B, H, 1, N)
        p_col = torch.exp(s - c)
        p_d = row_softmax(s - c)
        p_u = row_softmax(s) if hybrid else None
        p = torch.lerp(p_u, p_d, u) if hybrid else p_d
        ctx.save_for_backward(q, k, v, u_t, p_col, p_d, p_u, p)
        return torch.matmul(p, v)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        if ctx.kernel:
            return _SmallDoublyNormalized._kernel_backward(ctx, g)
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

    @staticmethod
    def _kernel_backward(ctx, g):
        q, k, v, u_t, p_d, p_u, e, weights = ctx.saved_tensors
        grad_q, grad_k, grad_v, grad_u_heads = kp.train_backward(g, q, k, v, p_d, p_u, e, weights, ctx.scale)
        grad_u = None
        if u_t is not None and ctx.needs_input_grad[3]:
            grad_u = grad_u_heads.view(*q.shape[:2], 1, 1).sum_to_size(u_t.shape)  # (B, H, 1, 1) summed
        return grad_q, grad_k, grad_v, grad_u, None, None, None


def _needs_grad(q, k, v, ctx) -> bool:
    return kp.needs_grad(q, k, v, ctx.params.get("u"))


def _small_with_grad(q, k, v, ctx) -> bool:
    return _needs_grad(q, k, v, ctx) and not ctx.causal and q.shape[-2] * k.shape[-2] <= SMALL_SCORES


def _mixed_kernel(q, k, v, mask, scale, ctx):
    """(1 - u) softmax_j(s) v + u softmax_j(s - c_j) v (Eq. 12 with V entering linearly) from one score
    panel per task through attnlab's CPU kernel (kernels.mix_attend); None where it does not apply
    (not built, not CPU float32/64, gradients needed, a mask that depends on both i and j, u not one
    weight per (batch, head))."""
    if ctx.causal or not kp.applies(q, k, mask, _needs_grad(q, k, v, ctx)):
        return None
    ops = kp.cpu_ops()
    weights = kp.head_weights(ctx.u, q)
    if ops is None or weights is None:
        return None
    B, H, M, _ = q.shape
    N = k.shape[-2]
    c = query_lse(q, k, mask, scale)  # (B, H, N)
    key_bias, _ = kp.separable_biases(q, k, mask)  # invalid queries: their rows are zeroed below
    out = ops.mix_attend(kp.heads_flat(q), kp.heads_flat(k), kp.heads_flat(v), key_bias,
                         (-c).reshape(B * H, N).contiguous(), weights, scale)
    out = out.view(B, H, M, v.shape[-1])
    rows = _row_valid(mask)
    return out if rows is None else out.masked_fill(~rows, 0.0)


def _held(q, k, v, mask, scale, u=None, iters=1):
    """The held-scores kernel (kernels.held_attend) with invalid queries' rows zeroed, or None."""
    out = kp.held_kernel(q, k, v, mask, scale, u, iters)
    rows = _row_valid(mask)
    return out if out is None or rows is None else out.masked_fill(~rows, 0.0)


def fused_dnas(q, k, v, mask, scale, ctx):
    if ctx.causal:
        out = kp.causal_kernel(q, k, v, mask, scale)
        return _causal_dnas_blocked(q, k, v, mask, scale) if out is None else out
    if _small_with_grad(q, k, v, ctx):
        return _SmallDoublyNormalized.apply(q, k, v, 1.0, mask, scale, False)
    out = kp.panel_kernel(q, k, v, mask, scale)  # column panels; else whole heads held
    if out is None:
        out = kp.held_kernel(q, k, v, mask, scale)
    if out is not None:
        rows = _row_valid(mask)
        return out if rows is None else out.masked_fill(~rows, 0.0)
    c = query_lse(q, k, mask, scale)  # (B, H, N)
    return _sdpa(q, k, v, mask, scale, key_bias=-c)


def fused_hnas(q, k, v, mask, scale, ctx):
    # Eq. (12) with V entering linearly: u * (pi_dnas V) + (1 - u) * (pi_unas V)
    if _small_with_grad(q, k, v, ctx):
        return _SmallDoublyNormalized.apply(q, k, v, as_weight(ctx.u, q), mask, scale, True)
    if ctx.causal:  # one pass for the causal softmax and causal DNAS (kernels.causal_hnas)
        out = kp.causal_kernel(q, k, v, mask, scale, ctx.u)
    else:
        out = _held(q, k, v, mask, scale, u=ctx.u)
        if out is None:
            out = _mixed_kernel(q, k, v, mask, scale, ctx)
    if out is not None:
        return out
    out_unas = fused_unas(q, k, v, mask, scale, ctx)
    return torch.lerp(out_unas, fused_dnas(q, k, v, mask, scale, ctx), as_weight(ctx.u, q))


def fused_sinkhorn(q, k, v, mask, scale, ctx):
    if ctx.causal or ctx.iters == 1:
        return fused_dnas(q, k, v, mask, scale, ctx)
    out = None
    if ctx.tol == 0 and ctx.iters <= kp.SINKHORN_KERNEL_ROUNDS:  # else round by round (tol, Ctrl-C)
        out = _held(q, k, v, mask, scale, iters=ctx.iters)
    if out is None:
        out = kp.sinkhorn_heads_kernel(q, k, v, mask, scale, ctx)
    if out is not None:
        return out
    return _sdpa(q, k, v, mask, scale, key_bias=-potentials(q, k, mask, scale, ctx.iters, ctx.tol))


