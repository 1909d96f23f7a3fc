"""Weights of every variant for a padded batch: recompute (captured q, k) and swap modes.

- ``recompute``: one forward with the model's own attention, capturing every layer's q and k (after
  projection and rotary embedding); each variant's weights are computed from those same q and k with
  the real padding mask: "what would DNAS do with this model's queries and keys".
- ``swap``: one forward per variant with the variant in place of the model's attention, so later
  layers see different inputs too.

Unmasked inputs (one window) take a fast path that computes all variants from one score matrix per
layer; masked ones (padding, causal models) use :func:`attnlab.attention_weights` directly. One window
of a bidirectional model on the CPU takes the fused path (:func:`_variants_with_sums`), which also
computes the statistics' row sums while each head is in cache. The forward stops after the last
layer's q and k. On a GPU the weights are computed there and copied to the CPU, with the row sums.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from attnlab import stats
from attnlab.hf.interface import CapturedLayer, capture_qk, check_settings, use_variant
from attnlab.hf.loading import LoadedModel, model_on
from attnlab.normalizers import (
    DEFAULT_VARIANTS,
    VARIANTS,
    attention_weights,
    check_params,
    check_variant,
    variant_spec,
)

__all__ = ["MODES", "LINEAR_SPAN_MAX", "batch_weights"]

LN2 = math.log(2.0)

MODES = ("recompute", "swap")


# ----------------------------------------------------------------------------------------------
# Weights for a padded batch
# ----------------------------------------------------------------------------------------------


def check_arguments(variants, mode, params: Mapping[str, Any], info=None) -> tuple[tuple[str, ...], dict]:
    """-> (the variants as a tuple without repeats, the given parameters checked); ValueError naming
    any bad argument. ``params`` holds every variant parameter the caller passed (None = not given);
    with ``info`` (a ModelInfo) per-head tensors must broadcast to (L, H) and a causal model applies
    each variant's causal rule (Sinkhorn: iters=1 unless given; iters > 1 refused)."""
    if isinstance(variants, str):
        variants = (variants,)
    variants = tuple(variants)
    if not variants:
        raise ValueError("variants must name at least one of " + ", ".join(VARIANTS))
    for v in variants:
        check_variant(v, "variants")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    shape = (info.n_layers, info.n_heads) if info is not None else (None, None)
    given = check_settings(params, *shape).params
    if info is not None and info.causal:
        for v in variants:
            check_params(v, given, causal=True)
    return tuple(dict.fromkeys(variants)), given


# The variants the fused analysis (this module's linear/log layer passes and attnlab_hf.head) is
# written for; their specs declare hf_kernel. Any other variant takes the generic materialized path.
KERNEL_VARIANTS = ("unas", "dnas", "hnas", "sinkhorn")


def _check_kernel_variants(variants) -> None:
    other = [v for v in variants if v not in KERNEL_VARIANTS]
    if other:  # never hand out buffers nobody fills
        raise ValueError(f"variants {other} have no fused analysis path (only {KERNEL_VARIANTS})")


def _fast(variant: str, params: Mapping[str, Any]) -> bool:
    """True when attnlab.hf's fused analysis computes ``variant`` with these parameters."""
    kernel = variant_spec(variant).hf_kernel
    return variant in KERNEL_VARIANTS and bool(kernel(params) if callable(kernel) else kernel)


def _layer_mask(c: CapturedLayer, valid: torch.Tensor) -> torch.Tensor | None:
    """bool (B, 1, N, N): the model's mask, and padded queries removed. None when nothing is masked."""
    if c.mask is None and bool(valid.all()):
        return None
    base = c.mask if c.mask is not None else valid[:, None, None, :]
    return base & valid[:, None, :, None]


def _u_per_layer(u, n_layers: int, n_heads: int, device=None):
    """u as a float or (L, 1, H, 1, 1) on ``device``, broadcastable over (L, B, H, N, N)."""
    if not isinstance(u, torch.Tensor) or u.numel() == 1:
        return float(u)
    try:
        u2 = u.float().to(device).reshape(u.shape if u.dim() == 2 else (1, -1))  # (L|1, H|1)
        table = torch.broadcast_to(u2, (n_layers, n_heads))
    except RuntimeError:
        raise ValueError(
            f"u must be broadcastable to (L, H) = ({n_layers}, {n_heads}), got shape {tuple(u.shape)}"
        ) from None
    return table[:, None, :, None, None]


