"""Weights of every variant for a padded batch: recompute (captured q, k) and swap modes.

- ``recompute``: one forward with the model's own attention, capturing every layer's q and k (after
  projection and rotary embedding); each variant's weights are computed from those same q and k with
  the real padding mask: "what would DNAS do with this model's queries and keys".
- ``swap``: one forward per variant with the variant in place of the model's attention, so later
  layers see different inputs too.

Unmasked inputs (one window) take a fast path that computes all variants from one score matrix per
layer; masked ones (padding, causal models) use :func:`attnlab.attention_weights` directly.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Sequence

import numpy as np
import torch

from attnlab.hf.interface import DEFAULT_ITERS, DEFAULT_U, CapturedLayer, capture_qk, use_variant
from attnlab.hf.loading import LoadedModel, load_model
from attnlab.normalizers import VARIANTS, attention_weights, column_logsumexp, sinkhorn_potentials

__all__ = ["MODES", "LINEAR_SPAN_MAX", "batch_weights"]

LN2 = math.log(2.0)

MODES = ("recompute", "swap")


# ----------------------------------------------------------------------------------------------
# Weights for a padded batch
# ----------------------------------------------------------------------------------------------


def check_arguments(variants, mode, u, iters) -> tuple[str, ...]:
    """-> the variants as a tuple without repeats; ValueError naming any bad argument."""
    if isinstance(variants, str):
        variants = (variants,)
    variants = tuple(variants)
    if not variants:
        raise ValueError("variants must name at least one of " + ", ".join(VARIANTS))
    for v in variants:
        if v not in VARIANTS:
            raise ValueError(f"variants must be among {VARIANTS}, got {v!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be an integer >= 1, got {iters!r}")
    if not isinstance(u, torch.Tensor) and (
        isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 <= u <= 1.0
    ):
        raise ValueError(f"u must be a float in [0, 1] (or a tensor broadcastable to (L, H)), got {u!r}")
    return tuple(dict.fromkeys(variants))


def _layer_mask(c: CapturedLayer, valid: torch.Tensor) -> torch.Tensor | None:
    """bool (B, 1, N, N): the model's mask, and padded queries removed. None when nothing is masked."""
    if c.mask is None and bool(valid.all()):
        return None
    base = c.mask if c.mask is not None else valid[:, None, None, :]
    return base & valid[:, None, :, None]


def _u_per_layer(u, n_layers: int, n_heads: int):
    """u as a float or (L, 1, H, 1, 1), broadcastable over (L, B, H, N, N)."""
    if not isinstance(u, torch.Tensor) or u.numel() == 1:
        return float(u)
    try:
        u2 = u.float().reshape(u.shape if u.dim() == 2 else (1, -1))  # (L|1, H|1)
        table = torch.broadcast_to(u2, (n_layers, n_heads))
    except RuntimeError:
        raise ValueError(
            f"u must be broadcastable to (L, H) = ({n_layers}, {n_heads}), got shape {tuple(u.shape)}"
        ) from None
    return table[:, None, :, None, None]


def _recompute(loaded: LoadedModel, input_ids, attention_mask, variants, u, iters) -> dict[str, torch.Tensor]:
    return _recompute_with_sums(loaded, input_ids, attention_mask, variants, u, iters)[0]


def _recompute_with_sums(loaded, input_ids, attention_mask, variants, u, iters, specials=None):
    """-> (weights as in :func:`_recompute`, row sums of every variant for the tidy table or None).

    The row sums (``attnlab.stats._row_sums`` layout over L*H maps, special-token masses for each
    mask of ``specials``) come with the fused path only: one unmasked text (B = 1) of a bidirectional
    model, with ``specials`` given (a list of bool (N,) key masks).
    """
    with capture_qk(loaded.model) as captured:
        loaded.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    valid = attention_mask.bool()  # (B, N)
    causal = {c.causal for c in captured}
    if len(causal) != 1:
        raise ValueError("models mixing causal and bidirectional self-attention layers are not supported")
    causal = causal.pop() and input_ids.shape[1] > 1
    q = torch.stack([c.query for c in captured]).float()  # (L, B, H, N, D)
    k = torch.stack([c.key for c in captured]).float()  # (L, B, H, N, D)
    scale = [c.scaling for c in captured]
    u_l = _u_per_layer(u, len(captured), q.shape[2])
    masks = [_layer_mask(c, valid) for c in captured]
    if not causal and all(m is None for m in masks):
        if specials is not None and q.shape[1] == 1:
            return _variants_with_sums(q, k, scale, variants, u_l, iters, specials)
        return _variants_unmasked(q, k, scale, variants, u_l, iters), None
    B, N = valid.shape
    everything = torch.ones(B, 1, N, N, dtype=torch.bool)  # a layer without a mask
    mask = torch.stack([everything if m is None else m for m in masks])  # (L, B, 1, N, N)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(torch.tensor(scale).reshape(-1, 1, 1, 1, 1))
    weights = {  # (L, B, H, N, N) each
        variant: attention_weights(
            scores,
            variant,
            mask=mask,
            causal=causal,
            u=u_l if variant == "hnas" else None,
            iters=iters if variant == "sinkhorn" else None,
        )
        for variant in variants
    }
    return weights, None


