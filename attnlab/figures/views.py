"""Attention views of the app beyond the library's maps: the token strip (attention each token
receives), maps of several sources side by side on one colour scale, difference maps and the
Jensen-Shannon distance per head.

Every view that shows tokens takes an optional ``focus`` (a token position: click to focus) and
outlines that token's row (what it sends) and column (what it receives).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from attnlab.figures._data import MAGMA, as_array, check_focus, check_tokens
from attnlab.figures.attention import (
    COLORSCALE,
    FOCUS_COLOR,
    focus_shapes,
    label_step,
    position_labels,
)

__all__ = [
    "difference_heatmap",
    "js_distance_heatmap",
    "panel_heatmaps",
    "token_mass_strip",
]

CAP_QUANTILE = 0.95  # the token strip's colour scale tops out here (attention sinks would wash it out)


def token_mass_strip(
    tokens: Sequence[str],
    mass,
    *,
    per_row: int = 16,
    title: str = "Attention received",
    bound: float | None = None,
    focus: int | None = None,
    what: str = "mass",
) -> go.Figure:
    """The tokens in reading order, ``per_row`` to a line, each cell shaded by ``mass``.

    mass: (N,) e.g. the attention each token receives (column mass averaged over heads), or the
    row a focused token sends. ``bound``, when given, is named in the colour bar title (e.g. the
    DNAS floor 1/N). The colour scale tops out at the 95th percentile so that attention sinks
    ([CLS], [SEP], punctuation) do not wash out the rest; the colour bar says so whenever a value
    lies above it, and hover shows every exact value. ``focus`` outlines one token. The second
    trace holds one (invisible) marker per token, ``customdata`` = position (what a click selects).
    """
    mass = as_array(mass, "mass", 1)
    tokens = check_tokens(tokens, mass.shape[0], "tokens")
    n = len(tokens)
    focus = check_focus(focus, n)
    rows = max(1, math.ceil(n / per_row))
    z = np.full((rows, per_row), np.nan, dtype=np.float32)
    text = np.full((rows, per_row), "", dtype=object)
    for i, (t, m) in enumerate(zip(tokens, mass, strict=True)):
        z[i // per_row, i % per_row] = m
        text[i // per_row, i % per_row] = t if len(t) <= 12 else t[:11] + "…"
    top = float(mass.max()) if mass.size else 1.0
    cap = max(float(np.quantile(mass, CAP_QUANTILE)), 1e-9) if mass.size else 1.0
    bar = what if bound is None else f"{what} (1/N = {bound:.3g})"
    if top > cap:
        bar += f"<br>scale capped at the 95th<br>percentile ({cap:.3g}; max {top:.3g})"
    pos = np.arange(n)
    fig = go.Figure(
        [
            go.Heatmap(
                z=z,
                text=text,
                texttemplate="%{text}",
                textfont={"size": 12},
                colorscale="Blues",
                zmin=0.0,
                zmax=cap,
                hoverongaps=False,
                hoverinfo="skip",
                xgap=2,
                ygap=2,
                colorbar={"title": {"text": bar, "side": "right"}},
            ),
            go.Scatter(  # the click / hover targets: one marker per token, on its cell
                x=pos % per_row,
                y=pos // per_row,
                mode="markers",
                marker={"size": 26, "symbol": "square", "color": "rgba(0, 0, 0, 0)"},
                customdata=pos,
                hovertext=[f"{i}: {t}" for i, t in enumerate(tokens)],
                text=[f"{m:.4f}" for m in mass],  # exact values for the hover
                hovertemplate="token %{hovertext}<br>" + what + " %{text}<extra></extra>",
                showlegend=False,
                selected={"marker": {"opacity": 1.0}},
                unselected={"marker": {"opacity": 1.0}},
            ),
        ]
    )
    if focus is not None:
        r, c = divmod(focus, per_row)
        fig.add_shape(
            type="rect",
            x0=c - 0.5,
            x1=c + 0.5,
            y0=r - 0.5,
            y1=r + 0.5,
            line={"color": FOCUS_COLOR, "width": 3},
        )
    fig.update_xaxes(visible=False, range=[-0.5, per_row - 0.5], fixedrange=True)
    fig.update_yaxes(visible=False, autorange="reversed", fixedrange=True)
    fig.update_layout(
        title=title,
        width=min(1400, 78 * per_row + 160),
        height=60 + 30 * rows + 70,
        plot_bgcolor="white",
        margin={"l": 10, "r": 10, "t": 60, "b": 10},
        hovermode="closest",
    )
    return fig


def difference_heatmap(
    a, b, tokens: Sequence[str], *, title: str = "Difference A - B", focus: int | None = None
) -> go.Figure:
    """A - B of two (N, N) maps on a diverging scale centred on 0 (symmetric range, stated in the
    colour bar), with position-labelled tokens."""
    a, b = as_array(a, "a", 2), as_array(b, "b", 2)
    if a.shape != b.shape:
        raise ValueError(f"a and b must have one shape, got {a.shape} and {b.shape}")
    d = a - b
    return panel_heatmaps([d], tokens, [title], diverging=True, focus=focus, title=title)


NARROWEST_PX = 820  # the app's main column in a 1280 px wide window (sidebar open): the narrowest a
# figure drawn at the container's width gets, where its panels' labels must still not collide
BESIDE_PANELS_PX = 230  # of a figure's width, what is not panels: query labels and title, colour bar
PANEL_TITLE_FONT = 13
CHAR_PX = 0.6  # a character's width, in font sizes (plotly's sans-serif, a generous mean)


def wrap_title(title: str, chars: int) -> str:
    """``title`` as it is when it has at most ``chars`` characters, else in lines of at most ``chars``
    where it can break (" · " first, then spaces), joined with ``<br>``; a longer word stays whole."""
    if len(title) <= chars:
        return title
    lines: list[str] = []
    for part in title.split(" · "):
        for word in part.split(" "):
            if lines and lines[-1] and len(lines[-1]) + 1 + len(word) <= chars:
                lines[-1] += " " + word
            else:
                lines.append(word)
        lines.append("")  # " · " breaks the line
    return "<br>".join(line for line in lines if line)


def panel_heatmaps(
    maps: Sequence,
    tokens: Sequence[str],
    titles: Sequence[str],
    *,
    shared_scale: bool = True,
    diverging: bool = False,
    focus: int | None = None,
    title: str = "",
    panel_px: int = 420,
    axis_labels: tuple[Sequence[str], Sequence[str]] | None = None,
) -> go.Figure:
    """Several (N, N) maps side by side in one figure.

    shared_scale: one colour axis and one colour bar for every panel (the same colour means the same
    weight); False gives each panel its own range and colour bar. diverging: a red-blue scale centred
    at 0 with a symmetric range +-max|value| (difference maps); the colour bar states the range.
    Axis categories are position-labelled tokens ("3: the"), or ``axis_labels`` (query labels, key
    labels) as given, e.g. the token ranges of pooled maps; ``focus`` outlines a row and column (a token,
    or a pooled map's cell) in every panel.
    The app draws the figure at its container's width: the key labels (every k-th) and the panel
    titles (wrapped) are sized for the narrowest, :data:`NARROWEST_PX`, so that none collide there.
    """
    arrays = [as_array(m, f"maps[{k}]", 2) for k, m in enumerate(maps)]
    if not arrays:
        raise ValueError("maps must hold at least one (N, N) map")
    if len({a.shape for a in arrays}) != 1:
        raise ValueError(f"every map must have one shape, got {sorted({a.shape for a in arrays})}")
    if len(titles) != len(arrays):
        raise ValueError(f"got {len(arrays)} maps and {len(titles)} titles")
    M, N = arrays[0].shape
    focus = check_focus(focus, max(M, N))
    if axis_labels is not None:
        ys, xs = (check_tokens(names, n, "axis_labels")
                  for names, n in zip(axis_labels, (M, N), strict=True))
    else:
        keys = check_tokens(tokens, N)
        xs, ys = position_labels(keys), position_labels(keys if M == N else [str(i) for i in range(M)])
    n = len(arrays)
    # room between panels: a gap, or a colour bar with its ticks when each panel has its own
    spacing = (0.1 / n + 0.03) if shared_scale else 0.12
    narrow = (1 - spacing * (n - 1)) / n * (NARROWEST_PX - BESIDE_PANELS_PX)  # a panel's px, at its narrowest
    # a panel named as the figure (one difference map) is not named twice: the two lines overlapped
    chars = max(8, int(narrow / (CHAR_PX * PANEL_TITLE_FONT)))
    subplot_titles = ["" if t == title else wrap_title(t, chars) for t in titles]
    fig = make_subplots(rows=1, cols=n, subplot_titles=subplot_titles, horizontal_spacing=spacing)
    fig.update_annotations(font={"size": PANEL_TITLE_FONT})
    lines = max([t.count("<br>") + 1 for t in subplot_titles if t] + [0])

    def span(a):
        return float(np.abs(a).max()) if diverging else float(a.max())

    shared = max([span(a) for a in arrays] + [1e-9])
    font = 10 if N <= 40 else 9
    shapes = []
    for k, a in enumerate(arrays):
        axis = "coloraxis" if shared_scale else f"coloraxis{k + 1}"
        fig.add_trace(
            go.Heatmap(
                z=a,
                x=xs,
                y=ys,
                coloraxis=axis,
                hovertemplate=f"{titles[k]}<br>query %{{y}}<br>key %{{x}}<br>"
                + ("difference" if diverging else "weight")
                + " %{z:.4f}<extra></extra>",
            ),
            row=1,
            col=k + 1,
        )
        lim = shared if shared_scale else max(span(a), 1e-9)
        if k == 0 or not shared_scale:
            domain = fig.layout[f"xaxis{k + 1 if k else ''}"].domain
            name = "difference" if diverging else "weight"
            bar = {"title": {"text": f"{name}<br>{'±' if diverging else '0–'}{lim:.3g}"}, "len": 0.9}
            if not shared_scale:  # its range under the bar: a title above it ran into the next panel's
                bar |= {"x": domain[1] + 0.005, "xanchor": "left", "thickness": 10,
                        "title": {"text": f"{'±' if diverging else '0–'}{lim:.2g}", "side": "bottom"}}
            fig.layout[axis] = {
                "colorscale": "RdBu_r" if diverging else COLORSCALE,
                "cmin": -lim if diverging else 0.0,
                "cmax": lim,
                "colorbar": bar,
            }
        shapes += focus_shapes(focus, M, N, xref=f"x{k + 1 if k else ''}", yref=f"y{k + 1 if k else ''}")
    fig.update_xaxes(
        type="category", tickangle=-90, tickmode="array", tickvals=xs[:: label_step(N, narrow, font)],
        tickfont={"size": font},
    )
    fig.update_yaxes(
        type="category",
        autorange="reversed",
        tickmode="array",
        tickvals=ys[:: label_step(M, panel_px - 120, font)],  # the height is the figure's own
        tickfont={"size": font},
        showticklabels=False,
    )
    fig.update_yaxes(showticklabels=True, col=1, title="query", automargin=True, title_standoff=6)
    fig.update_xaxes(title="key", automargin=True, title_standoff=6)
    fig.update_layout(
        title=title,
        width=n * panel_px + 160,
        height=panel_px + 160,
        margin={"b": 110, "t": max(100, 32 * lines + 40)},  # the title clear of wrapped panel titles
        shapes=shapes,
    )
    return fig


def js_distance_heatmap(
    values, *, title: str = "Jensen-Shannon distance per layer and head", zmax: float | None = None
) -> go.Figure:
    """(L, H) distances in [0, 1] (0 = same rows, 1 = disjoint), cell values printed when small.
    ``zmax``: the top of the colour scale (default: the largest distance), one for maps compared."""
    v = as_array(values, "values", 2)
    L, H = v.shape
    fig = go.Figure(
        go.Heatmap(
            z=v,
            x=np.arange(H),
            y=np.arange(L),
            colorscale=MAGMA,
            zmin=0.0,
            zmax=max(float(v.max()), 1e-6) if zmax is None else float(zmax),
            texttemplate="%{z:.2f}" if L * H <= 144 else None,
            textfont={"size": 10},
            colorbar={"title": {"text": "JS distance"}},
            hovertemplate="layer %{y}, head %{x}<br>JS distance %{z:.4f}<extra></extra>",
        )
    )
    fig.update_xaxes(title="head", dtick=1)
    fig.update_yaxes(title="layer", dtick=1, autorange="reversed")
    fig.update_layout(title=title, width=min(1200, 160 + 46 * H), height=150 + 36 * L)
    return fig
