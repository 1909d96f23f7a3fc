"""Attention sinks (Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks"):
how much attention the first position and the special tokens take, and the column-mass statistics
recomputed without them. Pure functions on tensors.

A sink absorbs most of a row's mass, so the rest of the keys look explained away even when the row
spreads evenly over them. With the sink keys S removed, each row is renormalized over the remaining
keys: pi'_ij = pi_ij / (1 - s_i), s_i = sum_{j in S} pi_ij, and the column masses become
m'_j = sum_i pi_ij / (1 - s_i) (j not in S). Rows with s_i = 1 (everything on sinks) have nothing to
spread and are left out (M' = rows kept); the explained-away rule of ``attnlab.stats`` is applied to
m' with M' rows and N' = N - |S| keys.

    sink_keys                 bool (N,) sink keys: "first", "special" or "first+special"
    sink_mass                 mean_i sum_{j in S} pi_ij                       (...,)
    sink_excluded_column_mass m'_j and the rows kept                          (..., N'), (..., M)
    sink_statistics           {statistic: (L, H)} of SINK_STATISTICS
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from attnlab import stats
from attnlab.stats import check_eps, check_weights

__all__ = [
    "SINK_CHOICES",
    "SINK_STATISTICS",
    "sink_keys",
    "sink_mass",
    "sink_excluded_column_mass",
    "sink_statistics",
    "sink_table",
]

SINK_CHOICES = ("first", "special", "first+special")
# A row whose sinks take more than 1 - ROW_FLOOR of its mass counts as "all on sinks".
ROW_FLOOR = 1e-6

SINK_STATISTICS: dict[str, str] = {
    "sink_mass_first": "sum_i pi_i1 / M: attention the first position receives, mean over rows",
    "sink_mass_special": "sum_i sum_{j special} pi_ij / M: attention special tokens receive, mean over rows",
    "sink_mass": "mean over rows of the mass on the sink keys S",
    "column_mass_min_no_sinks": "min_j m'_j over the keys outside S (rows renormalized without S)",
    "explained_away_no_sinks": "share of keys outside S with m'_j < eps",
    "explained_away_relative_no_sinks": "share of keys outside S with m'_j N' / M' < eps_relative",
    "gini_no_sinks": "Gini coefficient of m' over the keys outside S",
}


def sink_keys(n: int, special: torch.Tensor | None = None, which: str = "first+special") -> torch.Tensor:
    """bool (n,): True for sink keys. ``which``: "first" (position 0), "special" (``special``, bool
    (n,)), or "first+special" (both)."""
    if which not in SINK_CHOICES:
        raise ValueError(f"which must be one of {SINK_CHOICES}, got {which!r}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be an integer >= 1 (tokens), got {n!r}")
    keys = torch.zeros(int(n), dtype=torch.bool)
    if which != "special":
        keys[0] = True
    if which != "first":
        if special is None:
            raise ValueError(f"which={which!r} needs special, a bool (N,) tensor of special tokens")
        special = torch.as_tensor(special)
        if special.dtype != torch.bool or special.shape != (n,):
            raise ValueError(
                f"special must be bool of shape ({n},), got {special.dtype} {tuple(special.shape)}"
            )
        keys |= special.cpu()
    return keys


def _check(weights, keys) -> tuple[torch.Tensor, torch.Tensor]:
    w = check_weights("weights", weights, min_dim=2)
    N = w.shape[-1]
    if not isinstance(keys, torch.Tensor) or keys.dtype != torch.bool or keys.shape != (N,):
        got = f"{keys.dtype} {tuple(keys.shape)}" if isinstance(keys, torch.Tensor) else type(keys).__name__
        raise ValueError(f"keys must be a bool tensor of shape ({N},) (one flag per key), got {got}")
    return w, keys.to(w.device)


def sink_mass(weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Mean over the M rows of the mass on ``keys``: weights (..., M, N), keys bool (N,) -> (...,).
    0 for M = 0."""
    w, keys = _check(weights, keys)
    s = (w * keys.to(w.dtype)).sum(-1)  # (..., M)
    return s.mean(-1) if w.shape[-2] else s.sum(-1)


