"""Contribution norms: how much each key *contributes* to the attention output, not only how much
weight it gets (Kobayashi et al. 2020, "Attention is Not Only a Weight: Analyzing Transformers with
Vector Norms"). Pure functions on tensors.

Notation as in ``attnlab.stats``; f_h(x_j) = (x_j W_V,h + b_V,h) W_O,h (D,) is key j's value vector
in head h carried through the head's slice of the output projection (``attnlab.hf.capture.values``).

    value_norms               ||f_h(x_j)||                                     (..., H, N)
    value_gram                G_j[h, k] = f_h(x_j) . f_k(x_j)                   (..., N, H, H)
    contribution_mass         c_j = sum_i pi_ij ||f_h(x_j)||                    (..., H, N)
    layer_contribution_norms  ||sum_h pi^h_ij f_h(x_j)|| (Kobayashi Eq. (7))    (..., M, N)
    contribution_statistics   the explained-away rule of ``attnlab.stats`` on c~_j = c_j M / sum_j c_j

The layer-level norm uses ||sum_h a_h f_h||^2 = a^T G_j a (a_h = pi^h_ij), a block of query rows at a
time: O(M N H^2) work and (rows, N, H) memory, never the (M, N, D) vectors of the layer.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from attnlab import stats
from attnlab.normalizers.checks import check_number, scalar
from attnlab.stats import check_eps
from attnlab.stats._checks import is_lazy_maps

__all__ = [
    "CONTRIBUTION_STATISTICS",
    "value_norms",
    "value_gram",
    "contribution_mass",
    "relative_contribution",
    "layer_contribution_norms",
    "contribution_statistics",
    "contribution_table",
]

# Rows of a block in ``layer_contribution_norms``: two (rows, N) float32 buffers, 256 KiB each at N = 512.
BLOCK_ROWS = 128

CONTRIBUTION_STATISTICS: dict[str, str] = {
    "contribution_explained_away": "share of keys with c~_j < eps (c~_j = c_j M / sum_j c_j, "
    "c_j = sum_i pi_ij ||f_h(x_j)||: contributions rescaled to the weights' total M)",
    "contribution_explained_away_relative": "share of keys with c~_j N / M < eps_relative "
    "(less than eps_relative of the average key's contribution)",
    "contribution_gini": "Gini coefficient of the contribution masses c_j",
    "away_by_weight_not_contribution": "share of keys explained away by weight (m_j N / M < eps_relative) "
    "but not by contribution (c~_j N / M >= eps_relative)",
}


def _check(name: str, t, min_dim: int) -> torch.Tensor:
    if is_lazy_maps(t):  # a causal window's HeadMaps: the whole (L, H, N, N), or a ValueError naming its size
        t = t.materialize()
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dims, got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be floating point, got {t.dtype}")
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def value_norms(f: torch.Tensor) -> torch.Tensor:
    """||f_h(x_j)||: f (..., H, N, D) -> (..., H, N)."""
    return torch.linalg.vector_norm(_check("f", f, 3), dim=-1)


def value_gram(f: torch.Tensor) -> torch.Tensor:
    """Per token the Gram matrix of its head vectors: f (..., H, N, D) -> (..., N, H, H)."""
    f = _check("f", f, 3)
    return torch.einsum("...hnd,...knd->...nhk", f, f)


def _check_nonnegative(name: str, t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` >= 0 (NaN passes: it propagates, docs/DESIGN.md §4). One reduction over a (..., N)
    tensor: norms and contributions are small next to the weights."""
    if t.numel() and not torch.compiler.is_compiling():
        low = float(torch.nan_to_num(t.detach(), nan=0.0).min())
        if low < 0:
            raise ValueError(f"{name} must be >= 0 ({what}), got a minimum of {low:.4g}")
    return t


def _check_pair(weights, norms) -> tuple[torch.Tensor, torch.Tensor]:
    w = _check("weights", weights, 3)
    n = _check("norms", norms, 2)
    if n.shape != w.shape[:-2] + w.shape[-1:]:
        raise ValueError(
            f"norms must be weights' shape without the query dim, {tuple(w.shape[:-2] + w.shape[-1:])}, "
            f"got {tuple(n.shape)}"
        )
    _check_nonnegative("norms", n, "vector norms ||f_h(x_j)||")
    return w, n.to(w.device, w.dtype)


