"""Plotly figure builders shared by the Streamlit app and the CLI (no streamlit import here).

Builders take plain tensors / arrays plus tokens and return ``plotly.graph_objects.Figure``::

    attention_grid(weights (L, H, N, N), tokens=None, title=...)        layer x head grid, one trace
    attention_heatmap(weights (N, N), tokens, title=...)                one head, token labels, hover
    column_mass_distribution({variant: masses}, n_valid, u=None, kind="ecdf" | "histogram")
    explained_away_heatmap(fractions (L, H) or {variant: (L, H)}, title)

Export (``attnlab.figures.export``): ``export_figure(fig, "out/grid.png")`` (PNG / SVG / PDF via
kaleido + Chromium, HTML with plotly.js inline), ``export_figures``, ``export_data`` (CSV / JSON /
NPZ), ``chromium_available()``, ``ExportError``.
"""

from attnlab.figures.attention import attention_grid, attention_heatmap
from attnlab.figures.distributions import column_mass_distribution, explained_away_heatmap
from attnlab.figures.export import (
    ExportError,
    ExportReport,
    chromium_available,
    chromium_path,
    close_session,
    export_data,
    export_figure,
    export_figures,
)

__all__ = [
    "ExportError",
    "ExportReport",
    "attention_grid",
    "attention_heatmap",
    "chromium_available",
    "chromium_path",
    "close_session",
    "column_mass_distribution",
    "explained_away_heatmap",
    "export_data",
    "export_figure",
    "export_figures",
]
