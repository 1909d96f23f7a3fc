"""Explaining-away figures: column-mass distributions on a log axis, explained-away fractions."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from attnlab.figures._data import as_array, variant_color

__all__ = ["column_mass_distribution", "explained_away_heatmap"]

BOUND_STYLE = {"dnas": {"color": "black", "dash": "dash"}, "hnas": {"color": "dimgray", "dash": "dot"}}
OTHER_BOUND = {"color": "gray", "dash": "dashdot"}
LABEL_ROW_PX = 18  # the floors' labels sit above the plot, one row each (font 11), whatever its height


def column_floors(data: Mapping, n_valid: int, u: float | None) -> list[tuple[str, str, float]]:
    """(variant, label, value) of the column-mass floors to draw: DNAS's 1/N always (the reference
    line), and the floor c/N each other variant among ``data``'s keys guarantees (its spec's
    ``column_floor``), when its parameters are known (HNAS: ``u``)."""
    from attnlab.normalizers import VARIANTS, variant_spec

    bounds = [("dnas", f"1/N = 1/{n_valid} (DNAS floor)", 1.0 / n_valid)]
    given = {} if u is None else {"u": u}
    for name in dict.fromkeys([*data, *(["hnas"] if u is not None else [])]):  # u given: its floor too
        if name not in VARIANTS or name == "dnas":
            continue
        spec = variant_spec(name)
        if spec.column_floor is None or any(p.name not in given for p in spec.params):
            continue  # no floor, or it depends on a parameter not given here
        value = float(spec.column_floor(given))
        if any(abs(value / n_valid - b[2]) < 1e-12 for b in bounds):
            continue  # the same line (e.g. Sinkhorn's 1/N)
        symbol = "/".join(p.name for p in spec.params) or f"{value:g}"
        bounds.append((name, f"{symbol}/N = {value:g}/{n_valid} ({spec.display} floor)", value / n_valid))
    return bounds


def _ecdf(x: np.ndarray, max_points: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted values and the fraction of values <= each; at most max_points exact ECDF points."""
    xs = np.sort(x)
    ys = np.arange(1, xs.size + 1, dtype=np.float64) / max(xs.size, 1)
    if xs.size > max_points:  # evenly spaced order statistics, always keeping the extremes
        idx = np.unique(np.linspace(0, xs.size - 1, max_points).round().astype(np.int64))
        xs, ys = xs[idx], ys[idx]
    return xs, ys


def column_mass_distribution(
    masses: Mapping[str, object],
    n_valid: int,
    u: float | None = None,
    *,
    kind: str = "ecdf",
    title: str = "Column mass per key (attention received)",
    legend_title: str | None = "variant",
    bins: int = 60,
    max_points: int = 20_000,
) -> go.Figure:
    """Distribution of column masses m_j per variant on a log x-axis, with the DNAS / HNAS floors.

    Args:
        masses: {variant: column masses} of any shape (e.g. (L, H, N) from ``stats.column_mass``;
            flattened). Pass only valid keys' masses. Values <= 0 cannot sit on a log axis and are
            drawn at a floor a decade below the smallest positive value (and 1/N).
        n_valid: N_valid; a vertical line marks the DNAS floor 1/N_valid.
        u: HNAS hybrid weight; if given, a second line marks u/N_valid.
        kind: "ecdf" (fraction of keys with mass <= m; one exact step curve per variant) or
            "histogram" (fraction of keys per log-spaced bin, drawn as a step curve).
        bins: number of log-spaced bins for "histogram".
        max_points: an ECDF with more values is drawn through this many exact order statistics.
        legend_title: what the curves are ("variant"; "panel" for Compare's sources); None: no title.

    Returns:
        Figure with one trace per variant (named by the variant, in dict order), then one line trace
        named "1/N = ..." and, with u, one named "u/N = ..."; each line also has a text label.
    """
    if kind not in ("ecdf", "histogram"):
        raise ValueError(f'kind must be "ecdf" or "histogram", got {kind!r}')
    if isinstance(n_valid, bool) or not isinstance(n_valid, (int, np.integer)) or n_valid < 1:
        raise ValueError(f"n_valid must be an integer >= 1, got {n_valid!r}")
    if not isinstance(masses, Mapping) or not masses:
        raise ValueError("masses must be a non-empty dict {variant: array of column masses}")
    data = {name: as_array(m, f"masses[{name!r}]").reshape(-1) for name, m in masses.items()}
    positive = [x[x > 0] for x in data.values()]
    smallest = min([float(p.min()) for p in positive if p.size] + [1.0 / n_valid])
    floor = smallest / 10.0
    bounds = column_floors(data, n_valid, u)

    fig = go.Figure()
    ymax = 1.0
    if kind == "histogram":
        top = max([float(x.max()) for x in data.values() if x.size] + [1.0 / n_valid])
        edges = np.geomspace(floor / 1.0001, top * 1.0001, bins + 1)
        ymax = 0.0
    for k, (name, x) in enumerate(data.items()):
        x = np.where(x > 0, x, floor).astype(np.float64)
        line = {"shape": "hv", "color": variant_color(name.rsplit(" · ", 1)[-1], k)}
        if kind == "ecdf":
            xs, ys = _ecdf(x, max_points)
            fig.add_trace(go.Scatter(
                x=xs, y=ys, name=name, mode="lines", line=line,
                hovertemplate=f"{name}<br>m = %{{x:.3g}}<br>fraction of keys <= m: %{{y:.3f}}<extra></extra>",
            ))
        else:
            counts = np.histogram(x, bins=edges)[0] / max(x.size, 1)
            ymax = max(ymax, float(counts.max()) if counts.size else 0.0)
            fig.add_trace(go.Scatter(
                x=edges, y=np.append(counts, counts[-1]), name=name, mode="lines", line=line,
                hovertemplate=f"{name}<br>bin from m = %{{x:.3g}}<br>fraction of keys: %{{y:.3f}}"
                "<extra></extra>",
            ))
    ymax = ymax or 1.0
    for k, (key, label, value) in enumerate(bounds):
        fig.add_trace(go.Scatter(
            x=[value, value], y=[0.0, ymax], name=label, mode="lines", line=BOUND_STYLE.get(key, OTHER_BOUND),
            hovertemplate=f"{label} = {value:.4g}<extra></extra>",
        ))
        # annotations on a log axis are placed in log10 units (traces and shapes in data units); a
        # floor below 1/N is labelled on its left, so its label does not run across the 1/N line; each
        # label gets its own row above the plot, in pixels (rows in paper units overlapped "u/N" and
        # "1/N" on a short plot)
        side = "left" if value >= 1.0 / n_valid else "right"
        fig.add_annotation(x=math.log10(value), y=1.0, yref="paper", yshift=2 + LABEL_ROW_PX * k,
                           text=label.split(" (")[0], showarrow=False, xanchor=side, yanchor="bottom",
                           font={"size": 11})
    top = max([float(x.max()) for x in data.values() if x.size] + [1.0 / n_valid])
    lo = min([floor] + [value for _, _, value in bounds])
    fig.update_xaxes(range=[math.log10(lo) - 0.15, math.log10(top) + 0.15])  # log10 units
    fig.update_xaxes(type="log", title="column mass m_j = sum_i pi_ij (log scale)")
    fig.update_yaxes(title="fraction of keys with mass <= m" if kind == "ecdf" else "fraction of keys",
                     rangemode="tozero")
    fig.update_layout(title=title, legend={"title": {"text": legend_title or ""}}, width=820, height=480,
                      margin={"t": 70 + LABEL_ROW_PX * len(bounds)})
    return fig


