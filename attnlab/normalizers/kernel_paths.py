"""attnlab's CPU kernels (attnlab/kernels.py) as the fast paths of the normalizers need them.

Each function returns the kernel's result, or None where the kernel does not apply (not built,
``ATTNLAB_KERNELS=0``, not CPU float32/64, gradients needed, a mask that depends on both i and j,
empty problems, ...); the caller then takes a PyTorch path with the same result.
Shapes: q (B, H, M, D), k (B, H, N, D), v (B, H, N, Dv); the kernels take (B*H, L, D) with a
contiguous last dimension.
"""

from __future__ import annotations

import math

import torch

from attnlab.normalizers.functions import LSE_FLOOR, NEG_INF

# DNAS, HNAS and Sinkhorn without gradients on CPU hold a head's (M, N) scores (kernels.held_attend)
# when one head takes at most this many bytes (S = 4096 float32: 64 MiB); a group of smaller heads
# shares the buffer. Beyond it they stream (one score product per pass, a few MiB).
HELD_HEAD_BYTES = 128 * 2**20
# DNAS without gradients on CPU (non-causal) goes by column panels (kernels.panel_dnas): each thread
# holds one M x C panel of scores of at most this many bytes (C >= 16 keys), so the working set stays in
# cache whatever N is; with the accumulated output (M x Dv per thread) that is all it holds. 0 switches
# the panels off (then DNAS takes held_attend, as before). 1 MiB (C = 64 keys at M = 4096): on the
# 2-core Zen 3 machine 1 MiB and 0.5 MiB panels ran at 1.00-1.10x SDPA, 2 MiB at 1.04-1.21x, 8 MiB at
# 1.3-1.37x (docs/BENCHMARKS.md): a panel near the L2 keeps the second pass off a shared L3.
PANEL_BYTES = 1 * 2**20
# HNAS and Sinkhorn(k >= 2) take the held panels (kernels.panel_hnas / panel_sinkhorn: one head at a
# time, the head's buffer written once and read once per round) from heads of this many scores on;
# smaller heads take held_attend, which holds several heads at once and whose extra passes stay in
# cache there (12 heads, D = 64, medians: S = 512 held 1.06 / 1.14x SDPA for HNAS / Sinkhorn(3),
# panels 1.66 / 1.82x; S = 768 1.56 / 1.53x against 1.59 / 2.15x; S = 1024 even; S = 2048 and 4096
# the panels 5-17 % faster, docs/BENCHMARKS.md).
PANEL_HELD_MIN_SCORES = 1024 * 1024
# The older whole-head Sinkhorn kernel (one head per thread) within this many bytes in all; it runs
# only where held_attend does not apply.
SINKHORN_HEAD_BYTES = 256 * 2**20
# The whole-head Sinkhorn kernel runs at most this many rounds in one call: longer runs (and runs with
# a tolerance) go round by round, so that Ctrl-C and the tolerance are honoured between rounds.
SINKHORN_KERNEL_ROUNDS = 64


def flash_lse_available(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)


def cpu_ops():
    """attnlab's CPU kernels (attnlab/kernels.py) or None; imported here so that importing attnlab
    builds nothing."""
    from attnlab import kernels  # noqa: PLC0415

    return kernels.cpu_ops()


def heads_flat(t: torch.Tensor) -> torch.Tensor:
    """(B, H, L, D) -> (B*H, L, D) with a contiguous last dimension, as the CPU kernels take it."""
    t = t.reshape(t.shape[0] * t.shape[1], *t.shape[-2:])
    return t if t.stride(-1) == 1 else t.contiguous()


def kernel_shapes(q: torch.Tensor, k: torch.Tensor) -> bool:
    """The CPU kernels take q (B, H, M, D), k (B, H, N, D) with the same B, H and nothing empty."""
    return q.shape[:2] == k.shape[:2] and q.numel() > 0 and k.numel() > 0


def separable(mask: torch.Tensor | None) -> bool:
    """True when the mask depends on the query alone (..., M, 1) or on the key alone (..., 1, N)."""
    return mask is None or mask.shape[-1] == 1 or mask.shape[-2] == 1


