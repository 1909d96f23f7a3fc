"""Figures of the measures beyond weights (contributions, sinks, rollout and flow, interventions,
faithfulness); shared by the CLI and the app. Each builder returns a
:class:`attnlab.figures.app_views.FigureBundle` (figure + long table + arrays for export).

    weight_vs_contribution(table)            explained away by weight vs by contribution, per layer
    sink_mass_by_layer(sinks_table)          sink mass per layer, one line per variant
    token_map(matrix (M, N), tokens, ...)    rollout (N, N) or flow (n_outputs, N) as a heatmap
    flow_heatmap({variant: (O, N)}, tokens, outputs)   one panel per variant
    intervention_heatmap({measure: (L, H)}, variant)   the L x H map, one panel per measure
    faithfulness_bars(table)                 Kendall tau per measure and variant
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from attnlab.figures._data import MAGMA, as_array, check_tokens, unique_labels
from attnlab.figures.app_views import FigureBundle

__all__ = [
    "weight_vs_contribution",
    "sink_mass_by_layer",
    "token_map",
    "flow_heatmap",
    "intervention_heatmap",
    "faithfulness_bars",
    "MEASURE_TITLES",
    "MEASURE_FORMATS",
    "INTERVENTION_COLUMNS",
    "intervention_columns",
]

# The measures of attnlab.hf.beyond.interventions, named for people (titles, table headers).
MEASURE_TITLES = {
    "hidden_cosine": "final hidden states: cosine distance (mean over tokens)",
    "pooled_cosine": "mean-pooled embedding: cosine distance",
    "loglik_change": "log-likelihood per token: change (nats)",
}
# One number format per measure (d3 / plotly), in the map's hover and colour bar and (printf, "%" + it)
# in the table: cosine distances span decades (1e-6 to 0.1 on MiniLM), so in scientific notation; a
# model has either the two cosine distances (encoders) or the log-likelihood change (causal LMs)
MEASURE_FORMATS = {"hidden_cosine": ".2e", "pooled_cosine": ".2e", "loglik_change": "+.2e"}
DEFAULT_FORMAT = ".3g"
# InterventionResult.table()'s columns: name -> (header, number format), for the app's table
INTERVENTION_COLUMNS = {
    "variant": ("swapped to", None),
    "layer": ("layer", "%d"),
    "head": ("head", "%d"),
    "measure": ("measure", None),
    "value": ("output change", "%.4g"),
}


def intervention_columns(measures) -> dict[str, tuple[str, str | None]]:
    """INTERVENTION_COLUMNS for a result with these measures: "output change" in the measures' one
    format (:data:`MEASURE_FORMATS`, printf), as the map's hover and colour bar write it."""
    formats = {MEASURE_FORMATS.get(m, DEFAULT_FORMAT) for m in measures}
    value = formats.pop() if len(formats) == 1 else DEFAULT_FORMAT
    return {**INTERVENTION_COLUMNS, "value": ("output change", "%" + value)}


WEIGHT_STAT = "explained_away_relative"
CONTRIBUTION_STAT = "contribution_explained_away_relative"


def _layer_means(table: pd.DataFrame, statistic: str) -> pd.DataFrame:
    rows = table[table["statistic"] == statistic]
    if rows.empty:
        raise ValueError(f"the table has no {statistic!r} rows (analyse with contributions / sinks)")
    return rows.groupby(["variant", "layer"], sort=False)["value"].mean().reset_index()


def _paired_layer_curves(pairs, label: str, layout: dict) -> go.Figure:
    """Per-layer curves, one colour per variant and one dash per measure; ``pairs``: ((frame of
    _layer_means, dash, what), ...), trace names ``label.format(variant=..., what=...)``."""
    fig = go.Figure()
    for i, variant in enumerate(dict.fromkeys(pairs[0][0]["variant"])):
        color = f"hsl({(i * 83) % 360}, 60%, 45%)"
        for frame, dash, what in pairs:
            r = frame[frame["variant"] == variant]
            fig.add_trace(go.Scatter(x=r["layer"], y=r["value"], mode="lines+markers",
                                     name=label.format(variant=variant, what=what),
                                     line=dict(color=color, dash=dash)))
    fig.update_layout(xaxis_title="layer", template="plotly_white", **layout)
    return fig


