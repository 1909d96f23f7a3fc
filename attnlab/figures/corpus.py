"""Figures of a corpus run (attnlab.corpus): per-layer curves with confidence bands, and a layer x
head heatmap of any statistic. Input: the summary DataFrame (``CorpusResult.summary()``: columns
variant, layer, head, statistic, mean, ci_low, ci_high, ...; ``head == -1`` = mean over heads).
Each builder returns an ``app_views.FigureBundle`` (figure + the table it draws, for export)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from attnlab.figures._data import variant_color
from attnlab.figures.app_views import FigureBundle

__all__ = ["layer_curves", "head_heatmap", "LABELS"]

ALL_HEADS = -1
# Short captions of the statistics the Corpus page and docs/RESULTS.md plot.
LABELS = {
    "received:special:[CLS]": "attention to [CLS]",
    "received:special:[SEP]": "attention to [SEP]",
    "received:punctuation": "attention to punctuation",
    "received:first_position": "attention to the first position",
    "received:special": "attention to special tokens",
    "explained_away_relative": "explained-away fraction (m_j N/M < 0.1)",
    "relative_column_mass_q10": "relative column mass, 10th percentile",
    "relative_column_mass_q50": "relative column mass, median",
    "relative_column_mass_q90": "relative column mass, 90th percentile",
    "sink_importance_first": "causal-corrected importance of the first key",
    "sink_rate": "sink rate (share of heads with first-key importance > 0.3)",
    "massive_ratio": "largest |hidden state| / median (massive activations)",
    "massive_max_abs": "largest |hidden state| (massive activations)",
}


def _rgba(color: str, alpha: float) -> str:
    color = color.lstrip("#")
    r, g, b = (int(color[i : i + 2], 16) for i in (0, 2, 4))
    return f"rgba({r},{g},{b},{alpha})"


def layer_curves(summary: pd.DataFrame, statistics: Sequence[str], variants: Sequence[str] | None = None, *,
                 title: str = "Per layer, mean over heads and documents (95 % CI)") -> FigureBundle:
    """One panel per statistic: the mean over heads per layer, a line per variant, its 95 % CI band."""
    missing = [s for s in statistics if s not in set(summary["statistic"])]
    if missing or not statistics:
        raise ValueError(f"statistics must be among the summary's statistics; missing {missing or 'all'}")
    rows = summary[(summary["head"] == ALL_HEADS) & summary["statistic"].isin(statistics)]
    variants = list(dict.fromkeys(rows["variant"])) if variants is None else list(variants)
    rows = rows[rows["variant"].isin(variants)].sort_values(["statistic", "variant", "layer"])
    fig = make_subplots(rows=1, cols=len(statistics), subplot_titles=[LABELS.get(s, s) for s in statistics],
                        horizontal_spacing=0.06)
    for c, stat in enumerate(statistics, 1):
        for i, variant in enumerate(variants):
            part = rows[(rows["statistic"] == stat) & (rows["variant"] == variant)]
            if part.empty:
                continue
            color = variant_color(variant, i)
            x = part["layer"].to_numpy()
            fig.add_trace(go.Scatter(x=np.concatenate([x, x[::-1]]),
                                     y=np.concatenate([part["ci_high"], part["ci_low"].to_numpy()[::-1]]),
                                     fill="toself", fillcolor=_rgba(color, 0.2), line=dict(width=0),
                                     hoverinfo="skip", showlegend=False, legendgroup=variant), row=1, col=c)
            fig.add_trace(go.Scatter(x=x, y=part["mean"], mode="lines+markers", name=variant,
                                     line=dict(color=color), legendgroup=variant, showlegend=c == 1,
                                     customdata=part[["ci_low", "ci_high"]].to_numpy(),
                                     hovertemplate="layer %{x}: %{y:.3f} [%{customdata[0]:.3f}, "
                                                   "%{customdata[1]:.3f}]<extra>" + variant + "</extra>"),
                          row=1, col=c)
        fig.update_xaxes(title_text="layer", dtick=1, row=1, col=c)
    fig.update_layout(title=title, height=380, width=max(520, 380 * len(statistics)), template="plotly_white")
    table = rows[["variant", "statistic", "layer", "mean", "ci_low", "ci_high", "n_documents"]]
    table = table.reset_index(drop=True)
    return FigureBundle(fig, table)


def head_heatmap(summary: pd.DataFrame, statistic: str, variant: str, *,
                 title: str | None = None) -> FigureBundle:
    """Layer x head heatmap of one statistic's mean over documents for one variant; a statistic of
    whole layers (only head = -1 rows: the massive_* rows of attnlab.corpus.sink_rows) is one column."""
    rows = summary[(summary["statistic"] == statistic) & (summary["variant"] == variant)]
    per_head = rows[rows["head"] != ALL_HEADS]
    rows = per_head if not per_head.empty else rows
    if rows.empty:
        raise ValueError(f"no summary rows for statistic {statistic!r} and variant {variant!r}")
    grid = rows.pivot(index="layer", columns="head", values="mean").sort_index()
    fig = go.Figure(go.Heatmap(z=grid.to_numpy(), x=grid.columns, y=grid.index, colorscale="Viridis",
                               colorbar=dict(title="mean"),
                               hovertemplate="layer %{y}, head %{x}: %{z:.4f}<extra></extra>"))
    fig.update_layout(title=title or f"{variant}: {LABELS.get(statistic, statistic)}, mean over documents",
                      xaxis_title="head", yaxis_title="layer", height=360, width=560, template="plotly_white")
    fig.update_yaxes(autorange="reversed", dtick=1)
    fig.update_xaxes(dtick=1)
    table = rows[["variant", "statistic", "layer", "head", "mean", "ci_low", "ci_high"]]
    table = table.reset_index(drop=True)
    return FigureBundle(fig, table, {"mean": grid.to_numpy()})
