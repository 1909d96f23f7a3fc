"""The variants as pure functions: ``(logits (B, H, M, N) with -inf where masked, ctx) -> weights``.

Notation (docs/DESIGN.md §1): queries i = 1..M, keys j = 1..N, s_ij the scores, pi_ij the weights.
Each function is the math of one variant and nothing else; its declaration (parameters, guarantees,
fast paths) is its spec in ``attnlab/normalizers/builtin.py``.

Numerics rule (docs/DESIGN.md §4): a masked entry is -inf and gets weight 0; a row with no valid key
is all zero, a column with no valid query contributes nothing, and no NaN comes from finite scores
(forward or backward). A NaN or +inf score is not a mask: it makes every weight it influences NaN, as
``torch.softmax`` does (its row; for column-normalizing variants also the rows that share its column).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

NEG_INF = float("-inf")
# Stand-in for "logsumexp of an empty set": finite, so gradients stay NaN-free, and far below
# any real score, so logaddexp(real, FLOOR) == real exactly.
LSE_FLOOR = -1e30


@dataclass(frozen=True)
class NormalizerContext:
    """What a normalizer may need beyond the logits: the causal flag and its validated parameters.

    ``ctx.u``, ``ctx.iters``, ... read ``params`` (filled with the spec's defaults by the caller).
    """

    causal: bool = False  # the mask already contains j <= i; DNAS then normalizes columns over prefixes
    params: Mapping[str, Any] = field(default_factory=dict)  # validated variant parameters

    def __getattr__(self, name: str):
        params = object.__getattribute__(self, "params")
        if name in params:
            return params[name]
        raise AttributeError(f"NormalizerContext has no parameter {name!r} (it has {tuple(params)})")

    def with_params(self, **changes) -> NormalizerContext:
        return NormalizerContext(causal=self.causal, params={**self.params, **changes})


# ----------------------------------------------------------------------------------------------
# Numerically safe building blocks
# ----------------------------------------------------------------------------------------------


def safe_logsumexp(x: torch.Tensor, dim: int) -> torch.Tensor:
    """logsumexp over ``dim`` (keepdim) that returns 0 instead of -inf for an all -inf slice.

    Gradients are finite everywhere for finite or -inf inputs: the shift is detached and the log
    never sees 0. NaN and +inf propagate (a NaN slice gives NaN, not 0).
    """
    if x.shape[dim] == 0:  # the empty set: 0, as for an all -inf slice
        shape = list(x.shape)
        shape[dim] = 1
        return x.new_zeros(shape)
    m = x.amax(dim, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    total = torch.exp(x - m).sum(dim, keepdim=True)
    return torch.log(torch.where(total == 0, torch.ones_like(total), total)) + m


def shift(logits: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """logits - c, masked entries (-inf) left -inf whatever c is: a NaN potential reaches only the
    valid entries of its row or column (docs/DESIGN.md §4)."""
    return torch.where(torch.isneginf(logits), logits, logits - c)


def row_softmax(logits: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim; a row of -inf becomes all zeros (not NaN)."""
    return torch.exp(shift(logits, safe_logsumexp(logits, -1)))


def prefix_column_logsumexp(logits: torch.Tensor, carry: torch.Tensor | None = None) -> torch.Tensor:
    """c_j(i) = logsumexp over i' <= i of logits_{i' j}  (causal DNAS, docs/VARIANTS.md).

    logits (..., M, N); carry (..., 1, N) is the prefix of earlier query blocks (None = empty).
    Empty prefixes give LSE_FLOOR (finite), which keeps the backward pass NaN-free.
    """
    if carry is None:
        carry = logits.new_full((*logits.shape[:-2], 1, logits.shape[-1]), LSE_FLOOR)
    return torch.logcumsumexp(torch.cat([carry, logits], dim=-2), dim=-2)[..., 1:, :]


def as_weight(u: float | torch.Tensor, like: torch.Tensor) -> float | torch.Tensor:
    return u.to(like.dtype) if isinstance(u, torch.Tensor) else u


# ----------------------------------------------------------------------------------------------
# The variants ("Attention that does not Explain Away", Eqs. 1, 5, 10, 12; Martins & Astudillo 2016;
# Miller 2023 "off-by-one" softmax)
# ----------------------------------------------------------------------------------------------


def unas(logits: torch.Tensor, ctx: NormalizerContext) -> torch.Tensor:
    """Eq. (1): pi_ij = exp(s_ij) / sum_j' exp(s_ij'). Rows sum to 1."""
    return row_softmax(logits)


def dnas(logits: torch.Tensor, ctx: NormalizerContext) -> torch.Tensor:
    """Eq. (5): normalize over queries i, then over keys j.

    In log space: pi_ij = softmax_j(s_ij - c_j) with c_j = logsumexp over valid i of s_ij. Every
    valid column then receives mass >= 1/N_valid. With ``ctx.causal`` the column sum runs over the
    prefix i' <= i only (c_j(i)), so a later query never changes an earlier row; this is an extension
    of the paper and puts logit 0 = s_ii - c_i(i) on the diagonal, the largest possible.
    """
    if ctx.causal:
        c = prefix_column_logsumexp(logits)  # (B, H, M, N)
    else:
        c = safe_logsumexp(logits, -2)  # (B, H, 1, N); gradients flow through c_j
    return row_softmax(shift(logits, c))


def hnas(logits: torch.Tensor, ctx: NormalizerContext) -> torch.Tensor:
    """Eq. (12): u * pi_dnas + (1 - u) * pi_unas, u in [0, 1] per head. Column mass >= u/N_valid."""
    return torch.lerp(unas(logits, ctx), dnas(logits, ctx), as_weight(ctx.u, logits))


def sinkhorn_column_step(logits: torch.Tensor, mask_counts: torch.Tensor | None = None) -> torch.Tensor:
    """One column step of Eq. (10) re-centred: columns sum to M_valid / N_valid (not 1).

    Re-centring subtracts a per-head constant, which the following row softmax cancels exactly; it
    keeps the potentials from drifting by ln(M/N) per round (float32 drift over many rounds).
    ``mask_counts`` is log(M_valid / N_valid) of shape (..., 1, 1) or None (0: M = N).
    """
    logits = shift(logits, safe_logsumexp(logits, -2))
    return logits if mask_counts is None else logits + mask_counts


def sinkhorn(logits: torch.Tensor, ctx: NormalizerContext) -> torch.Tensor:
    """Eq. (10): ``iters`` rounds of (column, row) normalization in log space.

    ``iters=1`` is exactly DNAS; as iters grows every valid column's mass approaches M_valid/N_valid
    (doubly stochastic when M = N). With ``tol`` > 0 the rounds stop early once every valid column's
    mass is within ``tol`` of M_valid/N_valid. Causal use allows only iters=1 (the spec's causal rule).
    """
    if ctx.causal or ctx.iters == 1:
        return dnas(logits, ctx)
    valid = torch.isfinite(logits) | torch.isnan(logits)  # masked entries are exactly -inf
    rows = valid.any(-1, keepdim=True)  # (B, H, M, 1)
    cols = valid.any(-2, keepdim=True)  # (B, H, 1, N)
    m_valid = rows.sum(-2, keepdim=True).to(logits.dtype)  # (B, H, 1, 1)
    n_valid = cols.sum(-1, keepdim=True).to(logits.dtype)
    target = torch.where(n_valid > 0, m_valid / n_valid.clamp(min=1), torch.ones_like(m_valid))
    recentre = torch.log(target.clamp(min=torch.finfo(logits.dtype).tiny))  # (B, H, 1, 1)
    for _ in range(ctx.iters - 1):
        logits = sinkhorn_column_step(logits, recentre)  # column step: sum_i = M_valid / N_valid
        logits = shift(logits, safe_logsumexp(logits, -1))  # row step:    sum_j = 1
        if ctx.tol > 0 and not torch.is_grad_enabled():
            mass = torch.exp(logits).sum(-2, keepdim=True)  # (B, H, 1, N), after the row step
            gap = torch.where(cols, (mass - target).abs(), torch.zeros_like(mass))
            if bool(gap.amax() <= ctx.tol):
                break
    return dnas(logits, ctx)  # the last (column, row) round


def sparsemax(logits: torch.Tensor, ctx: NormalizerContext) -> torch.Tensor:
    """Martins & Astudillo (2016), Eq. (2): the Euclidean projection of each row onto the simplex,
    pi_i = argmin_{p in simplex} ||p - s_i||^2 = max(s_ij - tau_i, 0).

    tau_i = (sum_{j <= k_i} z_(j) - 1) / k_i over the row sorted decreasingly (z_(1) >= z_(2) >= ...),
    k_i = max{k : 1 + k z_(k) > sum_{j <= k} z_(j)}. Rows sum to 1 with exact zeros: a key outside the
    support is explained away completely. Masked (-inf) keys are never in the support; a row with no
    valid key is all zero. Differentiable (autograd through the sort gives the sparsemax Jacobian).
    """
    n = logits.shape[-1]
    if n == 0:
        return logits.clone()
    finite = logits.masked_fill(torch.isneginf(logits), torch.finfo(logits.dtype).min)
    # tau_i >= max_j s_ij - 1 (the largest term alone would exceed 1 below it), so the support lies in
    # {j : s_ij > max - 1}: only the K largest of each row are sorted, K = the most such keys of any row
    top = finite.amax(-1, keepdim=True)
    K = min(max(int((finite > top - 1).sum(-1).amax()) if finite.numel() else 1, 1), n)
    if K < n:
        z = torch.topk(finite, K, dim=-1).values  # (..., M, K), decreasing
    else:
        z, _ = torch.sort(finite, dim=-1, descending=True)  # (..., M, N)
    ks = torch.arange(1, K + 1, device=logits.device, dtype=logits.dtype)
    cum = z.cumsum(-1)
    in_support = (1 + ks * z > cum) & (z > torch.finfo(logits.dtype).min)
    k = in_support.sum(-1, keepdim=True).clamp(min=1)  # (..., M, 1)
    tau = (cum.gather(-1, k - 1) - 1) / k.to(logits.dtype)
    out = torch.clamp(finite - tau, min=0)
    empty = torch.isneginf(logits).all(-1, keepdim=True)
    bad = (torch.isnan(logits) | torch.isposinf(logits)).any(-1, keepdim=True)  # the NaN rule
    return out.masked_fill(empty, 0.0).masked_fill(bad, float("nan"))


def softmax1(logits: torch.Tensor, ctx: NormalizerContext) -> torch.Tensor:
    """"Off-by-one" softmax: pi_ij = exp(s_ij) / (1 + sum_j' exp(s_ij')).

    A built-in null key with score 0 takes the rest of the row: rows sum to < 1 (1 - sum_j pi_ij is
    the null key's share), so a query can attend to nothing; relevant to attention sinks. Computed as
    exp(s_ij - logaddexp(0, logsumexp_j s_ij)); a row with no valid key is all zero.
    """
    lse = safe_logsumexp(logits, -1)
    empty = torch.isneginf(logits).all(-1, keepdim=True) if logits.shape[-1] else None
    if empty is not None:
        lse = lse.masked_fill(empty, NEG_INF)  # the empty set's LSE: then logaddexp(0, .) = 0
    return torch.exp(shift(logits, torch.logaddexp(torch.zeros_like(lse), lse)))
