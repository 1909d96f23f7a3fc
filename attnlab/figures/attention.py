"""Attention maps: the layer x head grid and one head's heatmap with token labels."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from attnlab.figures._data import as_array, block_mean, check_tokens, unique_labels

__all__ = ["attention_grid", "attention_heatmap"]

COLORSCALE = "Viridis"


def attention_grid(
    weights,
    tokens: Sequence[str] | None = None,
    *,
    title: str = "Attention weights by layer and head",
    max_tokens: int = 128,
    zmax: float | None = None,
    cell_px: int = 80,
) -> go.Figure:
    """A layer x head grid of small heatmaps (rows = layers, columns = heads).

    Args:
        weights: (L, H, M, N) attention weights (tensor or array) of one example.
        tokens: optional N key tokens (checked against N); when the maps are not downsampled they
            label the keys and queries in the hover text.
        title: figure title.
        max_tokens: maps with a side longer than this are averaged over f x f token blocks
            (f = ceil(max(M, N) / max_tokens)) to keep the figure light; the title says so.
        zmax: top of the shared color scale (default: the largest weight shown).
        cell_px: pixel size of one map.

    Returns:
        Figure with L*H heatmap traces in row-major order (layer 0 heads 0..H-1, layer 1, ...), one
        shared ``coloraxis``, axes 1-based as plotly numbers them (trace k sits on axis k+1).
        Hover shows layer, head, query, key and weight from a per-trace template (no per-cell text).
    """
    w = as_array(weights, "weights", 4)
    L, H, M, N = w.shape
    tokens = check_tokens(tokens, N)
    maps, f = block_mean(w, max_tokens)
    if f == 1 and tokens is not None and M == N:
        ys = xs = unique_labels(tokens)
    else:  # block start positions (token indices)
        ys, xs = np.arange(0, M, f), np.arange(0, N, f)
    fig = make_subplots(
        rows=L,
        cols=H,
        shared_xaxes=True,
        shared_yaxes=True,
        horizontal_spacing=min(0.01, 0.5 / max(H - 1, 1)),
        vertical_spacing=min(0.015, 0.5 / max(L - 1, 1)),
        column_titles=[f"head {h}" for h in range(H)],
        row_titles=[f"layer {layer}" for layer in range(L)],
    )
    traces = [
        go.Heatmap(
            z=maps[layer, head],
            x=xs,
            y=ys,
            coloraxis="coloraxis",
            hovertemplate=f"layer {layer}, head {head}<br>query %{{y}}<br>key %{{x}}<br>"
            "weight %{z:.4f}<extra></extra>",
        )
        for layer in range(L)
        for head in range(H)
    ]
    fig.add_traces(traces, rows=[r + 1 for r in range(L) for _ in range(H)], cols=list(range(1, H + 1)) * L)
    fig.update_xaxes(showticklabels=False, ticks="")
    fig.update_yaxes(showticklabels=False, ticks="", autorange="reversed")  # query 0 at the top
    if f > 1:
        title = f"{title} (means over {f}x{f} token blocks)"
    fig.update_layout(
        title=title,
        coloraxis={"colorscale": COLORSCALE, "cmin": 0.0, "cmax": float(maps.max()) if zmax is None else zmax,
                   "colorbar": {"title": {"text": "weight"}}},
        width=cell_px * H + 220,
        height=cell_px * L + 140,
        margin={"l": 40, "r": 40, "t": 90, "b": 30},
    )
    fig.update_annotations(font_size=10)  # the row / column titles
    return fig


def attention_heatmap(
    weights,
    tokens: Sequence[str],
    *,
    query_tokens: Sequence[str] | None = None,
    title: str = "Attention weights",
    zmax: float | None = None,
) -> go.Figure:
    """One head's (M, N) weights with token labels on both axes and hover (query, key, weight).

    ``tokens`` label the N keys (x); ``query_tokens`` the M queries (y), default ``tokens``. Queries
    run top to bottom. Repeated tokens stay separate rows / columns (made distinct invisibly).
    The single heatmap trace holds the weights unchanged (float32).
    """
    w = as_array(weights, "weights", 2)
    M, N = w.shape
    keys = check_tokens(tokens, N)
    queries = check_tokens(tokens if query_tokens is None else query_tokens, M, "query_tokens")
    fig = go.Figure(
        go.Heatmap(
            z=w,
            x=unique_labels(keys),
            y=unique_labels(queries),
            colorscale=COLORSCALE,
            zmin=0.0,
            zmax=float(w.max()) if zmax is None and w.size else zmax,
            colorbar={"title": {"text": "weight"}},
            hovertemplate="query: %{y}<br>key: %{x}<br>weight: %{z:.4f}<extra></extra>",
        )
    )
    side = int(min(max(14 * max(M, N) + 160, 420), 1400))
    fig.update_xaxes(type="category", title="key (attended to)", tickangle=-60)
    fig.update_yaxes(type="category", title="query (attending)", autorange="reversed")
    fig.update_layout(title=title, width=side + 80, height=side)
    return fig