def _sinkhorn_bias(q: torch.Tensor, k: torch.Tensor, scale: float, iters: int) -> torch.Tensor:
    """Sinkhorn (Eq. 10) in scaling form: beta (B, H, N) with weights = softmax_j(s_ij + beta_j),
    from the fused potentials of :func:`attnlab.normalizers.sinkhorn_potentials` (no (N, N) matrix)."""
    return -sinkhorn_potentials(q, k, None, scale, iters)


# A head whose scores span at most this many nats has exp(s - max) >= e^-60 ~ 1e-26 everywhere: normal
# float32 numbers, so its normalizations can divide exponentials instead of subtracting log-sum-exps.
LINEAR_SPAN_MAX = 60.0


def _variants_unmasked(q, k, scale, variants, u, iters) -> dict[str, torch.Tensor]:
    """Every variant from one score matrix per layer, for inputs without any mask (one window).

    The math of :func:`attnlab.attention_weights` (tests check equality), arranged for speed: per
    layer one (B, H, N, N) score matrix, every op over all heads at once, buffers reused. Layers whose
    scores span at most ``LINEAR_SPAN_MAX`` take :func:`_layer_linear` (one exp pass for all variants),
    others :func:`_layer_log` (log space with fused column passes).
    q, k: (L, B, H, N, D); scale: L floats; u: float or (L, 1, H, 1, 1). Returns (L, B, H, N, N).
    """
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
            _layer_log(s, x, ql, kl, scale[layer], **targets)
        else:  # linear for every head, then the wide heads again in log space
            s_wide = s[wide][None]  # (1, n, N, N)
            _layer_linear(s, **targets)
            _heads_log(s_wide, ql[wide][None], kl[wide][None], scale[layer], wide, targets)
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
            slab = np.empty(n, dtype=np.float32)
        return torch.from_numpy(np.asarray(_Lease(slab))).view(shape)

    def give_back(self, slab: np.ndarray) -> None:
        if slab.nbytes > self.max_bytes:
            return
        with self.lock:
            kept = sum(s.nbytes for s in self.free)
            while self.free and kept + slab.nbytes > self.max_bytes:  # the oldest go first
                kept -= self.free.pop(0).nbytes
            self.free.append(slab)


_POOL = _WeightPool(max_bytes=512 << 20)

# Heads per group of the fused path: a group's scores, exponentials and scratch stay in the caches.
_GROUP_HEADS = 2
# Worker threads of the fused path (None: torch's thread count), each running torch with one thread.
_WORKERS = None