def weight_vs_contribution(table: pd.DataFrame, *, title: str | None = None) -> FigureBundle:
    """Explained-away fraction (relative rule) by weight (solid) and by contribution (dashed) per layer,
    mean over heads (and windows), one colour per variant; ``table``: WindowResult.table() rows."""
    w, c = _layer_means(table, WEIGHT_STAT), _layer_means(table, CONTRIBUTION_STAT)
    fig = _paired_layer_curves(
        ((w, "solid", "weight"), (c, "dash", "contribution")), "{variant} by {what}",
        dict(title=title or "Explained away by weight (solid) and by contribution (dashed)",
             yaxis_title="share of keys (relative mass < ε)"))
    long = pd.concat([w.assign(measure="weight"), c.assign(measure="contribution")], ignore_index=True)
    return FigureBundle(figure=fig, table=long)


def sink_mass_by_layer(sinks_table: pd.DataFrame, *, title: str | None = None) -> FigureBundle:
    """Mean attention on the sink keys per layer (solid) and on the first position (dotted)."""
    total, first = _layer_means(sinks_table, "sink_mass"), _layer_means(sinks_table, "sink_mass_first")
    fig = _paired_layer_curves(
        ((total, "solid", "sinks"), (first, "dot", "first position")), "{variant}: {what}",
        dict(title=title or "Attention taken by sinks per layer (mean over heads and rows)",
             yaxis_title="mass per row", yaxis_range=[0, 1]))
    long = pd.concat([total.assign(keys="sinks"), first.assign(keys="first")], ignore_index=True)
    return FigureBundle(figure=fig, table=long)


def _heat(z: np.ndarray, x: list, y: list, colorscale="Viridis", **kw) -> go.Heatmap:
    return go.Heatmap(z=z, x=x, y=y, colorscale=colorscale, **kw)


def token_map(
    matrix, tokens: Sequence[str], outputs: Sequence[int] | None = None, *, title: str = "Rollout"
) -> FigureBundle:
    """(M, N) token-to-token map (rollout: M = N; flow: one row per output in ``outputs``)."""
    z = as_array(matrix, "matrix", 2)
    labels = unique_labels(check_tokens(tokens, z.shape[1]))
    rows = list(range(z.shape[0])) if outputs is None else list(outputs)
    if len(rows) != z.shape[0]:
        raise ValueError(f"outputs has {len(rows)} positions, but the map has {z.shape[0]} rows")
    y = [labels[i] for i in rows]
    fig = go.Figure(_heat(z, labels, y, hovertemplate="output %{y}<br>input %{x}<br>%{z:.4f}<extra></extra>"))
    fig.update_layout(
        title=title,
        xaxis_title="input token",
        yaxis_title="output position",
        yaxis_autorange="reversed",
        template="plotly_white",
    )
    table = pd.DataFrame(
        {
            "output": np.repeat(rows, z.shape[1]),
            "input": np.tile(np.arange(z.shape[1]), len(rows)),
            "value": z.reshape(-1),
        }
    )
    return FigureBundle(figure=fig, table=table, arrays={"map": z, "outputs": np.asarray(rows)})


