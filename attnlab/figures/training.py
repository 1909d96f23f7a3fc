"""Training figures: loss curves and HNAS's hybrid weight u (per layer over steps, per head at the end)
from the records of ``metrics.jsonl`` (``attnlab.train.read_metrics``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from attnlab.figures.bundle import FigureBundle, long_table
from attnlab.stats.intervals import t_half_width

__all__ = ["hybrid_weight_curves", "hybrid_weight_heatmap", "seed_band", "training_curves"]


# one colour per layer (cycled), shared by the u curves and the seed band
LAYER_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


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
    colors = LAYER_COLORS
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
    return FigureBundle(fig, long_table(u, [], ("layer", "head")).rename(columns={"weight": "u"}), {"u": u})


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


def seed_band(per_seed: Mapping[str, Sequence[Mapping]], *, title: str | None = None) -> FigureBundle:
    """Several seeds of one recipe together: per layer, u averaged over heads in each seed, then the mean
    over seeds with its 95 % t-interval (the band) at every step all seeds logged.

    per_seed: {run name: its metrics.jsonl records}, at least two runs of one (L, H). The table holds
    one row per (step, layer): mean, ci_low, ci_high and n_seeds."""
    if len(per_seed) < 2:
        raise ValueError(f"per_seed must hold at least two runs, got {len(per_seed)}")
    histories = {name: _u_history(recs) for name, recs in per_seed.items()}
    shapes = {u.shape[1:] for _, u in histories.values()}
    if len(shapes) != 1 or not next(iter(shapes)):
        raise ValueError(f"per_seed must be runs of one model with logged u (one (L, H)), got {shapes}")
    common = sorted(set.intersection(*(set(s.tolist()) for s, _ in histories.values())))
    layer_u = np.stack([np.stack([u[list(s).index(t)].mean(-1) for t in common])
                        for s, u in histories.values()])  # (R, T, L)
    R = layer_u.shape[0]
    mean = layer_u.mean(0)  # (T, L)
    half = t_half_width(layer_u, axis=0)  # (T, L): the 95 % t-interval over the R runs
    lo, hi = mean - half, mean + half
    steps = np.array(common)
    fig = go.Figure()
    colors = LAYER_COLORS
    for layer in range(mean.shape[1]):
        c = colors[layer % len(colors)]
        fig.add_trace(go.Scatter(x=np.concatenate([steps, steps[::-1]]),
                                 y=np.concatenate([hi[:, layer], lo[::-1, layer]]), fill="toself",
                                 fillcolor=c, opacity=0.2, line={"width": 0}, hoverinfo="skip",
                                 showlegend=False, legendgroup=str(layer)))
        hover = f"layer {layer}<br>step %{{x}}<br>mean u %{{y:.3f}}<extra></extra>"
        fig.add_trace(go.Scatter(x=steps, y=mean[:, layer], mode="lines", name=f"layer {layer}",
                                 line={"color": c}, legendgroup=str(layer), hovertemplate=hover))
    fig.add_hline(y=0.5, line={"dash": "dot", "color": "gray"}, annotation_text="u = 0.5 (init)")
    fig.update_xaxes(title="training step")
    fig.update_yaxes(title="u (0 = UNAS, 1 = DNAS), mean over heads")
    fig.update_layout(title=title or f"u per layer: mean over {R} seeds, 95 % CI band", width=760,
                      height=440)
    table = pd.DataFrame([{"step": int(t), "layer": la, "mean": float(mean[i, la]),
                           "ci_low": float(lo[i, la]), "ci_high": float(hi[i, la]), "n_seeds": R}
                          for i, t in enumerate(common) for la in range(mean.shape[1])],
                         columns=["step", "layer", "mean", "ci_low", "ci_high", "n_seeds"])
    return FigureBundle(fig, table, {"steps": steps, "mean": mean, "half_width": half,
                                     "runs": list(per_seed)})
