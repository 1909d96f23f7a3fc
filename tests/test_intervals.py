"""attnlab.stats.intervals.t_half_width: the one 95 % t-interval over seeds, against scipy's own
t.interval on the mean, along any axis, with the worded errors and NaN for a single run."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from attnlab.stats.intervals import t_half_width


def test_equals_scipys_interval_of_the_mean_along_any_axis():
    x = np.random.default_rng(0).normal(0.6, 0.05, size=(3, 4, 5))  # 3 seeds x (4, 5)
    for axis in range(3):
        half = t_half_width(x, axis=axis)
        mean, sem = x.mean(axis), stats.sem(x, axis=axis)
        lo, hi = stats.t.interval(0.95, x.shape[axis] - 1, loc=mean, scale=sem)
        np.testing.assert_allclose(half, (hi - lo) / 2, rtol=1e-12)
    assert float(t_half_width([0.5, 0.7], level=0.9)) == pytest.approx(
        stats.t.ppf(0.95, 1) * np.std([0.5, 0.7], ddof=1) / np.sqrt(2))


def test_one_run_gives_nan_and_bad_input_is_worded():
    assert np.isnan(t_half_width([0.6])).all()
    assert t_half_width(np.ones((1, 3))).shape == (3,) and np.isnan(t_half_width(np.ones((1, 3)))).all()
    with pytest.raises(ValueError, match=r"values must hold at least one run along axis 0, got shape \(0,\)"):
        t_half_width([])
    with pytest.raises(ValueError, match=r"level must be in \(0, 1\), got 1.5"):
        t_half_width([1.0, 2.0], level=1.5)
