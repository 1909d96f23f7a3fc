"""bertviz's neuron view of one (query, key) pair: the query and key vectors per dimension, the
products ``scale · q_d · k_d`` whose sum is the pair's score, and the weight each variant gives the
pair (the same score, normalized differently: DNAS's column normalization reweights it).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from attnlab.figures._data import as_array, variant_color
from attnlab.figures.bundle import FigureBundle

__all__ = ["neuron_view", "neuron_bundle"]

POSITIVE, NEGATIVE = "#1f77b4", "#d62728"


def _check(q, k, scale) -> tuple[np.ndarray, np.ndarray, float]:
    q, k = as_array(q, "q", 1), as_array(k, "k", 1)
    if q.shape != k.shape or q.size == 0:
        raise ValueError(f"q and k must be (D,) vectors of one length D > 0, got {q.shape} and {k.shape}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)) or not scale > 0:
        raise ValueError(f"scale must be a number > 0, got {scale!r}")
    return q, k, float(scale)


def neuron_view(
    q,
    k,
    scale: float,
    *,
    query_label: str,
    key_label: str,
    weights: Mapping[str, float],
    title: str = "Neuron view",
    softcap: float | None = None,
) -> go.Figure:
    """The neuron view of one pair.

    q, k: (D,) the query's and the key's vectors in one head (after projection and rotary
    embedding; a grouped-query layer's key head). ``scale``: the layer's score scale. ``weights``:
    {variant: the weight it gives the pair}. Top left, q and k per dimension (one diverging scale
    centred at 0); below, ``scale · q_d · k_d`` per dimension (blue > 0, red < 0), whose sum, the
    score, is in the title (and ``softcap · tanh(score / softcap)`` for a softcapped layer); right,
    the weight of each variant.
    """
    q, k, scale = _check(q, k, scale)
    D = q.size
    prod = scale * q.astype(np.float64) * k.astype(np.float64)  # (D,)
    score = float(prod.sum())
    fig = make_subplots(
        rows=2,
        cols=2,
        column_widths=[0.78, 0.22],
        row_heights=[0.3, 0.7],
        specs=[[{}, {"rowspan": 2}], [{}, None]],
        horizontal_spacing=0.1,
        vertical_spacing=0.18,
        subplot_titles=("q and k per dimension", "weight of the pair", "scale · q_d · k_d per dimension"),
    )
    lim = float(max(np.abs(q).max(), np.abs(k).max(), 1e-12))
    fig.add_trace(
        go.Heatmap(
            z=np.stack([q, k]),
            x=np.arange(D),
            y=["q", "k"],  # (the query and the key are named in the title)
            colorscale="RdBu",
            reversescale=True,
            zmid=0.0,
            zmin=-lim,
            zmax=lim,
            showscale=False,
            hovertemplate="%{y} dim %{x}: %{z:.4f}<extra></extra>",
        ),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Bar(
            x=np.arange(D),
            y=prod,
            marker={"color": np.where(prod >= 0, POSITIVE, NEGATIVE)},
            customdata=np.column_stack([q, k]),
            hovertemplate="dim %{x}: q %{customdata[0]:.4f} · k %{customdata[1]:.4f} · scale"
            " = %{y:.4f}<extra></extra>",
            showlegend=False,
        ),
        row=2,
        col=1,
    )
    names = list(weights)
    fig.add_trace(
        go.Bar(
            x=names,
            y=[float(weights[v]) for v in names],
            marker={"color": [variant_color(v, i) for i, v in enumerate(names)]},
            text=[f"{float(weights[v]):.4f}" for v in names],
            textposition="outside",
            hovertemplate="%{x}: %{y:.5f}<extra></extra>",
            showlegend=False,
        ),
        row=1,
        col=2,
    )
    capped = "" if softcap is None else f", softcapped {softcap * np.tanh(score / softcap):.4f}"
    fig.update_xaxes(title_text="dimension d", row=2, col=1)
    fig.update_yaxes(title_text="contribution to the score", row=2, col=1)
    top = max([float(weights[v]) for v in names] + [1e-6])
    fig.update_yaxes(range=[0, top * 1.25], row=1, col=2)
    fig.update_layout(
        title=f"{title}: query {query_label} → key {key_label}; score = Σ_d = {score:.4f}{capped}",
        width=1100,
        height=520,
        plot_bgcolor="white",
        bargap=0.1,
        margin={"t": 90},
    )
    return fig


def neuron_bundle(q, k, scale: float, **options) -> FigureBundle:
    """:func:`neuron_view` (``options``: its keyword arguments) with its data: one row per dimension
    (d, q, k, product) and the arrays (q, k, products, score, scale, each variant's weight) for the
    NPZ export."""
    fig = neuron_view(q, k, scale, **options)
    q, k, scale = _check(q, k, scale)
    prod = scale * q.astype(np.float64) * k.astype(np.float64)
    table = pd.DataFrame({"dimension": np.arange(q.size), "q": q, "k": k, "product": prod})
    arrays = {"q": q, "k": k, "products": prod, "score": np.array(prod.sum()), "scale": np.array(scale)}
    arrays |= {f"weight_{v}": np.array(float(w)) for v, w in options["weights"].items()}
    return FigureBundle(fig, table, arrays)
