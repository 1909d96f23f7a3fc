"""The fused analysis of one unmasked window on the CPU: every variant's weights and, computed while
each head is in cache, the row sums of ``attnlab.stats.engine.row_sums_dict`` for the tidy table
(:func:`variants_with_sums`; every head in attnlab's CPU kernel ``attnlab_hf.heads`` when built).
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
from dataclasses import dataclass

import torch

from attnlab.hf.compute.layers import LINEAR_SPAN_MAX, _check_kernel_variants, _variants_unmasked
from attnlab.hf.compute.pool import _POOL
from attnlab.hf.compute.softmax1_sums import softmax1_sums
from attnlab.hf.compute.sparsemax_slot import sparsemax_head, sparsemax_sums, sparsemax_weights
from attnlab.stats import distance_matrix
from attnlab.stats.divergence import js2_rowsum
from attnlab.stats.engine import row_sums_dict

LN2 = math.log(2.0)

# Worker threads of the fused path (None: torch's thread count), each running torch with one thread.
_WORKERS = None
# Their pool, kept between calls (starting and stopping two threads cost 2-4 ms a call): (size, pool)
_EXECUTOR: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None
_EXECUTOR_LOCK = threading.Lock()


def _executor(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """The kept pool of ``workers`` threads (a new one when the count changed). Concurrent analyses
    share it: their heads queue behind each other's, on the same cores."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None or _EXECUTOR[0] != workers:
            if _EXECUTOR is not None:
                _EXECUTOR[1].shutdown(wait=False)
            pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="attnlab-heads")
            _EXECUTOR = (workers, pool)
        return _EXECUTOR[1]


# Rows per block of the PyTorch row pass: a block's weights are read back while they are still in the
# core's L2 cache.
_BLOCK_ROWS = 128


@dataclass
class _FusedBuffers:
    """Per-map (L*H) products of the fused path, filled head by head, turned into row sums at the end.

    E is exp(scores - their row maxima) of a head; each variant is a diagonal scaling
    pi = diag(alpha) E diag(beta) (unas: beta = 1; dnas: alpha_d, beta_d; sinkhorn: a, b). Index c of
    the (L*H, 3, ...) buffers is unas, dnas, sinkhorn.
    """

    alpha: torch.Tensor  # (LH, 3, N) row factors
    beta: torch.Tensor  # (LH, 3, N) column factors (1 for unas)
    cols: torch.Tensor  # (LH, 3, N) alpha^T E (column masses before the column factor)
    dn_rows: torch.Tensor  # (LH, N, 3 + 2S) E @ [1, beta_d, beta_d ln beta_d, special, beta_d special]
    sk_rows: torch.Tensor  # (LH, N, 2 + S) E @ [b, b ln b, b special] (sinkhorn, iters >= 2)
    rows: torch.Tensor  # (LH, N, ROW_SUMS) the row pass' sums, columns as in ROW_SUMS
    # (LH, 2, N) softmax1 = unas / (1 + t_i): [0] ln t_i (t_i = 1 / sum_j exp(s_ij)), [1] its column
    # masses; None when softmax1 is not analysed (its other sums follow from unas', softmax1_sums)
    s1: torch.Tensor | None = None
    # (LH, 5 + S, N) sparsemax's sums from each row's support (attnlab/csrc/analysis_sparsemax.h): [0] the
    # column masses, per row [1] sum p, [2] sum p ln p, [3] sum p |i - j|, [4] 2 JSD to unas, [5:] specials
    sm: torch.Tensor | None = None

    @classmethod
    def new(cls, LH: int, N: int, S: int, like: torch.Tensor, softmax1: bool = False,
            sparsemax: bool = False) -> _FusedBuffers:
        z = lambda *shape: like.new_zeros(*shape)  # noqa: E731
        return cls(alpha=z(LH, 3, N), beta=like.new_ones(LH, 3, N), cols=z(LH, 3, N),
                   dn_rows=z(LH, N, 3 + 2 * S), sk_rows=z(LH, N, 2 + S), rows=z(LH, N, len(ROW_SUMS)),
                   s1=z(LH, 2, N) if softmax1 else None, sm=z(LH, 5 + S, N) if sparsemax else None)


