"""Triton forward kernels: the column log-sum-exp pass and the biased row pass (DNAS, HNAS, Sinkhorn).

Loaded only through ``attnlab.gpu.loader`` (compiled for CUDA, or interpreted under
``TRITON_INTERPRET=1`` on CPU tensors); importing attnlab never imports this file.

Notation (docs/VARIANTS.md): one program works on one (batch, head) pair ``bh`` and one block of keys
(column pass) or queries (row pass). Scores s_ij = scale * q_i . k_j, plus the additive biases
rb_i (per query) and kb_j (per key), each 0 or -inf (a mask) or a potential; masked entries are -inf.

    col_lse_kernel   c_j = logsumexp over i of (s_ij + rb_i) (no value product), 0 for an empty column;
                     CAUSAL: only i >= j counts, and the running value at the start of every query block
                     b is stored, CARRY[bh, b, j] = logsumexp over i < b * BLOCK_M (the prefix carry)
    row_kernel       out_i = sum_j softmax_j(s_ij + rb_i + kb_j - c_j) v_j (DNAS, Eq. 5 in log space)
                     HYBRID: two accumulators from one score tile, the second without -c_j (UNAS, Eq. 1),
                     out = u * out_dnas + (1 - u) * out_unas (Eq. 12, V enters linearly)
                     CAUSAL: c_j(i) = logsumexp over j <= i' <= i of s_i'j, the carry plus the prefix
                     inside the tile (causal DNAS, normalizers._causal_dnas_blocked)

Accumulation is float32 for every input dtype; probabilities enter the value product in the value
dtype (as in FlashAttention). Empty rows give 0 and, when SAVE, row log-sum-exp +inf (so that the
backward's exp(l - r) is 0, never NaN).
"""

import triton
import triton.language as tl

NEG_INF = tl.constexpr(float("-inf"))
# A prefix sum below this (relative to the tile's column maximum, in the fast cumsum path) may have
# lost its leading terms to float32 underflow (e^-87); such tiles take the exact log-space scan.
PREFIX_TINY = tl.constexpr(1e-20)


@triton.jit
def _dot(a, b, PREC: tl.constexpr, F32: tl.constexpr):
    """tl.dot with float32 accumulation; F32 casts the operands to float32 first (the interpreter's
    dot misreads bfloat16, which it stores as raw uint16)."""
    if F32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _logaddexp(a, b):
    """log(e^a + e^b), -inf when both are -inf (no NaN)."""
    hi = tl.maximum(a, b)
    lo = tl.minimum(a, b)
    safe = tl.where(hi == NEG_INF, 0.0, hi)
    return hi + tl.log(1.0 + tl.exp(lo - safe))


@triton.jit
def _prefix_lse(s, carry):
    """p_ij = logaddexp(carry_j, logsumexp over i' <= i of s_i'j) for a (BLOCK_M, BLOCK_N) tile.

    Fast path: one column maximum per tile and a cumulative sum of exponentials. Where a valid entry's
    prefix is so far below the column's maximum that it may have underflowed, the whole tile is
    recomputed by an exact associative scan of logaddexp.
    """
    top = tl.maximum(tl.max(s, 0), carry)  # (BLOCK_N,)
    safe = tl.where(top == NEG_INF, 0.0, top)
    run = tl.cumsum(tl.exp(s - safe[None, :]), 0) + tl.exp(carry - safe)[None, :]
    pre = tl.log(tl.maximum(run, 1e-38)) + safe[None, :]
    bad = (s > NEG_INF) & (run < PREFIX_TINY)
    if tl.sum(bad.to(tl.int32)) > 0:
        pre = _logaddexp(tl.associative_scan(s, 0, _logaddexp), carry[None, :])
    return pre


@triton.jit
def col_lse_kernel(
    Q, K, RB, C, CARRY,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd,
    H, M, N, scale,
    HAS_RB: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
    F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
):
    """c (BH, N) = logsumexp over queries of (s_ij + rb_i); grid (cdiv(N, BLOCK_N), B*H).

    Q (B, H, M, D), K (B, H, N, D) by strides; RB (BH, M) float32; C (BH, N) float32;
    CARRY (BH, cdiv(M, BLOCK_M), N) float32, written only when CAUSAL.
    """
    pid_n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    n_ok = offs_n < N
    # k^T tile (D, BLOCK_N)
    kt = tl.load(K + b * skb + h * skh + offs_n[None, :] * skn + offs_d[:, None] * skd,
                 mask=n_ok[None, :], other=0.0)
    m = tl.full((BLOCK_N,), NEG_INF, tl.float32)
    l = tl.zeros((BLOCK_N,), tl.float32)
    n_blocks = tl.cdiv(M, BLOCK_M)
    lo = 0
    if CAUSAL:
        # query blocks entirely above the diagonal (every i < j) contribute nothing: empty carry
        lo = (pid_n * BLOCK_N) // BLOCK_M
        for blk in range(0, lo):
            tl.store(CARRY + (bh * n_blocks + blk) * N + offs_n, m, mask=n_ok)
    for blk in range(lo, n_blocks):
        if CAUSAL:
            carry = tl.where(l > 0, m + tl.log(tl.maximum(l, 1e-38)), NEG_INF)
            tl.store(CARRY + (bh * n_blocks + blk) * N + offs_n, carry, mask=n_ok)
        offs_m = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                    mask=m_ok[:, None], other=0.0)
        s = _dot(q, kt, PREC, F32) * scale  # (BLOCK_M, BLOCK_N)
        valid = m_ok[:, None] & n_ok[None, :]
        if HAS_RB:
            s += tl.load(RB + bh * M + offs_m, mask=m_ok, other=NEG_INF)[:, None]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(valid, s, NEG_INF)
        m_new = tl.maximum(m, tl.max(s, 0))
        safe = tl.where(m_new == NEG_INF, 0.0, m_new)
        l = l * tl.exp(m - safe) + tl.sum(tl.exp(s - safe[None, :]), 0)
        m = m_new
    c = tl.where(l > 0, m + tl.log(tl.maximum(l, 1e-38)), 0.0)
    tl.store(C + bh * N + offs_n, c, mask=n_ok)


