"""Log-sum-exp over queries without the (M, N) matrix: c_j = logsumexp_i (s_ij + b_i), the column
potential of DNAS (Eq. 5 in log space) and, alternated with the row LSE, Sinkhorn's (Eq. 10).

Backends, first that applies: CUDA's memory-efficient SDPA (returns the LSE of the transposed
problem), attnlab's CPU kernel (kernels.col_lse), PyTorch's CPU flash kernel (returns that LSE), and
key blocks of (B, H, M, KEY_BLOCK) anywhere. The backward runs by key blocks.
Shapes: q (B, H, M, D), k (B, H, N, D), mask bool broadcastable to (B, H, M, N), bias (B, H, M).
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from attnlab.normalizers import kernel_paths as kp
from attnlab.normalizers.checks import check_float_tensor, check_mask, check_scale
from attnlab.normalizers.functions import NEG_INF, safe_logsumexp

__all__ = ["column_logsumexp", "row_logsumexp", "sinkhorn_potentials", "KEY_BLOCK"]

# Key block of the blocked column-logsumexp fallback and its backward: (B, H, M, KEY_BLOCK) at a time.
KEY_BLOCK = 256


def _lse_fused(q, k, bias, mask, scale):
    """The column LSE is the row LSE of the transposed problem (keys attend to queries): one pass of
    attnlab's CPU kernel (a score panel per task, no value product) or, where that does not apply,
    of PyTorch's CPU flash-attention kernel, which returns that log-sum-exp. bias (B, H, M) or None."""
    c = kp.lse_kernel(q, k, bias, mask, scale)
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
        # non-finite inputs take the blocked path, which follows the materialized semantics exactly
        fast = all_finite(q, k, bias)
        c = _lse_cuda(q, k, bias, mask, scale) if fast and q.device.type == "cuda" else None
        if c is None and fast and kp.flash_lse_available(q):
            c = _lse_fused(q, k, bias, mask, scale)
        if c is None:
            blocks = _score_blocks(q, k, bias, mask, scale)
            c = torch.cat([safe_logsumexp(s, -2).squeeze(-2) for _, _, s in blocks], dim=-1)
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


def all_finite(*tensors) -> bool:
    """True when every given tensor (None skipped) is finite: one sum each (NaN and +-inf propagate into
    a sum, so a finite sum means finite entries), one host sync. A sum of finite entries that overflows
    says False: the caller then takes its exact path for non-finite inputs, which gives the same
    result, slower. (``isfinite(t).all()`` made a bool tensor: 2 ms at 12 x 1024 x 64, 25x the sum.)"""
    for t in tensors:
        if t is None:
            continue
        wide = torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else None
        if not math.isfinite(float(t.detach().sum(dtype=wide))):
            return False
    return True


def query_lse(q, k, mask, scale, query_bias=None) -> torch.Tensor:
    """column_logsumexp on checked, contiguous arguments (the fast paths call this)."""
    if q.shape[-2] == 0 or k.shape[-2] == 0:  # no query (every column empty: 0) or no key
        return torch.zeros(*torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]), k.shape[-2],
                           dtype=q.dtype, device=q.device)
    return _QueryLogSumExp.apply(q, k, query_bias, mask, scale)


def _check_lse_args(q, k, mask, scale, bias, bias_name):
    for name, t in (("q", q), ("k", k)):
        check_float_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, H, length, dim), got shape {tuple(t.shape)}")
    if k.shape[:2] != q.shape[:2] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k must be (B, H, N, D) matching q (B, H, M, D) in B, H and D; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}")
    if q.device != k.device:
        raise ValueError(f"q and k must be on one device, got {q.device} and {k.device}")
    B, H, M, D = q.shape
    mask = check_mask(mask, torch.Size((B, H, M, k.shape[-2])))
    if bias is not None:
        check_float_tensor(bias_name, bias)
        try:
            ok = torch.broadcast_shapes(bias.shape, (B, H, M)) == (B, H, M)
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"{bias_name} must broadcast to (B, H, M) = {(B, H, M)}, "
                             f"got {tuple(bias.shape)}")
        bias = bias.to(q.dtype).expand(B, H, M).contiguous()
    dt = torch.promote_types(q.dtype, k.dtype)
    return q.to(dt).contiguous(), k.to(dt).contiguous(), mask, check_scale(scale, 1.0 / math.sqrt(D)), bias