# Columns of the row pass' sums (attnlab/csrc/analysis_cpu.cpp computes the same): with E and s as
# in _FusedBuffers, beta_c the column factor of c = unas, dnas, sinkhorn, h the hnas weights, and
# twice the Jensen-Shannon divergence (nats) of each row of v = dnas, hnas, sinkhorn to unas
# (``attnlab.stats.divergence.js2_rowsum``).
ROW_SUMS = (
    "es_unas", "es_dnas", "es_sinkhorn",  # sum_j E_ij s_ij beta_cj
    "ed_unas", "ed_dnas", "ed_sinkhorn",  # sum_j E_ij |i - j| beta_cj
    "h_xlogx",  # sum_j h_ij ln h_ij (0 ln 0 = 0)
    "js2_dnas", "js2_hnas", "js2_sinkhorn",  # 2 JSD(v, unas) per row, nats
)


_COL = {name: i for i, name in enumerate(ROW_SUMS)}


def variants_with_sums(q, k, scale, variants, u, iters, specials, use_kernel: bool = True, write=None,
                       sums: bool = True):
    """Weights of the variants in ``write`` (default: every variant; like :func:`_variants_unmasked`,
    B = 1) and, computed while each head's matrices are in cache, the row sums of every variant
    (``attnlab.stats.engine.row_sums_dict``) for the tidy table. The statistics need no weights
    written (``write=()``): a variant's weights, written by a later call with the same arguments, have
    the values they would have had (attnlab/hf/compute/lazy_weights.py materializes them on first access).

    For heads whose scores span at most ``LINEAR_SPAN_MAX`` every variant is a diagonal scaling of one
    matrix E_ij = exp(s_ij - max_j s_ij): unas = diag(alpha_u) E, dnas = diag(alpha_d) E diag(beta_d),
    sinkhorn = diag(a) E diag(b), hnas = lerp(unas, dnas, u). Sinkhorn's first round is DNAS's, and
    DNAS's row factors give unas' and dnas' column masses and Sinkhorn's next column step in one
    product. Column masses, row sums, distances, special-token masses and unas/dnas/sinkhorn row
    entropies (ln pi_ij = ln alpha_i + s_ij - max_j s_ij + ln beta_j) then come from a few products of
    E, E * (s - max) and E * |i - j| with the factors, assembled for all heads at once at the end
    (:func:`_assemble_sums`); only the hnas entropy and the Jensen-Shannon divergences to unas take
    logarithms of the weights. Heads with wider scores are computed in log space, their row sums
    from the weights themselves. One head at a time per thread, so that its scores and exponentials
    stay in the core's cache: every head in one call of attnlab's CPU kernel ``attnlab_hf.heads``
    (:func:`run_kernel`, :mod:`attnlab.kernels`; wide heads in its log-space path,
    attnlab/csrc/analysis_wide.h) when it is built, else PyTorch operations on worker threads
    (:func:`_heads_torch`): the row pass on blocks of rows (:func:`_rows_torch`), wide heads by
    :func:`_variants_unmasked` and ``row_sums_dict`` on the weights (the same results).
    attnlab/hf/compute/fused_forward.py makes the same kernel call layer by layer inside the capture forward.

    q, k: (L, 1, H, N, D); specials: list of S bool (N,) key masks. Returns ({variant in write: (L, 1, H,
    N, N)}, {variant: row sums over L*H maps} or None without ``sums``); ``js`` (to unas) when unas is
    among the variants.
    """
    from attnlab import kernels  # (not at import: importing attnlab builds nothing)

    _check_kernel_variants(variants)
    L, B, H, N, _ = q.shape
    assert B == 1
    LH = L * H
    ref = "unas" if "unas" in variants else None
    write = variants if write is None else tuple(write)
    out = {v: _POOL.empty((L, B, H, N, N)) for v in write}
    spec = torch.stack([m.to(q.dtype) for m in specials], -1) if specials else q.new_zeros(N, 0)  # (N, S)
    S = spec.shape[-1]
    dist = distance_matrix(N, N, q)  # (N, N) |i - j|
    u_maps = (q.new_full((LH,), u) if isinstance(u, float) else u.to(q.dtype).reshape(L, H).reshape(LH))
    js_variants = _js_variants(variants)
    clamp_hnas = bool((u_maps > 1.0 - 1e-6).any())  # hnas = dnas may underflow to 0: 0 ln 0 = 0
    buf = _FusedBuffers.new(LH, N, S, q, softmax1="softmax1" in variants and sums,
                            sparsemax="sparsemax" in variants and sums)
    fallback = []  # (row, {variant: row sums}) of wide heads
    kernel = kernels.analysis_ops() if use_kernel else None
    spec_t = spec.t().contiguous()  # (S, N)
    settings = _HeadSettings(variants, iters, spec, dist, js_variants, clamp_hnas)

    flags = flags_for(variants, write, sums)
    workers = _WORKERS if _WORKERS is not None else torch.get_num_threads()
    if kernel is not None:  # every map in the CPU kernel (attnlab/csrc/analysis_cpu.cpp), a wide one in its
        # log-space path (analysis_wide.h) with the same buffer layout, on ``workers`` threads
        # softmax1's weights are unas' times 1 / (1 + t_i): the kernel writes unas' into its buffer
        unas_out = out.get("unas", out.get("softmax1"))
        maps = [None if unas_out is None else unas_out[:, 0].view(LH, N, N)]
        maps += [out[v][:, 0].view(LH, N, N) if v in write else None for v in ("dnas", "hnas", "sinkhorn")]
        s1 = buf.s1 if buf.s1 is not None or "softmax1" not in write else q.new_zeros(LH, 2, N)
        run_kernel(kernel, q[:, 0].reshape(LH, N, -1), k[:, 0].reshape(LH, N, -1),
                   [scale[row // H] for row in range(LH)], u_maps, spec_t, iters, maps,
                   (buf.alpha, buf.beta, buf.cols, buf.dn_rows, buf.sk_rows, buf.rows), flags, workers,
                   softmax1=s1, sparsemax=buf.sm)
        if "softmax1" in write:  # r_i = 1 / (1 + t_i) = sigmoid(-ln t_i), per row
            p1 = out["softmax1"][:, 0].view(LH, N, N)
            if p1.data_ptr() != unas_out.data_ptr():
                p1.copy_(unas_out[:, 0].view(LH, N, N))
            p1.mul_(torch.sigmoid(-s1[:, 0])[..., None])
        if "sparsemax" in write:  # its reference function on the scores (the generic path's values)
            sparsemax_weights(q, k, scale, out["sparsemax"])
    else:
        span_bound = _span_bounds(q[:, 0], k[:, 0], torch.tensor(scale, dtype=q.dtype)[:, None])  # (L*H)
        _heads_torch(q, k, scale, u, variants, iters, spec, dist, ref, write, out, buf, span_bound, u_maps,
                     settings, workers, fallback)
    if not sums:
        return out, None
    raw = _assemble_sums(buf, variants, ref, u_maps, iters, S)
    for row, sums in fallback:
        for v, r in sums.items():
            for key, t in r.items():
                if t is not None:
                    raw[v][key][row] = t
    return out, raw


def _span_bounds(q: torch.Tensor, k: torch.Tensor, scale) -> list[float]:
    """Bounds on each map's score span, 2 scale max_i |q_i| max_j |k_j| (|s_ij| <= scale |q_i| |k_j|):
    maps whose bound is at most ``LINEAR_SPAN_MAX`` skip the exact check. q, k (..., N, D), scale a
    number or broadcastable to q's leading dimensions; flattened over them."""
    norms = q.norm(dim=-1).amax(-1) * k.norm(dim=-1).amax(-1)
    return (2.0 * norms * torch.as_tensor(scale, dtype=q.dtype)).reshape(-1).tolist()


def _queue(span_bound: list[float]) -> list[int]:
    """The maps in the order the workers take them: those that may be wide first (a wide head costs
    several linear ones: started last, it would leave the other workers idle at the end)."""
    return sorted(range(len(span_bound)), key=lambda row: -span_bound[row])


def _js_variants(variants) -> list[str]:
    """The variants whose Jensen-Shannon divergence to unas is summed: all but unas, when it is there."""
    return [v for v in variants if v != "unas"] if "unas" in variants else []


def flags_for(variants, write, sums: bool) -> tuple[bool, ...]:
    """The kernel's (js_dnas, js_hnas, js_sinkhorn, hnas, sinkhorn): the Jensen-Shannon sums to unas
    when it is analysed; without sums only the written variants are needed (no Sinkhorn rounds or HNAS
    rows that are not written)."""
    js = _js_variants(variants) if sums else ()
    need = variants if sums else write
    return ("dnas" in js, "hnas" in js, "sinkhorn" in js, "hnas" in need, "sinkhorn" in need)


def run_kernel(kernel, q, k, scales: list[float], u_maps, spec_t, iters, maps, buffers, flags, workers: int,
               v=None, out=None, analyse: bool = True, softmax1=None, sparsemax=None) -> torch.Tensor:
    """``kernel.heads`` (attnlab/csrc/analysis_cpu.cpp) on M maps: q, k (M, N, D); scales per map (the
    kernel bounds each map's score span itself and takes those that may be wide first);
    u_maps (M,); maps: the (M, N, N) weight outputs of unas, dnas, hnas, sinkhorn or None each;
    buffers: the (M, ...) rows of _FusedBuffers' alpha, beta, cols, dn_rows, sk_rows, rows; v, out
    (M, N, Dv): unas' attention output into ``out`` (without ``analyse``: that alone); softmax1 (M, 2,
    N) or None: ``_FusedBuffers.s1``. On ``workers`` torch threads. Returns bool (M,): linear heads."""
    previous = torch.get_num_threads()
    if workers != previous:
        torch.set_num_threads(workers)
    try:
        return kernel.heads(q, k, torch.tensor(scales, dtype=torch.float64), spec_t, iters, None,
                            u_maps.double().contiguous(), None, *maps, *buffers, *flags, v, out, analyse,
                            softmax1, sparsemax)
    finally:
        if workers != previous:
            torch.set_num_threads(previous)


def _heads_torch(q, k, scale, u, variants, iters, spec, dist, ref, write, out, buf, span_bound, u_maps,
                 settings, workers, fallback) -> None:
    """The maps of :func:`variants_with_sums` without attnlab's CPU kernel: PyTorch operations, heads taken
    by ``workers`` threads (one torch thread each) in the order of :func:`_queue`, wide heads by
    :func:`_wide_head` into ``fallback``."""
    L, _, H, N, _ = q.shape
    LH = L * H
    queue = _queue(span_bound)
    # per map: its q, k, weight outputs and buffer rows as views made at once (not indexed per head)
    q_maps, k_maps = q[:, 0].reshape(LH, N, -1).unbind(0), k[:, 0].reshape(LH, N, -1).unbind(0)
    out_maps = {v: out[v][:, 0].view(LH, N, N).unbind(0) for v in write}  # views: written in place
    u_list = u_maps.tolist()

    def work(threads: int | None) -> None:
        """Take heads from the queue until it is empty (``threads``: this worker's torch threads)."""
        if threads is not None:
            torch.set_num_threads(threads)
        R = min(N, _BLOCK_ROWS)
        scratch = [q.new_empty(N, N), q.new_empty(N, N), q.new_empty(6, R, N)]
        while True:
            try:
                row = queue.pop(0)  # atomic under the GIL
            except IndexError:
                return
            layer, h = divmod(row, H)
            views = {v: out_maps[v][row] for v in write}
            ql, kl, u_h = q_maps[row], k_maps[row], u_list[row]
            check_span = span_bound[row] > LINEAR_SPAN_MAX
            s = scratch[0]
            torch.addmm(s, ql, kl.t(), beta=0.0, alpha=scale[layer], out=s)
            mu = s.amax(-1, keepdim=True)  # (N, 1) row maxima
            gmax = mu.max()
            if not (check_span and float(gmax - s.min()) > LINEAR_SPAN_MAX):
                s.sub_(mu)  # s_ij - max_j s_ij in [-LINEAR_SPAN_MAX, 0]
                row_max = mu.clone() if "softmax1" in views or buf.s1 is not None else None
                rho = mu.sub_(gmax).exp_()  # (N, 1): exp(s - max over the head) = rho_i exp(s_ij - mu_i)
                _head_linear(*scratch, rho, views, buf, row, u_h, settings, row_max)
                continue
            wide = _wide_head(q, k, scale, u, layer, h, views, variants, iters, spec, dist, ref)
            fallback.append((row, wide))

    if workers <= 1:
        work(None)
    else:  # one torch thread per worker: no per-operation barrier, idle workers take more heads
        previous = torch.get_num_threads()
        try:
            pool = _executor(workers)
            for f in [pool.submit(work, 1) for _ in range(workers)]:
                f.result()
        finally:
            torch.set_num_threads(previous)


@dataclass(frozen=True)
class _HeadSettings:
    """What :func:`_head_linear` needs besides the head's data (the same for every head)."""

    variants: tuple[str, ...]
    iters: int
    spec: torch.Tensor  # (N, S) special-key masks as floats
    dist: torch.Tensor  # (N, N) |i - j|
    js_variants: list[str]  # variants whose JS distance to unas is computed
    clamp_hnas: bool


def _wide_head(q, k, scale, u, layer, h, views, variants, iters, spec, dist, ref) -> dict:
    """One head with widely spread scores: weights by :func:`_variants_unmasked` (log space), row sums
    from those weights (``attnlab.stats.engine.row_sums_dict``)."""
    u_w = u if isinstance(u, float) else u[layer : layer + 1, :, h : h + 1]
    part = _variants_unmasked(q[layer : layer + 1, :, h : h + 1], k[layer : layer + 1, :, h : h + 1],
                              [scale[layer]], variants, u_w, iters)
    sums = {}
    for v in sorted(variants, key=lambda n: n != ref):
        w = part[v][0, 0, 0]  # (N, N)
        if v in views:
            views[v].copy_(w)
        sums[v] = row_sums_dict(w[None], spec, dist, None if ref is None or v == ref else part[ref][0, 0, 0])
    return {v: {key: None if t is None else t[0] for key, t in r.items()} for v, r in sums.items()}


def _head_linear(s, e, blocks, rho, views, buf: _FusedBuffers, row: int, u: float, cfg: _HeadSettings,
                 row_max=None):
    """Weights of one head from its scores less their row maxima s (N, N) (in [-LINEAR_SPAN_MAX, 0]; rho
    (N, 1) = exp(row max - head max); e (N, N) and blocks (4, R, N) are scratch), and its products into
    ``buf`` row ``row``. Eq. numbers of "Attention that does not Explain Away": unas (1), dnas (5), sinkhorn
    (10), hnas (12); softmax1 = unas / (1 + t_i), t_i = 1 / sum_j exp(s_ij) (row_max (N, 1): the row
    maxima, when softmax1 is analysed or written)."""
    torch.exp(s, out=e)  # E_ij = exp(s_ij - max_j s_ij)
    alpha, beta = buf.alpha[row], buf.beta[row]  # (3, N) each
    b_d = beta[1]
    torch.mm(rho.t(), e, out=b_d[None]).reciprocal_()  # dnas column step: 1 / sum_i rho_i E_ij
    col = b_d[:, None]  # (N, 1)
    w = torch.cat([beta[0, :, None], col, col * col.log(), cfg.spec, col * cfg.spec], 1)  # (N, 3 + 2S)
    dn = buf.dn_rows[row]  # (N, 3 + 2S)
    torch.mm(e, w, out=dn)  # r_i = sum_j E_ij, R_i = sum_j E_ij beta_j, ...
    torch.reciprocal(dn[:, :2].t(), out=alpha[:2])  # alpha_u = 1 / r, alpha_d = 1 / R (dnas row step)
    torch.mm(alpha[:2], e, out=buf.cols[row, :2])  # unas column masses; dnas' before beta_d
    if row_max is not None:  # softmax1: ln t_i = -mu_i - ln sum_j E_ij, weights unas * r_i, r = 1 / (1 + t)
        lnt = row_max[:, 0].neg().sub_(dn[:, 0].log())  # (N,)
        a1 = alpha[0] * torch.sigmoid(-lnt)  # (N,) softmax1's row factors
        if buf.s1 is not None:
            buf.s1[row, 0] = lnt
            torch.mv(e.t(), a1, out=buf.s1[row, 1])
        if "softmax1" in views:
            torch.mul(e, a1[:, None], out=views["softmax1"])
    if buf.sm is not None or "sparsemax" in views:  # sparsemax of s - max (shift-invariant), its sums
        sparsemax_head(s, e, alpha[0], views, buf.sm, row, cfg.spec, cfg.dist)
    if "sinkhorn" in cfg.variants and cfg.iters > 1:
        b = buf.cols[row, 1].reciprocal()  # Sinkhorn's second column step (its first round is dnas)
        for _ in range(cfg.iters - 2):
            a = torch.mv(e, b).reciprocal_()  # row step
            b = torch.mv(e.t(), a).reciprocal_()  # column step
        beta[2] = b
        sk = buf.sk_rows[row]  # (N, 2 + S)
        torch.mm(e, torch.cat([b[:, None], (b * b.log())[:, None], b[:, None] * cfg.spec], 1), out=sk)
        torch.reciprocal(sk[:, 0], out=alpha[2])  # the last row step normalizes the rows
        torch.mv(e.t(), alpha[2], out=buf.cols[row, 2])
    else:  # sinkhorn with one round is dnas
        alpha[2], beta[2], buf.cols[row, 2] = alpha[1], b_d, buf.cols[row, 1]
    _rows_torch(s, e, blocks, views, buf.rows[row], alpha, beta, u, cfg)


def _rows_torch(s, e, blocks, views, sums, alpha, beta, u: float, cfg: _HeadSettings) -> None:
    """The row pass of :func:`_head_linear` with PyTorch operations: the weights of the variants in
    ``views`` (the others' rows go to scratch, when their sums need them), and the sums of
    ``ROW_SUMS`` into ``sums`` (N, len(ROW_SUMS)), a block of rows at a time (kept in L2 cache)."""
    factors = beta.t()  # (N, 3)
    N, R = e.shape[0], blocks.shape[1]
    analysed = set(cfg.variants)
    need = {"unas": bool(analysed & {"unas", "hnas"}), "dnas": bool(analysed & {"dnas", "hnas"}),
            "hnas": "hnas" in analysed, "sinkhorn": "sinkhorn" in analysed}
    for i0 in range(0, N, R):
        rows = slice(i0, min(i0 + R, N))
        x, y, *spare = blocks[:, : rows.stop - i0]  # scratch (R, N) each; spare: unas, dnas, hnas, sinkhorn
        eb, out = e[rows], sums[rows]
        # products for the entropies and distances of unas, dnas, sinkhorn
        torch.mm(torch.mul(eb, s[rows], out=x), factors, out=out[:, 0:3])
        torch.mm(torch.mul(eb, cfg.dist[rows], out=x), factors, out=out[:, 3:6])
        p = {v: (views[v][rows] if v in views else spare[c]) if need[v] else None
             for c, v in enumerate(("unas", "dnas", "hnas", "sinkhorn"))}  # this block's rows
        if p["unas"] is not None:
            torch.mul(eb, alpha[0, rows, None], out=p["unas"])
        if p["dnas"] is not None:
            torch.mul(eb, beta[1], out=p["dnas"]).mul_(alpha[1, rows, None])
        if p["sinkhorn"] is not None:
            torch.mul(eb, beta[2], out=p["sinkhorn"]).mul_(alpha[2, rows, None])
        if p["hnas"] is not None:  # and sum_j x ln x of the hnas weights
            ph = torch.lerp(p["unas"], p["dnas"], u, out=p["hnas"])
            t = torch.log(ph, out=x)
            if cfg.clamp_hnas:
                t.clamp_min_(math.log(torch.finfo(ph.dtype).tiny))
            torch.sum(t.mul_(ph), -1, out=out[:, _COL["h_xlogx"]])
        for v in cfg.js_variants:  # 2 JSD(v, unas) per row (every weight > 0 in a linear head)
            if v in ("softmax1", "sparsemax"):  # in closed form from unas' (softmax1_sums); from its support
                continue
            js2_rowsum(p[v], p["unas"], x, y, out=out[:, _COL["js2_" + v]], positive=True)


def _assemble_sums(buf: _FusedBuffers, variants, ref, u_maps, iters, S) -> dict:
    """Row sums of every variant (``attnlab.stats.engine.row_sums_dict`` layout) from the products in ``buf``,
    for all maps at once: pi = alpha_i E_ij beta_j, so sum_j pi ln pi = ln alpha_i sum_j pi
    + alpha_i sum_j E_ij (s_ij - max) beta_j + alpha_i sum_j E_ij beta_j ln beta_j."""
    dn, sk = buf.dn_rows, buf.sk_rows
    if iters == 1:  # sinkhorn = dnas
        sk = torch.cat([dn[..., 1:3], dn[..., 3 + S :]], -1)
    rows = {  # (sum_j E beta, sum_j E beta ln beta or None, sum_j E beta special)
        "unas": (dn[..., 0], None, dn[..., 3 : 3 + S]),
        "dnas": (dn[..., 1], dn[..., 2], dn[..., 3 + S :]),
        "sinkhorn": (sk[..., 0], sk[..., 1], sk[..., 2:]),
    }
    fact = {}
    for c, v in enumerate(("unas", "dnas", "sinkhorn")):
        al = buf.alpha[:, c]  # (LH, N)
        e_beta, e_blogb, e_spec = rows[v]
        rowsum = al * e_beta
        xlogx = al.log() * rowsum + al * buf.rows[..., _COL["es_" + v]]
        if e_blogb is not None:
            xlogx += al * e_blogb
        fact[v] = {
            "cols": buf.cols[:, c] * buf.beta[:, c], "rowsum": rowsum, "entropy": xlogx.neg_(),
            "distance": al * buf.rows[..., _COL["ed_" + v]], "special": al[..., None] * e_spec,
        }
    if "hnas" in variants:
        w = u_maps[:, None]
        fact["hnas"] = {
            key: torch.lerp(fact["unas"][key], fact["dnas"][key], w if key != "special" else w[..., None])
            for key in ("cols", "rowsum", "distance", "special")
        }
        fact["hnas"]["entropy"] = -buf.rows[..., _COL["h_xlogx"]]
    js2 = {v: buf.rows[..., _COL["js2_" + v]] for v in ("dnas", "hnas", "sinkhorn")}  # (LH, N) each
    if "softmax1" in variants:
        fact["softmax1"], js2["softmax1"] = softmax1_sums(fact["unas"], buf.s1[:, 0], buf.s1[:, 1])
    if "sparsemax" in variants:
        fact["sparsemax"], js2["sparsemax"] = sparsemax_sums(buf.sm)
    raw = {v: dict(fact[v], js=None) for v in variants}
    for v in variants:
        if ref is not None and v != ref:  # JSD in bits = (2 JSD in nats) / (2 ln 2); distance = sqrt
            raw[v]["js"] = (js2[v] / (2.0 * LN2)).clamp_(0.0, 1.0).sqrt_()
    return raw

