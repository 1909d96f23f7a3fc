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

import os
from collections.abc import Sequence

import torch

from attnlab.hf.interface import DEFAULT_ITERS, DEFAULT_U, CapturedLayer, capture_qk, use_variant
from attnlab.hf.loading import LoadedModel, load_model
from attnlab.normalizers import VARIANTS, attention_weights, column_logsumexp

__all__ = ["MODES", "LINEAR_SPAN_MAX", "batch_weights"]

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
        return _variants_unmasked(q, k, scale, variants, u_l, iters)
    B, N = valid.shape
    everything = torch.ones(B, 1, N, N, dtype=torch.bool)  # a layer without a mask
    mask = torch.stack([everything if m is None else m for m in masks])  # (L, B, 1, N, N)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(torch.tensor(scale).reshape(-1, 1, 1, 1, 1))
    return {  # (L, B, H, N, N) each
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


def _augment(x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """(..., N, D), (..., N) -> (..., N, D + 1): one more coordinate per row."""
    return torch.cat([x, extra[..., None]], dim=-1)


def _sinkhorn_bias(q: torch.Tensor, k: torch.Tensor, scale: float, iters: int) -> torch.Tensor:
    """Sinkhorn (Eq. 10) in scaling form: -> beta (B, H, N) with weights = softmax_j(s_ij + beta_j).

    ``iters`` (column, row) rounds of the log-space iteration keep the logits as s_ij + alpha_i + beta_j;
    a column step sets beta_j = -logsumexp_i(s_ij + alpha_i), a row step alpha_i = -logsumexp_j(s_ij +
    beta_j), and alpha cancels in the final row softmax. Each logsumexp is a fused column pass
    (:func:`attnlab.column_logsumexp`) on q, k augmented by one coordinate, so no (N, N) matrix is
    built: [scale q_i, alpha_i] . [k_j, 1] = s_ij + alpha_i.
    """
    qs, ones = q * scale, q.new_ones(q.shape[:-1])
    alpha = q.new_zeros(q.shape[:-1])  # (B, H, M)
    for _ in range(iters - 1):
        beta = -column_logsumexp(_augment(qs, alpha), _augment(k, ones), None, 1.0)  # column step
        alpha = -column_logsumexp(_augment(k, beta), _augment(qs, ones), None, 1.0)  # row step
    return -column_logsumexp(_augment(qs, alpha), _augment(k, ones), None, 1.0)  # (B, H, N)


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