def _recompute(loaded: LoadedModel, input_ids, attention_mask, variants, given) -> dict[str, torch.Tensor]:
    return _recompute_with_sums(loaded, input_ids, attention_mask, variants, given)[0]


def _recompute_with_sums(loaded, input_ids, attention_mask, variants, given, specials=None):
    """-> (weights as in :func:`_recompute`, row sums of every variant for the tidy table or None).

    The row sums (``attnlab.stats._row_sums`` layout over L*H maps, special-token masses for each
    mask of ``specials``) come with the fused CPU path only: one unmasked text (B = 1) of a
    bidirectional model, with ``specials`` given (a list of bool (N,) key masks). Tensors stay on the
    model's device.
    """
    with capture_qk(loaded.model, stop_after=loaded.info.n_layers) as captured:  # no work after the last q, k
        loaded.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    valid = attention_mask.bool()  # (B, N)
    causal = {c.causal for c in captured}
    if len(causal) != 1:
        raise ValueError("models mixing causal and bidirectional self-attention layers are not supported")
    causal = causal.pop() and input_ids.shape[1] > 1
    q = torch.stack([c.query for c in captured]).float()  # (L, B, H, N, D)
    k = torch.stack([c.key for c in captured]).float()  # (L, B, H, N, D)
    scale = [c.scaling for c in captured]
    params = {v: check_params(v, given, causal=causal) for v in variants}
    fast = [v for v in variants if _fast(v, params[v])]
    u = params["hnas"]["u"] if "hnas" in params else 0.5
    iters = params["sinkhorn"]["iters"] if "sinkhorn" in params else 1
    u_l = _u_per_layer(u, len(captured), q.shape[2], q.device)
    masks = [_layer_mask(c, valid) for c in captured]
    if not causal and all(m is None for m in masks) and len(fast) == len(variants):
        if specials is not None and q.shape[1] == 1 and q.device.type == "cpu":
            return _variants_with_sums(q, k, scale, variants, u_l, iters, specials)
        return _variants_unmasked(q, k, scale, variants, u_l, iters), None
    B, N = valid.shape
    everything = torch.ones(B, 1, N, N, dtype=torch.bool, device=q.device)  # a layer without a mask
    mask = torch.stack([everything if m is None else m for m in masks])  # (L, B, 1, N, N)
    scale_l = torch.tensor(scale, dtype=q.dtype, device=q.device).reshape(-1, 1, 1, 1, 1)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale_l)  # (L, B, H, N, N)
    per_head = {name: _u_per_layer(value, len(captured), q.shape[2], q.device)
                for name, value in given.items() if isinstance(value, torch.Tensor)}
    weights = {  # (L, B, H, N, N) each: the generic materialized path, every registered variant
        variant: attention_weights(scores, variant, mask=mask, causal=causal,
                                   **{**params[variant], **{k: t for k, t in per_head.items()
                                                            if k in params[variant]}})
        for variant in variants
    }
    return weights, None


# A head whose scores span at most this many nats has exp(s - max) >= e^-60 ~ 1e-26 everywhere: normal
# float32 numbers, so its normalizations can divide exponentials instead of subtracting log-sum-exps.
LINEAR_SPAN_MAX = 60.0


