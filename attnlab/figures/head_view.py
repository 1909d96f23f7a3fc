"""Line views of attention, as bertviz draws them: one head's view (queries left, keys right, a line
per pair, opacity = weight) and the model view (every layer x head as a small head view).

Both take plain weights plus tokens and an optional ``focus`` token (click to focus): the lines it
sends (as a query) and receives (as a key) are drawn in the focus colour, every other line faded.
Token markers carry their position in ``customdata`` (what a click selects).

Cross-attention (an encoder-decoder's target queries x source keys) is rectangular: ``query_tokens``
name the M queries (left), ``tokens`` the N keys (right), and the focus is a **key** (a source
token): the lines it receives from every query are drawn in the focus colour.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go

from attnlab.figures._data import as_array, check_focus, check_tokens
from attnlab.figures.attention import FOCUS_COLOR

__all__ = ["head_view", "model_view", "MODEL_VIEW_MAX_TOKENS"]

LINE_COLOR = "rgb(31, 119, 180)"
MODEL_VIEW_MAX_TOKENS = 64  # beyond this the model view is unreadable: use the layer x head grid
NO_DIM = {"marker": {"opacity": 1.0}}  # selecting a token must not grey out the others


def _segments(qi: np.ndarray, kj: np.ndarray, x0: float, x1: float, y0: float = 0.0):
    """(xs, ys) of line segments query qi -> key kj, separated by NaN (one trace for many lines)."""
    nan = np.full(qi.size, np.nan)
    xs = np.column_stack([np.full(qi.size, x0), np.full(qi.size, x1), nan]).ravel()
    ys = np.column_stack([qi + y0, kj + y0, nan]).ravel()
    return xs, ys


def _line_traces(
    pairs,
    top: float,
    min_weight: float,
    buckets: int,
    focus: int | None,
    *,
    color: str = LINE_COLOR,
    focus_color: str = FOCUS_COLOR,
    group: str | None = None,
    query_focus: bool = True,
) -> list[go.Scatter]:
    """Lines grouped into ``buckets`` opacity levels (one trace each) + the focused token's lines.

    pairs: list of (qi, kj, weight, x0, x1, y0) arrays / offsets, one entry per head drawn.
    ``color`` / ``focus_color``: the lines' colours; ``group``: a legend group the traces join (the
    head overlay toggles a head's lines through its legend entry); ``query_focus`` False (cross-attention):
    the focus is a key only, so only the lines it receives are focused.
    """
    edges = np.linspace(min_weight, max(top, min_weight * 1.0001), buckets + 1)
    traces = []
    for b in range(buckets):
        lo, hi = edges[b], edges[b + 1]
        for focused in (False, True) if focus is not None else (False,):
            xs, ys = [], []
            for qi, kj, w, x0, x1, y0 in pairs:
                sel = (w >= lo) & ((w < hi) if b < buckets - 1 else (w <= hi))
                if focus is not None:
                    touches = ((qi == focus) if query_focus else False) | (kj == focus)
                    sel &= touches if focused else ~touches
                if sel.any():
                    x, y = _segments(qi[sel], kj[sel], x0, x1, y0)
                    xs.append(x)
                    ys.append(y)
            if not xs:
                continue
            level = (b + 1) / buckets
            faded = focus is not None and not focused
            traces.append(
                go.Scatter(
                    x=np.concatenate(xs),
                    y=np.concatenate(ys),
                    mode="lines",
                    hoverinfo="skip",
                    showlegend=False,
                    legendgroup=group,
                    line={"color": focus_color if focused else color, "width": 1 + 2.5 * level},
                    opacity=(0.15 + 0.85 * level) * (0.12 if faded else 1.0),
                )
            )
    return traces


def _top_pairs(w: np.ndarray, min_weight: float, max_lines: int | None):
    """Indices and weights of the (query, key) pairs worth a line: weight >= min_weight, at most
    ``max_lines`` of the strongest."""
    qi, kj = np.nonzero(w >= min_weight)
    vals = w[qi, kj]
    if max_lines is not None and vals.size > max_lines:
        keep = np.argpartition(vals, -max_lines)[-max_lines:]
        qi, kj, vals = qi[keep], kj[keep], vals[keep]
    return qi, kj, vals


def _top_text(row: np.ndarray, tokens: Sequence[str], k: int = 3) -> str:
    order = np.argsort(row)[::-1][:k]
    return ", ".join(f"{j}: {tokens[j]} {row[j]:.2f}" for j in order)


def head_view(
    weights,
    tokens: Sequence[str],
    *,
    title: str = "Head view",
    min_weight: float = 0.02,
    buckets: int = 6,
    focus: int | None = None,
    query_tokens: Sequence[str] | None = None,
) -> go.Figure:
    """bertviz-style head view: queries on the left, keys on the right, a line per (query, key)
    with opacity growing with the weight; weights below ``min_weight`` are not drawn.

    weights: (M, N) of one head; ``tokens`` the N keys, ``query_tokens`` the M queries (given:
    cross-attention, the focus is a key; None: self-attention, ``tokens`` on both sides). Lines are
    grouped into ``buckets`` opacity levels (one trace each,
    segments separated by None), so even 4,096 pairs stay a handful of traces. Hovering a query
    names its three strongest keys; hovering a key its column mass and three strongest queries.
    The last two traces are the query and key markers (``customdata`` = position).
    """
    w = as_array(weights, "weights", 2)
    M, N = w.shape
    keys = check_tokens(tokens, N)
    cross = query_tokens is not None
    queries = check_tokens(query_tokens, M, "query_tokens") if cross else keys if M == N else [
        str(i) for i in range(M)]
    focus = check_focus(focus, N if cross else max(M, N))
    top = float(w.max()) if w.size else 1.0
    qi, kj, vals = _top_pairs(w, min_weight, None)
    fig = go.Figure(_line_traces([(qi, kj, vals, 0.0, 1.0, 0.0)], top, min_weight, buckets, focus,
                                 query_focus=not cross))
    mass = w.sum(0)  # (N,) column mass of each key
    q_hover = [f"{i}: {queries[i]} → {_top_text(w[i], keys)}" for i in range(M)]
    k_hover = [f"{j}: {keys[j]}, column mass {mass[j]:.3f} ← {_top_text(w[:, j], queries)}" for j in range(N)]

    token_traces(fig, queries, keys, q_hover, k_hover, focus, query_focus=not cross)
    fig.update_layout(title=title, width=520, height=max(300, 20 * max(M, N) + 120))
    return fig


def token_traces(fig: go.Figure, queries, keys, q_hover, k_hover, focus: int | None,
                 query_focus: bool = True) -> None:
    """The query (x = 0) and key (x = 1) token markers of a head view, with their hover texts, as
    its last two traces (``customdata`` = position; the focused token's label in orange, on the key
    side alone when ``query_focus`` is False: cross-attention), and the view's axes and white,
    hover-closest layout (head_view, head_overlay)."""
    for side, x, labels, hover, pos in (
        ("query", 0.0, queries, q_hover, "middle left"),
        ("key", 1.0, keys, k_hover, "middle right"),
    ):
        n = len(labels)
        focus_here = focus if side == "key" or query_focus else None
        fig.add_trace(
            go.Scatter(
                x=np.full(n, x),
                y=np.arange(n),
                mode="markers+text",
                text=labels,
                textposition=pos,
                textfont={"size": 12, "color": ["#d45500" if i == focus_here else "#222" for i in range(n)]},
                marker={"size": 9, "color": "rgba(31, 119, 180, 0.35)", "symbol": "square"},
                customdata=np.arange(n),
                hovertext=hover,
                showlegend=False,
                selected=NO_DIM,
                unselected=NO_DIM,
                hovertemplate=side + " %{hovertext}<extra></extra>",
            )
        )
    fig.update_xaxes(visible=False, range=[-0.9, 1.9], fixedrange=True)
    fig.update_yaxes(visible=False, autorange="reversed", fixedrange=True)
    fig.update_layout(plot_bgcolor="white", margin={"l": 10, "r": 10, "t": 60, "b": 10}, hovermode="closest")


def model_view(
    weights,
    tokens: Sequence[str],
    *,
    title: str = "Model view",
    min_weight: float = 0.05,
    buckets: int = 4,
    focus: int | None = None,
    max_tokens: int = MODEL_VIEW_MAX_TOKENS,
    query_tokens: Sequence[str] | None = None,
) -> go.Figure:
    """bertviz's model view: every layer (rows) x head (columns) as a small head view, in one plot.

    weights: (L, H, M, N); ``tokens`` the N keys, ``query_tokens`` the M queries (given:
    cross-attention, the focus is a key; None: self-attention, M == N). Head (l, h) draws queries at
    x = 3h, keys at x = 3h + 1 and its tokens at y = l (max(M, N) + 3) + position; per head at most
    2 max(M, N) of the strongest lines >= ``min_weight``. With ``focus`` only the lines that token
    sends and receives (cross-attention: receives) are drawn strongly, in every head. The last trace
    holds one marker per (layer, head, focusable token) — the queries, or the keys for
    cross-attention — (``customdata`` = [position, layer, head]). Texts over ``max_tokens`` tokens
    raise ValueError (use the layer x head grid).
    """
    w = as_array(weights, "weights", 4)
    L, H, M, N = w.shape
    tokens = check_tokens(tokens, N)
    cross = query_tokens is not None
    if cross:
        check_tokens(query_tokens, M, "query_tokens")
    elif M != N:
        raise ValueError(f"model_view needs self-attention (M == N) or query_tokens, got maps of {M} x {N}")
    side = max(M, N)
    if side > max_tokens:
        raise ValueError(
            f"the model view draws up to {max_tokens} tokens, this window has {side}: use the layer x head "
            "grid"
        )
    focus = check_focus(focus, N)
    gap = side + 3  # rows of one layer's band, blank rows included
    pairs = []
    for layer in range(L):
        for head in range(H):
            qi, kj, vals = _top_pairs(w[layer, head], min_weight, 2 * side)
            pairs.append((qi, kj, vals, 3.0 * head, 3.0 * head + 1, float(layer * gap)))
    top = float(w.max()) if w.size else 1.0
    fig = go.Figure(_line_traces(pairs, top, min_weight, buckets, focus, query_focus=not cross))
    n = N if cross else M  # the markers: the focusable side's tokens (cross: the keys)
    pos = np.tile(np.arange(n), L * H)
    layer_of = np.repeat(np.arange(L), H * n)
    head_of = np.tile(np.repeat(np.arange(H), n), L)
    is_focus = pos == focus
    fig.add_trace(
        go.Scatter(
            x=3.0 * head_of + (1.0 if cross else 0.0),
            y=layer_of * gap + pos,
            mode="markers",
            marker={  # colour by number (0 / 1 on a two-colour scale): plotly checks every colour
                "size": np.where(is_focus, 6, 3),  # string of an array one by one (~1 s for 72 heads)
                "color": is_focus.astype(np.float32),
                "colorscale": [[0.0, "rgba(60, 60, 60, 0.5)"], [1.0, FOCUS_COLOR]],
                "cmin": 0.0,
                "cmax": 1.0,
                "showscale": False,
            },
            customdata=np.column_stack([pos, layer_of, head_of]),
            hovertext=[f"{p}: {tokens[p]}" for p in pos],
            hovertemplate="layer %{customdata[1]}, head %{customdata[2]}<br>"
            + ("key" if cross else "query") + " %{hovertext}<extra></extra>",
            showlegend=False,
            selected=NO_DIM,
            unselected=NO_DIM,
        )
    )
    annotations = [
        {"x": 3.0 * h + 0.5, "y": 1.0, "yref": "paper", "yanchor": "bottom", "text": f"head {h}"}
        for h in range(H)
    ] + [
        {"x": 0.0, "xref": "paper", "xanchor": "right", "y": la * gap + side / 2, "text": f"layer {la}"}
        for la in range(L)
    ]
    row_px = max(3.0, min(8.0, 260.0 / side))
    fig.update_xaxes(visible=False, range=[-0.5, 3.0 * H - 1.5], fixedrange=True)
    fig.update_yaxes(visible=False, autorange="reversed", fixedrange=True)
    fig.update_layout(
        title=title if focus is None else f"{title} (focus: {focus}: {tokens[focus]})",
        annotations=[{**a, "showarrow": False, "font": {"size": 11}} for a in annotations],
        width=80 * H + 120,
        height=int(row_px * gap * L + 120),
        plot_bgcolor="white",
        margin={"l": 70, "r": 20, "t": 80, "b": 10},
        hovermode="closest",
    )
    return fig
