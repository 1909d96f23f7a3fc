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
    sink_importance           sum_i pi_ij / (queries that may attend j)                  (..., N)
    sink_rate                 share of heads whose importance of one key exceeds eps      (L,)
    massive_activations       per layer: largest |hidden state|, where, ratio to median  dict of (L,)

The causal-corrected importance and the sink rate follow Gu et al. 2024 ("When Attention Sink Emerges
in Language Models", sail-sg): in a causal layer key j can be attended by N - j queries only, so its
raw column mass is divided by that count. Massive activations follow Sun et al. 2024 ("Massive
Activations in Large Language Models"): the largest magnitudes of the residual stream, with their
token and dimension, and their ratio to the median magnitude.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from attnlab import stats
from attnlab.stats import check_eps, check_weights
from attnlab.stats._checks import check_number

__all__ = [
    "SINK_CHOICES",
    "SINK_STATISTICS",
    "sink_keys",
    "sink_mass",
    "sink_excluded_column_mass",
    "sink_statistics",
    "sink_table",
    "sink_importance",
    "importance_from_masses",
    "sink_rate",
    "check_rate",
    "queries_per_key",
    "massive_activations",
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
    "sink_importance_first": "sum_i pi_i1 / (queries that may attend position 1): causal-corrected "
                             "importance",
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
    counts: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """{statistic: (L, H)} of ``SINK_STATISTICS`` for weights (L, H, M, N) and sink ``keys`` (N,);
    ``special`` (N,) for ``sink_mass_special`` (0 without); ``counts`` (N,) the queries that may attend
    each key (default: every row, M)."""
    w, keys = _check(weights, keys)
    if w.dim() != 4:
        raise ValueError(f"weights must be (L, H, M, N), got shape {tuple(w.shape)}")
    L, H, M, N = w.shape
    first = torch.zeros(N, dtype=torch.bool)
    first[:1] = True
    col, kept = sink_excluded_column_mass(w, keys)  # (L, H, N'), (L, H, M)
    return statistics_from_parts(
        first=sink_mass(w, first),
        special=sink_mass(w, special.to(torch.bool)) if special is not None else w.new_zeros(L, H),
        sink=sink_mass(w, keys), excluded=col, kept=kept,
        importance_first=w[..., 0].sum(-1) / _count0(counts, M), eps=eps, eps_relative=eps_relative)


def _count0(counts, m: int) -> float:
    c = float(m) if counts is None else float(counts[0])
    return max(c, 1.0)


def statistics_from_parts(first, special, sink, excluded, kept, importance_first, eps: float = 0.01,
                          eps_relative: float = 0.1) -> dict[str, torch.Tensor]:
    """``SINK_STATISTICS`` (each (L, H)) from their parts: the mean row masses on position 0, on the
    special tokens and on the sink keys (L, H), the column masses m' without the sinks (L, H, N') and
    the rows kept (L, H, M), and the first key's importance (L, H); shared by the dense path and the
    streamed analysis (attnlab/hf/compute/streamed.py)."""
    eps, eps_relative = check_eps("eps", eps), check_eps("eps_relative", eps_relative)
    out = {"sink_mass_first": first, "sink_mass_special": special, "sink_mass": sink}
    col = excluded
    L, H, n_keys = col.shape
    m_rows = kept.sum(-1).to(col.dtype)  # (L, H)
    if n_keys == 0:
        zero = col.new_zeros(L, H)
        out.update(column_mass_min_no_sinks=zero, explained_away_no_sinks=zero,
                   explained_away_relative_no_sinks=zero, gini_no_sinks=zero)
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
    out["sink_importance_first"] = importance_first
    return {k: v.to(torch.float64) for k, v in out.items()}


def queries_per_key(n_queries: int, n_keys: int, causal: bool = True, mask: torch.Tensor | None = None,
                    sliding_window: int | None = None) -> torch.Tensor:
    """(N,) how many queries may attend each key: from ``mask`` (bool broadcastable to (M, N), True =
    may attend) when given, else M (bidirectional) or, causal with queries at the end of the keys,
    the queries at or after j (within ``sliding_window`` when given)."""
    if mask is not None:
        m = torch.as_tensor(mask).to(torch.bool)
        full = torch.broadcast_to(m, (*m.shape[:-2], n_queries, n_keys))
        return full.sum(-2).reshape(-1, n_keys)[0].float()
    j = torch.arange(n_keys, dtype=torch.float32)
    if not causal:
        return torch.full((n_keys,), float(n_queries))
    first_query_key = n_keys - n_queries  # query i sits at key position i + first_query_key
    count = (n_queries - (j - first_query_key).clamp(min=0)).clamp(min=0)
    if sliding_window:
        count = count.clamp(max=float(sliding_window))
    return count


def sink_importance(weights: torch.Tensor, causal: bool = True,
                    mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal-corrected importance of each key (Gu et al. 2024): sum_i pi_ij / (queries that may attend
    j). weights (..., M, N) -> (..., N); 0 for a key no query may attend. ``mask`` bool broadcastable to
    (M, N) (True = may attend) gives the counts; else causal (queries at the end of the keys) or all M."""
    w = check_weights("weights", weights, min_dim=2)
    M, N = w.shape[-2:]
    return importance_from_masses(w.sum(-2), queries_per_key(M, N, causal, mask))


def importance_from_masses(masses: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """I_j = m_j / n_j from column masses (..., N) and the queries that may attend each key, counts
    broadcastable to (..., N); 0 for a key no query may attend (Gu et al. 2024)."""
    counts = counts.to(masses.device, masses.dtype)
    return torch.where(counts > 0, masses / counts.clamp(min=1), torch.zeros_like(masses))


def sink_rate(weights, eps: float = 0.3, causal: bool = True, position: int = 0,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per layer, the share of heads whose :func:`sink_importance` of key ``position`` exceeds ``eps``
    (Gu et al. 2024 use eps = 0.3 and the first token): weights (L, H, M, N) -> (L,) float64. NaN
    importances count as not exceeding eps."""
    w = check_weights("weights", weights, min_dim=2)
    if w.dim() != 4:
        raise ValueError(f"weights must be (L, H, M, N), got shape {tuple(w.shape)}")
    eps, position = check_rate(eps, position, w.shape[-1])
    return rate_from_importance(sink_importance(w, causal, mask)[..., position], eps)


def check_rate(eps, position, n_keys: int) -> tuple[float, int]:
    """The sink rate's ``eps`` (a number in [0, 1]) and ``position`` (an integer in [-N, N - 1]),
    Python or numpy numbers or 0-d tensors, as (float, int); else a ValueError naming the argument."""
    eps = check_number("eps", eps, low=0.0, high=1.0)
    position = check_number("position", position, low=-n_keys, high=n_keys - 1, integer=True)
    return eps, position


def rate_from_importance(importance: torch.Tensor, eps: float) -> torch.Tensor:
    """(L, H) importances of one key -> (L,) share of heads above ``eps``."""
    return (importance > eps).to(torch.float64).mean(-1)


def massive_activations(hidden: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sun et al. 2024 per layer: hidden (L, N, d) residual-stream states (one text) -> {"max_abs" (L,),
    "token" (L,) int64 and "dim" (L,) int64 where it occurs, "median_abs" (L,), "ratio" (L,) =
    max_abs / median_abs} (float64). NaN states give NaN (torch's max and median propagate NaN)."""
    h = hidden
    if not isinstance(h, torch.Tensor) or h.dim() != 3 or not h.is_floating_point():
        raise ValueError(f"hidden must be a floating tensor (L, N, d), got "
                         f"{tuple(h.shape) if isinstance(h, torch.Tensor) else type(h).__name__}")
    L, N, d = h.shape
    if N == 0 or d == 0:
        raise ValueError(f"hidden must hold at least one token and one dimension, got shape {tuple(h.shape)}")
    a = h.detach().abs().to(torch.float64).reshape(L, N * d)
    top, where = a.max(-1)
    median = a.median(-1).values
    return {"max_abs": top, "token": where // d, "dim": where % d, "median_abs": median,
            "ratio": top / median}


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
    per = {}
    for v, w in weights.items():
        keys = sink_keys(w.shape[-1], special, which)
        if hasattr(w, "sink_parts"):  # a streamed window's weights (attnlab/hf/compute/head_maps.py)
            per[v] = statistics_from_parts(**w.sink_parts(keys, special), eps=eps, eps_relative=eps_relative)
        else:
            per[v] = sink_statistics(w, keys, special, eps, eps_relative)
    return stats.long_table(per, window)
