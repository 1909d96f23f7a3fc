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

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from attnlab.figures._data import as_array, check_tokens, variant_color
from attnlab.figures.bundle import FigureBundle

__all__ = ["FIRST_KEYS", "importance_by_layer", "sink_rate_by_layer", "first_token_mass_heatmap",
           "massive_activations_by_layer"]

FIRST_KEYS = 16  # keys drawn by importance_by_layer (sinks sit at the start of the text)


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
        fig.add_trace(go.Scatter(x=np.arange(len(y)), y=y, mode="lines+markers", name=v,
                                 line={"color": variant_color(v, i)},
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
        go.Bar(x=t["layer"], y=t["max_abs"], name="largest |h|", text=where, textposition="outside",
               customdata=custom, marker_color="#1f77b4",
               hovertemplate="layer %{x}<br>largest |h| %{y:.4g} at token %{text}<br>median |h| "
                             "%{customdata[1]:.4g}, ratio %{customdata[0]:.1f}<extra></extra>"),
        go.Scatter(x=t["layer"], y=t["median_abs"], name="median |h|", mode="markers",
                   marker={"color": "#7f7f7f", "symbol": "line-ew-open", "size": 18}),
    ])
    fig.update_layout(title=title or "Massive activations: the largest |hidden state| per layer and its "
                                     "ratio to the median", xaxis_title="layer (residual stream after it)",
                      yaxis_title="|h|", yaxis_type="log", template="plotly_white", height=420, width=760)
    fig.update_xaxes(dtick=1)
    return FigureBundle(fig, t.reset_index(drop=True), {"max_abs": t["max_abs"].to_numpy(np.float64),
                                                        "ratio": t["ratio"].to_numpy(np.float64)})
