"""Statistics views: which tokens are explained away (docs/DESIGN.md §4), as a table for the app."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from attnlab.figures._data import check_tokens, column_masses

__all__ = ["MOST_EXPLAINED_AWAY_COLUMNS", "most_explained_away", "relative_mass"]

# The columns of :func:`most_explained_away`: name -> (label for people, number format). The app's
# table reads its headers and formats from here, so the two cannot drift apart.
MOST_EXPLAINED_AWAY_COLUMNS = {
    "position": ("position", "%d"),
    "token": ("token", None),
    "share_of_heads": ("explained away in (share of heads)", "%.2f"),
    "mean_relative_mass": ("mean relative mass", "%.3f"),
    "min_relative_mass": ("min relative mass", "%.3f"),
}


def relative_mass(w: np.ndarray) -> np.ndarray:
    """(..., M, N) -> (..., N) relative column mass m_j * N / M (mean 1); docs/DESIGN.md §4."""
    M, N = w.shape[-2:]
    return w.sum(-2) * (N / max(M, 1))


def most_explained_away(
    weights, tokens: Sequence[str], eps: float, *, layer: int | None = None, top: int = 15
) -> pd.DataFrame:
    """Tokens ranked by how often they are eps-explained away (relative column mass < eps).

    weights: (L, H, N, N) of one variant; ``layer`` restricts to one layer (None: all layers).
    Columns: position, token, share_of_heads (share of (layer, head) maps where the token is
    explained away), mean_relative_mass, min_relative_mass (labels: MOST_EXPLAINED_AWAY_COLUMNS);
    sorted by share, then mean mass.
    """
    cm, M = column_masses(weights)  # (L, H, N): a streamed window's without computing its maps
    tokens = check_tokens(tokens, cm.shape[-1])
    if layer is not None:
        cm = cm[layer : layer + 1]
    rel = (cm * (cm.shape[-1] / max(M, 1))).reshape(-1, cm.shape[-1])  # (L*H, N), as relative_mass
    frame = pd.DataFrame(
        {
            "position": np.arange(len(tokens)),
            "token": tokens,
            "share_of_heads": (rel < eps).mean(0),
            "mean_relative_mass": rel.mean(0),
            "min_relative_mass": rel.min(0),
        }
    )
    frame = frame.sort_values(["share_of_heads", "mean_relative_mass"], ascending=[False, True])
    return frame.head(top).reset_index(drop=True)