def flow_heatmap(
    flows: Mapping[str, np.ndarray],
    tokens: Sequence[str],
    outputs: Sequence[int],
    *,
    title: str = "Attention flow (window 0)",
) -> FigureBundle:
    """One panel per variant of the (n_outputs, N) flows."""
    names = list(flows)
    fig = make_subplots(rows=len(names), cols=1, subplot_titles=names, vertical_spacing=0.08)
    labels = unique_labels(check_tokens(tokens, as_array(flows[names[0]], "flow", 2).shape[1]))
    tables = []
    for i, v in enumerate(names, 1):
        b = token_map(flows[v], tokens, outputs)
        fig.add_trace(
            _heat(b.arrays["map"], labels, [labels[o] for o in outputs], coloraxis="coloraxis"), row=i, col=1
        )
        tables.append(b.table.assign(variant=v))
    fig.update_layout(
        title=title,
        coloraxis=dict(colorscale="Viridis"),
        height=max(300, 220 * len(names)),
        template="plotly_white",
    )
    return FigureBundle(
        figure=fig,
        table=pd.concat(tables, ignore_index=True),
        arrays={v: np.asarray(f) for v, f in flows.items()},
    )


def intervention_heatmap(
    measures: Mapping[str, np.ndarray], variant: str, *, title: str | None = None
) -> FigureBundle:
    """The L x H map of each measure of a per-head intervention (swap of one head to ``variant``)."""
    names = list(measures)
    # room between panels for a panel's colour bar and the next panel's axis labels (the bar sat on
    # the next panel's "layer" title and ticks)
    fig = make_subplots(rows=1, cols=len(names), subplot_titles=[MEASURE_TITLES.get(n, n) for n in names],
                        horizontal_spacing=0.2)
    rows = []
    for i, name in enumerate(names, 1):
        z = as_array(measures[name], name, 2)
        L, H = z.shape
        fig.add_trace(
            _heat(
                z,
                list(range(H)),
                list(range(L)),
                colorscale=MAGMA if name != "loglik_change" else "RdBu",
                colorbar=dict(x=fig.layout[f"xaxis{'' if i == 1 else i}"].domain[1] + 0.01, len=0.9,
                              thickness=14, tickformat=MEASURE_FORMATS.get(name, DEFAULT_FORMAT)),
                hovertemplate=f"layer %{{y}}, head %{{x}}<br>{MEASURE_TITLES.get(name, name)}: "
                f"%{{z:{MEASURE_FORMATS.get(name, DEFAULT_FORMAT)}}}<extra></extra>",
            ),
            row=1,
            col=i,
        )
        fig.update_xaxes(title_text="head", row=1, col=i)
        fig.update_yaxes(title_text="layer", autorange="reversed", row=1, col=i)
        rows.append(
            pd.DataFrame(
                {
                    "measure": name,
                    "layer": np.repeat(np.arange(L), H),
                    "head": np.tile(np.arange(H), L),
                    "value": z.reshape(-1),
                }
            )
        )
    fig.update_layout(
        title=title or f"Output change when one head's normalizer becomes {variant}", template="plotly_white"
    )
    return FigureBundle(
        figure=fig,
        table=pd.concat(rows, ignore_index=True),
        arrays={k: as_array(v, k, 2) for k, v in measures.items()},
    )


def faithfulness_bars(table: pd.DataFrame, *, title: str | None = None) -> FigureBundle:
    """Kendall tau (importance measure vs leave-one-out) per variant, one bar group per measure."""
    need = {"variant", "measure", "tau"}
    if not need <= set(table.columns):
        raise ValueError(f"table needs the columns {sorted(need)}, got {list(table.columns)}")
    fig = go.Figure()
    for variant in dict.fromkeys(table["variant"]):
        r = table[table["variant"] == variant]
        fig.add_trace(go.Bar(x=r["measure"], y=r["tau"], name=variant))
    n = int(table["n_tokens"].iloc[0]) if "n_tokens" in table and len(table) else 0
    fig.update_layout(
        barmode="group",
        yaxis_range=[-1, 1],
        yaxis_title="Kendall τ with leave-one-out",
        title=title or f"Faithfulness per normalizer ({n} tokens)",
        template="plotly_white",
    )
    return FigureBundle(figure=fig, table=table.copy())
