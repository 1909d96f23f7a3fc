"""Plotly figure builders shared by the Streamlit app and the CLI (no streamlit import here).

Builders take plain tensors / arrays plus tokens and return ``plotly.graph_objects.Figure``::

    attention_grid(weights (L, H, N, N), tokens=None, title=...)        layer x head grid, one trace
    attention_heatmap(weights (N, N), tokens, title=...)                one head, token labels, hover
    column_mass_distribution({variant: masses}, n_valid, u=None, kind="ecdf" | "histogram")
    explained_away_heatmap(fractions (L, H) or {variant: (L, H)}, title)

The app's views (one module per concern; ``attnlab.figures.app_views`` re-exports them)::

    head_view / model_view (bertviz-style lines), token_mass_strip, panel_heatmaps,
    difference_heatmap, js_distance_heatmap, most_explained_away, embedding_scatter / embedding_view,
    pca_2d / umap_2d / joint_query_key, training_curves, hybrid_weight_curves / hybrid_weight_heatmap,
    build(kind, weights, tokens, params) -> FigureBundle, manifest / analyze_command /
    reproduce_figure (the `attnlab analyze` round trip), figure_bytes / data_bytes.

Export (``attnlab.figures.export``): ``export_figure(fig, "out/grid.png")`` (PNG / SVG / PDF via
kaleido + Chromium, HTML with plotly.js inline), ``export_figures``, ``export_data`` (CSV / JSON /
NPZ), ``chromium_available()``, ``ExportError``.
"""

from attnlab.figures.app_views import (
    KINDS,
    MANIFEST_FORMAT,
    MULTI_KINDS,
    PAIR_KINDS,
    FigureBundle,
    analyze_command,
    build,
    data_bytes,
    difference_heatmap,
    embedding_scatter,
    embedding_view,
    figure_bytes,
    head_view,
    hybrid_weight_curves,
    hybrid_weight_heatmap,
    joint_query_key,
    js_distance_heatmap,
    manifest,
    model_view,
    most_explained_away,
    panel_heatmaps,
    pca_2d,
    reproduce_figure,
    token_mass_strip,
    training_curves,
    umap_2d,
)
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
    "KINDS",
    "MANIFEST_FORMAT",
    "MULTI_KINDS",
    "PAIR_KINDS",
    "ExportError",
    "FigureBundle",
    "analyze_command",
    "build",
    "data_bytes",
    "difference_heatmap",
    "embedding_scatter",
    "embedding_view",
    "figure_bytes",
    "head_view",
    "hybrid_weight_curves",
    "hybrid_weight_heatmap",
    "joint_query_key",
    "js_distance_heatmap",
    "manifest",
    "model_view",
    "most_explained_away",
    "panel_heatmaps",
    "pca_2d",
    "reproduce_figure",
    "token_mass_strip",
    "training_curves",
    "umap_2d",
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
