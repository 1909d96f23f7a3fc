"""Triton backward kernels of DNAS and HNAS attention (not causal).

Loaded only through ``attnlab.gpu.loader``. With l_ij = s_ij - c_j (masked -inf), the saved row
log-sum-exps r^d_i, r^u_i and, from the forward, g = dL/dout:

    pi^d_ij = exp(l_ij - r^d_i)      pi^u_ij = exp(s_ij - r^u_i)      P_ij = exp(s_ij - c_j)
    dpi_ij  = g_i . v_j              Dd_i = g_i . out^d_i             Du_i = g_i . out^u_i
    dl_ij   = u pi^d_ij (dpi_ij - Dd_i)          (softmax backward of the DNAS part)
    ds_ij   = dl_ij - P_ij e_j + (1 - u) pi^u_ij (dpi_ij - Du_i),   e_j = sum_i dl_ij
              (c_j = logsumexp_i s_ij depends on the whole column j: dc_j/ds_ij = P_ij, the column
              softmax; the last term is UNAS's softmax backward, present when HYBRID)
    grad_v_j = sum_i (u pi^d_ij + (1 - u) pi^u_ij) g_i
    grad_k_j = scale (sum_i (ds_ij + P_ij e_j) q_i - e_j sum_i P_ij q_i)   (one pass over queries)
    grad_q_i = scale sum_j ds_ij k_j                                          (a second pass, needs e)

DNAS is u = 1 without the UNAS terms. Every exponential of a masked entry is exp(-inf) = 0 and empty
rows carry r = +inf, so no NaN appears.
"""

import triton
import triton.language as tl

NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _dot(a, b, PREC: tl.constexpr, F32: tl.constexpr):
    """tl.dot with float32 accumulation; F32 casts the operands to float32 first (the interpreter's
    dot misreads bfloat16, which it stores as raw uint16)."""
    if F32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _tile(q, kt, rb, kb, c, rd, ru, dd, du, g, vt, u, m_ok, n_ok, scale,
          HAS_KB: tl.constexpr, HYBRID: tl.constexpr, PREC: tl.constexpr, F32: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) tile: (p, P, dl, ds_u) as defined in the module docstring."""
    s = _dot(q, kt, PREC, F32) * scale + rb[:, None]
    if HAS_KB:
        s += kb[None, :]
    s = tl.where(m_ok[:, None] & n_ok[None, :], s, NEG_INF)
    col = tl.exp(s - c[None, :])
    pd = tl.exp(s - c[None, :] - rd[:, None])
    dp = _dot(g, vt, PREC, F32)
    dl = u * pd * (dp - dd[:, None])
    p = pd
    dsu = tl.zeros_like(dl)
    if HYBRID:
        pu = tl.exp(s - ru[:, None])
        dsu = (1.0 - u) * pu * (dp - du[:, None])
        p = u * pd + (1.0 - u) * pu
    return p, col, dl, dsu


@triton.jit
def bwd_kv_kernel(
    Q, K, V, G, RB, KB, C, RD, RU, DD, DU, U, DK, DVv, E,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sgb, sgh, sgm, sgd,
    H, M, N, scale,
    HAS_RB: tl.constexpr, HAS_KB: tl.constexpr, HYBRID: tl.constexpr, PREC: tl.constexpr,
    F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
):
    """grad_k (BH, N, D), grad_v (BH, N, DV) and e (BH, N) float32; grid (cdiv(N, BLOCK_N), B*H)."""
    pid_n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    n_ok = offs_n < N
    kt = tl.load(K + b * skb + h * skh + offs_n[None, :] * skn + offs_d[:, None] * skd,
                 mask=n_ok[None, :], other=0.0)
    vt = tl.load(V + b * svb + h * svh + offs_n[None, :] * svn + offs_dv[:, None] * svd,
                 mask=n_ok[None, :], other=0.0)
    c = tl.load(C + bh * N + offs_n, mask=n_ok, other=0.0)
    kb = tl.zeros((BLOCK_N,), tl.float32)
    if HAS_KB:
        kb = tl.load(KB + bh * N + offs_n, mask=n_ok, other=NEG_INF)
    u = 1.0
    if HYBRID:
        u = tl.load(U + bh)
    acc_dv = tl.zeros((BLOCK_N, DV), tl.float32)
    acc_dk = tl.zeros((BLOCK_N, D), tl.float32)  # sum_i (dl_ij + ds^u_ij) q_i
    acc_pq = tl.zeros((BLOCK_N, D), tl.float32)  # sum_i P_ij q_i
    e = tl.zeros((BLOCK_N,), tl.float32)
    for i0 in range(0, M, BLOCK_M):
        offs_m = i0 + tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                    mask=m_ok[:, None], other=0.0)
        g = tl.load(G + b * sgb + h * sgh + offs_m[:, None] * sgm + offs_dv[None, :] * sgd,
                    mask=m_ok[:, None], other=0.0)
        rb = tl.zeros((BLOCK_M,), tl.float32)
        if HAS_RB:
            rb = tl.load(RB + bh * M + offs_m, mask=m_ok, other=NEG_INF)
        rd = tl.load(RD + bh * M + offs_m, mask=m_ok, other=float("inf"))
        dd = tl.load(DD + bh * M + offs_m, mask=m_ok, other=0.0)
        ru = rd
        du = dd
        if HYBRID:
            ru = tl.load(RU + bh * M + offs_m, mask=m_ok, other=float("inf"))
            du = tl.load(DU + bh * M + offs_m, mask=m_ok, other=0.0)
        p, col, dl, dsu = _tile(q, kt, rb, kb, c, rd, ru, dd, du, g, vt, u, m_ok, n_ok, scale,
                                HAS_KB, HYBRID, PREC, F32)
        acc_dv += _dot(tl.trans(p).to(g.dtype), g, PREC, F32)
        acc_dk += _dot(tl.trans(dl + dsu).to(q.dtype), q, PREC, F32)
        acc_pq += _dot(tl.trans(col).to(q.dtype), q, PREC, F32)
        e += tl.sum(dl, 0)
    dk = scale * (acc_dk - e[:, None] * acc_pq)
    tl.store(DK + bh * N * D + offs_n[:, None] * D + offs_d[None, :], dk.to(DK.dtype.element_ty),
             mask=n_ok[:, None])
    tl.store(DVv + bh * N * DV + offs_n[:, None] * DV + offs_dv[None, :], acc_dv.to(DVv.dtype.element_ty),
             mask=n_ok[:, None])
    tl.store(E + bh * N + offs_n, e, mask=n_ok)


@triton.jit
def bwd_q_kernel(
    Q, K, V, G, RB, KB, C, RD, RU, DD, DU, U, E, DQ,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sgb, sgh, sgm, sgd,
    H, M, N, scale,
    HAS_RB: tl.constexpr, HAS_KB: tl.constexpr, HYBRID: tl.constexpr, PREC: tl.constexpr,
    F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
):
    """grad_q (BH, M, D) from e (bwd_kv_kernel); grid (cdiv(M, BLOCK_M), B*H)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    m_ok = offs_m < M
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                mask=m_ok[:, None], other=0.0)
    g = tl.load(G + b * sgb + h * sgh + offs_m[:, None] * sgm + offs_dv[None, :] * sgd,
                mask=m_ok[:, None], other=0.0)
    rb = tl.zeros((BLOCK_M,), tl.float32)
    if HAS_RB:
        rb = tl.load(RB + bh * M + offs_m, mask=m_ok, other=NEG_INF)
    rd = tl.load(RD + bh * M + offs_m, mask=m_ok, other=float("inf"))
    dd = tl.load(DD + bh * M + offs_m, mask=m_ok, other=0.0)
    ru = rd
    du = dd
    u = 1.0
    if HYBRID:
        ru = tl.load(RU + bh * M + offs_m, mask=m_ok, other=float("inf"))
        du = tl.load(DU + bh * M + offs_m, mask=m_ok, other=0.0)
        u = tl.load(U + bh)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    for j0 in range(0, N, BLOCK_N):
        offs_n = j0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        kt = tl.load(K + b * skb + h * skh + offs_n[None, :] * skn + offs_d[:, None] * skd,
                     mask=n_ok[None, :], other=0.0)
        vt = tl.load(V + b * svb + h * svh + offs_n[None, :] * svn + offs_dv[:, None] * svd,
                     mask=n_ok[None, :], other=0.0)
        c = tl.load(C + bh * N + offs_n, mask=n_ok, other=0.0)
        kb = tl.zeros((BLOCK_N,), tl.float32)
        if HAS_KB:
            kb = tl.load(KB + bh * N + offs_n, mask=n_ok, other=NEG_INF)
        e = tl.load(E + bh * N + offs_n, mask=n_ok, other=0.0)
        p, col, dl, dsu = _tile(q, kt, rb, kb, c, rd, ru, dd, du, g, vt, u, m_ok, n_ok, scale,
                                HAS_KB, HYBRID, PREC, F32)
        ds = dl - col * e[None, :] + dsu
        acc += _dot(ds.to(q.dtype), tl.trans(kt), PREC, F32)
    tl.store(DQ + bh * M * D + offs_m[:, None] * D + offs_d[None, :], (scale * acc).to(DQ.dtype.element_ty),
             mask=m_ok[:, None])
