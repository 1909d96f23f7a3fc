"""Figures of attention sinks as the literature measures them, shared by ``attnlab analyze --sinks``
and the app's Explaining away page. Each builder takes plain arrays or a table and returns a
:class:`attnlab.figures.bundle.FigureBundle` (figure + long table + arrays for export).

    importance_by_layer(importance (L, H, N), tokens, variant)   causal-corrected importance of the
        first keys, layer x key, mean over heads (or one head)     -- Gu et al. 2024
    sink_rate_by_layer({variant: (L,)}, eps)                      share of heads with I_0 > eps per
        layer, one line per variant                                -- Gu et al. 2024
    first_token_mass_heatmap(mass (L, H), variant)                mean row mass on position 0, layer
        x head                                                     -- Xiao et al. 2023
    massive_activations_by_layer(table)                           largest |h| per layer, its token and
        dimension, the median and their ratio                      -- Sun et al. 2024
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from attnlab.figures._data import as_array, check_tokens, variant_color
from attnlab.figures.bundle import FigureBundle

__all__ = ["FIRST_KEYS", "MASSIVE_ACTIVATIONS_COLUMNS", "importance_by_layer", "sink_rate_by_layer",
           "first_token_mass_heatmap", "massive_activations_by_layer"]

FIRST_KEYS = 16  # keys drawn by importance_by_layer (sinks sit at the start of the text)
# The columns of massive activations' table (attnlab.hf.beyond.activations.COLUMNS): name -> (header
# for people, number format), for the app's table (appkit.show.table_columns)
MASSIVE_ACTIVATIONS_COLUMNS = {
    "layer": ("layer", "%d"),
    "max_abs": ("largest |hidden state|", "%.1f"),
    "token_index": ("at token", "%d"),
    "token": ("token", None),
    "dim": ("dimension", "%d"),
    "median_abs": ("median |hidden state|", "%.3f"),
    "ratio": ("largest / median", "%.0f×"),
}
# Lines of several variants that coincide (DNAS's and Sinkhorn's sink rates: both normalize columns)
# stay apart: each later line is narrower, dashed otherwise and marked by another symbol, so it is
# drawn inside the earlier one instead of over it
LINE_STYLES = (("solid", "circle", 5, 12), ("dash", "diamond", 3.5, 9), ("dot", "square", 2.5, 7),
               ("dashdot", "x", 1.8, 6), ("longdash", "triangle-up", 1.3, 5))  # dash, symbol, width, size


def decade_ticks(values, *, room: float = 0.0) -> dict:
    """A log axis labelled at whole decades only ("0.1", "1", "10", ..., no minor "2" and "5" between),
    its range the positive ``values``' decades with ``room`` decades more on top (bar texts)."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v) & (v > 0)]
    lo, hi = (math.log10(v.min()), math.log10(v.max())) if v.size else (0.0, 1.0)
    decades = np.arange(math.floor(lo), math.ceil(hi + room) + 1)
    return {"range": [math.floor(lo) - 0.05, hi + room], "tickvals": (10.0 ** decades).tolist(),
            "ticktext": [f"{10.0 ** k:,g}" if -4 <= k <= 6 else f"1e{k:d}" for k in decades]}


def importance_by_layer(importance, tokens: Sequence[str], variant: str, *, keys: int = FIRST_KEYS,
                        head: int | None = None) -> FigureBundle:
    """Layer x key heatmap of the causal-corrected importance I_j = sum_i pi_ij / n_j of the first
    ``keys`` keys (Gu et al. 2024): importance (L, H, N); the mean over heads, or ``head``'s."""
    imp = as_array(importance, "importance", 3)  # (L, H, N)
    L, H, N = imp.shape
    labels = check_tokens(tokens, N)
    if isinstance(keys, bool) or not isinstance(keys, (int, np.integer)) or keys < 1:
        raise ValueError(f"keys must be an integer >= 1, got {keys!r}")
    if head is not None and (isinstance(head, bool) or not isinstance(head, (int, np.integer))
                             or not 0 <= head < H):
        raise ValueError(f"head must be None (mean over heads) or an integer in [0, {H - 1}], got {head!r}")
    k = min(int(keys), N)
    z = (imp[:, :, :k].mean(1) if head is None else imp[:, head, :k]).astype(np.float64)  # (L, k)
    top = imp[:, :, :k].max(1)  # (L, k) the most sink-like head
    x = [f"{j}: {labels[j]}" for j in range(k)]
    which = "mean over heads" if head is None else f"head {head}"
    fig = go.Figure(go.Heatmap(
        z=z, x=x, y=list(range(L)), colorscale="Viridis", zmin=0.0,
        zmax=max(1e-12, float(np.nanmax(z))) if np.isfinite(z).any() else 1.0,
        customdata=top, colorbar={"title": {"text": "importance"}},
        hovertemplate="layer %{y}<br>key %{x}<br>importance %{z:.4f}<br>largest over heads "
                      "%{customdata:.4f}<extra></extra>"))
    fig.update_layout(title=f"{variant}: causal-corrected importance of the first {k} keys ({which})",
                      xaxis_title="key (position: token)", yaxis_title="layer", template="plotly_white",
                      height=max(300, 26 * L + 160), width=max(520, 34 * k + 220))
    fig.update_xaxes(type="category", tickangle=-60)
    fig.update_yaxes(autorange="reversed", dtick=1)
    table = pd.DataFrame({"variant": variant, "layer": np.repeat(np.arange(L), k),
                          "key": np.tile(np.arange(k), L),
                          "token": np.tile(np.asarray(labels[:k], object), L),
                          "importance": z.reshape(-1), "max_over_heads": top.reshape(-1).astype(np.float64)})
    return FigureBundle(fig, table, {"importance": z, "max_over_heads": top})


