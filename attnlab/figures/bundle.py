"""A figure and the data behind it (:class:`FigureBundle`), and the bytes of its downloads.

Every builder of the app's figures returns a bundle: the plotly figure, the table it draws (long
format, the CSV export) and full-precision arrays (the NPZ export, no pickle).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import plotly.graph_objects as go

__all__ = ["FigureBundle", "data_bytes", "figure_bytes", "long_table"]


@dataclass
class FigureBundle:
    """A figure and the data behind it, ready for export."""

    figure: go.Figure
    table: pd.DataFrame  # what the figure draws, long format (CSV export)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)  # full-precision data (NPZ export)


def long_table(
    maps: np.ndarray, names: Sequence[str], columns: Sequence[str] = ("query", "key")
) -> pd.DataFrame:
    """(..., M, N) -> one row per entry with integer index columns ``names`` + columns + value."""
    idx = np.indices(maps.shape).reshape(maps.ndim, -1)
    data = {name: idx[k] for k, name in enumerate([*names, *columns])}
    data["weight"] = maps.reshape(-1)
    return pd.DataFrame(data)


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
