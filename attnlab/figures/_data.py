"""Data preparation shared by every figure builder: arrays in, checked shapes, light payloads.

Builders take torch tensors or numpy arrays; they are turned into float32 numpy arrays here, which
plotly serializes as compact base64 typed arrays (not lists of numbers) in JSON and HTML.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

ZERO_WIDTH = "\u200b"
# One colour per variant, the same in every figure that draws a line per variant (column-mass ECDFs,
# corpus curves): fixed for the built-in variants, so no two of them get near-identical colours
# whatever subset a figure draws (softmax1 was drawn over UNAS in a near-identical blue).
VARIANT_COLORS = {
    "unas": "#1f77b4",  # blue
    "dnas": "#d62728",  # red
    "hnas": "#2ca02c",  # green
    "sinkhorn": "#9467bd",  # purple
    "sparsemax": "#ff7f0e",  # orange
    "softmax1": "#8c564b",  # brown
}
OTHER_COLORS = ("#e377c2", "#17becf", "#bcbd22", "#7f7f7f")  # plugin variants, other labels


def _magma() -> list[list]:
    """Plotly's Magma with its first stop black (#000000, not #000004): Streamlit's browser code
    replaces the colours #000001 to #000040 anywhere in a figure with its theme's (the placeholders
    of its plotly theme, even with theme=None), so Magma's #000004 came out lilac (#ab63fa) and the
    lowest values of the intervention and Jensen-Shannon maps looked higher than the next ones."""
    import plotly.colors

    stops = plotly.colors.make_colorscale(plotly.colors.sequential.Magma)
    return [[s, "#000000" if k == 0 else c] for k, (s, c) in enumerate(stops)]


MAGMA = _magma()


def variant_color(name: str, k: int = 0) -> str:
    """The colour of variant ``name`` (a plugin variant or another label: the k-th other colour)."""
    return VARIANT_COLORS.get(name) or OTHER_COLORS[k % len(OTHER_COLORS)]


def as_array(x, name: str, ndim: int | tuple[int, ...] | None = None) -> np.ndarray:
    """float32 numpy array from a tensor / array / nested list; checks the number of dims."""
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch here
        x = x.detach().float().cpu().numpy()
    try:
        a = np.asarray(x, dtype=np.float32)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be numeric (a tensor or an array), got {type(x).__name__}") from None
    dims = (ndim,) if isinstance(ndim, int) else ndim
    if dims is not None and a.ndim not in dims:
        want = " or ".join(f"{d}-D" for d in dims)
        raise ValueError(f"{name} must be {want}, got shape {a.shape}")
    return a


def check_tokens(tokens: Sequence[str] | None, n: int, name: str = "tokens") -> list[str] | None:
    """Tokens as a list of str of length n (bertviz-style message when the lengths disagree)."""
    if tokens is None:
        return None
    tokens = [str(t) for t in tokens]
    if len(tokens) != n:
        raise ValueError(f"attention has {n} positions, while {name} has {len(tokens)} tokens")
    return tokens


def unique_labels(tokens: Sequence[str]) -> list[str]:
    """Make repeated tokens distinct for a categorical axis without changing how they look.

    Plotly merges equal category labels, so the k-th repeat of a token gets k zero-width spaces.
    """
    seen: dict[str, int] = {}
    out = []
    for t in tokens:
        k = seen.get(t, 0)
        seen[t] = k + 1
        out.append(t + ZERO_WIDTH * k)
    return out


def block_mean(maps: np.ndarray, max_size: int) -> tuple[np.ndarray, int]:
    """Downsample (..., M, N) maps so that neither side exceeds max_size: mean over f x f blocks.

    Returns (pooled (..., ceil(M/f), ceil(N/f)), f); f = 1 (no copy) when the maps are small enough.
    Partial blocks at the edges are averaged over the entries they have.
    """
    m, n = maps.shape[-2:]
    f = max(1, math.ceil(max(m, n) / max_size))
    if f == 1:
        return maps, 1
    # block sums without a padded copy: sums over [0, f), [f, 2f), ... along each axis
    sums = np.add.reduceat(np.add.reduceat(maps, np.arange(0, n, f), axis=-1), np.arange(0, m, f), axis=-2)
    bm, bn = sums.shape[-2:]
    rows = np.minimum(f, m - np.arange(bm) * f)  # entries per block row / column
    cols = np.minimum(f, n - np.arange(bn) * f)
    return (sums / np.outer(rows, cols)).astype(np.float32), f


def column_masses(weights) -> tuple[np.ndarray, int]:
    """((L, H, N) column masses m_j = sum_i pi_ij, M) of one variant's (L, H, M, N) weights. A streamed
    window's weights (HeadMaps, whose ``window`` streams them: attnlab/hf/compute/streamed.py) give
    them without computing any map; other weights are summed."""
    window = getattr(weights, "window", None)
    if window is not None and hasattr(window, "column_masses") and hasattr(weights, "variant"):
        return as_array(window.column_masses()[weights.variant], "column masses", 3), int(weights.shape[-2])
    w = as_array(weights, "weights", 4)
    return w.sum(-2), w.shape[-2]


def check_focus(focus, n: int) -> int | None:
    """A focused token position: None, or an int in [0, n) (numpy integers accepted)."""
    if focus is None:
        return None
    if isinstance(focus, bool) or not isinstance(focus, (int, np.integer)):
        raise ValueError(f"focus must be a token position (int) or None, got {type(focus).__name__}")
    if not 0 <= int(focus) < n:
        raise ValueError(f"focus must be a token position in [0, {n}), got {int(focus)}")
    return int(focus)