def _variants_with_sums(q, k, scale, variants, u, iters, specials):
    """Weights of every variant (like :func:`_variants_unmasked`, B = 1) and, computed while each
    group of heads is in cache, the row sums of ``attnlab.stats._row_sums`` for the tidy table.

    For heads whose scores span at most ``LINEAR_SPAN_MAX`` every variant is a diagonal scaling of one
    matrix E_ij = exp(s_ij - max_j s_ij): unas = diag(alpha_u) E, dnas = diag(alpha_d) E diag(beta_d),
    sinkhorn = diag(a) E diag(b), hnas = lerp(unas, dnas, u). Column masses, distances, special-token
    masses and unas/dnas/sinkhorn row entropies (ln pi_ij = ln alpha_i + s_ij - max + ln beta_j) then
    come from a few matrix products with E, E * (s - max) and E * |i - j| shared by the variants, and
    are assembled for all heads at once at the end (:func:`_assemble_sums`); only the hnas entropy
    and the Jensen-Shannon mixtures take a logarithm pass (with u = 0.5 the dnas/unas mixture is the
    hnas weights themselves). Groups with a wider head take :func:`_variants_unmasked` and
    ``_row_sums`` on the weights.

    q, k: (L, 1, H, N, D); specials: list of S bool (N,) key masks. Returns ({variant: (L, 1, H, N, N)},
    {variant: row sums over L*H maps}); ``js`` (to unas) when unas is among the variants.
    """
    from attnlab import stats

    L, B, H, N, _ = q.shape
    assert B == 1
    LH = L * H
    ref = "unas" if "unas" in variants else None
    out = {v: _POOL.empty((L, B, H, N, N)) for v in variants}
    spec = torch.stack([m.to(q.dtype) for m in specials], -1) if specials else q.new_zeros(N, 0)  # (N, S)
    S = spec.shape[-1]
    dist = stats._distance_matrix(N, N, q)  # (N, N) |i - j|
    u_maps = (q.new_full((LH,), u) if isinstance(u, float) else u.to(q.dtype).reshape(L, H).reshape(LH))
    hnas_is_mix = bool({"hnas", "dnas", "unas"} <= set(variants) and (u_maps == 0.5).all())
    clamp_hnas = bool((u_maps > 1.0 - 1e-6).any())  # hnas = dnas may underflow to 0: 0 ln 0 = 0
    buf = {  # per map (L*H), filled group by group, assembled at the end
        "alpha": q.new_zeros(LH, N, 3),  # row factors of unas, dnas, sinkhorn
        "beta": q.new_ones(LH, N, 3),  # column factors (1 for unas)
        "e_beta": q.new_ones(LH, N, 3),  # sum_j E_ij beta_j
        "cols": q.new_zeros(LH, 3, N),  # sum_i alpha_i E_ij
        "e_rows": q.new_zeros(LH, N, 2 + 3 * S),  # E @ [beta ln beta (dnas, sinkhorn), beta * special]
        "es_rows": q.new_zeros(LH, N, 3),  # (E * (s - max)) @ beta
        "ed_rows": q.new_zeros(LH, N, 3),  # (E * |i - j|) @ beta
        "rowsum": {v: q.new_zeros(LH, N) for v in variants},  # of the weights themselves
        "tlogt": {v: q.new_zeros(LH, N) for v in variants if v != ref and ref is not None},
        "h_xlogx": q.new_zeros(LH, N),
    }
    fallback = []  # (rows, {variant: row sums}) of groups with a wide head
    # |s_ij| <= scale |q_i| |k_j|: heads whose bound on the score span is small skip the exact check
    norms = q.norm(dim=-1).amax(-1) * k.norm(dim=-1).amax(-1)  # (L, 1, H)
    span_bound = 2.0 * torch.tensor(scale)[:, None] * norms[:, 0]  # (L, H)
    G = min(_GROUP_HEADS, H)
    queue = [(layer, h0, min(h0 + G, H)) for layer in range(L) for h0 in range(0, H, G)]

    def work(threads: int | None) -> None:
        """Take groups from the queue until it is empty (``threads``: this worker's torch threads)."""
        if threads is not None:
            torch.set_num_threads(threads)
        bufs = [q.new_empty(G, N, N) for _ in range(4)]
        while True:
            try:
                groups = [queue.pop(0)]  # atomic under the GIL
            except IndexError:
                return
            while groups:
                layer, h0, h1 = groups.pop(0)
                g = h1 - h0
                s, e, x, y = (b[:g] for b in bufs)
                ql, kl = q[layer, 0, h0:h1], k[layer, 0, h0:h1]
                torch.baddbmm(s, ql, kl.transpose(-1, -2), beta=0.0, alpha=scale[layer], out=s)
                rows = slice(layer * H + h0, layer * H + h1)
                views = {v: out[v][layer, 0, h0:h1] for v in variants}
                mu = s.amax(-1, keepdim=True)  # (g, N, 1) row maxima
                gmax = mu.amax(-2, keepdim=True)  # (g, 1, 1)
                if bool((span_bound[layer, h0:h1] > LINEAR_SPAN_MAX).any()) and bool(
                    (gmax.view(g) - s.amin((-2, -1)) > LINEAR_SPAN_MAX).any()
                ):
                    if g > 1:  # head by head: only the wide ones take the slow path
                        groups[:0] = [(layer, h, h + 1) for h in range(h0, h1)]
                        continue
                    fallback.append((rows, _wide_head(q, k, scale, u, layer, h0, views, variants, iters,
                                                      spec, dist, ref)))
                    continue
                u_g = u_maps[rows].view(g, 1, 1)
                _group_linear(s, e, x, y, mu, gmax, views, buf, rows, u_g, iters, spec, dist, ref,
                              hnas_is_mix, clamp_hnas)

    workers = _WORKERS if _WORKERS is not None else torch.get_num_threads()
    if workers <= 1:
        work(None)
    else:  # one torch thread per worker: no per-operation barrier, idle workers take more groups
        import concurrent.futures

        previous = torch.get_num_threads()
        try:
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                for f in [pool.submit(work, 1) for _ in range(workers)]:
                    f.result()
        finally:
            torch.set_num_threads(previous)
    raw = _assemble_sums(buf, variants, ref, u_maps, hnas_is_mix, S)
    for rows, sums in fallback:
        for v, r in sums.items():
            for key, t in r.items():
                if t is not None:
                    raw[v][key][rows] = t
    return out, raw


