"""Every variant's weights from one score matrix per layer, for inputs without any mask (one window):
the math of :func:`attnlab.attention_weights` (tests check equality), arranged for speed. Heads whose
scores span at most ``LINEAR_SPAN_MAX`` nats divide exponentials (:func:`_layer_linear`), others
work in log space (:func:`_layer_log`). Shapes: q, k (L, B, H, N, D); weights (L, B, H, N, N).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from attnlab.normalizers import functions as fn

# The slots of the fused analysis (this module's linear/log layer passes and attnlab_hf.heads): the
# normalizers whose math it implements, each computed into its slot. A variant takes it when its spec
# declares ``hf_kernel`` (for its parameters) and its normalizer is one of these (:func:`fused_slot`);
# any other streams beside them (attnlab/hf/compute/mixed.py) or takes the generic materialized path.
# softmax1 is unas scaled per row (a null key of score 0): its statistics follow from unas' in closed
# form (attnlab/hf/compute/softmax1_sums.py) and the kernel's softmax1 output (ln t_i, column masses).
FUSED_NORMALIZERS = {fn.unas: "unas", fn.dnas: "dnas", fn.hnas: "hnas", fn.sinkhorn: "sinkhorn",
                     fn.softmax1: "softmax1", fn.sparsemax: "sparsemax"}
KERNEL_VARIANTS = tuple(FUSED_NORMALIZERS.values())  # the slots, in the kernel's output order


def fused_slot(spec, params: Mapping[str, Any]) -> str | None:
    """The fused analysis' slot that computes ``spec``'s variant with these (checked) parameters, or
    None: its spec declares no hf kernel (``VariantSpec.hf_kernel``, a bool or a predicate of the
    parameters), or its normalizer is not one the fused analysis implements."""
    kernel = spec.hf_kernel
    if not (kernel(params) if callable(kernel) else kernel):
        return None
    return FUSED_NORMALIZERS.get(spec.normalizer)


def _check_kernel_variants(variants) -> None:
    other = [v for v in variants if v not in KERNEL_VARIANTS]
    if other:  # never hand out buffers nobody fills
        raise ValueError(f"variants {other} are not slots of the fused analysis ({KERNEL_VARIANTS})")


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
    una = None if "unas" in out or not {"hnas", "softmax1"} & set(out) else q.new_empty(B, H, N, N)
    dna = None if "dnas" in out or not need_dnas else q.new_empty(B, H, N, N)
    for layer in range(L):
        ql, kl = q[layer], k[layer]  # (B, H, N, D)
        torch.matmul(ql, kl.transpose(-1, -2), out=s).mul_(scale[layer])  # (B, H, N, N)
        if "sparsemax" in out:  # its reference function on the scores, before they are consumed
            out["sparsemax"][layer] = fn_sparsemax_weights(s)
        targets = dict(
            pu=out["unas"][layer] if "unas" in out else una,
            pd=out["dnas"][layer] if "dnas" in out else dna,
            ph=out["hnas"][layer] if "hnas" in out else None,
            ps=out["sinkhorn"][layer] if "sinkhorn" in out else None,
            p1=out["softmax1"][layer] if "softmax1" in out else None,
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


def fn_sparsemax_weights(s: torch.Tensor) -> torch.Tensor:
    """sparsemax (Martins & Astudillo 2016, Eq. 2) of unmasked scores (..., N, N), by attention_weights."""
    from attnlab.normalizers import attention_weights

    return attention_weights(s, "sparsemax")


def _heads_log(s, heads, targets) -> None:
    """Recompute the (B, H) heads selected by ``heads`` in log space; s: (1, n, N, N) their scores."""
    sub = {name: None if t is None else torch.empty_like(s) for name, t in targets.items() if name[0] == "p"}
    u = targets["u"]
    u = u if isinstance(u, float) else u.expand(*heads.shape, 1, 1)[heads][None]  # (1, n, 1, 1)
    _layer_log(s, torch.empty_like(s), u=u, iters=targets["iters"], **sub)  # (s consumed by nothing here)
    for name, t in sub.items():
        if t is not None:
            targets[name][heads] = t[0]


def _layer_linear(s, pu, pd, ph, ps, u, iters, p1=None) -> None:
    """One layer's variants from e = exp(s - max over the head) (consumes ``s``).

    unas = e_ij / sum_j e_ij (Eq. 1); dnas: gamma_ij = e_ij / sum_i e_ij, then rows normalized (Eq. 5);
    hnas = lerp(unas, dnas, u) (Eq. 12); sinkhorn (Eq. 10) keeps pi_ij = a_i e_ij b_j and alternates
    the column step b = 1 / (a^T e) and the row step a = 1 / (e b) -- matrix-vector products -- then
    ends with a column step and a row normalization; softmax1 = unas / (1 + t_i), t_i = 1 / sum_j
    exp(s_ij) (a null key of score 0). Targets that are None are skipped (p1 needs pu).
    """
    top = s.amax(dim=(-2, -1), keepdim=True)  # (B, H, 1, 1)
    e = s.sub_(top).exp_()  # (B, H, N, N), entries in [e^-60, 1]
    if pu is not None:
        rows = e.sum(-1, keepdim=True)  # (B, H, N, 1)
        torch.div(e, rows, out=pu)
        if p1 is not None:  # t_i = exp(-top) / rows_i; exp overflows to inf: p1 = 0
            torch.mul(pu, torch.div(rows, rows + torch.exp(-top)), out=p1)
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


def _layer_log(s, x, pu, pd, ph, ps, u, iters, p1=None) -> None:
    """One layer's variants in log space, for heads with widely spread scores s (B, H, N, N).

    unas = softmax_j(s) (Eq. 1); dnas = softmax_j(s_ij - c_j), c_j = logsumexp_i s_ij (Eq. 5, DESIGN.md
    §2); hnas = lerp(unas, dnas, u) (Eq. 12); sinkhorn = softmax_j(s_ij - c_j) with the column
    potentials after ``iters`` (column, row) rounds of logsumexp (Eq. 10); softmax1 = exp(s_ij -
    logaddexp(0, logsumexp_j s_ij)). x is scratch like s.
    """
    if pu is not None:
        torch.softmax(s, -1, out=pu)
    if p1 is not None:
        lse = torch.logsumexp(s, -1, keepdim=True)  # (B, H, N, 1)
        torch.exp(torch.sub(s, torch.logaddexp(torch.zeros_like(lse), lse), out=x), out=p1)
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
