"""Inspect on a long context (a window of more than ``analysis.LONG_CONTEXT`` tokens: a causal model's
whole text, thousands of tokens): one head's map downsampled into token blocks, a region of it at full
resolution, and the span of tokens around the focus that the head view and the token strip draw.

Only the chosen head's (N, N) map is computed (``weights.head(layer, head)`` on a streamed window's
HeadMaps), kept for the page's two charts (:func:`_head`); the figures are
``attnlab.figures.long_maps``' (kinds ``heatmap_blocks`` and ``heatmap_zoom``), their manifests
name the block size and how blocks are pooled, or the region.
"""

from __future__ import annotations

import numpy as np
import streamlit as st

from appkit.analysis import WindowView
from appkit.export import export_menu
from appkit.show import CHART_CONFIG, focus, manifest
from attnlab.figures import app_views
from attnlab.figures.long_maps import MAX_ZOOM, POOLS, block_size, describe_block, head_map

SPAN_HALF = 64  # the head view and the token strip show the focus ± this many tokens
ZOOM_DEFAULT = 128  # tokens per side of the zoomed region at first


def span_around(position: int | None, n: int, half: int = SPAN_HALF) -> tuple[int, int]:
    """[lo, hi) of 2 * half + 1 tokens centred on ``position`` (moved inside [0, n)); the first
    tokens when nothing is focused."""
    width = min(n, 2 * half + 1)
    lo = 0 if position is None else min(max(position - half, 0), n - width)
    return lo, lo + width


@st.cache_resource(max_entries=2, ttl=1800, show_spinner=False)
def _head(key: str, variant: str, layer: int, head: int, _view: WindowView):
    """One head's (N, N) float32 map (computed once for the overview and the zoom)."""
    return head_map(_view.weights[variant], layer, head)


def span_block(weights, layer: int, head: int, lo: int, hi: int) -> np.ndarray:
    """(hi - lo, hi - lo) float32: one head's map over the tokens [lo, hi) (queries and keys), the
    values of ``head_map(weights, layer, head)[lo:hi, lo:hi]``. On a streamed window's HeadMaps, only
    the tiles that hold the span (``attnlab.hf.compute.tiles.head_block``): the head view's heads cost
    a tile or two each instead of the head's whole (N, N) map. Anything else (arrays, a head already
    computed whole): the whole head, sliced."""
    window, variant = getattr(weights, "window", None), getattr(weights, "variant", None)
    if window is None or variant is None or getattr(weights, "_whole", None) is not None:
        return head_map(weights, layer, head)[lo:hi, lo:hi].copy()
    from attnlab.hf.compute import tiles

    return tiles.head_block(window.layers[layer], layer, head, variant, window.params, lo, hi).cpu().numpy()


class _OneHead:
    """{variant: this} for the figure builders: reads the one head the page computed."""

    def __init__(self, view: WindowView, variant: str):
        self.view, self.variant = view, variant

    def head(self, layer: int, head: int):
        return _head(self.view.key, self.variant, layer, head, self.view)


def _region(prefix: str, n: int, f: int | None) -> tuple[tuple[int, int], tuple[int, int]]:
    """The zoom's query and key ranges from three number boxes (first query, first key, size)."""
    size = min(int(st.session_state.get(f"{prefix}_zoom_size", ZOOM_DEFAULT)), MAX_ZOOM, n)
    start = 0 if f is None else min(max(f - size // 2, 0), n - size)
    for name, first, top in (("size", size, min(MAX_ZOOM, n)), ("rows", start, n - 1),
                             ("cols", start, n - 1)):
        key = f"{prefix}_zoom_{name}"  # first centred on the focus; kept inside a shorter text
        st.session_state[key] = min(st.session_state.get(key, first), top)
    a, b, c = st.columns(3)
    size = int(c.number_input("Region size (tokens per side)", 8, min(MAX_ZOOM, n), step=8,
                              key=f"{prefix}_zoom_size"))
    q0 = int(a.number_input("Queries from", 0, n - 1, key=f"{prefix}_zoom_rows"))
    k0 = int(b.number_input("Keys from", 0, n - 1, key=f"{prefix}_zoom_cols"))
    q0, k0 = min(q0, n - size), min(k0, n - size)  # the region stays inside the text
    return (q0, q0 + size), (k0, k0 + size)


def long_map(prefix: str, view: WindowView, variant: str, layer: int, head: int,
             text: str) -> tuple[int, int]:
    """The downsampled map, the zoomed region and their Export menus; returns the span [lo, hi) the
    head view and the token strip draw (around the focus)."""
    N = view.shape[2]
    f = focus(view)
    block = block_size(N)
    how = st.segmented_control("Each cell of the whole map is the", POOLS, default="mean", required=True,
                               key=f"{prefix}_pool", help="over the block's weights")
    st.caption(
        f"{N:,} tokens: the whole map is drawn downsampled, **{describe_block(block, how)}** "
        f"({-(-N // block)} × {-(-N // block)} cells; the last block row and column hold what is left). "
        f"Below it, a region at full resolution (up to {MAX_ZOOM} × {MAX_ZOOM} tokens, outlined on the map)."
    )
    rows, cols = _region(prefix, N, f)
    weights = {variant: _OneHead(view, variant)}
    common = {"variant": variant, "layer": layer, "head": head, "focus": f}
    for kind, p in (("heatmap_blocks", {**common, "block": block, "how": how, "rows": list(rows),
                                        "cols": list(cols)}),
                    ("heatmap_zoom", {**common, "rows": list(rows), "cols": list(cols)})):
        b = app_views.build(kind, weights, view.tokens, p)
        st.plotly_chart(b.figure, key=f"{prefix}_{kind}", width="content", theme=None, config=CHART_CONFIG)
        export_menu(prefix, kind, b, manifest(kind, view, p, file_name=f"{kind}.manifest.json"), text)
    lo, hi = span_around(f, N)
    where = "around the focused token" if f is not None else "from the start; a click on a token centres them"
    st.caption(f"The head view and the token strip show tokens {lo}–{hi - 1} of {N:,} ({where}).")
    return lo, hi