def sink_excluded_column_mass(weights: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(m' (..., N'), rows kept bool (..., M)): column masses of the rows renormalized over the keys
    outside ``keys`` (see the module docstring); N' = number of keys outside ``keys``."""
    w, keys = _check(weights, keys)
    rest = w[..., ~keys]  # (..., M, N')
    r = rest.sum(-1)  # (..., M) = 1 - s_i for rows summing to 1
    total = w.sum(-1)
    kept = r > ROW_FLOOR * torch.where(total > 0, total, 1.0)
    scale = torch.where(kept, 1.0 / torch.where(kept, r, 1.0), torch.zeros_like(r))  # (..., M)
    return torch.einsum("...m,...mn->...n", scale, rest), kept


def sink_statistics(
    weights: torch.Tensor,
    keys: torch.Tensor,
    special: torch.Tensor | None = None,
    eps: float = 0.01,
    eps_relative: float = 0.1,
) -> dict[str, torch.Tensor]:
    """{statistic: (L, H)} of ``SINK_STATISTICS`` for weights (L, H, M, N) and sink ``keys`` (N,);
    ``special`` (N,) for ``sink_mass_special`` (0 without)."""
    w, keys = _check(weights, keys)
    if w.dim() != 4:
        raise ValueError(f"weights must be (L, H, M, N), got shape {tuple(w.shape)}")
    eps, eps_relative = check_eps("eps", eps), check_eps("eps_relative", eps_relative)
    L, H, M, N = w.shape
    first = torch.zeros(N, dtype=torch.bool)
    first[:1] = True
    out = {
        "sink_mass_first": sink_mass(w, first),
        "sink_mass_special": sink_mass(w, special.to(torch.bool))
        if special is not None
        else w.new_zeros(L, H),
        "sink_mass": sink_mass(w, keys),
    }
    col, kept = sink_excluded_column_mass(w, keys)  # (L, H, N'), (L, H, M)
    n_keys = col.shape[-1]
    m_rows = kept.sum(-1).to(col.dtype)  # (L, H)
    if n_keys == 0:
        zero = w.new_zeros(L, H)
        out.update(
            column_mass_min_no_sinks=zero,
            explained_away_no_sinks=zero,
            explained_away_relative_no_sinks=zero,
            gini_no_sinks=zero,
        )
    else:
        rel = col * (n_keys / torch.where(m_rows > 0, m_rows, 1.0))[..., None]
        has_rows = m_rows > 0
        frac = lambda b: torch.where(has_rows, b.to(col.dtype).mean(-1), 0.0)  # noqa: E731
        out.update(
            column_mass_min_no_sinks=col.amin(-1),
            explained_away_no_sinks=frac(col < eps),
            explained_away_relative_no_sinks=frac(rel < eps_relative),
            gini_no_sinks=stats.gini(col),
        )
    return {k: v.to(torch.float64) for k, v in out.items()}


def sink_table(
    weights: Mapping[str, torch.Tensor],
    special: torch.Tensor | None,
    *,
    which: str = "first+special",
    eps: float = 0.01,
    eps_relative: float = 0.1,
    window: int | None = None,
):
    """Tidy rows (variant, layer, head, statistic, value[, window]) of :func:`sink_statistics` for
    every variant of ``weights`` ({variant: (L, H, N, N)})."""
    if not isinstance(weights, Mapping) or not weights:
        raise ValueError("weights must be a non-empty dict {variant name: tensor (L, H, N, N)}")
    return stats.long_table({v: sink_statistics(w, sink_keys(w.shape[-1], special, which), special, eps,
                                                eps_relative) for v, w in weights.items()}, window)