def _variants_unmasked(q, k, scale, variants, u, iters) -> dict[str, torch.Tensor]:
    """Every variant from one score matrix per layer, for inputs without any mask (one window).

    The math of :func:`attnlab.attention_weights` (tests check equality), arranged for speed: per
    layer one (B, H, N, N) score matrix, every op over all heads at once, buffers reused. Layers whose
    scores span at most ``LINEAR_SPAN_MAX`` take :func:`_layer_linear` (one exp pass for all variants),
    others :func:`_layer_log` (log space).
    q, k: (L, B, H, N, D); scale: L floats; u: float or (L, 1, H, 1, 1). Returns (L, B, H, N, N).
    """
    _check_kernel_variants(variants)
    L, B, H, N, _ = q.shape
    out = {v: q.new_empty(L, B, H, N, N) for v in variants}
    s, x = q.new_empty(B, H, N, N), q.new_empty(B, H, N, N)  # scores, scratch
    need_dnas = bool({"dnas", "hnas"} & set(variants)) or ("sinkhorn" in variants and iters == 1)
    una = None if "unas" in out or "hnas" not in out else q.new_empty(B, H, N, N)
    dna = None if "dnas" in out or not need_dnas else q.new_empty(B, H, N, N)
    for layer in range(L):
        ql, kl = q[layer], k[layer]  # (B, H, N, D)
        torch.matmul(ql, kl.transpose(-1, -2), out=s).mul_(scale[layer])  # (B, H, N, N)
        targets = dict(
            pu=out["unas"][layer] if "unas" in out else una,
            pd=out["dnas"][layer] if "dnas" in out else dna,
            ph=out["hnas"][layer] if "hnas" in out else None,
            ps=out["sinkhorn"][layer] if "sinkhorn" in out else None,
            u=u if isinstance(u, float) else u[layer],
            iters=iters,
        )
        wide = (s.amax(dim=(-2, -1)) - s.amin(dim=(-2, -1))) > LINEAR_SPAN_MAX  # (B, H)
        if not bool(wide.any()):
            _layer_linear(s, **targets)
        elif bool(wide.all()):
            _layer_log(s, x, **targets)
        else:  # linear for every head, then the wide heads again in log space
            s_wide = s[wide][None]  # (1, n, N, N)
            _layer_linear(s, **targets)
            _heads_log(s_wide, wide, targets)
    return out


class _Lease:
    """Memory of one weight tensor lent from ``_POOL``: numpy arrays made from it (and the tensors made
    from those) keep it alive; when the last one is gone it goes back to the pool."""

    def __init__(self, slab: np.ndarray):
        self.slab = slab
        self.__array_interface__ = slab.__array_interface__

    def __del__(self):
        try:
            _POOL.give_back(self.slab)
        except Exception:  # noqa: BLE001 -- interpreter shutdown: nothing to keep
            pass