def contribution_mass(weights: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """c_j = sum_i pi_ij ||f_h(x_j)||: weights (..., H, M, N), norms (..., H, N) -> (..., H, N).

    The column mass of the norm-weighted attention (Kobayashi et al. 2020, Sec. 4: ||alpha f(x)||
    summed over the queries); c_j = m_j ||f_h(x_j)||.
    """
    w, n = _check_pair(weights, norms)
    return w.sum(-2) * n


def relative_contribution(c: torch.Tensor, n_rows: int) -> torch.Tensor:
    """c~_j = c_j M / sum_j c_j (..., N): contributions on the scale of column masses (they sum to M
    over the keys like m_j); 0 where every contribution is 0. ``c`` >= 0, ``n_rows`` an integer >= 0."""
    n_rows = check_number("n_rows", n_rows, kind=int, low=0)
    c = _check_nonnegative("c", _check("c", c, 1), "contributions c_j = m_j ||f_h(x_j)||")
    return _relative(c, n_rows)


def _relative(c: torch.Tensor, n_rows: int) -> torch.Tensor:
    """relative_contribution on checked arguments."""
    total = c.sum(-1, keepdim=True)
    keep = (total > 0) | total.isnan()  # a NaN contribution makes its head's c~ NaN (docs/DESIGN.md §4)
    return torch.where(keep, c * n_rows / torch.where(keep, total, 1.0), torch.zeros_like(c))


def layer_contribution_norms(
    weights: torch.Tensor, gram: torch.Tensor, block_rows: int = BLOCK_ROWS
) -> torch.Tensor:
    """||sum_h pi^h_ij f_h(x_j)|| of one layer (Kobayashi et al. 2020, Eq. (7) without the bias).

    weights (..., H, M, N); gram (..., N, H, H) from :func:`value_gram`. Returns (..., M, N). Computed
    as sqrt(a^T G_j a) with a = pi_{:, i, j}, ``block_rows`` query rows at a time: O(M N H^2) work,
    (rows, N) scratch.
    """
    w = _check("weights", weights, 3)
    g = _check("gram", gram, 3).to(w.device, w.dtype)
    H, M, N = w.shape[-3:]
    if g.shape[-3:] != (N, H, H) or g.shape[:-3] != w.shape[:-3]:
        raise ValueError(
            f"gram must be {tuple(w.shape[:-3]) + (N, H, H)} for weights {tuple(w.shape)}, "
            f"got {tuple(g.shape)}"
        )
    block_rows = scalar(block_rows)  # numpy and 0-d tensor numbers as Python ones
    if isinstance(block_rows, bool) or not isinstance(block_rows, int) or block_rows < 1:
        raise ValueError(f"block_rows must be an integer >= 1, got {block_rows!r}")
    out = w.new_empty(*w.shape[:-3], M, N)
    # a^T G_j a = sum_h sum_k>=h (2 - [h = k]) G_j[h, k] pi^h_ij pi^k_ij: H (H + 1) / 2 elementwise
    # passes over a block of rows (large vectorized ops, no tiny per-token matrix products)
    coef = [(h, k, g[..., h, k] * (1.0 if h == k else 2.0)) for h in range(H) for k in range(h, H)]
    for i0 in range(0, M, block_rows):
        wb = w[..., i0 : i0 + block_rows, :]  # (..., H, R, N)
        acc = torch.zeros_like(wb[..., 0, :, :])  # (..., R, N)
        tmp = torch.empty_like(acc)
        for h, k, c in coef:
            torch.mul(wb[..., h, :, :], c[..., None, :], out=tmp)
            acc.addcmul_(tmp, wb[..., k, :, :])
        out[..., i0 : i0 + block_rows, :] = acc.clamp_min_(0.0).sqrt_()
    return out


def contribution_statistics(
    weights: torch.Tensor, norms: torch.Tensor, eps: float = 0.01, eps_relative: float = 0.1
) -> dict[str, torch.Tensor]:
    """{statistic: (L, H)} of ``CONTRIBUTION_STATISTICS`` for weights (L, H, M, N), norms (L, H, N).

    Every key is valid (one window, no padding); an empty window gives zeros.
    """
    w, n = _check_pair(weights, norms)
    if w.dim() != 4:
        raise ValueError(f"weights must be (L, H, M, N), got shape {tuple(w.shape)}")
    return _statistics(w.sum(-2), n, w.shape[-2], eps, eps_relative)


def contribution_statistics_from_masses(masses: torch.Tensor, norms: torch.Tensor, n_rows: int,
                                        eps: float = 0.01,
                                        eps_relative: float = 0.1) -> dict[str, torch.Tensor]:
    """:func:`contribution_statistics` from the column masses m_j (L, H, N) of ``n_rows`` query rows
    instead of the weights (they use nothing else): for windows whose weights are streamed."""
    m = _check("masses", masses, 3)
    n = _check("norms", norms, 3)
    if n.shape != m.shape:
        raise ValueError(f"norms must have the masses' shape {tuple(m.shape)}, got {tuple(n.shape)}")
    _check_nonnegative("norms", n, "vector norms ||f_h(x_j)||")
    return _statistics(m, n.to(m.device, m.dtype), check_number("n_rows", n_rows, kind=int, low=0), eps,
                       eps_relative)


def _statistics(m: torch.Tensor, n: torch.Tensor, M: int, eps, eps_relative) -> dict[str, torch.Tensor]:
    """The statistics of column masses m (L, H, N) of M rows and norms n (L, H, N), checked."""
    L, H, N = m.shape
    eps, eps_relative = check_eps("eps", eps), check_eps("eps_relative", eps_relative)
    if not (M and N):
        return {k: torch.zeros(L, H, dtype=torch.float64) for k in CONTRIBUTION_STATISTICS}
    c = m * n  # contribution masses
    ct = _relative(c, M)
    rel = N / M
    away_w = m * rel < eps_relative
    away_c = ct * rel < eps_relative
    nan = (m.isnan() | ct.isnan()).any(-1)  # (L, H): a NaN weight or norm makes the head's shares NaN
    mean = lambda b: torch.where(nan, torch.nan, b.to(torch.float64).mean(-1))  # noqa: E731
    return {
        "contribution_explained_away": mean(ct < eps),
        "contribution_explained_away_relative": mean(away_c),
        "contribution_gini": stats.gini(c).double(),
        "away_by_weight_not_contribution": mean(away_w & ~away_c),
    }


def contribution_table(
    weights: Mapping[str, torch.Tensor],
    norms: Mapping[str, torch.Tensor],
    *,
    eps: float = 0.01,
    eps_relative: float = 0.1,
    window: int | None = None,
):
    """Tidy rows (variant, layer, head, statistic, value[, window]) of :func:`contribution_statistics`
    for every variant of ``weights`` ({variant: (L, H, N, N)}), with ``norms`` {variant: (L, H, N)}
    (the same tensor for every variant in recompute mode)."""
    for variant in weights:
        if variant not in norms:
            raise ValueError(f"norms has no entry for variant {variant!r} (has {sorted(norms)})")
    def one(v, w):
        if getattr(w, "streamed_window", False):  # streamed weights: their column masses, no weights
            masses = w.window.column_masses()[v] if w.window is not None else w.sum(-2)
            return contribution_statistics_from_masses(masses, norms[v], w.shape[-2], eps, eps_relative)
        return contribution_statistics(w, norms[v], eps, eps_relative)

    return stats.long_table({v: one(v, w) for v, w in weights.items()}, window)


def explained_away_fraction_by(
    weights: torch.Tensor,
    eps_relative: float = 0.1,
    *,
    norms: torch.Tensor | None = None,
    exclude: torch.Tensor | None = None,
) -> torch.Tensor:
    """The relative explained-away fraction (share of keys with mass * N / M < eps_relative) of weights
    (..., H, M, N) -> (..., H), by weight or, with ``norms`` (..., H, N), by contribution (c~_j), and
    with ``exclude`` (bool (N,), e.g. ``attnlab.sinks.sink_keys``) over the remaining keys with rows
    renormalized (``attnlab.sinks.sink_excluded_column_mass``)."""
    from attnlab import sinks

    eps_relative = check_eps("eps_relative", eps_relative)
    streamed = getattr(weights, "streamed_window", False) and weights.window is not None
    w = weights if streamed else _check("weights", weights, 3)
    M = w.shape[-2]
    if exclude is None:
        # a streamed window's (HeadMaps) column masses are streamed: no map computed
        col = w.window.column_masses()[w.variant] if streamed else w.sum(-2)
        m_rows, keep = col.new_full(col.shape[:-1], float(M)), slice(None)
    else:
        if streamed:  # the streamed sink pass (attnlab/hf/compute/streamed.py): no map computed
            parts = w.sink_parts(exclude.to(torch.bool), None)
            col, kept = parts["excluded"], parts["kept"]
        else:
            col, kept = sinks.sink_excluded_column_mass(w, exclude)
        m_rows, keep = kept.sum(-1).to(col.dtype), ~exclude.to(torch.bool).cpu()
    n_keys = col.shape[-1]
    if not n_keys:
        return col.new_zeros(col.shape[:-1])
    if norms is not None:
        if not streamed:
            _check_pair(w, norms)
        col = col * norms.to(col.device, col.dtype)[..., keep]
        total = col.sum(-1, keepdim=True)
        col = torch.where(total > 0, col * m_rows[..., None] / torch.where(total > 0, total, 1.0), 0.0)
    rel = col * (n_keys / torch.where(m_rows > 0, m_rows, 1.0))[..., None]
    return torch.where(m_rows > 0, (rel < eps_relative).to(col.dtype).mean(-1), 0.0)
