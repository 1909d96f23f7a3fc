"""Figures of the Streamlit app that ``attnlab.figures`` does not have, and their export bundles.

Everything here is plain Python (no streamlit): the app's pages call :func:`build` with a figure kind
and its parameters, and :func:`reproduce_figure` calls the same :func:`build` on the files that
``attnlab analyze`` writes, so an exported manifest rebuilds the very figure the page showed.

Kinds built from one analysis (weights ``{variant: (L, H, N, N)}`` of one window + its tokens)::

    grid            layer x head maps of one variant (attnlab.figures.attention_grid: one trace)
    heatmap         one head's map with token labels (attnlab.figures.attention_heatmap)
    head_view       lines from each query to each key, opacity = weight (bertviz-style)
    token_mass      the text's tokens shaded by the attention they receive (column mass)
    column_mass     column-mass distributions per variant or layer (attnlab.figures, log axis)
    explained_away  explained-away fraction per layer and head, one panel per variant

Kinds built from two analyses ("sources" A and B, same tokens)::

    difference      A - B for one layer and head (diverging colours)
    js_distance     Jensen-Shannon distance between A and B per layer and head

Other builders: :func:`hybrid_weight_curves`, :func:`hybrid_weight_heatmap`, :func:`training_curves`,
:func:`embedding_scatter` with :func:`pca_2d` / :func:`umap_2d`, :func:`most_explained_away`.
Bytes for download buttons: :func:`figure_bytes` (PNG/SVG/PDF/HTML/JSON), :func:`data_bytes`
(CSV/NPZ/JSON), :func:`manifest` and :func:`analyze_command`.
"""

from __future__ import annotations

import datetime
import io
import json
import math
import shlex
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch

from attnlab.figures._data import as_array, block_mean, check_tokens, unique_labels
from attnlab.figures.attention import attention_grid, attention_heatmap
from attnlab.figures.distributions import column_mass_distribution, explained_away_heatmap

__all__ = [
    "KINDS",
    "FigureBundle",
    "analyze_command",
    "build",
    "data_bytes",
    "difference_heatmap",
    "embedding_scatter",
    "embedding_view",
    "figure_bytes",
    "head_view",
    "hybrid_weight_curves",
    "hybrid_weight_heatmap",
    "joint_query_key",
    "js_distance_heatmap",
    "manifest",
    "most_explained_away",
    "pca_2d",
    "reproduce_figure",
    "token_mass_strip",
    "training_curves",
    "umap_2d",
]

KINDS = (
    "grid",
    "heatmap",
    "head_view",
    "token_mass",
    "column_mass",
    "explained_away",
    "difference",
    "js_distance",
)
PAIR_KINDS = ("difference", "js_distance")
MANIFEST_FORMAT = "attnlab-figure/1"


@dataclass
class FigureBundle:
    """A figure and the data behind it, ready for export."""

    figure: go.Figure
    table: pd.DataFrame  # what the figure draws, long format (CSV export)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)  # full-precision data (NPZ export)


# ----------------------------------------------------------------------------------------------
# Attention maps
# ----------------------------------------------------------------------------------------------


