"""A GAM checkpoint's parts on Inspect: its content map Φ (Eq. 14), relative-position map Θ (Eq. 22)
and their combination (Eq. 20) of one head, side by side on one colour scale, with an Export menu."""

from __future__ import annotations

import numpy as np

from appkit.analysis import WindowView
from appkit.show import current_focus, show_bundle
from attnlab.figures.bundle import FigureBundle, long_table
from attnlab.figures.views import panel_heatmaps

PARTS = {"phi": "Φ: content brains", "theta": "Θ: relative position", "combined": "combined weights"}
NOTE = (
    "GAM model: the variant normalizes each brain's scores (Ψ_b = variant(ε_b), Eq. 14) and each "
    "relative-position brain (Eq. 22) before they are mixed into Φ and Θ and combined (Eq. 20). "
    "UNAS is the paper's softmax; DNAS, HNAS and Sinkhorn put the column normalization in each brain."
)


def is_gam(view: WindowView) -> bool:
    """True for a GAM checkpoint's analysis (it comes with the maps Φ and Θ of every variant)."""
    return any("phi" in maps or "theta" in maps for maps in view.components.values())


def gam_bundle(view: WindowView, variant: str, layer: int, head: int, focus: int | None) -> FigureBundle:
    """Φ, Θ and the combined map of (layer, head), one figure, one colour scale."""
    maps = {**view.components[variant], "combined": view.weights[variant]}
    shown = [k for k in PARTS if k in maps]
    arrays = [np.asarray(maps[k][layer, head]) for k in shown]  # (N, N) each
    fig = panel_heatmaps(
        arrays,
        view.tokens,
        [PARTS[k] for k in shown],
        focus=focus,
        title=f"GAM, {variant} in each brain: layer {layer}, head {head} — one colour scale",
    )
    table = long_table(np.stack(arrays), ["map"])
    table["map"] = [shown[i] for i in table["map"]]
    return FigureBundle(fig, table, dict(zip(shown, arrays, strict=True)))


def gam_maps(prefix: str, view: WindowView, variant: str, layer: int, head: int) -> None:
    b = gam_bundle(view, variant, layer, head, current_focus(view))
    show_bundle(prefix, "gam", b, {"model": view.settings.source.label, "variant": variant}, width="stretch")
