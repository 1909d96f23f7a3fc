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
    values of ``head_map(weights, layer, head)[lo:hi, lo:hi]``.

    On a streamed window's HeadMaps only the tiles of query rows up to ``hi`` are computed, by the
    tiles ``head_weights`` uses (attnlab/hf/compute/tiles.py, the same tile rows, so the same values);
    a variant normalized by rows (unas, sparsemax, softmax1) computes only the tiles holding rows
    [lo, hi), one normalized by columns (causal dnas, hnas, one-round Sinkhorn) the tiles above them
    too (the prefix column potential carries from tile to tile). The head view's heads, 129 tokens
    each, cost a tile or two per head instead of the head's whole (N, N) map. Anything else (arrays, a
    variant streamed by whole heads): the whole head, sliced."""
    window, variant = getattr(weights, "window", None), getattr(weights, "variant", None)
    if window is None or variant is None or getattr(weights, "_whole", None) is not None:
        return head_map(weights, layer, head)[lo:hi, lo:hi].copy()
    from attnlab.hf.compute import tiles
    from attnlab.normalizers import functions as fn
    from attnlab.normalizers import variant_spec

    inner = ("stream_rule", "_tile_rows", "_LIVE", "_tiles", "_layer_u")  # (tiles.py's own: hf may change)
    if not all(hasattr(tiles, name) for name in inner):
        return head_map(weights, layer, head)[lo:hi, lo:hi].copy()
    inputs, params = window.layers[layer], window.params
    rule = tiles.stream_rule(variant, params[variant], inputs.causal)
    if rule == "head":
        return head_map(weights, layer, head)[lo:hi, lo:hi].copy()
    normalizer = variant_spec(variant).normalizer
    rows = tiles._tile_rows(inputs, 1, tiles._LIVE + 1)  # head_weights' tiles
    out = np.zeros((hi - lo, hi - lo), np.float32)

    def put(i0: int, i1: int, k0: int, k1: int, tile) -> None:  # tile (1, i1 - i0, k1 - k0)
        r0, r1, c0, c1 = max(i0, lo), min(i1, hi), max(k0, lo), min(k1, hi)
        if r1 > r0 and c1 > c0:
            out[r0 - lo:r1 - lo, c0 - lo:c1 - lo] = tile[0, r0 - i0:r1 - i0, c0 - k0:c1 - k0].cpu().numpy()

    one = slice(head, head + 1)
    if rule == "row":  # each tile alone, as tiles._tiles computes a row rule's
        n_q = inputs.query.shape[1]
        for i0 in range(0, n_q, rows):
            i1 = min(n_q, i0 + rows)
            if i0 >= hi:
                break
            if i1 <= lo:
                continue
            k0, k1 = inputs.span(i0, i1)
            if k1 > k0:
                s = inputs.logits(one, i0, i1, k0, k1)
                w = fn.row_softmax(s) if normalizer is fn.unas else normalizer(
                    s, fn.NormalizerContext(causal=inputs.causal, params=dict(params[variant])))
                put(i0, i1, k0, k1, w)
        return out
    u = None
    if normalizer is fn.hnas:
        u = tiles._layer_u(params[variant]["u"], layer, inputs.query.shape[0])[head:head + 1]
        u = u.to(inputs.query.device)
    for i0, i1, k0, k1, tile in tiles._tiles(inputs, one, [variant], {variant: rule}, params, u, rows):
        if k1 > k0 and i1 > lo:
            put(i0, i1, k0, k1, tile[variant])
        if i1 >= hi:  # the tiles below the span are never computed
            break
    return out


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