def head_view(
    weights, tokens: Sequence[str], *, title: str = "Head view", min_weight: float = 0.02, buckets: int = 6
) -> go.Figure:
    """bertviz-style head view: queries on the left, keys on the right, a line per (query, key)
    with opacity growing with the weight; weights below ``min_weight`` are not drawn.

    weights: (N, N) of one head. Lines are grouped into ``buckets`` opacity levels (one trace each,
    segments separated by None), so even 4,096 pairs stay a handful of traces.
    """
    w = as_array(weights, "weights", 2)
    M, N = w.shape
    keys = check_tokens(tokens, N)
    queries = keys if M == N else [str(i) for i in range(M)]
    top = float(w.max()) if w.size else 1.0
    fig = go.Figure()
    edges = np.linspace(min_weight, max(top, min_weight * 1.0001), buckets + 1)
    for b in range(buckets):
        lo, hi = edges[b], edges[b + 1]
        sel = (w >= lo) & ((w < hi) if b < buckets - 1 else (w <= hi))
        qi, kj = np.nonzero(sel)
        if qi.size == 0:
            continue
        xs = np.column_stack([np.zeros(qi.size), np.ones(qi.size), np.full(qi.size, np.nan)]).ravel()
        ys = np.column_stack([qi, kj, np.full(qi.size, np.nan)]).ravel()
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=ys,
                mode="lines",
                hoverinfo="skip",
                showlegend=False,
                line={"color": "rgb(31, 119, 180)", "width": 1 + 2.5 * (b + 1) / buckets},
                opacity=0.15 + 0.85 * (b + 1) / buckets,
            )
        )
    mass = w.sum(0)  # (N,) column mass of each key
    fig.add_trace(
        go.Scatter(
            x=np.zeros(M),
            y=np.arange(M),
            mode="text",
            text=queries,
            textposition="middle left",
            showlegend=False,
            hovertemplate="query %{y}: %{text}<extra></extra>",
        )
    )
    fig.add_trace(
        go.Scatter(
            x=np.ones(N),
            y=np.arange(N),
            mode="text",
            text=keys,
            textposition="middle right",
            customdata=mass,
            showlegend=False,
            hovertemplate="key %{y}: %{text}<br>column mass %{customdata:.3f}<extra></extra>",
        )
    )
    fig.update_xaxes(visible=False, range=[-0.9, 1.9])
    fig.update_yaxes(visible=False, autorange="reversed")
    fig.update_layout(
        title=title,
        width=520,
        height=max(300, 18 * max(M, N) + 120),
        plot_bgcolor="white",
        margin={"l": 10, "r": 10, "t": 60, "b": 10},
    )
    return fig


