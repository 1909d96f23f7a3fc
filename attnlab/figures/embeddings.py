"""Token vectors in 2-D: PCA, UMAP, AttentionViz's joint query-key space, and their scatter plot."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from attnlab.figures._data import as_array
from attnlab.figures.bundle import FigureBundle

__all__ = ["embedding_scatter", "embedding_view", "joint_query_key", "pca_2d", "umap_2d"]


def pca_2d(x) -> np.ndarray:
    """(n, d) -> (n, 2): projection on the two leading principal components (centred SVD)."""
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] < 2:
        raise ValueError(f"x must be (n >= 2, d), got shape {a.shape}")
    a = a - a.mean(0)
    _, _, vt = np.linalg.svd(a, full_matrices=False)
    out = a @ vt[:2].T
    if out.shape[1] < 2:
        out = np.pad(out, ((0, 0), (0, 2 - out.shape[1])))
    return out.astype(np.float32)


def joint_query_key(q, k) -> tuple[np.ndarray, np.ndarray]:
    """Queries (N, D) and keys (N, D) of one head in one space, as AttentionViz does: keys translated
    so their centroid is the queries' centroid, then queries scaled by a and keys by 1/a so both have
    the same mean norm. Every query's softmax over keys is unchanged: q.(k + c) adds q.c to a whole
    row, and (a q).(k / a) = q.k."""
    q, k = np.asarray(q, dtype=np.float32), np.asarray(k, dtype=np.float32)
    if q.ndim != 2 or q.shape[1:] != k.shape[1:]:
        raise ValueError(f"q and k must be (N, D) with one D, got {q.shape} and {k.shape}")
    k = k - k.mean(0) + q.mean(0)
    a = np.sqrt(np.linalg.norm(k, axis=1).mean() / max(np.linalg.norm(q, axis=1).mean(), 1e-12))
    return q * a, k / a


def umap_2d(x, n_neighbors: int = 15, seed: int = 0) -> np.ndarray:
    """(n, d) -> (n, 2) with umap-learn (cosine metric). Its first call in a process JIT-compiles
    for tens of seconds: run it in a warmed worker (the app does)."""
    import umap

    a = np.asarray(x, dtype=np.float32)
    if a.ndim != 2 or a.shape[0] < 4:
        raise ValueError(f"x must be (n >= 4, d), got shape {a.shape}")
    k = max(2, min(n_neighbors, a.shape[0] - 1))
    reducer = umap.UMAP(
        n_neighbors=k, n_components=2, metric="cosine", random_state=seed, init="random", n_jobs=1
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "n_jobs overridden by random_state", small-n notes
        return reducer.fit_transform(a).astype(np.float32)


def embedding_scatter(
    coords,
    hover: Sequence[str],
    color,
    *,
    color_label: str,
    title: str,
    symbol: Sequence[str] | None = None,
    labels: Sequence[str] | None = None,
    max_labels: int = 80,
) -> go.Figure:
    """2-D scatter of token vectors; ``color`` numeric (colour scale) or strings (legend groups);
    ``symbol`` separates e.g. queries from keys (AttentionViz); ``labels`` are written next to the
    points when there are at most ``max_labels`` of them."""
    xy = as_array(coords, "coords", 2)
    n = xy.shape[0]
    hover = [str(h) for h in hover]
    if len(hover) != n:
        raise ValueError(f"coords has {n} points, while hover has {len(hover)} labels")
    color = list(color)
    numeric = all(isinstance(c, (int, float, np.integer, np.floating)) for c in color)
    sym = list(symbol) if symbol is not None else ["token"] * n
    fig = go.Figure()
    for s in dict.fromkeys(sym):
        idx = [i for i in range(n) if sym[i] == s]
        marker = {
            "size": 8,
            "symbol": "circle" if s in ("token", "query") else "diamond",
            "line": {"width": 0.5, "color": "white"},
        }
        if numeric:
            marker |= {
                "color": [color[i] for i in idx],
                "colorscale": "Viridis",
                "colorbar": {"title": {"text": color_label}},
                "showscale": s == sym[0],
            }
        fig.add_trace(
            go.Scatter(
                x=xy[idx, 0],
                y=xy[idx, 1],
                mode="markers+text" if labels is not None and n <= max_labels else "markers",
                name=s,
                marker=marker,
                text=[str(labels[i]) for i in idx] if labels is not None else None,
                textposition="top center",
                textfont={"size": 9, "color": "#555"},
                hovertext=[hover[i] for i in idx],
                customdata=[color[i] for i in idx],
                hovertemplate="%{hovertext}<br>" + color_label + ": %{customdata}<extra>" + s + "</extra>",
                showlegend=symbol is not None,
            )
        )
    if not numeric:  # categorical colours: colour each point by its category
        cats = list(dict.fromkeys(color))
        palette = [
            "#1f77b4",
            "#ff7f0e",
            "#2ca02c",
            "#d62728",
            "#9467bd",
            "#8c564b",
            "#e377c2",
            "#7f7f7f",
            "#bcbd22",
            "#17becf",
        ]
        lookup = {c: palette[k % len(palette)] for k, c in enumerate(cats)}
        for trace in fig.data:
            trace.marker.color = [lookup[c] for c in trace.customdata]
    fig.update_layout(
        title=title,
        width=760,
        height=580,
        xaxis_title="dim 1",
        yaxis_title="dim 2",
        # the legend (query / key) above the plot, clear of the colour bar's title on the right
        legend={"orientation": "h", "x": 0.0, "xanchor": "left", "y": 1.0, "yanchor": "bottom"},
        margin={"t": 100},
    )
    return fig


def embedding_view(
    coords, vectors, tokens: Sequence[str], color, kinds: Sequence[str], *, color_label: str, title: str
) -> FigureBundle:
    """:func:`embedding_scatter` of ``coords`` (n, 2) with its data: one row per point (x, y, token,
    kind, colour value) and the projected ``vectors`` (n, d) for NPZ export."""
    hover = [f"{k} {i % len(tokens)}: {tokens[i % len(tokens)]}" for i, k in enumerate(kinds)]
    fig = embedding_scatter(
        coords,
        hover,
        color,
        color_label=color_label,
        title=title,
        symbol=kinds if len(set(kinds)) > 1 else None,
        labels=[tokens[i % len(tokens)] for i in range(len(kinds))],
    )
    xy = np.asarray(coords)
    table = pd.DataFrame(
        {
            "x": xy[:, 0],
            "y": xy[:, 1],
            "token": [tokens[i % len(tokens)] for i in range(len(kinds))],
            "kind": list(kinds),
            color_label: list(color),
        }
    )
    return FigureBundle(
        fig, table, {"coords": xy, "vectors": np.asarray(vectors), "tokens": np.array(tokens)}
    )
