"""bertviz's head view with several heads of one layer at once: each head's lines in its own colour,
each head toggled through its legend entry (the app toggles them with coloured chips, drawn in the
browser by app/assets/line_views.js with the same colours, :data:`HEAD_COLORS`).

With one head it is :func:`attnlab.figures.head_view.head_view` (blue lines, the focus in orange).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go

from attnlab.figures._data import as_array, check_focus, check_tokens
from attnlab.figures.head_view import _line_traces, _top_pairs, head_view, token_traces

__all__ = ["HEAD_COLORS", "head_color", "head_overlay"]

# One colour per head, no orange (the focus colour) among them; heads beyond 20 reuse them in order.
HEAD_COLORS = (
    "#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
    "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#31a354",
    "#756bb1", "#636363", "#e7298a", "#66a61e",
)  # fmt: skip


def head_color(head: int) -> str:
    """The colour of head ``head`` in the overlay (and of its chip in the app)."""
    return HEAD_COLORS[head % len(HEAD_COLORS)]


def check_heads(heads: Sequence[int], n_heads: int) -> list[int]:
    """Distinct head indices in [0, n_heads), in the order given; ValueError otherwise."""
    out = []
    for h in heads:
        if isinstance(h, bool) or not isinstance(h, (int, np.integer)) or not 0 <= int(h) < n_heads:
            raise ValueError(f"heads must be head indices in [0, {n_heads}), got {list(heads)!r}")
        if int(h) in out:
            raise ValueError(f"heads must be distinct, got {list(heads)!r}")
        out.append(int(h))
    if not out:
        raise ValueError("heads must name at least one head")
    return out


def head_overlay(
    weights,
    tokens: Sequence[str],
    heads: Sequence[int],
    *,
    title: str = "Head view",
    min_weight: float = 0.02,
    buckets: int = 4,
    focus: int | None = None,
    query_tokens: Sequence[str] | None = None,
) -> go.Figure:
    """The head view of several heads of one layer, overlaid.

    weights: (h, M, N), the maps of ``heads`` (h head indices, in that order; they name the legend
    entries and pick the colours, :func:`head_color`). Each head's lines are bucketed by weight
    into ``buckets`` opacity levels (one trace each, legend group ``head <index>``, so a click on
    its legend entry hides or shows the whole head); lines below ``min_weight`` are not drawn. With
    ``focus`` the lines that token sends and receives keep their head's colour at full strength,
    every other line is faded. The last two traces are the query and key markers (``customdata`` =
    position), as in :func:`head_view`. One head: exactly :func:`head_view`. ``query_tokens``: the M
    queries of cross-attention (``tokens`` the N keys; the focus is a key); None: self-attention.
    """
    w = as_array(weights, "weights", 3)
    h, M, N = w.shape
    heads = check_heads(heads, 1 << 30)
    if len(heads) != h:
        raise ValueError(f"weights hold {h} heads' maps, while heads names {len(heads)}: {heads}")
    cross = query_tokens is not None
    if not cross and M != N:
        raise ValueError(f"the head overlay needs self-attention (M == N) or query_tokens, got maps of "
                         f"{M} x {N}")
    tokens = check_tokens(tokens, N)
    queries = check_tokens(query_tokens, M, "query_tokens") if cross else tokens
    focus = check_focus(focus, N)
    if h == 1:
        return head_view(w[0], tokens, title=title, min_weight=min_weight, focus=focus,
                         query_tokens=query_tokens)
    top = float(np.nanmax(w)) if w.size and np.isfinite(w).any() else 1.0
    fig = go.Figure()
    for k, head in enumerate(heads):
        color, group = head_color(head), f"head {head}"
        qi, kj, vals = _top_pairs(np.nan_to_num(w[k], nan=0.0), min_weight, None)
        fig.add_traces(
            _line_traces(
                [(qi, kj, vals, 0.0, 1.0, 0.0)],
                top,
                min_weight,
                buckets,
                focus,
                color=color,
                focus_color=color,
                group=group,
                query_focus=not cross,
            )
        )
        fig.add_trace(  # the legend entry of the head (a click toggles its whole group)
            go.Scatter(
                x=[None],
                y=[None],
                mode="lines",
                name=group,
                legendgroup=group,
                line={"color": color, "width": 4},
                hoverinfo="skip",
            )
        )
    best = np.nan_to_num(w).argmax(-1)  # (h, M): each head's strongest key per query

    def hover(i: int, side: str) -> str:
        if side == "query":
            return f"{i}: {queries[i]} → " + ", ".join(
                f"head {head}: {best[k, i]} {tokens[best[k, i]]} {w[k, i, best[k, i]]:.2f}"
                for k, head in enumerate(heads)
            )
        return f"{i}: {tokens[i]}, column mass " + ", ".join(
            f"head {head} {np.nansum(w[k, :, i]):.3f}" for k, head in enumerate(heads)
        )

    q_hover, k_hover = ([hover(i, side) for i in range(n)] for side, n in (("query", M), ("key", N)))
    token_traces(fig, queries, tokens, q_hover, k_hover, focus, query_focus=not cross)
    fig.update_layout(
        title=title if focus is None else f"{title} (focus: {focus}: {tokens[focus]})",
        width=560,
        height=max(300, 20 * max(M, N) + 150),
        margin={"t": 90},
        legend={"orientation": "h", "x": 0.0, "y": 1.0, "yanchor": "bottom", "title": {"text": "heads:"}},
    )
    return fig