def column_logsumexp(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    query_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """c_j = logsumexp over valid i of (scale * q_i . k_j + query_bias_i), as (B, H, N), differentiable.

    Never holds the (M, N) matrix. q (B, H, M, D), k (B, H, N, D); ``mask`` bool broadcastable to
    (B, H, M, N); ``query_bias`` broadcastable to (B, H, M). Columns with no valid query get 0. Any
    view is taken (it is made contiguous once); NaN in q or k makes the columns it touches NaN.
    """
    q, k, mask, scale, query_bias = _check_lse_args(q, k, mask, scale, query_bias, "query_bias")
    return query_lse(q, k, mask, scale, query_bias)


def row_logsumexp(q, k, mask=None, scale=None, key_bias=None) -> torch.Tensor:
    """r_i = logsumexp over valid j of (scale * q_i . k_j + key_bias_j), as (B, H, M)."""
    if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == 4 and k.dim() == 4:
        mt = None
        if mask is not None:
            mt = check_mask(mask, torch.Size((*q.shape[:3], k.shape[-2]))).transpose(-1, -2)
        scale = check_scale(scale, 1.0 / math.sqrt(q.shape[-1]))
        return column_logsumexp(k, q, mt, scale, key_bias)
    return column_logsumexp(q, k, mask, scale, key_bias)  # its checks word the error


def log_ratio(q, k, mask) -> torch.Tensor:
    """log(M_valid / N_valid) per head, (B, H, 1): Sinkhorn's re-centring constant."""
    B, H, M, _ = q.shape
    N = k.shape[-2]
    if mask is None:
        return torch.full((B, H, 1), math.log(M / N) if M and N else 0.0, dtype=q.dtype, device=q.device)
    m_valid = mask.any(-1).sum(-1, keepdim=True).expand(B, H, 1).to(q.dtype)
    n_valid = mask.any(-2).sum(-1, keepdim=True).expand(B, H, 1).to(q.dtype)
    ok = (m_valid > 0) & (n_valid > 0)
    return torch.where(ok, torch.log(m_valid.clamp(min=1) / n_valid.clamp(min=1)), torch.zeros_like(m_valid))


def sinkhorn_potentials(q, k, mask=None, scale=None, iters: int = 1, tol: float = 0.0) -> torch.Tensor:
    """Column potentials c (B, H, N) of Sinkhorn (Eq. 10): pi = softmax_j(s_ij - c_j) after ``iters``
    (column, row) rounds, without the (M, N) matrix.

    With pi_ij = exp(s_ij - c_j - r_i), each half-step is one LSE pass: c_j = logsumexp_i (s_ij - r_i),
    r_i = logsumexp_j (s_ij - c_j); the last row step is the final softmax. iters=1 gives DNAS's c.
    Each round re-centres c by log(M_valid / N_valid) (cancelled by the row softmax; no drift). With
    ``tol`` > 0 the rounds stop once every valid column's mass is within ``tol`` of M_valid/N_valid.
    Without gradients on CPU, a round is one pass of attnlab's kernel (kernels.sinkhorn_round).
    Rounds run in Python: Ctrl-C stops between rounds.
    """
    from attnlab.normalizers.specs import variant_spec  # noqa: PLC0415

    q, k, mask, scale, _ = _check_lse_args(q, k, mask, scale, None, "query_bias")
    spec = variant_spec("sinkhorn")
    iters, tol = spec.param("iters").check(iters), spec.param("tol").check(tol)
    return potentials(q, k, mask, scale, iters, tol)


def potentials(q, k, mask, scale, iters: int, tol: float) -> torch.Tensor:
    """sinkhorn_potentials on checked, contiguous arguments."""
    c = query_lse(q, k, mask, scale)  # (B, H, N)
    if iters == 1 or q.shape[-2] == 0 or k.shape[-2] == 0:
        return c
    recentre = log_ratio(q, k, mask)  # (B, H, 1)
    cols = None if mask is None else mask.any(-2).expand(*q.shape[:2], k.shape[-2])
    for _ in range(iters - 1):
        nxt = kp.sinkhorn_round_kernel(q, k, c, mask, scale, recentre)
        if nxt is None:
            r = query_lse(k, q, None if mask is None else mask.transpose(-1, -2), scale, -c)  # (B, H, M)
            nxt = query_lse(q, k, mask, scale, -r) - recentre
            if mask is not None:
                nxt = torch.where(cols, nxt, torch.zeros_like(nxt))
        if tol > 0:
            # column mass after the row step is exp(c'_j - c_j) * M_valid / N_valid
            gap = (torch.exp(nxt - c) - 1).abs() * torch.exp(recentre)
            if cols is not None:
                gap = torch.where(cols, gap, torch.zeros_like(gap))
            c = nxt
            if bool(gap.amax() <= tol):
                break
        else:
            c = nxt
    return c
