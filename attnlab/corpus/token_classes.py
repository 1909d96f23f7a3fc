"""Attention each key receives, broken down by the key's class, and column-mass quantiles.

For one window's weights w (L, H, N, N) of a variant (rows = queries i, columns = keys j), the
attention a class C of keys receives is the mean over the M valid queries of the mass they put on C:

    received(C) = (1 / M) * sum_i sum_{j in C} w_ij = (1 / M) * sum_{j in C} m_j      (L, H)

with m_j = sum_i w_ij the column mass (attnlab.stats.column_mass). It is the quantity of Clark et al.
2019 ("What does BERT look at?", Fig. 2: average attention to [CLS], [SEP], punctuation). Classes:

    special              every special token of the window ([CLS], [SEP], <s>, ...)
    special:<token>      each special token by name (special:[CLS], special:[SEP])
    punctuation          keys made only of punctuation or symbols (Window.punctuation)
    first_position       key position 0 of the window (attention sinks; [CLS] for BERT)
    position_d<k>        keys at relative position j / N in [k/10, (k+1)/10), k = 0..9
    frequency_q<b>       text tokens whose corpus frequency falls in bin b = 1 (most frequent) .. B;
                         bins split the corpus's token occurrences into B equal shares (counting pass)

plus ``relative_column_mass_q10/q50/q90``: quantiles over keys of m_j * N / M (mean 1).
"""

from __future__ import annotations

import numpy as np
import torch

from attnlab.normalizers.checks import scalar

__all__ = ["frequency_bins", "key_classes", "class_statistics", "class_statistics_from_masses", "QUANTILES",
           "N_DECILES"]

N_DECILES = 10
QUANTILES = (0.1, 0.5, 0.9)  # of relative column mass over keys


def frequency_bins(counts: np.ndarray, n_bins: int = 5) -> np.ndarray:
    """(V,) int64 bin 0..n_bins-1 of each token id (0 = most frequent), -1 for ids never seen.

    Ids are ranked by count (ties by id, so the bins are deterministic); an id belongs to the bin of
    the share of all occurrences that precede it: bin b holds the ids from b/B to (b+1)/B of the corpus.
    """
    counts = np.asarray(counts, dtype=np.int64)
    if counts.ndim != 1:
        raise ValueError(f"counts must be 1-D (one count per token id), got shape {counts.shape}")
    n_bins = scalar(n_bins)  # numpy and 0-d tensor integers as Python ints
    if isinstance(n_bins, bool) or not isinstance(n_bins, int) or n_bins < 1:
        raise ValueError(f"n_bins must be an integer >= 1, got {n_bins!r}")
    bins = np.full(counts.shape, -1, dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        return bins
    order = np.lexsort((np.arange(len(counts)), -counts))  # count descending, then id
    before = np.cumsum(counts[order]) - counts[order]  # occurrences of more frequent ids
    bins[order] = np.minimum(n_bins - 1, (before * n_bins) // total)
    bins[counts == 0] = -1
    return bins


def key_classes(tokens: list[str], input_ids: list[int], special: np.ndarray, punctuation: np.ndarray,
                bins: np.ndarray | None, n_bins: int) -> tuple[list[str], torch.Tensor]:
    """Names and (N, C) float32 membership of the key classes of one window (module docstring)."""
    N = len(tokens)
    special = np.asarray(special, dtype=bool)
    columns: dict[str, np.ndarray] = {"special": special, "punctuation": np.asarray(punctuation, bool)}
    for name in dict.fromkeys(t for t, s in zip(tokens, special, strict=True) if s):
        columns[f"special:{name}"] = special & (np.asarray(tokens, dtype=object) == name)
    first = np.zeros(N, dtype=bool)
    first[0] = True
    columns["first_position"] = first
    decile = np.minimum(N_DECILES - 1, (np.arange(N) * N_DECILES) // N)  # relative position j / N
    for k in range(N_DECILES):
        columns[f"position_d{k}"] = decile == k
    if bins is not None:
        ids = np.asarray(input_ids, dtype=np.int64)
        known = (ids >= 0) & (ids < len(bins))
        b = np.where(known, bins[np.clip(ids, 0, len(bins) - 1)], -1)
        b[special] = -1  # special tokens are not corpus text
        for k in range(n_bins):
            columns[f"frequency_q{k + 1}"] = b == k
    names = list(columns)
    return names, torch.from_numpy(np.stack([columns[n] for n in names], -1).astype(np.float32))


@torch.no_grad()
def class_statistics(weights: dict[str, torch.Tensor], names: list[str], classes: torch.Tensor):
    """{variant: (names + quantile names, (L, H, C + Q) float64)} from weights (L, H, N, N).

    received(C) = (column mass @ membership) / M; quantiles of m_j * N / M over the N keys. The column
    masses are summed in the weights' dtype (float32, as ``attnlab.stats.RowSums.cols``: one pass
    over the weights, no float64 copy of them), then every variant's classes and quantiles are
    computed at once in float64 from the stacked (V, L, H, N) masses.
    """
    M = next(iter(weights.values())).shape[-2]
    return class_statistics_from_masses({v: w.sum(-2) for v, w in weights.items()}, M, names, classes)


def class_statistics_from_masses(masses: dict[str, torch.Tensor], n_rows: int, names: list[str],
                                 classes: torch.Tensor):
    """:func:`class_statistics` from column masses {variant: (L, H, N)} of ``n_rows`` query rows
    (e.g. ``WindowResult.column_masses()``, which needs no weights)."""
    stat_names = [f"received:{n}" for n in names] + [f"relative_column_mass_q{round(x * 100):02d}"
                                                     for x in QUANTILES]
    variants = list(masses)
    M, N = n_rows, next(iter(masses.values())).shape[-1]
    cols = torch.stack([masses[v] for v in variants]).to(torch.float64)  # (V, L, H, N) m_j
    received = cols @ classes.to(torch.float64) / M  # (V, L, H, C)
    q = torch.tensor(QUANTILES, dtype=torch.float64)
    quant = torch.quantile(cols * (N / M), q, dim=-1).permute(1, 2, 3, 0)  # (V, L, H, Q)
    values = torch.cat([received, quant], -1)  # (V, L, H, C + Q)
    return {v: (stat_names, values[i]) for i, v in enumerate(variants)}
