"""The app's figure builders under their historical module name (kept so that older manifests'
``from attnlab.figures.app_views import reproduce_figure`` still works). Each concern lives in its
own module; every public name is importable from ``attnlab.figures`` too:

    attnlab.figures.kinds       build(kind, ...), KINDS: the spec-driven builder of the app's pages
    attnlab.figures.head_view   head_view, model_view (bertviz-style line views)
    attnlab.figures.views       token_mass_strip, panel_heatmaps, difference_heatmap, js_distance_heatmap
    attnlab.figures.stat_views  most_explained_away
    attnlab.figures.embeddings  pca_2d, umap_2d, joint_query_key, embedding_scatter, embedding_view
    attnlab.figures.training    training_curves, hybrid_weight_curves, hybrid_weight_heatmap
    attnlab.figures.bundle      FigureBundle, figure_bytes, data_bytes
    attnlab.figures.reproduce   manifest, analyze_command, reproduce_figure (the CLI's output layout)
"""

from attnlab.figures.bundle import FigureBundle, data_bytes, figure_bytes
from attnlab.figures.embeddings import embedding_scatter, embedding_view, joint_query_key, pca_2d, umap_2d
from attnlab.figures.head_view import head_view, model_view
from attnlab.figures.kinds import KINDS, MULTI_KINDS, PAIR_KINDS, build
from attnlab.figures.reproduce import MANIFEST_FORMAT, analyze_command, manifest, reproduce_figure
from attnlab.figures.stat_views import most_explained_away
from attnlab.figures.training import hybrid_weight_curves, hybrid_weight_heatmap, training_curves
from attnlab.figures.views import difference_heatmap, js_distance_heatmap, panel_heatmaps, token_mass_strip

__all__ = [
    "KINDS",
    "MANIFEST_FORMAT",
    "MULTI_KINDS",
    "PAIR_KINDS",
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
]