def lse_kernel(q, k, bias, mask, scale):
    """Column LSE (B, H, N) through attnlab's CPU kernel (kernels.col_lse), or None where it does not
    apply (not built, a mask that depends on both i and j). An invalid query enters as bias -inf; a
    key-only mask changes nothing here (the caller zeroes columns without a valid query)."""
    ops = cpu_ops()
    if ops is None or not separable(mask) or not kernel_shapes(q, k):
        return None
    B, H, M, _ = q.shape
    rb = None if bias is None else bias.expand(B, H, M)
    if mask is not None and mask.shape[-1] == 1:
        rows = mask[..., 0].expand(B, H, M)
        rb = (torch.zeros((), dtype=q.dtype) if rb is None else rb).masked_fill(~rows, NEG_INF)
    rb = None if rb is None else rb.reshape(B * H, M).to(q.dtype).contiguous()
    return ops.col_lse(heads_flat(q), heads_flat(k), rb, scale).view(B, H, k.shape[-2])


def separable_biases(q, k, mask):
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


def head_weights(u, q) -> torch.Tensor | None:
    """u as one weight per (batch, head), (B*H,), or None when it varies within a head."""
    B, H = q.shape[:2]
    if not isinstance(u, torch.Tensor):
        return torch.full((B * H,), float(u), dtype=q.dtype)
    if u.dim() > 4 or (u.dim() >= 2 and u.shape[-2:] != (1, 1)) or (u.dim() < 2 and u.numel() != 1):
        return None
    u = u.reshape(*u.shape[:-2]) if u.dim() >= 2 else u.reshape(())
    return u.detach().to(q.dtype).expand(B, H).reshape(B * H).contiguous()


def needs_grad(q, k, v, u=None) -> bool:
    return torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or (v is not None and v.requires_grad)
        or (isinstance(u, torch.Tensor) and u.requires_grad)
    )


def applies(q, k, mask, grad: bool) -> bool:
    """The common conditions of every CPU kernel: no gradients, CPU float32/64, a separable mask,
    non-empty heads of one (B, H)."""
    return not grad and flash_lse_available(q) and separable(mask) and kernel_shapes(q, k)


def sinkhorn_round_kernel(q, k, c, mask, scale, recentre):
    """c' (B, H, N) from c through kernels.sinkhorn_round (a row step, then a column step), or None
    where it does not apply. ``recentre`` (B, H, 1) = log(M_valid / N_valid) is subtracted (a per-head
    constant the row softmax cancels; without it c drifts by ln(M/N) per round)."""
    if not applies(q, k, mask, needs_grad(q, k, None)):
        return None
    ops = cpu_ops()
    if ops is None:
        return None
    B, H, M, _ = q.shape
    N = k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    key_bias, row_bias = separable_biases(q, k, mask)
    nxt = ops.sinkhorn_round(heads_flat(q), heads_flat(k), c.reshape(B * H, N).contiguous(), key_bias,
                             row_bias, scale).view(B, H, N)
    nxt = nxt - recentre
    return torch.where(torch.isneginf(nxt), torch.zeros((), dtype=nxt.dtype), nxt)  # empty columns: 0


def sinkhorn_heads_kernel(q, k, v, mask, scale, ctx):
    """Sinkhorn attention through kernels.sinkhorn_attend: each head's (M, N) scores held once by its
    thread (threads x M x N at most SINKHORN_HEAD_BYTES), one score product per head instead of one
    per half-step; None where it does not apply (gradients, causal, a tolerance, more than
    SINKHORN_KERNEL_ROUNDS rounds, too large, and the conditions of :func:`applies`)."""
    if ctx.causal or ctx.tol > 0 or ctx.iters > SINKHORN_KERNEL_ROUNDS:
        return None
    if not applies(q, k, mask, needs_grad(q, k, v)):
        return None
    B, H, M, _ = q.shape
    N = k.shape[-2]
    if min(torch.get_num_threads(), B * H) * M * N * q.element_size() > SINKHORN_HEAD_BYTES:
        return None
    ops = cpu_ops()
    if ops is None:
        return None
    key_bias, row_bias = separable_biases(q, k, mask)
    out = ops.sinkhorn_attend(heads_flat(q), heads_flat(k), heads_flat(v), key_bias, row_bias, ctx.iters,
                              scale)
    return out.view(B, H, M, v.shape[-1])