def explained_away_heatmap(
    fractions,
    title: str = "Explained-away fraction per layer and head",
    *,
    zmax: float = 1.0,
    show_values: bool | None = None,
    columns: int | None = None,
    cell_px: int = 46,
) -> go.Figure:
    """Explained-away fraction per layer (rows) and head (columns), 0 = no key explained away.

    ``fractions`` is an (L, H) array, or {variant: (L, H)} for one panel per variant sharing one
    color scale (e.g. ``stats.explained_away_fraction(weights, eps)`` per variant, or a pivot of the
    tidy table). Panels wrap into ``columns`` per row (default: as many as fit 1,500 px at
    ``cell_px`` per cell). Cell values are printed when ``show_values`` (default: when a cell is at
    least 36 px wide and there are at most 400 cells per panel, so the numbers never run together).
    """
    panels = dict(fractions) if isinstance(fractions, Mapping) else {"": fractions}
    if not panels:
        raise ValueError("fractions must be an (L, H) array or a non-empty dict {variant: (L, H)}")
    data = {name: as_array(f, "fractions" if not name else f"fractions[{name!r}]", 2)
            for name, f in panels.items()}
    shapes = {a.shape for a in data.values()}
    if len(shapes) != 1:
        raise ValueError(f"every panel must have one (L, H) shape, got {sorted(shapes)}")
    L, H = shapes.pop()
    n = len(data)
    cols = columns or max(1, min(n, 1500 // (cell_px * H + 70)))
    rows = -(-n // cols)
    if show_values is None:
        show_values = cell_px >= 36 and L * H <= 400
    names = list(data)
    fig = make_subplots(rows=rows, cols=cols, shared_yaxes=True, horizontal_spacing=0.05,
                        vertical_spacing=min(0.2, 0.6 / rows),
                        subplot_titles=names if n > 1 or names != [""] else None)
    for k, (name, z) in enumerate(data.items()):
        label = f"{name}<br>" if name else ""
        fig.add_trace(go.Heatmap(
            z=z, x=np.arange(H), y=np.arange(L), coloraxis="coloraxis",
            texttemplate="%{z:.2f}" if show_values else None, textfont={"size": 10},
            hovertemplate=f"{label}layer %{{y}}, head %{{x}}<br>explained away: %{{z:.3f}}<extra></extra>",
        ), row=k // cols + 1, col=k % cols + 1)
    fig.update_xaxes(dtick=1 if H <= 16 else None)
    fig.update_xaxes(title="head", row=rows)  # under the last row only: clear of the titles below
    fig.update_yaxes(autorange="reversed", dtick=1 if L <= 24 else None)
    fig.update_yaxes(title="layer", col=1)
    fig.update_layout(
        title=title,
        coloraxis={"colorscale": "Reds", "cmin": 0.0, "cmax": zmax,
                   "colorbar": {"title": {"text": "fraction"}}},
        width=min(1600, 130 + cols * (cell_px * H + 70)),
        height=120 + rows * (cell_px * 0.75 * L + 70),
    )
    return fig
