"""One head's map over a long context (a causal model's whole text, thousands of tokens): drawn
downsampled into token blocks, and a region of it (a query range x a key range) at full resolution.

An (N, N) map of 8,192 tokens has 64M cells: no browser draws that cell by cell. The overview
pools it into b x b token blocks (b = ceil(N / max_cells), so at most max_cells x max_cells cells),
each the mean (or the max) of the weights it covers; the zoom is a plain slice of the map, at most
``MAX_ZOOM`` x ``MAX_ZOOM`` cells, with token labels. Both take ONE head's map (read with
``weights.head(layer, head)`` on a streamed window's HeadMaps, attnlab/hf/compute/head_maps.py), so
no other head is computed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go

from attnlab.figures._data import as_array, check_focus
from attnlab.figures.attention import COLORSCALE, attention_heatmap
from attnlab.figures.bundle import FigureBundle, long_table

__all__ = ["MAX_OVERVIEW", "MAX_ZOOM", "POOLS", "block_pool", "block_size", "blocks_bundle", "head_map",
           "overview_heatmap", "pooled_panels", "zoom_bundle", "zoom_region"]

MAX_OVERVIEW = 512  # cells per side of the downsampled map at most
MAX_ZOOM = 512  # cells per side of a zoomed region at most (each labelled with its token)
POOLS = ("mean", "max")


def block_size(n: int, max_cells: int = MAX_OVERVIEW) -> int:
    """Tokens per block side so that n tokens make at most ``max_cells`` blocks (1: no pooling)."""
    if n < 0 or max_cells < 1:
        raise ValueError(f"n must be >= 0 and max_cells >= 1, got n={n}, max_cells={max_cells}")
    return max(1, math.ceil(n / max_cells))


def block_pool(weights, block: int, how: str = "mean") -> np.ndarray:
    """(M, N) map -> (ceil(M/b), ceil(N/b)) float32: cell (r, c) is the mean (or max) of
    weights[r*b:(r+1)*b, c*b:(c+1)*b]; a ragged last block row or column covers what is left (its
    mean is over the entries it holds). NaN propagates to its block (the NaN rule)."""
    w = as_array(weights, "weights", 2)
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1:
        raise ValueError(f"block must be an integer >= 1, got {block!r}")
    if how not in POOLS:
        raise ValueError(f"how must be one of {POOLS}, got {how!r}")
    M, N = w.shape
    if block == 1 or w.size == 0:
        return w.copy()
    rows, cols = np.arange(0, M, block), np.arange(0, N, block)
    if how == "max":
        return np.maximum.reduceat(np.maximum.reduceat(w, cols, axis=1), rows, axis=0).astype(np.float32)
    # float64 sums a strip of ``block`` rows at a time: numpy casts a reduction's whole input first, and
    # a float64 copy of the whole map (512 MB at 8,192 tokens, freshly paged in) took seconds
    sums = np.empty((len(rows), len(cols)))
    for r, r0 in enumerate(rows):
        strip = np.add.reduceat(w[r0:r0 + block], cols, axis=1, dtype=np.float64)  # (<= block, len(cols))
        sums[r] = np.add.reduce(strip, axis=0)
    counts = np.outer(np.minimum(block, M - rows), np.minimum(block, N - cols))  # entries per block
    return (sums / counts).astype(np.float32)


def zoom_region(n: int, rows: tuple[int, int], cols: tuple[int, int], max_cells: int = MAX_ZOOM):
    """Checked (start, stop) query and key ranges of an (n, n) map: 0 <= start < stop <= n, at most
    ``max_cells`` each; a ValueError names the range otherwise."""
    out = []
    for name, (a, b) in (("rows", rows), ("cols", cols)):
        a, b = int(a), int(b)
        if not 0 <= a < b <= n:
            raise ValueError(f"{name} must be a range start < stop within [0, {n}], got [{a}, {b})")
        if b - a > max_cells:
            raise ValueError(f"{name} may span at most {max_cells} tokens at full resolution, got {b - a}")
        out.append((a, b))
    return tuple(out)


def head_map(weights, layer: int, head: int) -> np.ndarray:
    """One head's (N, N) float32 map of (L, H, N, N) weights: ``weights.head(layer, head)`` when the
    weights compute a head on access (HeadMaps: no other head computed), else ``weights[layer, head]``."""
    one = weights.head(layer, head) if hasattr(weights, "head") else weights[layer, head]
    return as_array(one, "weights[layer, head]", 2)


def pooled_panels(maps: Sequence[np.ndarray], focus: int | None = None):
    """Maps compared side by side (panels, their differences), each (M, N) of one head: unchanged while
    both sides fit ``MAX_OVERVIEW`` cells, else every map pooled into the same b x b token blocks
    (means: the block mean of A - B is the mean of A's block minus B's). -> (maps, block, (query
    labels, key labels) or None, focus's cell or None); the labels are the blocks' token ranges."""
    M, N = maps[0].shape
    block = block_size(max(M, N))
    if block == 1:
        return list(maps), 1, None, focus
    labels = tuple([f"{a}–{min(a + block, n) - 1}" for a in range(0, n, block)] for n in (M, N))
    cell = None if focus is None else int(focus) // block
    return [block_pool(m, block) for m in maps], block, labels, cell


def describe_block(block: int, how: str) -> str:
    """What one cell of the overview is, for the page and the title: "each cell = 16 × 16 tokens (mean)"."""
    return "each cell = 1 token pair" if block == 1 else f"each cell = {block} × {block} tokens ({how})"


TITLE_PAD_PX, TOP_MARGIN_PX = 12, 110  # overview_heatmap: the title's room, then the top axis'


def overview_heatmap(pooled, block: int, n: int, *, how: str = "mean", title: str = "Attention weights",
                     region: tuple[tuple[int, int], tuple[int, int]] | None = None,
                     focus: int | None = None) -> go.Figure:
    """The (m, m) pooled map of an (n, n) head on axes in token positions (cell r covers tokens
    r*block .. min((r+1)*block, n) - 1); ``region`` ((q0, q1), (k0, k1)) is outlined (the zoom),
    ``focus`` marks its token's row and column."""
    z = as_array(pooled, "pooled", 2)
    starts_y, starts_x = np.arange(z.shape[0]) * block, np.arange(z.shape[1]) * block
    fig = go.Figure(go.Heatmap(
        z=z, x=starts_x + (block - 1) / 2, y=starts_y + (block - 1) / 2, colorscale=COLORSCALE, zmin=0.0,
        zmax=float(np.nanmax(z)) if z.size and np.isfinite(z).any() else 1.0,
        colorbar={"title": {"text": how}},
        hovertemplate=f"query ≈ %{{y:.0f}}<br>key ≈ %{{x:.0f}}<br>{how} of the block %{{z:.4f}}"
                      "<extra></extra>",
    ))
    fig.update_xaxes(title="key position (attended to)", range=[-0.5, n - 0.5], side="top", showgrid=False)
    fig.update_yaxes(title="query position (attending)", range=[n - 0.5, -0.5], showgrid=False)
    shapes = []
    if region is not None:
        (q0, q1), (k0, k1) = region
        shapes.append({"type": "rect", "x0": k0 - 0.5, "x1": k1 - 0.5, "y0": q0 - 0.5, "y1": q1 - 0.5,
                       "line": {"color": "white", "width": 2}})
    if (focus := check_focus(focus, n)) is not None:
        line = {"color": "#ff7f0e", "width": 1}
        shapes += [{"type": "line", "x0": -0.5, "x1": n - 0.5, "y0": focus, "y1": focus, "line": line},
                   {"type": "line", "x0": focus, "x1": focus, "y0": -0.5, "y1": n - 0.5, "line": line}]
    # the key axis is on top: the title sits at the top of the figure, above that axis' title and
    # ticks (by default both were drawn in the middle of the top margin, one over the other)
    fig.update_layout(
        title={"text": f"{title} ({describe_block(block, how)})", "yref": "container", "y": 1,
               "yanchor": "top", "pad": {"t": TITLE_PAD_PX}},
        margin={"t": TOP_MARGIN_PX}, width=760, height=700, shapes=shapes,
    )
    return fig


def blocks_bundle(weights, tokens: Sequence[str], p: dict) -> FigureBundle:
    """The overview of params' (variant's) ``layer``, ``head``: ``block`` (default
    :func:`block_size`), ``how`` ("mean" | "max"), ``rows`` / ``cols`` (the zoom outlined), ``focus``."""
    v, layer, head = p["variant"], p["layer"], p["head"]
    m = head_map(weights, layer, head)  # (N, N)
    n = m.shape[0]
    block, how = int(p.get("block") or block_size(n)), p.get("how", "mean")
    pooled = block_pool(m, block, how)  # (ceil(N/b), ceil(N/b))
    region = (tuple(p["rows"]), tuple(p["cols"])) if p.get("rows") and p.get("cols") else None
    fig = overview_heatmap(pooled, block, n, how=how, title=f"{v}: layer {layer}, head {head}",
                           region=region, focus=p.get("focus"))
    table = long_table(pooled, [], ("query_block", "key_block")).assign(
        query_start=lambda t: t["query_block"] * block, key_start=lambda t: t["key_block"] * block)
    return FigureBundle(fig, table, {f"{v}_{how}": pooled, "block": np.array(block), "n": np.array(n)})


def zoom_bundle(weights, tokens: Sequence[str], p: dict) -> FigureBundle:
    """The region ``rows`` x ``cols`` (token ranges [start, stop)) of params' head at full resolution,
    labelled with the tokens and their positions in the text."""
    v, layer, head = p["variant"], p["layer"], p["head"]
    m = head_map(weights, layer, head)  # (N, N)
    (q0, q1), (k0, k1) = zoom_region(m.shape[0], p["rows"], p["cols"])
    part = m[q0:q1, k0:k1]  # (q1 - q0, k1 - k0), the map's own values
    title = f"{v}: layer {layer}, head {head}, queries {q0}–{q1 - 1} × keys {k0}–{k1 - 1}"
    fig = attention_heatmap(part, list(tokens[k0:k1]), query_tokens=list(tokens[q0:q1]), starts=(q0, k0),
                            title=title)
    if (focus := p.get("focus")) is not None:  # its row (as a query) and column (as a key), where inside
        line = {"color": "#ff7f0e", "width": 2}
        if q0 <= focus < q1:
            fig.add_shape(type="rect", x0=-0.5, x1=k1 - k0 - 0.5, y0=focus - q0 - 0.5, y1=focus - q0 + 0.5,
                          line=line, xref="x", yref="y")
        if k0 <= focus < k1:
            fig.add_shape(type="rect", x0=focus - k0 - 0.5, x1=focus - k0 + 0.5, y0=-0.5, y1=q1 - q0 - 0.5,
                          line=line, xref="x", yref="y")
    table = long_table(part, []).assign(query=lambda t: t["query"] + q0, key=lambda t: t["key"] + k0)
    arrays = {v: part, "rows": np.array([q0, q1]), "cols": np.array([k0, k1]),
              "query_tokens": np.array(tokens[q0:q1]), "key_tokens": np.array(tokens[k0:k1])}
    return FigureBundle(fig, table, arrays)
