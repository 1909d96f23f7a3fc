"""Jensen-Shannon distance (base 2, in [0, 1]) between attention rows: of two maps, of every pair of
heads, of every pair of variants. weights (..., M, N); ``mask`` bool broadcastable to the weights."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from attnlab.stats._checks import LN2, check_weights, masked, valid_mean, xlogx_rowsum


def js_rows(p, q, hp, hq, mix_out=None, log_out=None) -> torch.Tensor:
    """Per-row JS distance (base 2) from rows p, q (..., M, N) and their entropies hp, hq (..., M).

    JSD = H((p + q)/2) - (H(p) + H(q))/2 in bits, clamped to [0, 1]; distance = sqrt(JSD).
    Symmetric bit for bit, and exactly 0 for identical rows ((p + p)/2 == p in floating point).
    ``mix_out`` / ``log_out`` are optional scratch tensors shaped like p. NaN propagates.
    """
    mix = torch.add(p, q, out=mix_out).mul_(0.5)
    hm = -xlogx_rowsum(mix, out=log_out)  # (..., M)
    jsd = (hm - 0.5 * (hp + hq)) / LN2
    return jsd.clamp_(0.0, 1.0).sqrt_()


def js2_rowsum(p, q, a, b, out=None, positive: bool = False) -> torch.Tensor:
    """sum_j p ln(2p / (p + q)) + q ln(2q / (p + q)) over the last dim: twice the Jensen-Shannon
    divergence (nats) of rows p and q (..., N) (a, b: scratch like p).

    The logarithms are log1p(+-d) with d = (p - q) / (p + q): no cancellation for close rows, where
    H((p + q)/2) - (H(p) + H(q))/2 in float32 loses the divergence to rounding (its square root, the
    distance, amplifies that). Zeros contribute 0 (0 ln 0); exactly 0 for identical rows.
    ``positive``: every entry of p and q is > 0 (skips the guards for zeros).
    """
    d = torch.sub(p, q, out=a).div_(torch.add(p, q, out=b))
    if positive:
        t = torch.log1p(d, out=b).mul_(p)
        return torch.sum(t.add_(d.neg_().log1p_().mul_(q)), -1, out=out)
    log_tiny = math.log(torch.finfo(p.dtype).tiny)
    d.nan_to_num_(0.0)  # 0 / 0 -> 0 (a NaN in p or q still reaches the sum through the factors p, q)
    t = torch.log1p(d, out=b).clamp_min_(log_tiny).mul_(p)
    t.add_(d.neg_().log1p_().clamp_min_(log_tiny).mul_(q))
    return torch.sum(t, -1, out=out)


def js_distance(
    p: torch.Tensor, q: torch.Tensor, mask: torch.Tensor | None = None, reduce: bool = True
) -> torch.Tensor:
    """Jensen-Shannon distance between the rows of p and q (..., M, N) -> mean over valid rows (...,).

    Base 2, so each row's distance lies in [0, 1]: 0 for identical rows, 1 for disjoint supports.
    It is sqrt(JSD), a metric. ``reduce=False`` returns (..., M) (0 on invalid rows).
    In float32 distances below ~1e-3 are at rounding level (sqrt of ~1e-7); pass float64 for more.
    """
    p = check_weights("p", p)
    q = check_weights("q", q)
    if p.shape != q.shape:
        raise ValueError(f"p and q must have the same shape, got {tuple(p.shape)} and {tuple(q.shape)}")
    dt = torch.promote_types(p.dtype, q.dtype)
    p, row_valid, _ = masked(p.to(dt), mask)
    q, _, _ = masked(q.to(dt), mask)
    d = js_rows(p, q, -xlogx_rowsum(p), -xlogx_rowsum(q))  # (..., M)
    if not reduce:
        return d if row_valid is None else torch.where(row_valid, d, d.new_zeros(()))
    return valid_mean(d, row_valid)


def head_js_matrix(weights: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """JS distance between every pair of heads: (..., H, M, N) -> (..., H, H), symmetric, 0 diagonal.

    Entry (a, b) is ``js_distance(weights[..., a, :, :], weights[..., b, :, :])``. One vectorized pass
    per head offset (H - 1 passes over the weights); ``mask`` broadcastable to the weights.
    """
    w = check_weights("weights", weights, min_dim=3)
    w, row_valid, _ = masked(w, mask)
    H = w.shape[-3]
    h = -xlogx_rowsum(w)  # (..., H, M)
    out = w.new_zeros((*w.shape[:-3], H, H))
    rv = None if row_valid is None else row_valid.expand(*w.shape[:-1])  # (..., H, M)
    for k in range(1, H):  # head pairs (a, a + k) for every a at once
        d = js_rows(w[..., :-k, :, :], w[..., k:, :, :], h[..., :-k, :], h[..., k:, :])  # (..., H-k, M)
        d = valid_mean(d, None if rv is None else rv[..., :-k, :] & rv[..., k:, :])
        idx = torch.arange(H - k, device=w.device)
        out[..., idx, idx + k] = d
        out[..., idx + k, idx] = d
    return out


def variant_js_matrix(weights: Mapping[str, torch.Tensor], mask: torch.Tensor | None = None) -> torch.Tensor:
    """JS distance between every pair of variants: {name: (..., M, N)} -> (V, V, ...), in dict order.

    Entry (a, b) is ``js_distance(weights[a], weights[b], mask)`` (mean over valid rows per slice).
    """
    if not isinstance(weights, Mapping):
        raise ValueError("weights must be a dict {variant name: tensor (..., M, N)}, got "
                         f"{type(weights).__name__}")
    names = list(weights)
    if not names:
        raise ValueError("weights must map at least one variant name to a tensor, got an empty mapping")
    ws = {n: masked(check_weights(f"weights[{n!r}]", weights[n]), mask) for n in names}
    shapes = {n: tuple(t[0].shape) for n, t in ws.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"every variant's weights must have one shape, got {shapes}")
    dt = ws[names[0]][0].dtype
    for t in ws.values():
        dt = torch.promote_types(dt, t[0].dtype)
    ws = {n: (t[0].to(dt), t[1], t[2]) for n, t in ws.items()}
    ents = {n: -xlogx_rowsum(t[0]) for n, t in ws.items()}
    row_valid = ws[names[0]][1]
    first = ws[names[0]][0]
    out = first.new_zeros((len(names), len(names), *first.shape[:-2]))
    for a in range(len(names)):
        for b in range(a + 1, len(names)):
            pa, pb = ws[names[a]][0], ws[names[b]][0]
            d = valid_mean(js_rows(pa, pb, ents[names[a]], ents[names[b]]), row_valid)
            out[a, b] = out[b, a] = d
    return out
