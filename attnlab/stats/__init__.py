"""Explaining-away statistics of attention weights (docs/DESIGN.md §4). Pure functions on tensors.

Notation: queries i = 1..M ("upper" neurons, rows), keys j = 1..N ("lower" neurons, columns).

    weights   (..., M, N)   pi_ij; typically (L, B, H, M, N) or (L, H, N, N); rows sum to 1
    mask      bool, broadcastable to ``weights``; True = valid (query, key) pair
    valid     bool (N,) per-token vector (True = real token); ``pair_mask(valid)`` turns it into a mask

A *valid row* is a query with at least one valid pair, a *valid key* a column with at least one valid
pair; M_valid and N_valid count them per (...) slice. Masked entries contribute 0 to every sum, means
run over valid rows or keys only, and a slice with no valid row or key gives 0 -- never NaN.

Statistics (formulas in docs/STATISTICS.md):

    column_mass               m_j = sum_i pi_ij                                  (..., N)
    relative_column_mass      m_j * N_valid / M_valid   (mean 1 over valid keys)   (..., N)
    explained_away_fraction   share of valid keys with m_j < eps                 (...,)
    dnas_bound / hnas_bound   1/N_valid and u/N_valid: DNAS / HNAS column-mass floors
    row_entropy               -sum_j pi_ij ln pi_ij, mean over valid rows (nats)  (...,)
    mean_attention_distance   sum_j pi_ij |i - j|, mean over valid rows          (...,)
    special_token_mass        sum_{j special} pi_ij, mean over valid rows        (...,)
    gini                      Gini coefficient of column mass over valid keys    (...,)
    doubly_stochastic_deviation  |m_j - M_valid/N_valid| (max, mean), |row sum - 1| (max)
    attention_rollout         prod over layers of rownorm(0.5 A + 0.5 I), heads averaged
    js_distance               Jensen-Shannon distance (base 2, in [0, 1]) of rows, mean over rows
    head_js_matrix / variant_js_matrix   pairwise JS distances (H x H, V x V)
    word_aggregate            token -> word weights: columns summed, rows averaged
    tidy_table                one row per (variant, layer, head, statistic) as a DataFrame
    RowSums                   the per-row / per-column sums every table statistic follows from
                              (immutable; ``attnlab.hf`` computes them with the weights)
    table_from_row_sums / statistics_from_row_sums   the table from RowSums, without the weights
    nan_note / with_nan_note  "NaN from layer l on: ..." for a table holding NaN (its attrs["notes"])

Computation runs in float32, or float64 when given float64 (half precision is upcast). NaN in the
weights propagates to every statistic it enters; arguments are checked with ValueErrors naming them.

Files (one concern each): ``_checks`` (argument checks, masks, masked means), ``maps`` (per-map
statistics), ``divergence`` (Jensen-Shannon), ``words`` (token decoding, word aggregation),
``engine`` (the blocked row-sums engine, ``RowSums``), ``table`` (pandas tables, aggregation),
``nan_notes`` (where NaN first appears).
"""

from __future__ import annotations

from attnlab.stats._checks import LN2, check_eps, check_weights, distance_matrix, pair_mask
from attnlab.stats.divergence import head_js_matrix, js_distance, variant_js_matrix
from attnlab.stats.divergence import js2_rowsum as _js2_rowsum
from attnlab.stats.engine import (
    BOUND_RTOL,
    CHUNK_BYTES,
    DEVICE_CHUNK_BYTES,
    STATISTICS,
    RowSums,
    statistics_from_row_sums,
)
from attnlab.stats.engine import row_sums_dict as _row_sums
from attnlab.stats.maps import (
    DoublyStochasticDeviation,
    attention_rollout,
    column_mass,
    dnas_bound,
    doubly_stochastic_deviation,
    explained_away_fraction,
    gini,
    hnas_bound,
    mean_attention_distance,
    relative_column_mass,
    row_entropy,
    special_token_mass,
)
from attnlab.stats.nan_notes import nan_note, weights_nan_note, with_nan_note
from attnlab.stats.table import (
    _statistics_from_row_sums,
    _tidy_from_row_sums,
    aggregate_windows,
    long_table,
    table_from_row_sums,
    tidy_table,
)
from attnlab.stats.words import merge_tokens, word_aggregate, word_units

_distance_matrix = distance_matrix  # the old private name

__all__ = [
    "long_table",
    "check_eps",
    "check_weights",
    "distance_matrix",
    "STATISTICS",
    "DoublyStochasticDeviation",
    "RowSums",
    "aggregate_windows",
    "attention_rollout",
    "column_mass",
    "dnas_bound",
    "doubly_stochastic_deviation",
    "explained_away_fraction",
    "gini",
    "head_js_matrix",
    "hnas_bound",
    "js_distance",
    "mean_attention_distance",
    "merge_tokens",
    "nan_note",
    "pair_mask",
    "relative_column_mass",
    "row_entropy",
    "sink_importance",
    "sink_rate",
    "special_token_mass",
    "statistics_from_row_sums",
    "table_from_row_sums",
    "tidy_table",
    "variant_js_matrix",
    "weights_nan_note",
    "with_nan_note",
    "word_aggregate",
    "word_units",
]
# Private names that attnlab.hf (and its tests) call today (_row_sums, _js2_rowsum, _distance_matrix,
# _tidy_from_row_sums, _statistics_from_row_sums): thin aliases until hf uses RowSums.
_PRIVATE = (_distance_matrix, _js2_rowsum, _row_sums, _statistics_from_row_sums, _tidy_from_row_sums,
            BOUND_RTOL, CHUNK_BYTES, DEVICE_CHUNK_BYTES, LN2)


# Gu et al. 2024's sink statistics live in attnlab.sinks (beside the other sink measures) and are also
# statistics of the weights: attnlab.stats.sink_importance / sink_rate name the same functions, looked up
# on first use (attnlab.sinks imports attnlab.stats)
_FROM_SINKS = ("sink_importance", "sink_rate")


def __getattr__(name: str):
    if name in _FROM_SINKS:
        from attnlab import sinks

        return getattr(sinks, name)
    raise AttributeError(f"module 'attnlab.stats' has no attribute {name!r}")