def _operands(q, k, v, mask, u=None):
    """(the CPU kernels, q, k, v as (B*H, L, D), key_bias, row_bias, u as one weight per (batch, head)
    or None) for a kernel call, or None where the kernels do not apply: Dv = 0 (BLAS refuses a leading
    dimension of 0; PyTorch's path gives the empty output), the conditions of :func:`applies`, u
    varying within a head, or not built."""
    if v.shape[-1] == 0 or not applies(q, k, mask, needs_grad(q, k, v, u)):
        return None
    found = _ops_and_weights(u, q)
    if found is None:
        return None
    ops, weights = found
    return (ops, heads_flat(q), heads_flat(k), heads_flat(v), *separable_biases(q, k, mask), weights)


def _ops_and_weights(u, q):
    """(the CPU kernels, u as one weight per (batch, head) or None) or None: not built, or u not one
    weight per head."""
    weights = None if u is None else head_weights(u, q)
    if u is not None and weights is None:
        return None
    ops = cpu_ops()
    return None if ops is None else (ops, weights)


def held_kernel(q, k, v, mask, scale, u=None, iters: int = 1):
    """DNAS (u None, iters 1), HNAS (u, one weight per (batch, head) or a number) or Sinkhorn (iters
    rounds) attention through kernels.held_attend: each head's scores computed once and held (one
    score product, one exponential per score, one value product); HNAS and Sinkhorn through
    kernels.panel_hnas / panel_sinkhorn (the held scores bound-shifted and in column panels, written
    once and read once per round; heads where a column's bound is loose, or a sum leaves the float
    range, go to held_attend) for heads of PANEL_HELD_MIN_SCORES scores or more. None where it does
    not apply (one head over HELD_HEAD_BYTES, u varying within a head, and the conditions of
    :func:`applies`)."""
    B, H, M, _ = q.shape
    N = k.shape[-2]
    if M * N * q.element_size() > HELD_HEAD_BYTES:
        return None
    found = _operands(q, k, v, mask, u)
    if found is None:
        return None
    ops, qf, kf, vf, key_bias, row_bias, weights = found
    panels = None  # HNAS and Sinkhorn(k >= 2): bound-shifted panels, written once, read once (a round)
    big = PANEL_BYTES > 0 and M * N >= PANEL_HELD_MIN_SCORES
    if big and weights is not None:
        panels = ops.panel_hnas(qf, kf, vf, key_bias, row_bias, weights, scale, PANEL_BYTES)
    elif big and iters > 1:
        panels = ops.panel_sinkhorn(qf, kf, vf, key_bias, row_bias, iters, scale, PANEL_BYTES)
    if panels is not None:
        out, done = panels
        redo = (~done).nonzero().flatten()
        if redo.numel():  # heads with a loose column bound: held_attend, exactly
            def pick(t):
                return None if t is None else t.index_select(0, redo)

            out[redo] = ops.held_attend(pick(qf), pick(kf), pick(vf), pick(key_bias), pick(row_bias),
                                        pick(weights), iters, scale, HELD_HEAD_BYTES)
        return out.view(B, H, M, v.shape[-1])
    out = ops.held_attend(qf, kf, vf, key_bias, row_bias, weights, iters, scale, HELD_HEAD_BYTES)
    return out.view(B, H, M, v.shape[-1])


def panel_kernel(q, k, v, mask, scale):
    """DNAS attention through kernels.panel_dnas (column panels of PANEL_BYTES per thread: one score
    product, one exponential per score, one value product); None where it does not apply (the
    conditions of :func:`applies`, PANEL_BYTES = 0)."""
    found = _operands(q, k, v, mask) if PANEL_BYTES > 0 else None
    if found is None:
        return None
    ops, qf, kf, vf, key_bias, row_bias, _ = found
    out = ops.panel_dnas(qf, kf, vf, key_bias, row_bias, scale, PANEL_BYTES)
    return out.view(*q.shape[:3], v.shape[-1])


