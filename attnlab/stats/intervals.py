"""Confidence intervals over independent runs (seeds): the one Student-t interval that the results
command (attnlab.train.scale_results), the retrofit's u per layer (attnlab.train.retrofit) and the
Hybrid weights page's seed band (attnlab.figures.training.seed_band) all report."""

from __future__ import annotations

import numpy as np

__all__ = ["t_half_width"]


def t_half_width(values, axis: int = 0, level: float = 0.95) -> np.ndarray:
    """Half the width of the ``level`` Student-t interval of the mean along ``axis``:
    t_{(1 + level) / 2, R - 1} · s / √R, with s the sample standard deviation (ddof 1) of the R values.

    values: array-like, (..., R, ...) with R along ``axis`` (float64 inside). Returns the other axes'
    shape (a 0-d array for 1-D input); NaN where R < 2 (no interval from one run).
    """
    from scipy import stats

    x = np.asarray(values, dtype=np.float64)
    if x.ndim == 0 or x.shape[axis] == 0:
        raise ValueError(f"values must hold at least one run along axis {axis}, got shape {x.shape}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    R = x.shape[axis]
    if R < 2:
        return np.full(np.delete(x.shape, axis), np.nan)
    return stats.t.ppf(0.5 + level / 2, R - 1) * x.std(axis=axis, ddof=1) / np.sqrt(R)