def _wide_head(q, k, scale, u, layer, h, views, variants, iters, spec, dist, ref) -> dict:
    """One head with widely spread scores: weights by :func:`_variants_unmasked` (log space), row sums
    from those weights (``attnlab.stats._row_sums``)."""
    from attnlab import stats

    u_w = u if isinstance(u, float) else u[layer : layer + 1, :, h : h + 1]
    part = _variants_unmasked(q[layer : layer + 1, :, h : h + 1], k[layer : layer + 1, :, h : h + 1],
                              [scale[layer]], variants, u_w, iters)
    sums = {}
    for v in sorted(variants, key=lambda n: n != ref):
        views[v].copy_(part[v][0, 0])
        js = None if ref is None or v == ref else (views[ref], sums[ref]["entropy"])
        sums[v] = stats._row_sums(views[v], spec, dist, js)
    return sums


def _group_linear(s, e, x, y, mu, gmax, views, buf, rows, u, iters, spec, dist, ref, hnas_is_mix,
                  clamp_hnas) -> None:
    """Weights of one group of heads with scores s (g, N, N) (consumed; mu: row maxima (g, N, 1), gmax
    (g, 1, 1), e, x, y scratch like s), and its matrix products into ``buf`` rows ``rows``."""
    g, N, _ = s.shape
    s.sub_(mu)  # s_ij - max_j s_ij in [-LINEAR_SPAN_MAX, 0]
    torch.exp(s, out=e)  # E
    rho = (mu - gmax).exp_().transpose(-1, -2)  # (g, 1, N): exp(s - max over the head) = rho_i E_ij
    alpha, beta, e_beta = buf["alpha"][rows], buf["beta"][rows], buf["e_beta"][rows]  # (g, N, 3) views
    torch.matmul(rho, e, out=beta[..., 1].unsqueeze(1)).reciprocal_()  # 1 / column sums: dnas
    e_beta[..., :2] = torch.matmul(e, beta[..., :2])  # r_i = sum_j E_ij, R_i = sum_j E_ij beta_j
    torch.reciprocal(e_beta[..., :2], out=alpha[..., :2])
    a, b, eb = alpha[..., 1], beta[..., 1], e_beta[..., 1]  # sinkhorn after one (column, row) round
    for _ in range(iters - 1):
        b = torch.matmul(a.unsqueeze(1), e).reciprocal_().squeeze(1)  # column step (g, N)
        eb = torch.stack([torch.mv(e[i], b[i]) for i in range(g)])  # row step (the last normalizes)
        a = eb.reciprocal()
    alpha[..., 2], beta[..., 2], e_beta[..., 2] = a, b, eb
    # the weights
    pu, pd = views.get("unas"), views.get("dnas")
    if pu is None and "hnas" in views:
        pu = x
    if pu is not None:
        torch.mul(e, alpha[..., :1], out=pu)
    if pd is None and "hnas" in views:
        pd = y
    if pd is not None:
        torch.mul(e, beta[..., 1].unsqueeze(1), out=pd).mul_(alpha[..., 1:2])
    if "hnas" in views:
        torch.lerp(pu, pd, u, out=views["hnas"])
    if "sinkhorn" in views:
        torch.mul(e, b.unsqueeze(1), out=views["sinkhorn"]).mul_(a.unsqueeze(-1))
    # products for the statistics
    torch.matmul(alpha.transpose(-1, -2), e, out=buf["cols"][rows])  # (g, 3, N)
    log_betas = beta[..., 1:] * beta[..., 1:].log()  # beta ln beta: (g, N, 2)
    spec_b = (beta[..., None, :] * spec[:, :, None]).reshape(g, N, -1)  # beta_j special_j: (g, N, 3 S)
    torch.matmul(e, torch.cat([log_betas, spec_b], -1), out=buf["e_rows"][rows])
    torch.matmul(torch.mul(e, s, out=s), beta, out=buf["es_rows"][rows])
    torch.matmul(torch.mul(e, dist, out=s), beta, out=buf["ed_rows"][rows])
    for v, w in views.items():
        torch.sum(w, -1, out=buf["rowsum"][v][rows])
    if "hnas" in views:
        ph = views["hnas"]
        t = torch.log(ph, out=s)
        if clamp_hnas:
            t.clamp_min_(math.log(torch.finfo(ph.dtype).tiny))
        torch.sum(t.mul_(ph), -1, out=buf["h_xlogx"][rows])
    if ref is None:
        return
    for v in views:
        if v == ref or (v == "dnas" and hnas_is_mix):
            continue
        t = torch.add(views[v], views[ref], out=x)  # 2 * the mixture; > 0 since unas > 0 here
        torch.sum(torch.log(t, out=s).mul_(t), -1, out=buf["tlogt"][v][rows])