def causal_kernel(q, k, v, mask, scale, u=None):
    """Causal DNAS attention through kernels.causal_dnas (one pass: query blocks outer, each column's
    running prefix maximum and sum carried down the rows), or with ``u`` (one weight per (batch, head)
    or a number) causal HNAS through kernels.causal_hnas (the same pass with the causal softmax's
    online row maxima and a second value product: one score product for both); None where it does not
    apply (the conditions of :func:`applies`, u varying within a head) or where some row's weights
    underflowed (the kernel's ``redo``): then the exact blocked path."""
    found = _operands(q, k, v, mask, u)
    if found is None:
        return None
    ops, qf, kf, vf, key_bias, row_bias, weights = found
    if weights is None:
        out, redo = ops.causal_dnas(qf, kf, vf, key_bias, row_bias, scale, LSE_FLOOR)
    else:
        out, redo = ops.causal_hnas(qf, kf, vf, key_bias, row_bias, weights, scale, LSE_FLOOR)
    return None if bool(redo.any()) else out.view(*q.shape[:3], v.shape[-1])


def train_forward(q, k, v, mask, u, scale):
    """The forward of a training-size DNAS (u None) or HNAS problem through kernels.train_dn_forward:
    per head, s = scale q k^T (masked entries -inf), the column log-sum-exp, the row softmaxes, the
    mix and out = pi v in one task. Returns (out, p_d, p_u, e, weights): the output (B, H, M, Dv),
    DNAS's and UNAS's weights (B, H, M, N) (p_u None for DNAS), the column-normalized row sums e
    (B*H, M) (the column-normalized weights are e_i p_d_ij) and u per (batch, head) (B*H,) (None for
    DNAS); or None where the kernel does not apply (not built, not CPU float32/64, empty heads or
    values, u varying within a head) or a score is NaN / +inf (q k^T overflowed): then the PyTorch
    path, with its NaN rule."""
    if not flash_lse_available(q) or not kernel_shapes(q, k) or v.shape[-1] == 0:
        return None
    found = _ops_and_weights(u, q)
    if found is None:
        return None
    ops, weights = found
    B, H, M, _ = q.shape
    N, Dv = k.shape[-2], v.shape[-1]
    mask = None if mask is None else mask.expand(B, H, M, N)
    out = q.new_empty(B, H, M, Dv)
    p_d = q.new_empty(B, H, M, N)
    p_u = None if u is None else torch.empty_like(p_d)
    e = q.new_empty(B * H, M)
    ok = ops.train_dn_forward(heads_flat(q), heads_flat(k), heads_flat(v), mask, weights, scale,
                              out.view(B * H, M, Dv), p_d.view(B * H, M, N),
                              None if p_u is None else p_u.view(B * H, M, N), e)
    return (out, p_d, p_u, e, weights) if ok else None


def train_backward(g, q, k, v, p_d, p_u, e, weights, scale):
    """The gradients of :func:`train_forward`'s problem through kernels.train_dn_backward: per head,
    dp = g v^T, the softmax backwards and the column term, and the gradient products in one task.
    Returns grad_q, grad_k, grad_v (shaped as q, k, v) and, for HNAS, sum_ij dp_ij (p_d_ij - p_u_ij)
    per (batch, head) (B*H,) (None for DNAS)."""
    B, H, M, D = q.shape
    N, Dv = k.shape[-2], v.shape[-1]
    g = g.to(q.dtype).contiguous()
    grad_q, grad_k, grad_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    grad_u = None if weights is None else q.new_empty(B * H)
    cpu_ops().train_dn_backward(g.view(B * H, M, Dv), heads_flat(q), heads_flat(k), heads_flat(v),
                                p_d.view(B * H, M, N), None if p_u is None else p_u.view(B * H, M, N), e,
                                weights, scale, grad_q.view(B * H, M, D), grad_k.view(B * H, N, D),
                                grad_v.view(B * H, N, Dv), grad_u)
    return grad_q, grad_k, grad_v, grad_u
