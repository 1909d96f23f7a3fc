"""AttentionViz's joint view, linked to the other views: the queries and keys of several heads,
layers and texts pooled into one 2-D scatter, every point carrying which token, position, layer,
head and text it is, and the focused token's points ringed (click to focus, shared with Inspect).

:func:`pool_query_key` pools the vectors (each head's queries and keys first put in one space by
:func:`attnlab.figures.embeddings.joint_query_key`); :func:`linked_scatter` draws the projection,
:func:`linked_view` adds the data behind it. A point's ``customdata`` is its row in the table, what a
selection names.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from attnlab.figures._data import as_array
from attnlab.figures.attention import FOCUS_COLOR
from attnlab.figures.bundle import FigureBundle
from attnlab.figures.embeddings import joint_query_key

__all__ = ["POINT_COLUMNS", "pool_query_key", "linked_scatter", "linked_view"]

POINT_COLUMNS = ("kind", "token", "position", "layer", "head", "text", "linked")
PALETTE = (
    "#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
    "#393b79", "#637939", "#8c6d31",
)  # fmt: skip
WEBGL_FROM = 1500  # points: beyond, the scatter is drawn with WebGL


def pool_query_key(groups: Sequence[dict]) -> tuple[np.ndarray, pd.DataFrame]:
    """Pool queries and keys of several (text, layer, head) into one set of points.

    groups: dicts with ``q`` (N, D) and ``k`` (N, D) of one head (a grouped-query layer's key head),
    ``tokens`` (N,), ``layer``, ``head``, ``text`` (a label) and ``linked`` (True: the text the other
    views show, whose points a selection can focus). Every group's D must agree. Returns
    (x (sum of 2N, D) float32: each group's queries then its keys, after ``joint_query_key``; the
    table of :data:`POINT_COLUMNS`, one row per point).
    """
    if not groups:
        raise ValueError("groups must hold at least one (text, layer, head) of queries and keys")
    xs, rows = [], []
    for g in groups:
        q, k = joint_query_key(g["q"], g["k"])  # (N, D) each
        tokens = [str(t) for t in g["tokens"]]
        if len(tokens) != q.shape[0] or k.shape[0] != q.shape[0]:
            raise ValueError(
                f"text {g['text']!r}: q has {q.shape[0]} positions, k {k.shape[0]}, tokens {len(tokens)}"
            )
        if xs and q.shape[1] != xs[0].shape[1]:
            raise ValueError(f"every group must have one D, got {xs[0].shape[1]} and {q.shape[1]}")
        xs.append(np.concatenate([q, k]))
        for kind in ("query", "key"):
            rows += [
                (kind, t, i, g["layer"], g["head"], g["text"], bool(g["linked"]))
                for i, t in enumerate(tokens)
            ]
    return np.concatenate(xs).astype(np.float32), pd.DataFrame(rows, columns=list(POINT_COLUMNS))


def _colours(values: list) -> tuple[bool, list]:
    numeric = all(
        isinstance(c, (int, float, np.integer, np.floating)) and not isinstance(c, bool) for c in values
    )
    if numeric:
        return True, values
    lookup = {c: PALETTE[k % len(PALETTE)] for k, c in enumerate(dict.fromkeys(values))}
    return False, [lookup[c] for c in values]


def linked_scatter(
    coords,
    points: pd.DataFrame,
    color: Sequence,
    *,
    color_label: str,
    title: str,
    focus: int | None = None,
    max_labels: int = 80,
) -> go.Figure:
    """The pooled points in 2-D: queries as circles, keys as diamonds (a trace each), coloured by
    ``color`` (numbers: Viridis with a colour bar; anything else: a colour per value); the linked
    text's points of token ``focus`` ringed in the focus colour, on top (last trace).

    coords: (n, 2); points: the table of :func:`pool_query_key` (n rows); color: (n,). Every
    point's ``customdata`` is [its row, colour value]. Tokens are written beside the points when
    there are at most ``max_labels``.
    """
    xy = as_array(coords, "coords", 2)
    n = len(points)
    if xy.shape != (n, 2):
        raise ValueError(f"coords must be (n, 2) for the {n} points, got {xy.shape}")
    color = list(color)
    if len(color) != n:
        raise ValueError(f"color has {len(color)} values for {n} points")
    numeric, marker_color = _colours(color)
    Scatter = go.Scattergl if n >= WEBGL_FROM else go.Scatter
    hover = [  # token representations have no head (-1)
        f"{r.kind} {r.position}: {r.token}<br>layer {r.layer}"
        + (f", head {r.head}" if r.head >= 0 else "")
        + f"<br>{r.text}"
        for r in points.itertuples()
    ]
    fig = go.Figure()
    kinds = list(dict.fromkeys(points["kind"]))
    for kind in kinds:
        idx = np.flatnonzero(points["kind"].to_numpy() == kind)
        marker = {
            "size": 7,
            "symbol": "diamond" if kind == "key" else "circle",
            "line": {"width": 0.5, "color": "white"},
        }
        marker["color"] = [marker_color[i] for i in idx]
        if numeric:
            marker |= {
                "colorscale": "Viridis",
                "showscale": kind == kinds[0],
                "colorbar": {"title": {"text": color_label}},
                "cmin": float(np.nanmin(color)),
                "cmax": float(np.nanmax(color)),
            }
        fig.add_trace(
            Scatter(
                x=xy[idx, 0],
                y=xy[idx, 1],
                mode="markers+text" if n <= max_labels else "markers",
                name=kind,
                marker=marker,
                text=[points["token"].iat[i] for i in idx] if n <= max_labels else None,
                textposition="top center",
                textfont={"size": 9, "color": "#555"},
                customdata=np.column_stack([idx, [str(color[i]) for i in idx]]),
                hovertext=[hover[i] for i in idx],
                hovertemplate="%{hovertext}<br>" + color_label + ": %{customdata[1]}<extra></extra>",
            )
        )
    if focus is not None:
        ring = np.flatnonzero(points["linked"].to_numpy() & (points["position"].to_numpy() == focus))
        if ring.size:
            fig.add_trace(
                Scatter(
                    x=xy[ring, 0],
                    y=xy[ring, 1],
                    mode="markers",
                    name=f"focus: {focus}: {points['token'].iat[ring[0]]}",
                    marker={
                        "size": 15,
                        "color": "rgba(0,0,0,0)",
                        "line": {"width": 2.5, "color": FOCUS_COLOR},
                    },
                    customdata=np.column_stack([ring, [str(color[i]) for i in ring]]),
                    hovertext=[hover[i] for i in ring],
                    hovertemplate="%{hovertext}<extra>focus</extra>",
                )
            )
    fig.update_layout(
        title=title if focus is None else f"{title} (focus: {focus})",
        width=820,
        height=620,
        xaxis_title="dim 1",
        yaxis_title="dim 2",
        legend={"orientation": "h", "x": 0.0, "xanchor": "left", "y": 1.0, "yanchor": "bottom"},
        margin={"t": 100},
    )
    return fig


def linked_view(
    coords,
    vectors,
    points: pd.DataFrame,
    color: Sequence,
    *,
    color_label: str,
    title: str,
    focus: int | None = None,
) -> FigureBundle:
    """:func:`linked_scatter` with its data: the table (x, y, the point columns, the colour value)
    and the arrays (coords (n, 2), the projected vectors (n, D))."""
    fig = linked_scatter(coords, points, color, color_label=color_label, title=title, focus=focus)
    xy = np.asarray(coords)
    table = pd.concat([pd.DataFrame({"x": xy[:, 0], "y": xy[:, 1]}), points.reset_index(drop=True)], axis=1)
    table[color_label] = list(color)
    arrays = {"coords": xy, "vectors": np.asarray(vectors), "position": points["position"].to_numpy()}
    return FigureBundle(fig, table, arrays)