@triton.jit
def _online_update(logits, m, l, acc, v, PREC: tl.constexpr, F32: tl.constexpr):
    """One key tile of an online softmax: (m, l, acc) -> updated, logits (BLOCK_M, BLOCK_N)."""
    m_new = tl.maximum(m, tl.max(logits, 1))
    safe = tl.where(m_new == NEG_INF, 0.0, m_new)
    alpha = tl.exp(m - safe)
    p = tl.exp(logits - safe[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PREC, F32)
    return m_new, l, acc


@triton.jit
def row_kernel(
    Q, K, V, RB, KB, C, CARRY, U, OUT, OD, OU, RD, RU,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    H, M, N, scale,
    HAS_RB: tl.constexpr, HAS_KB: tl.constexpr, HYBRID: tl.constexpr, CAUSAL: tl.constexpr,
    SAVE: tl.constexpr, PREC: tl.constexpr, F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
):
    """out (BH, M, DV) of DNAS (or HNAS when HYBRID) with the key potentials c; grid (cdiv(M, BLOCK_M), B*H).

    RB (BH, M), KB (BH, N), C (BH, N), CARRY (BH, cdiv(M, BLOCK_M), N), U (BH,): float32.
    SAVE writes the row log-sum-exps RD (DNAS logits) and RU (UNAS, HYBRID) (BH, M) and, when HYBRID,
    the two partial outputs OD, OU (BH, M, DV) float32, for the backward.
    """
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
    rb = tl.zeros((BLOCK_M,), tl.float32)
    if HAS_RB:
        rb = tl.load(RB + bh * M + offs_m, mask=m_ok, other=NEG_INF)
    m_d = tl.full((BLOCK_M,), NEG_INF, tl.float32)
    l_d = tl.zeros((BLOCK_M,), tl.float32)
    acc_d = tl.zeros((BLOCK_M, DV), tl.float32)
    m_u = tl.full((BLOCK_M,), NEG_INF, tl.float32)
    l_u = tl.zeros((BLOCK_M,), tl.float32)
    acc_u = tl.zeros((BLOCK_M, DV), tl.float32)
    hi = N
    if CAUSAL:
        hi = tl.minimum(N, (pid_m + 1) * BLOCK_M)  # keys j <= i of this query block
        carry_row = CARRY + (bh * tl.cdiv(M, BLOCK_M) + pid_m) * N
    for j0 in range(0, hi, BLOCK_N):
        offs_n = j0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        kt = tl.load(K + b * skb + h * skh + offs_n[None, :] * skn + offs_d[:, None] * skd,
                     mask=n_ok[None, :], other=0.0)
        v = tl.load(V + b * svb + h * svh + offs_n[:, None] * svn + offs_dv[None, :] * svd,
                    mask=n_ok[:, None], other=0.0)
        s = _dot(q, kt, PREC, F32) * scale + rb[:, None]
        if HAS_KB:
            s += tl.load(KB + bh * N + offs_n, mask=n_ok, other=NEG_INF)[None, :]
        valid = m_ok[:, None] & n_ok[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(valid, s, NEG_INF)
        if CAUSAL:
            carry = tl.load(carry_row + offs_n, mask=n_ok, other=NEG_INF)
            c = _prefix_lse(s, carry)  # (BLOCK_M, BLOCK_N): c_j(i)
            logits = s - tl.where(s > NEG_INF, c, 0.0)  # masked entries stay -inf
        else:
            c = tl.load(C + bh * N + offs_n, mask=n_ok, other=0.0)
            logits = s - c[None, :]
        m_d, l_d, acc_d = _online_update(logits, m_d, l_d, acc_d, v, PREC, F32)
        if HYBRID:
            m_u, l_u, acc_u = _online_update(s, m_u, l_u, acc_u, v, PREC, F32)
    out_d = acc_d / tl.where(l_d > 0, l_d, 1.0)[:, None]  # empty rows: acc = 0, out = 0
    out = out_d
    o_idx = bh * M * DV + offs_m[:, None] * DV + offs_dv[None, :]
    if HYBRID:
        u = tl.load(U + bh)
        out_u = acc_u / tl.where(l_u > 0, l_u, 1.0)[:, None]
        out = u * out_d + (1.0 - u) * out_u
        if SAVE:
            tl.store(OD + o_idx, out_d, mask=m_ok[:, None])
            tl.store(OU + o_idx, out_u, mask=m_ok[:, None])
            r_u = tl.where(l_u > 0, m_u + tl.log(tl.maximum(l_u, 1e-38)), float("inf"))
            tl.store(RU + bh * M + offs_m, r_u, mask=m_ok)
    if SAVE:
        r_d = tl.where(l_d > 0, m_d + tl.log(tl.maximum(l_d, 1e-38)), float("inf"))
        tl.store(RD + bh * M + offs_m, r_d, mask=m_ok)
    tl.store(OUT + o_idx, out.to(OUT.dtype.element_ty), mask=m_ok[:, None])
