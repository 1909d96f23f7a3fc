"""Attention maps: the layer x head grid and one head's heatmap with token labels."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go

from attnlab.figures._data import as_array, block_mean, check_focus, check_tokens

__all__ = ["attention_grid", "attention_heatmap"]

COLORSCALE = "Viridis"
PLURAL = {"query": "queries", "key": "keys"}
FOCUS_COLOR = "#ff7f0e"  # the outline of a focused token's row and column (click to focus)


def position_labels(tokens: Sequence[str], start: int = 0) -> list[str]:
    """``"3: the"``: a token with its position (from ``start``), unique even when tokens repeat
    (axis categories)."""
    return [f"{i}: {t}" for i, t in enumerate(tokens, start)]


def label_step(n: int, plot_px: float, font_px: float) -> int:
    """Label every k-th of n categories so that labels ``font_px`` high do not overlap on
    ``plot_px`` pixels (k = 1 while they fit)."""
    return max(1, math.ceil(n * (font_px + 2) / max(plot_px, 1.0)))


def focus_shapes(
    focus: int | None, m: int, n: int, *, xref: str = "x", yref: str = "y", at: tuple[int, int] = (0, 0)
) -> list[dict]:
    """Outlines of the focused token's row (what it sends, as a query) and column (what it receives,
    as a key) on an (m, n) map drawn on category axes (cells at integer positions; ``at`` = the
    map's first row and column there, e.g. a tile of the grid)."""
    if focus is None:
        return []
    line = {"color": FOCUS_COLOR, "width": 2}
    r, c = at
    out = []
    if 0 <= focus < m:
        out.append({"type": "rect", "x0": c - 0.5, "x1": c + n - 0.5, "y0": r + focus - 0.5,
                    "y1": r + focus + 0.5})
    if 0 <= focus < n:
        out.append({"type": "rect", "x0": c + focus - 0.5, "x1": c + focus + 0.5, "y0": r - 0.5,
                    "y1": r + m - 0.5})
    return [{**s, "xref": xref, "yref": yref, "line": line, "layer": "above"} for s in out]


def attention_grid(
    weights,
    tokens: Sequence[str] | None = None,
    *,
    title: str = "Attention weights by layer and head",
    max_tokens: int = 128,
    zmax: float | None = None,
    cell_px: int = 80,
    focus: int | None = None,
) -> go.Figure:
    """A layer x head grid of maps (rows = layers, columns = heads) drawn as ONE heatmap trace.

    The maps are tiled into one (L*(m+1)-1, H*(n+1)-1) matrix with a blank (NaN) row / column between
    neighbours: one trace builds in milliseconds and renders at once even for MiniLM's 72 maps, where
    L*H subplots took over a second to build and froze the browser.

    Args:
        weights: (L, H, M, N) attention weights (tensor or array) of one example.
        tokens: optional N key tokens (checked against N); when the maps are not downsampled they name
            the keys (and the queries, when M == N) in the hover text.
        title: figure title.
        max_tokens: maps with a side longer than this are averaged over f x f token blocks
            (f = ceil(max(M, N) / max_tokens), partial blocks at the edges over what they hold) to
            keep the figure light; the title says so.
        zmax: top of the color scale (default: the largest weight shown).
        cell_px: pixel size of one map.
        focus: a token position: its row and column (its token block's, when averaged) outlined in
            every map, and named in the title.

    Returns:
        Figure with one heatmap trace: map (layer, head) sits at rows layer*(m+1) ... +m and columns
        head*(n+1) ... +n of ``z`` (m, n = the map's sides after downsampling); gutter cells are NaN
        (no hover). Categorical axes with one unique label per row / column ("layer 2 · query 5
        'cat'", "head 7 · keys 0-3") give the hover text without per-cell data; annotations title
        the columns ("head h") and rows ("layer l").
    """
    w = as_array(weights, "weights", 4)
    L, H, M, N = w.shape
    tokens = check_tokens(tokens, N)
    maps, f = block_mean(w, max_tokens)  # (L, H, m, n)
    m, n = maps.shape[-2:]
    z = np.full((L, m + 1, H, n + 1), np.nan, dtype=np.float32)
    z[:, :m, :, :n] = maps.transpose(0, 2, 1, 3)  # (L, m, H, n): row = (layer, query), column = (head, key)
    z = z.reshape(L * (m + 1), H * (n + 1))[:-1, :-1]  # no gutter after the last layer / head

    def label(i: int, what: str, count: int, toks) -> str:
        if f == 1:
            return f"{what} {i} {toks[i]!r}" if toks is not None else f"{what} {i}"
        return f"{PLURAL[what]} {i * f}-{min((i + 1) * f, count) - 1}"

    xs, ys = [], []  # gutters get a unique blank label (thin spaces)
    for head in range(H):
        xs += [f"head {head} · {label(j, 'key', N, tokens)}" for j in range(n)]
        xs += ["\u2009" * (head + 1)] if head < H - 1 else []
    for layer in range(L):
        ys += [f"layer {layer} · {label(i, 'query', M, tokens if M == N else None)}" for i in range(m)]
        ys += ["\u2009" * (layer + 1)] if layer < L - 1 else []
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=xs,  # unique by construction (index in every label)
            y=ys,
            colorscale=COLORSCALE,
            zmin=0.0,
            zmax=float(np.nanmax(maps)) if zmax is None else zmax,
            hoverongaps=False,
            colorbar={"title": {"text": "weight"}},
            hovertemplate="%{y}<br>%{x}<br>weight %{z:.4f}<extra></extra>",
        )
    )
    fig.update_xaxes(type="category", showticklabels=False, ticks="", showgrid=False, side="top")
    fig.update_yaxes(type="category", showticklabels=False, ticks="", showgrid=False, autorange="reversed")
    titles = [  # column and row titles over the middle of their tiles, set at once
        {"x": xs[h * (n + 1) + n // 2], "y": 1.0, "yref": "paper", "yanchor": "bottom", "text": f"head {h}"}
        for h in range(H)
    ] + [
        {"y": ys[k * (m + 1) + m // 2], "x": 0.0, "xref": "paper", "xanchor": "right", "text": f"layer {k}"}
        for k in range(L)
    ]
    if f > 1:
        title = f"{title} (means over {f}x{f} token blocks)"
    focus = check_focus(focus, N)
    shapes = []
    if focus is not None:
        block = focus // f  # its query block and key block
        for layer in range(L):
            for head in range(H):
                shapes += focus_shapes(block, m, n, at=(layer * (m + 1), head * (n + 1)))
        title = f"{title} (focus: {focus}: {tokens[focus]})" if tokens else f"{title} (focus: {focus})"
    fig.update_layout(
        shapes=shapes,
        annotations=[{**a, "showarrow": False, "font": {"size": 10}} for a in titles],
        title=title,
        width=cell_px * H + 200,
        height=cell_px * L + 130,
        margin={"l": 70, "r": 30, "t": 90, "b": 20},
        plot_bgcolor="white",
    )
    return fig


def attention_heatmap(
    weights,
    tokens: Sequence[str],
    *,
    query_tokens: Sequence[str] | None = None,
    title: str = "Attention weights",
    zmax: float | None = None,
    focus: int | None = None,
    showscale: bool = True,
    click_targets: bool = False,
    starts: tuple[int, int] = (0, 0),
) -> go.Figure:
    """One head's (M, N) weights with token labels on both axes and hover (query, key, weight).

    ``tokens`` label the N keys (x); ``query_tokens`` the M queries (y), default ``tokens``. Queries
    run top to bottom. Axis categories carry the position ("3: the"), so repeated tokens stay apart
    and the hover names both positions; every label is drawn while they fit (else every k-th, evenly).
    ``focus`` outlines one token's row and column (:func:`focus_shapes`); ``zmax`` fixes the top of
    the colour scale (shared by compared panels). The heatmap trace holds the weights unchanged
    (float32). ``click_targets`` adds a second trace, one invisible marker per cell (``customdata`` =
    [query, key, weight]), which carries the hover and makes cells clickable (plotly cannot select
    heatmap cells); use it for maps of up to ~80 tokens. ``starts``: the text positions of the first
    query and the first key (a region of a longer map: labels name the positions in the text).
    """
    w = as_array(weights, "weights", 2)
    M, N = w.shape
    keys = check_tokens(tokens, N)
    queries = check_tokens(tokens if query_tokens is None else query_tokens, M, "query_tokens")
    focus = check_focus(focus, max(M, N))
    side = int(min(max(16 * max(M, N) + 170, 440), 1400))
    font = 11 if max(M, N) <= 48 else 10 if max(M, N) <= 80 else 9
    xs, ys = position_labels(keys, starts[1]), position_labels(queries, starts[0])
    fig = go.Figure(
        go.Heatmap(
            z=w,
            x=xs,
            y=ys,
            colorscale=COLORSCALE,
            zmin=0.0,
            zmax=(float(w.max()) if w.size else 1.0) if zmax is None else zmax,
            showscale=showscale,
            colorbar={"title": {"text": "weight"}},
            hovertemplate="query %{y}<br>key %{x}<br>weight %{z:.4f}<extra></extra>",
        )
    )
    kx, ky = label_step(N, side - 170, font), label_step(M, side - 170, font)
    fig.update_xaxes(
        type="category",
        title="key (attended to)",
        tickangle=-90,
        tickmode="array",
        tickvals=xs[::kx],
        tickfont={"size": font},
        range=[-0.5, N - 0.5],  # exactly the cells (click targets would pad an automatic range)
        automargin=True,
        title_standoff=6,
    )
    fig.update_yaxes(
        type="category",
        title="query (attending)",
        tickmode="array",
        tickvals=ys[::ky],
        tickfont={"size": font},
        range=[M - 0.5, -0.5],  # reversed: queries top to bottom
        automargin=True,
        title_standoff=6,
    )
    fig.update_layout(title=title, width=side + 80, height=side, shapes=focus_shapes(focus, M, N))
    if click_targets:
        qi, kj = (a.ravel() for a in np.indices((M, N)))
        fig.data[0].hoverinfo = "skip"
        fig.data[0].hovertemplate = None
        hidden = {"marker": {"opacity": 1.0}}  # transparent by colour: selection must not show them
        fig.add_trace(
            go.Scatter(
                x=np.asarray(xs, dtype=object)[kj],
                y=np.asarray(ys, dtype=object)[qi],
                mode="markers",
                marker={
                    "size": max(6, (side - 170) // max(M, N)),
                    "symbol": "square",
                    "color": "rgba(0,0,0,0)",
                },
                customdata=np.column_stack([qi, kj, w.ravel()]),
                hovertemplate="query %{y}<br>key %{x}<br>weight %{customdata[2]:.4f}<extra></extra>",
                showlegend=False,
                selected=hidden,
                unselected=hidden,
            )
        )
        fig.update_layout(hovermode="closest")
    return fig
