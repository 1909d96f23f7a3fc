"""Launching attnlab's Triton kernels (kernels_fwd.py, kernels_bwd.py) on (B, H, L, D) tensors.

    column_lse(L, q, k, rb)            c (BH, N) = logsumexp_i (s_ij + rb_i); the row log-sum-exp of the
                                       transposed problem is column_lse(L, k, q, kb - c) (Sinkhorn)
    row_pass(L, q, k, v, c, ...)       DNAS / HNAS / causal DNAS output (B, H, M, Dv)
    sinkhorn_potentials(L, q, k, n)    c after n (column, row) rounds (Eq. 10)
    DoublyNormalized                   autograd function of DNAS (Eq. 5) and HNAS (Eq. 12), backward by
                                       the two kernels of kernels_bwd.py

q, k, v keep their strides (no copy); biases, potentials and saved row statistics are float32
(BH, L) contiguous. ``Launch`` holds what every launch of one call shares.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch.autograd.function import once_differentiable


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Launch:
    """Shared by the kernel launches of one attention call."""

    ns: SimpleNamespace  # kernel modules (loader.kernels): ns.fwd, ns.bwd
    interpret: bool  # interpreted on CPU (no launch options)
    B: int
    H: int
    scale: float
    rb: torch.Tensor | None  # (BH, M) float32: 0 or -inf per query (query mask), None = all valid
    kb: torch.Tensor | None  # (BH, N) float32: 0 or -inf per key (key mask), None = all valid
    prec: str  # tl.dot input precision for float32 inputs: "ieee" or "tf32"
    f32: bool  # cast dot operands to float32 (the interpreter with bfloat16 inputs)
    block_m: int  # query block (the causal carry is indexed by it)
    block_n: int  # key block
    num_warps: int

    def opts(self) -> dict:
        return {} if self.interpret else {"num_warps": self.num_warps}


def column_lse(L: Launch, q, k, rb, causal: bool = False):
    """c (BH, N) float32 = logsumexp over valid i of (scale q_i . k_j + rb_i), 0 for an empty column;
    q (B, H, M, D), k (B, H, N, D), rb (BH, M) float32 or None. With ``causal`` also the carry
    (BH, cdiv(M, block_m), N): logsumexp over i < b * block_m with i >= j, else None."""
    B, H, M, D = q.shape
    N = k.shape[-2]
    c = torch.empty(B * H, N, dtype=torch.float32, device=q.device)
    carry = torch.empty(B * H, cdiv(M, L.block_m), N, dtype=torch.float32, device=q.device) if causal else c
    grid = (cdiv(N, L.block_n), B * H)
    L.ns.fwd.col_lse_kernel[grid](
        q, k, c if rb is None else rb, c, carry, *q.stride(), *k.stride(), H, M, N, L.scale,
        HAS_RB=rb is not None, CAUSAL=causal, PREC=L.prec, F32=L.f32, BLOCK_M=L.block_m,
        BLOCK_N=L.block_n, D=D, **L.opts())
    return c, (carry if causal else None)


def row_pass(L: Launch, q, k, v, c, u_bh=None, causal=False, save=False):
    """out (B, H, M, Dv) in q.dtype: softmax_j(s_ij + rb_i + kb_j - c_j) v (DNAS), mixed with the UNAS
    row pass by u_bh (BH,) float32 when given (HNAS, Eq. 12). ``causal``: c is ignored and c_j(i) is
    the prefix log-sum-exp (the carry is computed here). ``save``: also a dict of what the backward
    needs (rd, ru (BH, M); od, ou (BH, M, Dv) float32; None where not computed)."""
    B, H, M, D = q.shape
    N, DV = v.shape[-2:]
    dev = q.device
    carry = None
    if causal:
        _, carry = column_lse(L, q, k, L.rb, causal=True)
    hybrid = u_bh is not None
    out = torch.empty(B, H, M, DV, dtype=q.dtype, device=dev)
    f32 = dict(dtype=torch.float32, device=dev)
    rd = torch.empty(B * H, M, **f32) if save else None
    ru = torch.empty(B * H, M, **f32) if save and hybrid else None
    od = torch.empty(B * H, M, DV, **f32) if save and hybrid else None
    ou = torch.empty(B * H, M, DV, **f32) if save and hybrid else None
    any_f32 = out.new_empty(1, dtype=torch.float32)  # stands in for pointers a variant does not read
    pick = lambda t: any_f32 if t is None else t  # noqa: E731
    grid = (cdiv(M, L.block_m), B * H)
    L.ns.fwd.row_kernel[grid](
        q, k, v, pick(L.rb), pick(L.kb), pick(c), pick(carry), pick(u_bh), out,
        pick(od), pick(ou), pick(rd), pick(ru),
        *q.stride(), *k.stride(), *v.stride(), H, M, N, L.scale,
        HAS_RB=L.rb is not None, HAS_KB=L.kb is not None, HYBRID=hybrid, CAUSAL=causal, SAVE=save,
        PREC=L.prec, F32=L.f32, BLOCK_M=L.block_m, BLOCK_N=L.block_n, D=D, DV=DV, **L.opts())
    return out, {"rd": rd, "ru": ru, "od": od, "ou": ou}


def sinkhorn_potentials(L: Launch, q, k, iters: int) -> torch.Tensor:
    """Column potentials c (BH, N) after ``iters`` (column, row) rounds (Eq. 10 with potentials,
    pi_ij = exp(s_ij - c_j - r_i)): c = LSE_i(s_ij + rb_i), then iters - 1 times
    r_i = LSE_j(s_ij + kb_j - c_j) (the column pass of the transposed problem) and
    c_j = LSE_i(s_ij + rb_i - r_i). The last row step is the row pass with -c."""
    c, _ = column_lse(L, q, k, L.rb)
    for _ in range(iters - 1):
        r, _ = column_lse(L, k, q, -c if L.kb is None else L.kb - c)  # (BH, M)
        c, _ = column_lse(L, q, k, -r if L.rb is None else L.rb - r)
    return c


class DoublyNormalized(torch.autograd.Function):
    """DNAS (u4 None) or HNAS attention (B, H, M, Dv), not causal, with Triton forward and backward.

    u4: the HNAS weight as a 4-D tensor broadcastable to (B, H, 1, 1) (a float becomes one); its
    gradient is sum_i g_i . (out^d_i - out^u_i) per (batch, head), summed to u4's shape.
    """

    @staticmethod
    def forward(ctx, q, k, v, u4, L: Launch):
        B, H = L.B, L.H
        u_bh = None if u4 is None else u4.detach().float().expand(B, H, 1, 1).reshape(B * H).contiguous()
        c, _ = column_lse(L, q, k, L.rb)
        out, saved = row_pass(L, q, k, v, c, u_bh, save=True)
        ctx.save_for_backward(q, k, v, u4, u_bh, c, out, *saved.values())
        ctx.launch = L
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        q, k, v, u4, u_bh, c, out, rd, ru, od, ou = ctx.saved_tensors
        L: Launch = ctx.launch
        B, H, M, D = q.shape
        N, DV = v.shape[-2:]
        hybrid = u4 is not None
        g = g.to(q.dtype)
        g32 = g.float().reshape(B * H, M, DV)
        dd = (g32 * (od if hybrid else out.float().reshape(B * H, M, DV))).sum(-1)  # (BH, M)
        du = (g32 * ou).sum(-1) if hybrid else None
        dk = torch.empty(B, H, N, D, dtype=k.dtype, device=k.device)
        dv = torch.empty(B, H, N, DV, dtype=v.dtype, device=v.device)
        dq = torch.empty(B, H, M, D, dtype=q.dtype, device=q.device)
        e = torch.empty(B * H, N, dtype=torch.float32, device=q.device)
        pick = lambda t: dd if t is None else t  # noqa: E731
        args = (q, k, v, g, pick(L.rb), pick(L.kb), c, rd, pick(ru), dd, pick(du), pick(u_bh))
        strides = (*q.stride(), *k.stride(), *v.stride(), *g.stride())
        meta = dict(HAS_RB=L.rb is not None, HAS_KB=L.kb is not None, HYBRID=hybrid, PREC=L.prec, F32=L.f32,
                    BLOCK_M=L.block_m, BLOCK_N=L.block_n, D=D, DV=DV, **L.opts())
        sizes = (H, M, N, L.scale)
        L.ns.bwd.bwd_kv_kernel[(cdiv(N, L.block_n), B * H)](*args, dk, dv, e, *strides, *sizes, **meta)
        L.ns.bwd.bwd_q_kernel[(cdiv(M, L.block_m), B * H)](*args, e, dq, *strides, *sizes, **meta)
        grad_u = None
        if hybrid and ctx.needs_input_grad[3]:
            grad_u = (g32 * (od - ou)).sum((-1, -2)).view(B, H, 1, 1)
            grad_u = grad_u.sum_to_size(u4.shape).to(u4.dtype)
        return dq, dk, dv, grad_u, None