def _assemble_sums(buf, variants, ref, u_maps, hnas_is_mix, S) -> dict:
    """Row sums of every variant (``attnlab.stats._row_sums`` layout) from the products in ``buf``,
    for all maps at once: pi = alpha_i E_ij beta_j, so sum_j pi ln pi = ln alpha_i sum_j pi
    + alpha_i sum_j E_ij (s_ij - max) beta_j + alpha_i sum_j E_ij beta_j ln beta_j."""
    alpha, beta, e_beta, cols = buf["alpha"], buf["beta"], buf["e_beta"], buf["cols"]
    es_rows, ed_rows, e_rows = buf["es_rows"], buf["ed_rows"], buf["e_rows"]
    fact = {}
    for c, v in enumerate(("unas", "dnas", "sinkhorn")):
        al = alpha[..., c]
        xlogx = al.log() * (al * e_beta[..., c]) + al * es_rows[..., c]
        if c:
            xlogx += al * e_rows[..., c - 1]
        fact[v] = {
            "cols": cols[:, c] * beta[..., c], "entropy": xlogx.neg_(), "distance": al * ed_rows[..., c],
            "special": al[..., None] * e_rows[..., 2 + c :: 3],
        }
    if "hnas" in variants:
        w = u_maps[:, None]
        fact["hnas"] = {
            "cols": torch.lerp(fact["unas"]["cols"], fact["dnas"]["cols"], w),
            "entropy": -buf["h_xlogx"],
            "distance": torch.lerp(fact["unas"]["distance"], fact["dnas"]["distance"], w),
            "special": torch.lerp(fact["unas"]["special"], fact["dnas"]["special"], w[..., None]),
        }
    raw = {}
    for v in variants:
        raw[v] = dict(fact[v], rowsum=buf["rowsum"][v], js=None)
    if ref is not None:
        h_u, rs_u = raw[ref]["entropy"], raw[ref]["rowsum"]
        for v in variants:
            if v == ref:
                continue
            if v == "dnas" and hnas_is_mix:
                mlogm = -raw["hnas"]["entropy"]  # the mixture (dnas + unas) / 2 is hnas with u = 0.5
            else:  # sum_j m ln m with m = t / 2
                mlogm = 0.5 * buf["tlogt"][v] - (0.5 * LN2) * (raw[v]["rowsum"] + rs_u)
            jsd = (-mlogm - 0.5 * (raw[v]["entropy"] + h_u)) / LN2  # H(m) - (H(p) + H(q)) / 2, bits
            raw[v]["js"] = jsd.clamp_(0.0, 1.0).sqrt_()
            if v == "hnas":  # u = 0: hnas is unas bit for bit, at distance exactly 0 (not sqrt(rounding))
                raw[v]["js"].masked_fill_((u_maps == 0.0)[:, None], 0.0)
    return raw