def token_mass_strip(
    tokens: Sequence[str],
    mass,
    *,
    per_row: int = 16,
    title: str = "Attention received",
    bound: float | None = None,
) -> go.Figure:
    """The tokens in reading order, ``per_row`` to a line, each cell shaded by its column mass.

    mass: (N,) attention each token receives (e.g. column mass averaged over heads). ``bound``, when
    given, is named in the colour bar title (e.g. the DNAS floor 1/N). The colour scale tops out at
    the 95th percentile, so attention sinks ([CLS], [SEP], punctuation) do not wash out the rest;
    hover shows every exact value.
    """
    mass = as_array(mass, "mass", 1)
    tokens = check_tokens(tokens, mass.shape[0], "tokens")
    n = len(tokens)
    rows = max(1, math.ceil(n / per_row))
    z = np.full((rows, per_row), np.nan, dtype=np.float32)
    text = np.full((rows, per_row), "", dtype=object)
    index = np.full((rows, per_row), -1)
    for i, (t, m) in enumerate(zip(tokens, mass, strict=True)):
        z[i // per_row, i % per_row] = m
        text[i // per_row, i % per_row] = t if len(t) <= 12 else t[:11] + "…"
        index[i // per_row, i % per_row] = i
    fig = go.Figure(
        go.Heatmap(
            z=z,
            text=text,
            customdata=index,
            texttemplate="%{text}",
            textfont={"size": 11},
            colorscale="Blues",
            zmin=0.0,
            zmax=max(float(np.quantile(mass, 0.95)), 1e-9) if mass.size else 1.0,
            hoverongaps=False,
            xgap=2,
            ygap=2,
            colorbar={"title": {"text": "mass" if bound is None else f"mass (1/N = {bound:.3g})"}},
            hovertemplate="token %{customdata}: %{text}<br>attention received %{z:.3f}<extra></extra>",
        )
    )
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False, autorange="reversed")
    fig.update_layout(
        title=title,
        width=min(1400, 78 * per_row + 120),
        height=60 + 28 * rows + 60,
        plot_bgcolor="white",
        margin={"l": 10, "r": 10, "t": 60, "b": 10},
    )
    return fig


def difference_heatmap(a, b, tokens: Sequence[str], *, title: str = "Difference A - B") -> go.Figure:
    """A - B of two (N, N) maps on a diverging scale centred on 0, with token labels."""
    a, b = as_array(a, "a", 2), as_array(b, "b", 2)
    if a.shape != b.shape:
        raise ValueError(f"a and b must have one shape, got {a.shape} and {b.shape}")
    d = a - b
    labels = unique_labels(check_tokens(tokens, d.shape[-1]))
    lim = float(np.abs(d).max()) or 1e-9
    fig = go.Figure(
        go.Heatmap(
            z=d,
            x=labels,
            y=labels if d.shape[0] == d.shape[1] else None,
            colorscale="RdBu",
            zmid=0.0,
            zmin=-lim,
            zmax=lim,
            colorbar={"title": {"text": "A - B"}},
            hovertemplate="query: %{y}<br>key: %{x}<br>A - B: %{z:.4f}<extra></extra>",
        )
    )
    side = int(min(max(14 * d.shape[-1] + 160, 420), 1400))
    fig.update_xaxes(type="category", title="key", tickangle=-60)
    fig.update_yaxes(type="category", title="query", autorange="reversed")
    fig.update_layout(title=title, width=side + 80, height=side)
    return fig


def js_distance_heatmap(values, *, title: str = "Jensen-Shannon distance per layer and head") -> go.Figure:
    """(L, H) distances in [0, 1] (0 = same rows, 1 = disjoint), cell values printed when small."""
    v = as_array(values, "values", 2)
    L, H = v.shape
    fig = go.Figure(
        go.Heatmap(
            z=v,
            x=np.arange(H),
            y=np.arange(L),
            colorscale="Magma",
            zmin=0.0,
            zmax=max(float(v.max()), 1e-6),
            texttemplate="%{z:.2f}" if L * H <= 144 else None,
            textfont={"size": 9},
            colorbar={"title": {"text": "JS distance"}},
            hovertemplate="layer %{y}, head %{x}<br>JS distance %{z:.4f}<extra></extra>",
        )
    )
    fig.update_xaxes(title="head", dtick=1)
    fig.update_yaxes(title="layer", dtick=1, autorange="reversed")
    fig.update_layout(title=title, width=min(1200, 160 + 44 * H), height=150 + 34 * L)
    return fig


# ----------------------------------------------------------------------------------------------
# Statistics views
# ----------------------------------------------------------------------------------------------


def _relative_mass(w: np.ndarray) -> np.ndarray:
    """(..., M, N) -> (..., N) relative column mass m_j * N / M (mean 1); DESIGN.md §4."""
    M, N = w.shape[-2:]
    return w.sum(-2) * (N / max(M, 1))


def most_explained_away(
    weights, tokens: Sequence[str], eps: float, *, layer: int | None = None, top: int = 15
) -> pd.DataFrame:
    """Tokens ranked by how often they are eps-explained away (relative column mass < eps).

    weights: (L, H, N, N) of one variant; ``layer`` restricts to one layer (None: all layers).
    Columns: position, token, share_of_heads (share of (layer, head) maps where the token is
    explained away), mean_relative_mass, min_relative_mass; sorted by share, then mean mass.
    """
    w = as_array(weights, "weights", 4)
    tokens = check_tokens(tokens, w.shape[-1])
    if layer is not None:
        w = w[layer : layer + 1]
    rel = _relative_mass(w).reshape(-1, w.shape[-1])  # (L*H, N)
    frame = pd.DataFrame(
        {
            "position": np.arange(len(tokens)),
            "token": tokens,
            "share_of_heads": (rel < eps).mean(0),
            "mean_relative_mass": rel.mean(0),
            "min_relative_mass": rel.min(0),
        }
    )
    frame = frame.sort_values(["share_of_heads", "mean_relative_mass"], ascending=[False, True])
    return frame.head(top).reset_index(drop=True)


# ----------------------------------------------------------------------------------------------
# The spec-driven builder shared by the app and reproduce_figure
# ----------------------------------------------------------------------------------------------


def _long_table(
    maps: np.ndarray, names: Sequence[str], columns: Sequence[str] = ("query", "key")
) -> pd.DataFrame:
    """(..., M, N) -> one row per entry with integer index columns ``names`` + columns + value."""
    idx = np.indices(maps.shape).reshape(maps.ndim, -1)
    data = {name: idx[k] for k, name in enumerate([*names, *columns])}
    data["weight"] = maps.reshape(-1)
    return pd.DataFrame(data)


def build(
    kind: str,
    weights: Mapping[str, np.ndarray] | Sequence[Mapping[str, np.ndarray]],
    tokens: Sequence[str],
    params: Mapping,
    *,
    u: float | None = None,
    labels: Sequence[str] | None = None,
) -> FigureBundle:
    """Build a figure of ``kind`` (see ``KINDS``) and its data.

    Args:
        kind: one of ``KINDS``.
        weights: ``{variant: (L, H, N, N)}`` of one window; for ``difference`` / ``js_distance`` a
            pair of such dicts (sources A and B, same tokens).
        tokens: the window's N tokens.
        params: the kind's settings: ``variant``, ``layer``, ``head`` (maps); ``variants``,
            ``layer`` (None = all), ``group`` ("variant" | "layer"), ``dist`` ("ecdf" | "histogram")
            for column_mass; ``eps`` (relative) for explained_away; ``max_tokens`` for grid;
            ``variants`` = [variant of A, variant of B] for the pair kinds.
        u: HNAS weight for the u/N line of column_mass (float only).
        labels: display names of the sources (pair kinds; column_mass over several sources, where
            ``params["variants"]`` then holds one variant per source).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    p = dict(params)
    if kind in PAIR_KINDS:
        if isinstance(weights, Mapping) or len(weights) != 2:
            raise ValueError(f"{kind} needs two sources of weights (A, B)")
        va, vb = p["variants"]
        a, b = as_array(weights[0][va], "A", 4), as_array(weights[1][vb], "B", 4)
        if a.shape != b.shape:
            raise ValueError(f"A and B must have one shape to compare, got {a.shape} and {b.shape}")
        la, lb = labels or ("A", "B")
        if kind == "difference":
            layer, head = p["layer"], p["head"]
            fig = difference_heatmap(
                a[layer, head], b[layer, head], tokens, title=f"{la} minus {lb}: layer {layer}, head {head}"
            )
            return FigureBundle(
                fig,
                _long_table(a[layer, head] - b[layer, head], []),
                {"difference": a[layer, head] - b[layer, head], "tokens": np.array(tokens)},
            )
        from attnlab.stats import js_distance

        js = js_distance(torch.from_numpy(a), torch.from_numpy(b)).numpy()  # (L, H)
        fig = js_distance_heatmap(js, title=f"Jensen-Shannon distance, {la} vs {lb}")
        return FigureBundle(
            fig,
            _long_table(js, [], ("layer", "head")).rename(columns={"weight": "js_distance"}),
            {"js_distance": js},
        )
    if kind == "column_mass" and not isinstance(weights, Mapping):  # several sources overlaid
        labels = list(labels or [f"source {k}" for k in range(len(weights))])
        chosen = list(p["variants"])
        if not len(labels) == len(chosen) == len(weights):
            raise ValueError("column_mass over several sources needs one label and one variant per source")
        p["hnas"] = "hnas" in chosen
        weights = {f"{lab} · {v}": w[v] for lab, v, w in zip(labels, chosen, weights, strict=True)}
        p["variants"] = list(weights)
    if not isinstance(weights, Mapping):
        raise ValueError(f"{kind} needs one source of weights {{variant: (L, H, N, N)}}")
    if kind in ("grid", "heatmap", "head_view", "token_mass"):
        v = p["variant"]
        w = as_array(weights[v], f"weights[{v!r}]", 4)
        if kind == "grid":
            fig = attention_grid(
                w,
                tokens,
                title=f"{v}: attention by layer and head",
                max_tokens=p.get("max_tokens", 64),
                cell_px=72,
            )
            pooled, _ = block_mean(w, p.get("max_tokens", 64))
            return FigureBundle(
                fig, _long_table(pooled, ["layer", "head"]), {v: w, "tokens": np.array(tokens)}
            )
        layer, head = p["layer"], p["head"]
        if kind == "heatmap":
            fig = attention_heatmap(w[layer, head], tokens, title=f"{v}: layer {layer}, head {head}")
            return FigureBundle(
                fig, _long_table(w[layer, head], []), {v: w[layer, head], "tokens": np.array(tokens)}
            )
        if kind == "head_view":
            fig = head_view(
                w[layer, head],
                tokens,
                title=f"{v}: head view, layer {layer}, head {head}",
                min_weight=p.get("min_weight", 0.02),
            )
            return FigureBundle(
                fig, _long_table(w[layer, head], []), {v: w[layer, head], "tokens": np.array(tokens)}
            )
        sel = w[layer] if head is None else w[layer, head][None]  # (h, N, N)
        mass = sel.sum(-2).mean(0)  # (N,) column mass, mean over the heads shown
        where = f"layer {layer}, " + ("mean over heads" if head is None else f"head {head}")
        fig = token_mass_strip(
            tokens, mass, title=f"{v}: attention each token receives ({where})", bound=1.0 / len(tokens)
        )
        return FigureBundle(
            fig,
            pd.DataFrame({"position": np.arange(len(tokens)), "token": tokens, "column_mass": mass}),
            {"column_mass": mass},
        )
    if kind == "column_mass":
        variants = list(p.get("variants") or list(weights))
        layer, group = p.get("layer"), p.get("group", "variant")
        masses, frames = {}, []
        for v in variants:
            cm = as_array(weights[v], f"weights[{v!r}]", 4).sum(-2)  # (L, H, N)
            for lay in range(cm.shape[0]) if layer is None else [layer]:
                name = v if group == "variant" else f"{v} · layer {lay}"
                masses.setdefault(name, []).append(cm[lay].reshape(-1))
                frames.append(_long_table(cm[lay], ["head"], ("key",)).assign(variant=v, layer=lay))
        masses = {k: np.concatenate(x) for k, x in masses.items()}
        n = int(np.asarray(next(iter(weights.values()))).shape[-1])
        where = "every layer" if layer is None else f"layer {layer}"
        fig = column_mass_distribution(
            masses,
            n,
            u=u if p.get("hnas", "hnas" in variants) else None,
            kind=p.get("dist", "ecdf"),
            title=f"Column mass per key ({where}, every head)",
        )
        table = pd.concat(frames, ignore_index=True).rename(columns={"weight": "column_mass"})
        return FigureBundle(
            fig, table, {k.replace(" · ", "_").replace(" ", ""): x for k, x in masses.items()}
        )
    # explained_away
    from attnlab.stats import explained_away_fraction

    eps = float(p["eps"])
    variants = list(p.get("variants") or list(weights))
    fractions = {
        v: explained_away_fraction(torch.from_numpy(as_array(weights[v], v, 4)), eps, relative=True).numpy()
        for v in variants
    }
    fig = explained_away_heatmap(fractions, title=f"Explained-away fraction (relative column mass < {eps:g})")
    table = pd.concat(
        [_long_table(f, [], ("layer", "head")).assign(variant=v) for v, f in fractions.items()],
        ignore_index=True,
    ).rename(columns={"weight": "explained_away"})
    return FigureBundle(fig, table, dict(fractions))


# ----------------------------------------------------------------------------------------------
# Training and hybrid weights
# ----------------------------------------------------------------------------------------------


def _u_history(records: Sequence[Mapping]) -> tuple[np.ndarray, np.ndarray]:
    """(steps (T,), u (T, L, H)) from metrics records that carry "u"; NaN (non-mixture) kept."""
    rows = [(r["step"], r["u"]) for r in records if r.get("u") is not None]
    if not rows:
        return np.zeros(0), np.zeros((0, 0, 0))
    return np.array([s for s, _ in rows]), np.array([u for _, u in rows], dtype=np.float64)


def hybrid_weight_curves(
    records: Sequence[Mapping], *, title: str = "HNAS hybrid weight u per layer"
) -> FigureBundle:
    """Per-layer u over training steps (mean over heads, with the min-max band over heads) from
    metrics.jsonl records. u = 1 is pure DNAS, u = 0 pure UNAS (the paper reports u > 0.5)."""
    steps, u = _u_history(records)
    fig = go.Figure()
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
    for layer in range(u.shape[1] if u.ndim == 3 else 0):
        c = colors[layer % len(colors)]
        lo, hi, mean = u[:, layer].min(-1), u[:, layer].max(-1), u[:, layer].mean(-1)
        fig.add_trace(
            go.Scatter(
                x=np.concatenate([steps, steps[::-1]]),
                y=np.concatenate([hi, lo[::-1]]),
                fill="toself",
                fillcolor=c,
                opacity=0.15,
                line={"width": 0},
                hoverinfo="skip",
                showlegend=False,
                legendgroup=str(layer),
            )
        )
        fig.add_trace(
            go.Scatter(
                x=steps,
                y=mean,
                mode="lines",
                name=f"layer {layer}",
                line={"color": c},
                legendgroup=str(layer),
                hovertemplate=f"layer {layer}<br>step %{{x}}<br>mean u %{{y:.3f}}<extra></extra>",
            )
        )
    fig.add_hline(y=0.5, line={"dash": "dot", "color": "gray"}, annotation_text="u = 0.5 (init)")
    fig.update_xaxes(title="training step")
    fig.update_yaxes(title="u (0 = UNAS, 1 = DNAS)")  # auto range: trained u often stays near 0.5
    fig.update_layout(title=title, width=760, height=440)
    L, H = (u.shape[1], u.shape[2]) if u.ndim == 3 and u.size else (0, 0)
    table = pd.DataFrame(
        [
            {"step": int(s), "layer": la, "head": h, "u": float(u[t, la, h])}
            for t, s in enumerate(steps)
            for la in range(L)
            for h in range(H)
        ],
        columns=["step", "layer", "head", "u"],
    )
    return FigureBundle(fig, table, {"steps": steps, "u": u})


def hybrid_weight_heatmap(u, *, title: str = "Hybrid weight u per layer and head") -> FigureBundle:
    """(L, H) u values on a 0-1 scale (NaN = layer is not a UNAS/DNAS mixture)."""
    u = np.asarray(u, dtype=np.float64)
    if u.ndim != 2:
        raise ValueError(f"u must be (L, H), got shape {u.shape}")
    L, H = u.shape
    fig = go.Figure(
        go.Heatmap(
            z=u,
            x=np.arange(H),
            y=np.arange(L),
            colorscale="RdBu_r",
            zmin=0.0,
            zmax=1.0,
            zmid=0.5,
            texttemplate="%{z:.2f}",
            textfont={"size": 11},
            colorbar={"title": {"text": "u"}},
            hovertemplate="layer %{y}, head %{x}<br>u %{z:.3f}<extra></extra>",
        )
    )
    fig.update_xaxes(title="head", dtick=1)
    fig.update_yaxes(title="layer", dtick=1, autorange="reversed")
    fig.update_layout(title=title, width=min(1000, 200 + 60 * H), height=160 + 44 * L)
    return FigureBundle(fig, _long_table(u, [], ("layer", "head")).rename(columns={"weight": "u"}), {"u": u})


def training_curves(records: Sequence[Mapping], *, title: str = "Loss") -> FigureBundle:
    """Training loss (every logged step) and held-out loss (every eval) over steps."""
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    evals = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    fig = go.Figure()
    for name, pts, mode in (("train loss", train, "lines"), ("eval loss", evals, "lines+markers")):
        if pts:
            xs, ys = zip(*pts, strict=True)
            fig.add_trace(go.Scatter(x=xs, y=ys, mode=mode, name=name))
    fig.update_xaxes(title="step")
    fig.update_yaxes(title="cross-entropy (nats / token)")
    fig.update_layout(title=title, width=760, height=400)
    table = pd.DataFrame(
        [
            {
                "step": r.get("step"),
                "loss": r.get("loss"),
                "eval_loss": r.get("eval_loss"),
                "lr": r.get("lr"),
                "tokens_per_s": r.get("tokens_per_s"),
            }
            for r in records
        ]
    )
    return FigureBundle(fig, table, {})


# ----------------------------------------------------------------------------------------------
# Embeddings
# ----------------------------------------------------------------------------------------------


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
    fig.update_layout(title=title, width=760, height=560, xaxis_title="dim 1", yaxis_title="dim 2")
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


# ----------------------------------------------------------------------------------------------
# Export bytes, manifests and reproduction
# ----------------------------------------------------------------------------------------------


def figure_bytes(fig: go.Figure, fmt: str) -> bytes:
    """PNG / SVG / PDF (kaleido + Chromium; ``ExportError`` without it), HTML (plotly.js inline,
    opens offline) or JSON, as bytes for a download button."""
    from attnlab.figures.export import export_figure

    out = export_figure(fig, fmt)
    return out.encode("utf-8") if isinstance(out, str) else out


def data_bytes(bundle: FigureBundle, fmt: str) -> bytes:
    """The bundle's table as CSV, or its arrays as NPZ (no pickle: tokens are a unicode array)."""
    if fmt == "csv":
        return bundle.table.to_csv(index=False).encode("utf-8")
    if fmt == "npz":
        buf = io.BytesIO()
        np.savez_compressed(buf, **{k: np.asarray(v) for k, v in bundle.arrays.items()})
        return buf.getvalue()
    raise ValueError(f"fmt must be 'csv' or 'npz', got {fmt!r}")


def analyze_command(source: Mapping, text_file: str = "text.txt", out_dir: str = "attnlab-out") -> list[str]:
    """The ``attnlab analyze`` command line that recomputes ``source``'s weights (see :func:`manifest`)."""
    s = source["settings"]
    cmd = ["attnlab", "analyze", text_file]
    if source["model"].get("path") and not source["model"].get("embedded"):
        cmd += ["--model", source["model"]["path"]]
    # u per layer and head (a list) is a native HNAS checkpoint's learned u: the command's default there
    u = [] if isinstance(s["u"], list) else ["--u", f"{s['u']:g}"]
    cmd += [
        "--variants",
        ",".join(s["variants"]),
        "--mode",
        s["mode"],
        *u,
        "--iters",
        str(s["iters"]),
        "--window",
        str(s["window"]),
        "--weights",
        "all",
        "--no-figures",
        "--out",
        out_dir,
    ]
    return cmd


def manifest(
    kind: str,
    params: Mapping,
    sources: Sequence[Mapping],
    *,
    text_sha256: str,
    characters: int,
    window: int,
    labels: Sequence[str] | None = None,
    extra: Mapping | None = None,
) -> dict:
    """The JSON manifest of an exported figure: what was analysed and how to rebuild the figure.

    Each source is ``{"model": ModelInfo.as_dict(), "settings": {variants, mode, u, iters, window}}``.
    ``reproduce`` holds one ``attnlab analyze`` command per source (run on the same text, saved as
    text.txt; its sha256 is in ``input``) and the Python call that rebuilds the figure from their
    output directories: ``attnlab.figures.app_views.reproduce_figure(manifest, [dir, ...])``.
    """
    import attnlab

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    dirs = [f"attnlab-out-{k}" for k in range(len(sources))] if len(sources) > 1 else ["attnlab-out"]
    commands = []
    for src, d in zip(sources, dirs, strict=True):
        commands.append(shlex.join(analyze_command(src, out_dir=d)))
    return {
        "format": MANIFEST_FORMAT,
        "attnlab_version": getattr(attnlab, "__version__", "?"),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "figure": {"kind": kind, "params": dict(params), "window": window, "labels": list(labels or [])},
        "input": {"sha256": text_sha256, "characters": characters, "file": "text.txt"},
        "sources": [dict(s) for s in sources],
        "reproduce": {
            "commands": commands,
            "python": f"from attnlab.figures.app_views import reproduce_figure; "
            f"fig = reproduce_figure('manifest.json', {dirs!r})",
            "note": "run each command on the same text (text.txt, sha256 above)",
        },
        **({"extra": dict(extra)} if extra else {}),
    }


def _load_window(out_dir: Path, window: int) -> tuple[dict[str, np.ndarray], list[str], dict]:
    """Weights {variant: (L, H, N, N)} and tokens of one window from an ``attnlab analyze`` output."""
    info = json.loads((out_dir / "manifest.json").read_text(encoding="utf-8"))
    single = out_dir / "weights.npz"
    path = single if single.is_file() and window == 0 else out_dir / "weights" / f"window_{window:04d}.npz"
    if not path.is_file():
        raise FileNotFoundError(
            f"{out_dir} has no weights for window {window} (run attnlab analyze with --weights all)"
        )
    with np.load(path, allow_pickle=False) as npz:
        tokens = [str(t) for t in npz["tokens"]]
        weights = {k: npz[k] for k in npz.files if k not in ("tokens", "special")}
    return weights, tokens, info


def reproduce_figure(manifest_or_path, out_dirs: Sequence[str | Path]) -> FigureBundle:
    """Rebuild an exported figure from its manifest and the ``attnlab analyze`` output directories
    (one per source, in the manifest's order). Checks that the analysed text has the same sha256."""
    m = manifest_or_path
    if not isinstance(m, Mapping):
        m = json.loads(Path(m).read_text(encoding="utf-8"))
    if m.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"not an attnlab figure manifest (format {m.get('format')!r})")
    fig_spec, sources = m["figure"], m["sources"]
    if len(out_dirs) != len(sources):
        raise ValueError(f"the manifest has {len(sources)} source(s), got {len(out_dirs)} output directories")
    loaded = [_load_window(Path(d), fig_spec["window"]) for d in out_dirs]
    for _, _, info in loaded:
        if info["input"]["sha256"] != m["input"]["sha256"]:
            raise ValueError("the analysed text differs from the exported one (sha256 mismatch)")
    tokens = loaded[0][1]
    u = sources[0]["settings"].get("u")
    weights = [w for w, _, _ in loaded]
    multi = fig_spec["kind"] in PAIR_KINDS or len(weights) > 1
    return build(
        fig_spec["kind"],
        weights if multi else weights[0],
        tokens,
        fig_spec["params"],
        u=u if isinstance(u, float) else None,
        labels=fig_spec.get("labels") or None,
    )
