"""Tidy tables (pandas): every per-head statistic of every variant, one row per (variant, layer, head,
statistic), and their aggregation over windows. pandas is imported only here, when a table is built."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

from attnlab.stats._checks import check_bool, check_eps, check_weights, distance_matrix
from attnlab.stats.engine import (
    BASE_ORDER,
    RowSums,
    empty_statistics,
    row_sums_dict,
    statistics_from_row_sums,
    summarize,
    u_table,
)

if TYPE_CHECKING:
    import pandas as pd


def _check_window(window):
    if window is not None and (isinstance(window, bool) or not isinstance(window, (int, np.integer, str))):
        raise ValueError(f"window must be None, an int or a str, got {window!r}")
    return window


def _check_table_args(weights, valid, special, u, punctuation=None):
    if not isinstance(weights, Mapping) or not weights:
        raise ValueError("weights must be a non-empty dict {variant name: tensor (L, H, M, N)}")
    ws = {name: check_weights(f"weights[{name!r}]", w, min_dim=4).detach() for name, w in weights.items()}
    shapes = {name: tuple(w.shape) for name, w in ws.items()}
    if any(len(s) != 4 for s in shapes.values()) or len(set(shapes.values())) != 1:
        raise ValueError(f"every variant's weights must be one shape (L, H, M, N), got {shapes}")
    L, H, M, N = next(iter(shapes.values()))
    if valid is not None:
        if M != N:
            raise ValueError(f"valid (per-token, (N,)) needs square weights, got (M, N) = ({M}, {N})")
        check_bool("valid", valid, torch.Size((N,)), "tokens (N,)")
        if valid.shape != (N,):
            raise ValueError(f"valid must have shape ({N},), got {tuple(valid.shape)}")
    for name, keys in (("special", special), ("punctuation", punctuation)):
        if keys is not None:
            check_bool(name, keys, torch.Size((N,)), "keys (N,)")
            if keys.shape != (N,):
                raise ValueError(f"{name} must have shape ({N},), got {tuple(keys.shape)}")
    return ws, (L, H, M, N), u_table(u, L, H)


@torch.no_grad()
def tidy_table(
    weights: Mapping[str, torch.Tensor],
    *,
    valid: torch.Tensor | None = None,
    special: torch.Tensor | None = None,
    u: float | torch.Tensor = 0.5,
    eps: float = 0.01,
    eps_relative: float = 0.1,
    reference: str | None = "unas",
    window: int | str | None = None,
    punctuation: torch.Tensor | None = None,
) -> pd.DataFrame:
    """Every per-head statistic of every variant as one tidy DataFrame.

    Args:
        weights: {variant: (L, H, M, N)} weights of one example (one window), all the same shape.
        valid: bool (N,) real tokens (square weights only); invalid tokens are dropped as queries and
            keys before anything is computed, distances keep the original positions.
        special: bool (N,) keys whose received mass is reported as ``special_mass`` (the special
            tokens: [CLS], [SEP], <s>, ...).
        punctuation: bool (N,) keys whose received mass is reported as ``punctuation_mass``.
        u: HNAS hybrid weight for ``below_hnas_bound``, number or tensor broadcastable to (L, H).
        eps: absolute threshold of ``explained_away``; eps_relative: of ``explained_away_relative``.
        reference: variant that ``js_to_<reference>`` compares every variant with (skipped if absent).
        window: when given, a ``window`` column with this value (see ``aggregate_windows``).

    Returns:
        DataFrame with columns ``variant, layer, head, statistic, value`` (+ ``window``), one row per
        (variant, layer, head, statistic) in that order; ``STATISTICS`` describes each statistic.
        Layers and heads count from 0. Values are float64, never NaN for finite weights (a NaN weight
        makes the statistics it enters NaN).
    """
    ws, (L, H, M, N), u = _check_table_args(weights, valid, special, u, punctuation)
    eps, eps_relative = check_eps("eps", eps), check_eps("eps_relative", eps_relative)
    window = _check_window(window)
    names = list(ws)
    positions = None
    if valid is not None and not bool(valid.all()):
        keep = valid.nonzero().squeeze(-1)  # drop padding once: every later pass is dense
        ws = {k: w.index_select(-2, keep).index_select(-1, keep) for k, w in ws.items()}
        special = None if special is None else special[keep]
        punctuation = None if punctuation is None else punctuation[keep]
        positions = keep
        M = N = int(keep.numel())
    if reference not in ws:
        reference = None
    if not (L and H and M and N):
        empty = empty_statistics(names, reference, special is not None, L, H, punctuation is not None)
        return _to_frame(empty, names, L, H, window)
    keys = [m for m in (special, punctuation) if m is not None]
    spec = torch.stack(keys, -1) if keys else None  # (N, S): special, then punctuation
    special_index = 0 if special is not None else None
    punctuation_index = None if punctuation is None else len(keys) - 1
    dist = None
    per_variant = {}
    for name in names:
        w = ws[name]
        dist = distance_matrix(M, N, w, positions) if dist is None or dist.dtype != w.dtype else dist
        js_ref = None if reference is None or name == reference else ws[reference].to(w.dtype)
        raw = RowSums((L, H, M, N), **row_sums_dict(w.reshape(L * H, M, N), spec, dist, js_ref))
        per_variant[name] = summarize(raw, u, eps, eps_relative, reference, special_index, punctuation_index)
    return _to_frame(per_variant, names, L, H, window)


def table_from_row_sums(
    sums: Mapping[str, RowSums], *, special_index: int | None = None, u=0.5, eps=0.01, eps_relative=0.1,
    reference: str | None = "unas", window: int | str | None = None, punctuation_index: int | None = None,
) -> pd.DataFrame:
    """``tidy_table`` from row sums already computed ({variant: RowSums}, e.g. by ``attnlab.hf`` while it
    builds the weights): the same rows, columns and values as ``tidy_table`` on those weights.
    ``special_index`` picks ``special_mass``'s key mask among the row sums' S masks (None: none),
    ``punctuation_index`` that of ``punctuation_mass``."""
    window = _check_window(window)
    stats = statistics_from_row_sums(sums, special_index=special_index, u=u, eps=eps,
                                     eps_relative=eps_relative, reference=reference,
                                     punctuation_index=punctuation_index)
    L, H = next(iter(sums.values())).shape[:2]
    return _to_frame(stats, list(sums), L, H, window)


def _to_frame(stats: dict, names: list[str], L: int, H: int, window) -> pd.DataFrame:
    import pandas as pd

    keys = [k for k in BASE_ORDER if k in stats[names[0]]]
    keys += [k for k in stats[names[0]] if k not in keys]
    S, V = len(keys), len(names)
    values = torch.stack([stats[n][k].to("cpu") for n in names for k in keys]).to(torch.float64)
    values = values.reshape(V, S, L, H).permute(0, 2, 3, 1).numpy()  # (V, L, H, S)
    frame = pd.DataFrame({
        "variant": np.repeat(np.asarray(names, dtype=object), L * H * S),
        "layer": np.tile(np.repeat(np.arange(L), H * S), V),
        "head": np.tile(np.repeat(np.arange(H), S), V * L),
        "statistic": np.tile(np.asarray(keys, dtype=object), V * L * H),
        "value": values.reshape(-1),
    })
    if window is not None:
        frame["window"] = window
    return frame


def long_table(statistics: Mapping[str, Mapping[str, torch.Tensor]], window=None) -> pd.DataFrame:
    """Tidy rows (variant, layer, head, statistic, value[, window]) from {variant: {statistic: (L, H)}}
    (every variant with the same statistics and L, H): the layout of :func:`tidy_table`, for the
    statistics other modules compute (attnlab.contributions, attnlab.sinks)."""
    names = list(statistics)
    if not names:
        raise ValueError("statistics must be a non-empty dict {variant: {statistic: (L, H) tensor}}")
    L, H = next(iter(statistics[names[0]].values())).shape[:2]
    return _to_frame(statistics, names, L, H, window)


_KEYS = ["variant", "layer", "head", "statistic"]


def aggregate_windows(
    tables: Iterable[pd.DataFrame], weights: Iterable[float] | None = None
) -> pd.DataFrame:
    """Combine per-window ``tidy_table`` results: mean over windows per (variant, layer, head, statistic).

    ``tables`` may be a generator (windows streamed: only running sums are held). ``weights`` gives
    one finite weight >= 0 per window (e.g. its number of tokens) for a weighted mean; default: every
    window counts equally. Returns columns ``variant, layer, head, statistic, value, std, n_windows``:
    value is the (weighted) mean, std the (weighted) population standard deviation over windows (0
    for one window), n_windows how many windows had that statistic.
    """
    import pandas as pd

    weight_iter = iter(weights) if weights is not None else None
    acc = None  # per key: total weight w, weighted mean, M2 = sum of w (v - mean)^2, window count n
    for i, table in enumerate(tables):
        if not isinstance(table, pd.DataFrame):
            raise ValueError(f"tables must hold DataFrames (tidy_table results), got {type(table).__name__} "
                             f"at position {i}")
        wt = 1.0
        if weight_iter is not None:
            try:
                wt = next(weight_iter)
            except StopIteration:
                raise ValueError(f"weights must give one weight per table, got {i} for more tables") from None
            if isinstance(wt, (bool, np.bool_)) or not isinstance(wt, (int, float, np.integer, np.floating)) \
                    or not math.isfinite(wt) or wt < 0:
                raise ValueError(f"weights must be finite numbers >= 0, got {wt!r} at position {i}")
            wt = float(wt)
        missing = [c for c in (*_KEYS, "value") if c not in table.columns]
        if missing:
            raise ValueError(f"every table needs the columns {[*_KEYS, 'value']}; missing {missing}")
        v = table.set_index(_KEYS)["value"].astype(np.float64)
        groups = v.groupby(level=_KEYS, sort=False)  # a table may hold several windows
        mean = groups.mean()
        part = pd.DataFrame({
            "w": wt * groups.size().astype(np.float64),
            "mean": mean,
            "m2": wt * ((v - groups.transform("mean")) ** 2).groupby(level=_KEYS, sort=False).sum(),
            "n": groups.size().astype(np.float64),
        })
        acc = part if acc is None else _combine_moments(acc, part)
    if acc is None:
        raise ValueError("tables is empty: nothing to aggregate")
    var = (acc["m2"] / acc["w"].where(acc["w"] > 0, 1.0)).clip(lower=0.0)
    out = pd.DataFrame({"value": acc["mean"], "std": np.sqrt(var), "n_windows": acc["n"].astype(np.int64)})
    return out.reset_index()


def _combine_moments(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """Merge two sets of (weight, mean, M2, count) per key (Chan et al.'s parallel update, weighted):
    numerically stable, so one window gives std exactly 0."""
    import pandas as pd

    a, b = a.align(b, join="outer")
    a, b = a.fillna(0.0), b.fillna(0.0)  # a key missing on one side has weight 0 there
    w = a["w"] + b["w"]
    safe = w.where(w > 0, 1.0)
    delta = b["mean"] - a["mean"]
    return pd.DataFrame({
        "w": w,
        "mean": a["mean"] + delta * b["w"] / safe,
        "m2": a["m2"] + b["m2"] + delta * delta * a["w"] * b["w"] / safe,
        "n": a["n"] + b["n"],
    })


# ----------------------------------------------------------------------------------------------
# The private names attnlab.hf calls today (thin aliases until hf uses RowSums)
# ----------------------------------------------------------------------------------------------


def _coerce_sums(raw: Mapping, shape) -> dict[str, RowSums]:
    if not isinstance(raw, Mapping):
        raise ValueError(f"raw must be a dict {{variant: row sums}}, got {type(raw).__name__}")
    return {name: RowSums.from_dict(r, shape) for name, r in raw.items()}


def _tidy_from_row_sums(raw: Mapping, shape, *, special_index, u, eps, eps_relative, reference, window=None):
    """Deprecated alias of :func:`table_from_row_sums` taking dicts of RowSums' fields and (L, H, M, N)."""
    return table_from_row_sums(_coerce_sums(raw, shape), special_index=special_index, u=u, eps=eps,
                               eps_relative=eps_relative, reference=reference, window=window)


def _statistics_from_row_sums(raw: Mapping, shape, *, special_index, u, eps, eps_relative, reference):
    """Deprecated alias of :func:`statistics_from_row_sums` taking dicts and (L, H, M, N)."""
    return statistics_from_row_sums(_coerce_sums(raw, shape), special_index=special_index, u=u, eps=eps,
                                    eps_relative=eps_relative, reference=reference)