def _heads_log(s, q, k, scale, heads, targets) -> None:
    """Recompute the (B, H) heads selected by ``heads`` in log space; s: (1, n, N, N) their scores."""
    sub = {name: None if t is None else torch.empty_like(s) for name, t in targets.items() if name[0] == "p"}
    u = targets["u"]
    u = u if isinstance(u, float) else u.expand(*heads.shape, 1, 1)[heads][None]  # (1, n, 1, 1)
    _layer_log(s, torch.empty_like(s), q, k, scale, u=u, iters=targets["iters"], **sub)
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


def _layer_log(s, x, q, k, scale, pu, pd, ph, ps, u, iters) -> None:
    """One layer's variants in log space, for heads with widely spread scores.

    unas = softmax_j(s) (Eq. 1); dnas = softmax_j(s_ij - c_j), c_j = logsumexp_i s_ij from the fused
    column pass :func:`attnlab.column_logsumexp` (Eq. 5, DESIGN.md §2); hnas = lerp(unas, dnas, u)
    (Eq. 12); sinkhorn = softmax_j(s_ij + beta_j) with beta from :func:`_sinkhorn_bias` (Eq. 10).
    """
    if pu is not None:
        torch.softmax(s, -1, out=pu)
    if pd is not None:
        c = column_logsumexp(q, k, None, scale)  # (B, H, N)
        torch.softmax(torch.sub(s, c[..., None, :], out=x), -1, out=pd)
    if ph is not None:
        torch.lerp(pu, pd, u, out=ph)
    if ps is None:
        return
    if iters == 1:  # = dnas
        ps.copy_(pd)
        return
    beta = _sinkhorn_bias(q, k, scale, iters)  # (B, H, N)
    torch.softmax(torch.add(s, beta[..., None, :], out=x), -1, out=ps)


def _swap(loaded: LoadedModel, input_ids, attention_mask, variants, u, iters) -> dict[str, torch.Tensor]:
    out = {}
    for variant in variants:
        with use_variant(loaded.model, variant, u=u, iters=iters, return_weights=True):
            res = loaded.model(
                input_ids=input_ids, attention_mask=attention_mask, output_attentions=True, use_cache=False
            )
        out[variant] = torch.stack(res.attentions)  # (L, B, H, N, N)
    return out


def batch_weights(
    model: LoadedModel | str | os.PathLike | None,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    variants: Sequence[str] = VARIANTS,
    mode: str = "recompute",
    u: float | torch.Tensor = DEFAULT_U,
    iters: int = DEFAULT_ITERS,
) -> dict[str, torch.Tensor]:
    """Weights of every variant for a (padded) batch.

    Args:
        model: a :class:`LoadedModel`, a model directory, or None for the embedded default.
        input_ids: (B, N) token ids, padded on the right.
        attention_mask: (B, N) 1 for real tokens, 0 for padding (default: all ones).
        variants, mode, u, iters: as in :func:`analyze`; causal models use iters=1 for sinkhorn.

    Returns:
        variant -> (L, B, H, N, N) float32; rows and columns of padded tokens are zero, valid rows
        sum to 1.
    """
    loaded = model if isinstance(model, LoadedModel) else load_model(model)
    variants = check_arguments(variants, mode, u, iters)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (B, N), got shape {tuple(input_ids.shape)}")
    attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask must match input_ids {tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}"
        )
    if loaded.info.causal:
        iters = 1  # causal Sinkhorn degenerates for iters > 1 (DESIGN.md §2)
    run = _recompute if mode == "recompute" else _swap
    with loaded.lock, torch.no_grad():
        return run(loaded, input_ids, attention_mask, variants, u, iters)


def window_weights_and_sums(loaded: LoadedModel, input_ids, variants, mode, u, iters, specials):
    """One window (input_ids (1, N), no padding): (weights {variant: (L, 1, H, N, N)}, row sums for
    ``attnlab.stats._tidy_from_row_sums`` or None), the sums computed with the weights when the fused
    path applies (recompute mode, bidirectional model)."""
    if loaded.info.causal:
        iters = 1
    with loaded.lock, torch.no_grad():
        if mode != "recompute":
            return _swap(loaded, input_ids, torch.ones_like(input_ids), variants, u, iters), None
        ones = torch.ones_like(input_ids)
        return _recompute_with_sums(loaded, input_ids, ones, variants, u, iters, specials)