class _WeightPool:
    """Recycles the memory of released (L, B, H, N, N) weight tensors for the next window.

    Writing ~300 MB of weights into fresh memory costs a page fault per 4 KiB (a third of a window's
    analysis); texts are analysed window after window and each window's weights are usually dropped
    before the next, so their memory is kept (at most ``max_bytes``) and reused. Tensors lent are
    ordinary CPU tensors (views of numpy arrays): the memory returns here only once no tensor uses it.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.free: list[np.ndarray] = []
        # re-entrant: a lease may come back (garbage collection) while this thread holds the lock
        self.lock = threading.RLock()

    def empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        n = math.prod(shape)
        if n * 4 > self.max_bytes:
            return torch.empty(shape)
        slab = None
        with self.lock:
            for i in range(len(self.free)):
                if self.free[i].size == n:
                    slab = self.free.pop(i)
                    break
        if slab is None or slab.size != n:
            slab = _aligned_empty(n)
        return torch.from_numpy(np.asarray(_Lease(slab))).view(shape)

    def give_back(self, slab: np.ndarray) -> None:
        if slab.nbytes > self.max_bytes:
            return
        with self.lock:
            kept = sum(s.nbytes for s in self.free)
            while self.free and kept + slab.nbytes > self.max_bytes:  # the oldest go first
                kept -= self.free.pop(0).nbytes
            self.free.append(slab)


def _aligned_empty(n: int, align: int = 64) -> np.ndarray:
    """float32 (n,) starting on an ``align``-byte boundary (a cache line: the kernel streams whole
    lines to memory), a view of a slightly larger array."""
    raw = np.empty(n + align // 4, dtype=np.float32)
    start = (-raw.ctypes.data % align) // 4
    return raw[start : start + n]


_POOL = _WeightPool(max_bytes=512 << 20)

# Worker threads of the fused path (None: torch's thread count), each running torch with one thread.
_WORKERS = None
# Rows per block of the PyTorch row pass: a block's weights are read back while they are still in the
# core's L2 cache.
_BLOCK_ROWS = 128
# The row pass in attnlab's CPU kernel attnlab_hf.head when it is built (attnlab.kernels); False: PyTorch.
_USE_KERNEL = True


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

    @classmethod
    def new(cls, LH: int, N: int, S: int, like: torch.Tensor) -> _FusedBuffers:
        z = lambda *shape: like.new_zeros(*shape)  # noqa: E731
        return cls(alpha=z(LH, 3, N), beta=like.new_ones(LH, 3, N), cols=z(LH, 3, N),
                   dn_rows=z(LH, N, 3 + 2 * S), sk_rows=z(LH, N, 2 + S), rows=z(LH, N, len(ROW_SUMS)))


# Columns of the row pass' sums (attnlab/csrc/analysis_cpu.cpp computes the same): with E and s as
# in _FusedBuffers, beta_c the column factor of c = unas, dnas, sinkhorn, h the hnas weights, and
# twice the Jensen-Shannon divergence (nats) of each row of v = dnas, hnas, sinkhorn to unas
# (``attnlab.stats._js2_rowsum``).
ROW_SUMS = (
    "es_unas", "es_dnas", "es_sinkhorn",  # sum_j E_ij s_ij beta_cj
    "ed_unas", "ed_dnas", "ed_sinkhorn",  # sum_j E_ij |i - j| beta_cj
    "h_xlogx",  # sum_j h_ij ln h_ij (0 ln 0 = 0)
    "js2_dnas", "js2_hnas", "js2_sinkhorn",  # 2 JSD(v, unas) per row, nats
)
_COL = {name: i for i, name in enumerate(ROW_SUMS)}


def _variants_with_sums(q, k, scale, variants, u, iters, specials):
    """Weights of every variant (like :func:`_variants_unmasked`, B = 1) and, computed while each
    head's matrices are in cache, the row sums of ``attnlab.stats._row_sums`` for the tidy table.

    For heads whose scores span at most ``LINEAR_SPAN_MAX`` every variant is a diagonal scaling of one
    matrix E_ij = exp(s_ij - max_j s_ij): unas = diag(alpha_u) E, dnas = diag(alpha_d) E diag(beta_d),
    sinkhorn = diag(a) E diag(b), hnas = lerp(unas, dnas, u). Sinkhorn's first round is DNAS's, and
    DNAS's row factors give unas' and dnas' column masses and Sinkhorn's next column step in one
    product. Column masses, row sums, distances, special-token masses and unas/dnas/sinkhorn row
    entropies (ln pi_ij = ln alpha_i + s_ij - max_j s_ij + ln beta_j) then come from a few products of
    E, E * (s - max) and E * |i - j| with the factors, assembled for all heads at once at the end
    (:func:`_assemble_sums`); only the hnas entropy and the Jensen-Shannon divergences to unas take
    logarithms of the weights. Heads with wider scores take :func:`_variants_unmasked` and
    ``_row_sums`` on the weights. One head at a time per worker thread, so that its scores and
    exponentials stay in the core's cache; the pass over its rows that writes the weights and takes
    their sums is one sweep in attnlab's CPU kernel ``attnlab_hf.head`` (:mod:`attnlab.kernels`) when
    it is built, else PyTorch operations on blocks of rows (:func:`_rows_torch`, the same results).

    q, k: (L, 1, H, N, D); specials: list of S bool (N,) key masks. Returns ({variant: (L, 1, H, N, N)},
    {variant: row sums over L*H maps}); ``js`` (to unas) when unas is among the variants.
    """
    from attnlab import kernels  # (not at import: importing attnlab builds nothing)

    _check_kernel_variants(variants)
    L, B, H, N, _ = q.shape
    assert B == 1
    LH = L * H
    ref = "unas" if "unas" in variants else None
    out = {v: _POOL.empty((L, B, H, N, N)) for v in variants}
    spec = torch.stack([m.to(q.dtype) for m in specials], -1) if specials else q.new_zeros(N, 0)  # (N, S)
    S = spec.shape[-1]
    dist = stats._distance_matrix(N, N, q)  # (N, N) |i - j|
    u_maps = (q.new_full((LH,), u) if isinstance(u, float) else u.to(q.dtype).reshape(L, H).reshape(LH))
    js_variants = [v for v in variants if ref is not None and v != ref]
    clamp_hnas = bool((u_maps > 1.0 - 1e-6).any())  # hnas = dnas may underflow to 0: 0 ln 0 = 0
    buf = _FusedBuffers.new(LH, N, S, q)
    fallback = []  # (row, {variant: row sums}) of wide heads
    # |s_ij| <= scale |q_i| |k_j|: heads whose bound on the score span is small skip the exact check
    norms = (q.norm(dim=-1).amax(-1) * k.norm(dim=-1).amax(-1))[:, 0]  # (L, H)
    span_bound = (2.0 * norms * torch.tensor(scale, dtype=q.dtype)[:, None]).reshape(LH).tolist()
    # maps, taken one at a time by the workers; those that may be wide first (a wide head costs several
    # linear ones: started last, it would leave the other workers idle at the end)
    queue = sorted(range(LH), key=lambda row: -span_bound[row])
    kernel = kernels.analysis_ops() if _USE_KERNEL else None
    spec_t = spec.t().contiguous()  # (S, N)
    settings = _HeadSettings(variants, iters, spec, dist, js_variants, clamp_hnas)

    def work(threads: int | None) -> None:
        """Take heads from the queue until it is empty (``threads``: this worker's torch threads)."""
        if threads is not None:
            torch.set_num_threads(threads)
        R = min(N, _BLOCK_ROWS)
        scratch = [q.new_empty(N, N), q.new_empty(N, N), q.new_empty(4, R, N)]
        while True:
            try:
                row = queue.pop(0)  # atomic under the GIL
            except IndexError:
                return
            layer, h = divmod(row, H)
            views = {v: out[v][layer, 0, h] for v in variants}
            ql, kl, u_h = q[layer, 0, h], k[layer, 0, h], float(u_maps[row])
            check_span = span_bound[row] > LINEAR_SPAN_MAX
            if kernel is not None:  # the whole head in the CPU kernel (attnlab/csrc/analysis_cpu.cpp)
                js = settings.js_variants
                if kernel.head(ql, kl, scale[layer], spec_t, iters, check_span, u_h,
                               *(views.get(v) for v in ("unas", "dnas", "hnas", "sinkhorn")), *scratch[:2],
                               buf.alpha[row], buf.beta[row], buf.cols[row], buf.dn_rows[row],
                               buf.sk_rows[row], buf.rows[row], "dnas" in js, "hnas" in js, "sinkhorn" in js):
                    continue
            else:
                s = scratch[0]
                torch.addmm(s, ql, kl.t(), beta=0.0, alpha=scale[layer], out=s)
                mu = s.amax(-1, keepdim=True)  # (N, 1) row maxima
                gmax = mu.max()
                if not (check_span and float(gmax - s.min()) > LINEAR_SPAN_MAX):
                    s.sub_(mu)  # s_ij - max_j s_ij in [-LINEAR_SPAN_MAX, 0]
                    rho = mu.sub_(gmax).exp_()  # (N, 1): exp(s - max over the head) = rho_i exp(s_ij - mu_i)
                    _head_linear(*scratch, rho, views, buf, row, u_h, settings)
                    continue
            wide = _wide_head(q, k, scale, u, layer, h, views, variants, iters, spec, dist, ref)
            fallback.append((row, wide))

    workers = _WORKERS if _WORKERS is not None else torch.get_num_threads()
    if workers <= 1:
        work(None)
    else:  # one torch thread per worker: no per-operation barrier, idle workers take more heads
        import concurrent.futures

        previous = torch.get_num_threads()
        try:
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                for f in [pool.submit(work, 1) for _ in range(workers)]:
                    f.result()
        finally:
            torch.set_num_threads(previous)
    raw = _assemble_sums(buf, variants, ref, u_maps, iters, S)
    for row, sums in fallback:
        for v, r in sums.items():
            for key, t in r.items():
                if t is not None:
                    raw[v][key][row] = t
    return out, raw


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
    from those weights (``attnlab.stats._row_sums``)."""
    u_w = u if isinstance(u, float) else u[layer : layer + 1, :, h : h + 1]
    part = _variants_unmasked(q[layer : layer + 1, :, h : h + 1], k[layer : layer + 1, :, h : h + 1],
                              [scale[layer]], variants, u_w, iters)
    sums = {}
    for v in sorted(variants, key=lambda n: n != ref):
        views[v].copy_(part[v][0, 0, 0])
        sums[v] = stats._row_sums(views[v][None], spec, dist, None if ref is None or v == ref else views[ref])
    return {v: {key: None if t is None else t[0] for key, t in r.items()} for v, r in sums.items()}


def _head_linear(s, e, blocks, rho, views, buf: _FusedBuffers, row: int, u: float, cfg: _HeadSettings):
    """Weights of one head from its scores less their row maxima s (N, N) (in [-LINEAR_SPAN_MAX, 0]; rho
    (N, 1) = exp(row max - head max); e (N, N) and blocks (4, R, N) are scratch), and its products into
    ``buf`` row ``row``. Eq. numbers of "Attention that does not Explain Away": unas (1), dnas (5), sinkhorn
    (10), hnas (12)."""
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
    if "sinkhorn" in views and cfg.iters > 1:
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
    """The row pass of :func:`_head_linear` with PyTorch operations: the weights, and the sums of
    ``ROW_SUMS`` into ``sums`` (N, len(ROW_SUMS)), a block of rows at a time (kept in L2 cache)."""
    factors = beta.t()  # (N, 3)
    N, R = e.shape[0], blocks.shape[1]
    pu_v, pd_v, ph_v, ps_v = (views.get(v) for v in ("unas", "dnas", "hnas", "sinkhorn"))
    for i0 in range(0, N, R):
        rows = slice(i0, min(i0 + R, N))
        x, y, tu, td = blocks[:, : rows.stop - i0]
        eb, out = e[rows], sums[rows]
        # products for the entropies and distances of unas, dnas, sinkhorn
        torch.mm(torch.mul(eb, s[rows], out=x), factors, out=out[:, 0:3])
        torch.mm(torch.mul(eb, cfg.dist[rows], out=x), factors, out=out[:, 3:6])
        pu = pu_v[rows] if pu_v is not None else (tu if ph_v is not None else None)
        if pu is not None:
            torch.mul(eb, alpha[0, rows, None], out=pu)
        pd = pd_v[rows] if pd_v is not None else (td if ph_v is not None else None)
        if pd is not None:
            torch.mul(eb, beta[1], out=pd).mul_(alpha[1, rows, None])
        if ps_v is not None:
            torch.mul(eb, beta[2], out=ps_v[rows]).mul_(alpha[2, rows, None])
        if ph_v is not None:  # and sum_j x ln x of the hnas weights
            ph = torch.lerp(pu, pd, u, out=ph_v[rows])
            t = torch.log(ph, out=x)
            if cfg.clamp_hnas:
                t.clamp_min_(math.log(torch.finfo(ph.dtype).tiny))
            torch.sum(t.mul_(ph), -1, out=out[:, _COL["h_xlogx"]])
        for v in cfg.js_variants:  # 2 JSD(v, unas) per row (every weight > 0 in a linear head)
            stats._js2_rowsum(views[v][rows], pu, x, y, out=out[:, _COL["js2_" + v]], positive=True)


def _assemble_sums(buf: _FusedBuffers, variants, ref, u_maps, iters, S) -> dict:
    """Row sums of every variant (``attnlab.stats._row_sums`` layout) from the products in ``buf``,
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
    raw = {v: dict(fact[v], js=None) for v in variants}
    for v in variants:
        if ref is not None and v != ref:  # JSD in bits = (2 JSD in nats) / (2 ln 2); distance = sqrt
            raw[v]["js"] = (buf.rows[..., _COL["js2_" + v]] / (2.0 * LN2)).clamp_(0.0, 1.0).sqrt_()
    return raw


def _heads_log(s, heads, targets) -> None:
    """Recompute the (B, H) heads selected by ``heads`` in log space; s: (1, n, N, N) their scores."""
    sub = {name: None if t is None else torch.empty_like(s) for name, t in targets.items() if name[0] == "p"}
    u = targets["u"]
    u = u if isinstance(u, float) else u.expand(*heads.shape, 1, 1)[heads][None]  # (1, n, 1, 1)
    _layer_log(s, torch.empty_like(s), u=u, iters=targets["iters"], **sub)
    for name, t in sub.items():
        if t is not None:
            targets[name][heads] = t[0]


def _layer_linear(s, pu, pd, ph, ps, u, iters) -> None:
    """One layer's variants from e = exp(s - max over the head) (consumes ``s``).

    unas = e_ij / sum_j e_ij (Eq. 1); dnas: gamma_ij = e_ij / sum_i e_ij, then rows normalized (Eq. 5);
    hnas = lerp(unas, dnas, u) (Eq. 12); sinkhorn (Eq. 10) keeps pi_ij = a_i e_ij b_j and alternates
    the column step b = 1 / (a^T e) and the row step a = 1 / (e b) -- matrix-vector products -- then
    ends with a column step and a row normalization. Targets that are None are skipped.
    """
    e = s.sub_(s.amax(dim=(-2, -1), keepdim=True)).exp_()  # (B, H, N, N), entries in [e^-60, 1]
    if pu is not None:
        torch.div(e, e.sum(-1, keepdim=True), out=pu)
    if pd is not None:
        torch.div(e, e.sum(-2, keepdim=True), out=pd)  # columns sum to 1
        pd.div_(pd.sum(-1, keepdim=True))  # then rows
    if ph is not None:
        torch.lerp(pu, pd, u, out=ph)
    if ps is None:
        return
    if iters == 1:  # = dnas
        ps.copy_(pd)
        return
    a = e.new_ones(*e.shape[:-2], 1, e.shape[-1])  # (B, H, 1, N): row scalings a_i, as a row
    for _ in range(iters - 1):
        b = torch.matmul(a, e).reciprocal_()  # (B, H, 1, N): column step, b_j = 1 / sum_i a_i e_ij
        a = torch.matmul(e, b.transpose(-1, -2)).reciprocal_().transpose(-1, -2)  # row step
    b = torch.matmul(a, e).reciprocal_()  # the last column step; a cancels in the row normalization
    torch.mul(e, b, out=ps)
    ps.div_(ps.sum(-1, keepdim=True))


def _layer_log(s, x, pu, pd, ph, ps, u, iters) -> None:
    """One layer's variants in log space, for heads with widely spread scores s (B, H, N, N).

    unas = softmax_j(s) (Eq. 1); dnas = softmax_j(s_ij - c_j), c_j = logsumexp_i s_ij (Eq. 5, DESIGN.md
    §2); hnas = lerp(unas, dnas, u) (Eq. 12); sinkhorn = softmax_j(s_ij - c_j) with the column
    potentials after ``iters`` (column, row) rounds of logsumexp (Eq. 10). x is scratch like s.
    """
    if pu is not None:
        torch.softmax(s, -1, out=pu)
    c = torch.logsumexp(s, -2, keepdim=True) if pd is not None or ps is not None else None  # (B, H, 1, N)
    if pd is not None:
        torch.softmax(torch.sub(s, c, out=x), -1, out=pd)
    if ph is not None:
        torch.lerp(pu, pd, u, out=ph)
    if ps is None:
        return
    for _ in range(iters - 1):
        r = torch.logsumexp(torch.sub(s, c, out=x), -1, keepdim=True)  # (B, H, N, 1) row potentials
        c = torch.logsumexp(torch.sub(s, r, out=x), -2, keepdim=True)  # column potentials
    torch.softmax(torch.sub(s, c, out=x), -1, out=ps)


def _swap(loaded: LoadedModel, input_ids, attention_mask, variants, given) -> dict[str, torch.Tensor]:
    out = {}
    for variant in variants:
        with use_variant(loaded.model, variant, return_weights=True, **given):
            res = loaded.model(
                input_ids=input_ids, attention_mask=attention_mask, output_attentions=True, use_cache=False
            )
        out[variant] = torch.stack(res.attentions)  # (L, B, H, N, N)
    return out


def batch_weights(
    model: LoadedModel | str | os.PathLike | None,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    variants: Sequence[str] = DEFAULT_VARIANTS,
    mode: str = "recompute",
    u: float | torch.Tensor | None = None,
    iters: int | None = None,
    *,
    device=None,
    **params,
) -> dict[str, torch.Tensor]:
    """Weights of every variant for a (padded) batch.

    Args:
        model: a :class:`LoadedModel`, a model directory, or None for the embedded default.
        input_ids: (B, N) token ids, padded on the right.
        attention_mask: (B, N) 1 for real tokens, 0 for padding (default: all ones).
        variants, mode, u, iters, **params: as in :func:`analyze`.
        device: where the model runs, as in :func:`analyze` (None: the loaded model's device, the CPU
            for a directory).

    Returns:
        variant -> (L, B, H, N, N) float32 on the CPU; rows and columns of padded tokens are zero,
        valid rows sum to 1.
    """
    loaded = model_on(model, device)
    variants, given = check_arguments(variants, mode, {"u": u, "iters": iters, **params}, loaded.info)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype in (torch.bool,) \
            or input_ids.is_floating_point() or input_ids.is_complex():
        seen = f"dtype {input_ids.dtype}" if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be an integer tensor (B, N), got {seen}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (B, N), got shape {tuple(input_ids.shape)}")
    if input_ids.numel() == 0:
        raise ValueError(f"input_ids must hold at least one token, got shape {tuple(input_ids.shape)}")
    vocab = loaded.model.get_input_embeddings().num_embeddings
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"input_ids must be token ids in [0, {vocab - 1}] for {loaded.info.name}, "
                         f"got values in [{lo}, {hi}]")
    attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask must match input_ids {tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}"
        )
    run = _recompute if mode == "recompute" else _swap
    dev = loaded.device
    with loaded.lock, torch.no_grad():
        weights = run(loaded, input_ids.to(dev), attention_mask.to(dev), variants, given)
    return {v: w.cpu() for v, w in weights.items()}


