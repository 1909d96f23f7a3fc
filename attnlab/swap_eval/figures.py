"""Figures of a swap-eval run, from its tables (summary.py), as ``attnlab.figures`` bundles, and their
files: HTML sharing one ``figures/plotly.min.js`` (they open offline), as ``attnlab analyze`` writes them.

    loss_delta(delta_table)        loss delta per layer, a line per variant with its 95 % CI, and the
                                   all-layer swap at x = "all"
    loss_by_position(pos_table)    the StreamingLLM-style curve: loss by token position per swap and
                                   for the model, positions pooled in bins of equal width
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative

from attnlab.figures.app_views import FigureBundle

__all__ = ["loss_delta", "loss_by_position", "write_figures", "MAX_POINTS"]

MAX_POINTS = 64  # position bins drawn per curve


def _x(layer: int) -> str:
    return "all" if layer < 0 else str(layer)


def loss_delta(table: pd.DataFrame, baseline: str = "model") -> FigureBundle:
    """Per variant: delta (nats per token) against the swapped layer, error bars = 95 % bootstrap CI."""
    rows = table[table["variant"] != baseline]
    fig = go.Figure()
    order = sorted({int(x) for x in rows["layer"]}, key=lambda x: (x < 0, x))
    for i, (variant, part) in enumerate(rows.groupby("variant", sort=False)):
        part = part.assign(order=part["layer"].map({x: k for k, x in enumerate(order)})).sort_values("order")
        fig.add_trace(
            go.Scatter(
                x=[_x(x) for x in part["layer"]],
                y=part["delta"],
                mode="lines+markers",
                name=variant,
                line=dict(color=qualitative.Plotly[i % len(qualitative.Plotly)]),
                error_y=dict(
                    type="data",
                    array=part["ci_high"] - part["delta"],
                    arrayminus=part["delta"] - part["ci_low"],
                ),
                hovertemplate="layer %{x}: %{y:.4f} nats/token<extra>" + variant + "</extra>",
            )
        )
    model = float(table["loss_model"].iloc[0])
    fig.add_hline(y=0.0, line=dict(color="grey", dash="dot"))
    fig.update_layout(
        title=f"LM loss change when a variant replaces the attention (model: {model:.3f} nats/token; "
        "95 % CI over documents)",
        xaxis_title="swapped layer",
        yaxis_title="delta loss (nats/token)",
        xaxis=dict(type="category", categoryorder="array", categoryarray=[_x(x) for x in order]),
        template="plotly_white",
        height=420,
        width=760,
    )
    return FigureBundle(fig, table.reset_index(drop=True))


def _binned(part: pd.DataFrame, width: int) -> pd.DataFrame:
    """Token-weighted loss per bin of ``width`` positions (bin = its first position)."""
    bins = (part["position"] // width) * width
    sums = (part["loss"] * part["n_tokens"]).groupby(bins).sum()
    tokens = part["n_tokens"].groupby(bins).sum()
    return pd.DataFrame(
        {"position": sums.index, "loss": (sums / tokens).to_numpy(), "n_tokens": tokens.to_numpy()}
    )


def loss_by_position(table: pd.DataFrame, baseline: str = "model") -> FigureBundle:
    """Loss against token position, a curve per swap ("dnas L3", "dnas all") and the model's (black)."""
    width = max(1, int(np.ceil((int(table["position"].max()) + 1) / MAX_POINTS)))
    fig = go.Figure()
    frames = []
    colors = {
        v: qualitative.Plotly[i % len(qualitative.Plotly)]
        for i, v in enumerate(dict.fromkeys(table["variant"][table["variant"] != baseline]))
    }
    for (variant, layer), part in table.groupby(["variant", "layer"], sort=False):
        curve = _binned(part, width).assign(variant=variant, layer=layer)
        frames.append(curve)
        name = baseline if variant == baseline else f"{variant} {'all' if layer < 0 else f'L{layer}'}"
        fig.add_trace(
            go.Scatter(
                x=curve["position"],
                y=curve["loss"],
                mode="lines",
                name=name,
                line=dict(
                    color="black" if variant == baseline else colors[variant],
                    width=3 if variant == baseline or layer < 0 else 1,
                ),
                hovertemplate="position %{x}: %{y:.3f}<extra>" + name + "</extra>",
            )
        )
    fig.update_layout(
        title=f"LM loss by token position (bins of {width} position{'s' * (width > 1)})",
        xaxis_title="position in the window",
        yaxis_title="loss (nats/token)",
        template="plotly_white",
        height=420,
        width=760,
    )
    return FigureBundle(fig, pd.concat(frames, ignore_index=True))


def write_figures(directory: Path, delta: pd.DataFrame, positions: pd.DataFrame) -> list[str]:
    """figures/plotly.min.js, loss_delta.html and loss_by_position.html under ``directory``; -> names."""
    from plotly.offline import get_plotlyjs

    from attnlab.figures.export import export_figure

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "plotly.min.js").write_text(get_plotlyjs(), encoding="utf-8")
    written = ["plotly.min.js"]
    for name, bundle in (
        ("loss_delta", loss_delta(delta)),
        ("loss_by_position", loss_by_position(positions)),
    ):
        export_figure(bundle.figure, directory / f"{name}.html", include_plotlyjs="directory")
        written.append(f"{name}.html")
    return written