def sink_rate_by_layer(rates: Mapping[str, object], eps: float, *, position: int = 0) -> FigureBundle:
    """Sink rate per layer (Gu et al. 2024): the share of heads whose importance of key ``position``
    exceeds ``eps``; rates {variant: (L,)}, one line per variant."""
    if not isinstance(rates, Mapping) or not rates:
        raise ValueError("rates must be a non-empty dict {variant: (L,) sink rates}")
    fig, rows = go.Figure(), []
    for i, (v, r) in enumerate(rates.items()):
        y = as_array(r, f"rates[{v!r}]", 1).astype(np.float64)
        dash, symbol, width, size = LINE_STYLES[i % len(LINE_STYLES)]
        fig.add_trace(go.Scatter(x=np.arange(len(y)), y=y, mode="lines+markers", name=v,
                                 line={"color": variant_color(v, i), "dash": dash, "width": width},
                                 marker={"symbol": symbol, "size": size},
                                 hovertemplate=f"{v}<br>layer %{{x}}: %{{y:.0%}} of heads<extra></extra>"))
        rows.append(pd.DataFrame({"variant": v, "layer": np.arange(len(y)), "eps": float(eps),
                                  "sink_rate": y}))
    fig.update_layout(title=f"Sink rate per layer: share of heads with importance of key {position} "
                            f"> {eps:g}",
                      xaxis_title="layer", yaxis_title="share of heads", yaxis_range=[-0.02, 1.02],
                      template="plotly_white", height=360, width=620)
    fig.update_xaxes(dtick=1)
    return FigureBundle(fig, pd.concat(rows, ignore_index=True),
                        {v: as_array(r, v, 1) for v, r in rates.items()})


def first_token_mass_heatmap(mass, variant: str) -> FigureBundle:
    """Layer x head heatmap of the mean row mass on position 0, sum_i pi_i0 / M (the attention sink
    of Xiao et al. 2023): mass (L, H), on a fixed [0, 1] scale."""
    z = as_array(mass, "mass", 2).astype(np.float64)  # (L, H)
    L, H = z.shape
    fig = go.Figure(go.Heatmap(z=z, x=list(range(H)), y=list(range(L)), colorscale="Viridis", zmin=0.0,
                               zmax=1.0, colorbar={"title": {"text": "mass"}},
                               hovertemplate="layer %{y}, head %{x}: %{z:.4f} of each row<extra></extra>"))
    fig.update_layout(title=f"{variant}: attention on the first token (mean over rows)", xaxis_title="head",
                      yaxis_title="layer", template="plotly_white", height=max(300, 26 * L + 160),
                      width=max(420, 30 * H + 220))
    fig.update_yaxes(autorange="reversed", dtick=1)
    fig.update_xaxes(dtick=1)
    table = pd.DataFrame({"variant": variant, "layer": np.repeat(np.arange(L), H),
                          "head": np.tile(np.arange(H), L), "first_token_mass": z.reshape(-1)})
    return FigureBundle(fig, table, {"first_token_mass": z})


def massive_activations_by_layer(table: pd.DataFrame, *, title: str | None = None) -> FigureBundle:
    """Massive activations per layer (Sun et al. 2024): the largest |h| (bars, log axis) and the
    median |h| (markers) of the residual stream after each layer, the token and dimension of the
    largest in the hover and above the bars; ``table`` has the columns of
    ``attnlab.hf.beyond.activations.COLUMNS``."""
    need = {"layer", "max_abs", "token_index", "token", "dim", "median_abs", "ratio"}
    if not isinstance(table, pd.DataFrame) or not need <= set(table.columns) or table.empty:
        got = sorted(table.columns) if isinstance(table, pd.DataFrame) else type(table).__name__
        raise ValueError(f"table must be a non-empty DataFrame with columns {sorted(need)}, got {got}")
    t = table.sort_values("layer")
    where = [f"{int(i)}: {tok}, dim {int(d)}" for i, tok, d in zip(t["token_index"], t["token"], t["dim"],
                                                                  strict=True)]
    custom = np.stack([t["ratio"].to_numpy(np.float64), t["median_abs"].to_numpy(np.float64)], -1)
    fig = go.Figure([
        go.Bar(x=t["layer"], y=t["max_abs"], name="largest |hidden state|", text=where,
               textposition="outside", customdata=custom, marker_color="#1f77b4",
               hovertemplate="layer %{x}<br>largest |hidden state| %{y:.1f} at token %{text}<br>median "
                             "%{customdata[1]:.3f}, ratio %{customdata[0]:.0f}×<extra></extra>"),
        go.Scatter(x=t["layer"], y=t["median_abs"], name="median |hidden state|", mode="markers",
                   marker={"color": "#d62728", "symbol": "line-ew-open", "size": 22,
                           "line": {"width": 3, "color": "#d62728"}},  # a bar-wide stroke, not a hairline
                   hovertemplate="layer %{x}<br>median |hidden state| %{y:.3f}<extra></extra>"),
    ])
    fig.update_layout(title=title or "Massive activations: the largest |hidden state| per layer and its "
                                     "ratio to the median", xaxis_title="layer (residual stream after it)",
                      yaxis_title="|hidden state| (log scale)", template="plotly_white", height=420,
                      width=760)
    fig.update_xaxes(dtick=1)
    fig.update_yaxes(type="log", **decade_ticks(t[["max_abs", "median_abs"]].to_numpy(np.float64), room=0.6))
    return FigureBundle(fig, t.reset_index(drop=True), {"max_abs": t["max_abs"].to_numpy(np.float64),
                                                        "ratio": t["ratio"].to_numpy(np.float64)})