def window_weights_and_sums(loaded: LoadedModel, input_ids, variants, mode, given, specials):
    """One window (input_ids (1, N), no padding): (weights {variant: (L, 1, H, N, N)} on the CPU, row
    sums for ``attnlab.stats._tidy_from_row_sums`` or None). On the CPU the sums come with the weights
    when the fused path applies (recompute mode, bidirectional model); on a GPU they are always
    computed there, from the weights, before these are copied to the CPU."""
    dev = loaded.device
    ids = input_ids.to(dev)
    ones = torch.ones_like(ids)
    with loaded.lock, torch.no_grad():
        if mode != "recompute":
            weights, sums = _swap(loaded, ids, ones, variants, given), None
        else:
            weights, sums = _recompute_with_sums(loaded, ids, ones, variants, given, specials)
        if dev.type == "cpu":
            return weights, sums
        sums = _row_sums_of(weights, specials)
    return {v: w.cpu() for v, w in weights.items()}, sums


def _row_sums_of(weights: dict[str, torch.Tensor], specials) -> dict:
    """Row sums (``attnlab.stats._row_sums`` layout, on the CPU) of one window's weights {variant:
    (L, 1, H, N, N)}, computed where the weights are; ``js`` to unas when unas is among them."""
    first = next(iter(weights.values()))
    L, _, H, N, _ = first.shape
    spec = torch.stack([m.to(first.device, first.dtype) for m in specials], -1)  # (N, S)
    dist = stats._distance_matrix(N, N, first)
    ref = "unas" if "unas" in weights else None
    raw = {}
    for v in weights:
        js = None if ref is None or v == ref else weights[ref]
        raw[v] = stats._row_sums(weights[v].reshape(L * H, N, N), spec, dist, js)
    return {v: {key: None if t is None else t.cpu() for key, t in raw[v].items()} for v in weights}
