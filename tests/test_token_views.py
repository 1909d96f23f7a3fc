"""What Inspect's browser-drawn token views receive (app/appkit/token_views.py): each view's arrays
are the analysis' own numbers (float32 maps exactly; the model view's bytes within 1/255 of the
largest weight; the grid is attnlab.figures' block mean), with titles, tokens and sizes. How the
browser draws them and click to focus: tests/test_browser.py; on the page: tests/test_app.py."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("streamlit")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "app"))
from appkit.token_views import GRID_MAX_TOKENS, KINDS, STRIP_EXACT_MAX_TOKENS, decoded, view_data  # noqa: E402

from attnlab.figures._data import block_mean  # noqa: E402


def _view(L=2, H=3, N=5, seed=0, nan_row=False):
    rng = np.random.default_rng(seed)
    s = rng.normal(size=(L, H, N, N)).astype(np.float32)
    w = np.exp(s) / np.exp(s).sum(-1, keepdims=True)  # rows sum to 1
    if nan_row:
        w[0, 0, 1] = np.nan  # a NaN row is an ordinary input
    tokens = [f"t{i}" for i in range(N)]
    return SimpleNamespace(weights={"unas": w}, key="k1", tokens=tokens, shape=(L, H, N)), w


def test_each_view_gets_the_analysis_numbers():
    view, w = _view()
    heat = decoded(view_data("heatmap", view, "unas", 1, 2))
    assert heat["title"] == "unas: layer 1, head 2" and heat["tokens"] == view.tokens and heat["n"] == 5
    np.testing.assert_array_equal(heat["map"], w[1, 2])
    assert heat["zmax"] == pytest.approx(float(w[1, 2].max()))
    head = decoded(view_data("head_view", view, "unas", 0, 1))
    np.testing.assert_array_equal(head["map"], w[0, 1])
    assert head["title"] == "unas: head view, layer 0, head 1"
    mean = decoded(view_data("token_mass", view, "unas", 1, None))  # the mean over the layer's heads
    np.testing.assert_allclose(mean["strip"], w[1].mean(0), rtol=1e-6)
    np.testing.assert_allclose(mean["strip"].sum(0), w[1].sum(-2).mean(0), rtol=1e-5)  # column mass
    assert mean["strip_title"] == "unas: attention each token receives (layer 1, mean over heads)"
    one = decoded(view_data("token_mass", view, "unas", 1, 0))
    np.testing.assert_array_equal(one["strip"], w[1, 0])
    assert one["strip_where"] == "layer 1, head 0"
    model = decoded(view_data("model_view", view, "unas", 0, 0))
    assert (model["layers"], model["heads"]) == (2, 3) and model["model_off"].tolist()[0] == 0
    dense = np.zeros((2 * 3, 25))  # the pairs it draws (>= min_weight), one byte each, per head
    for h in range(6):
        span = slice(model["model_off"][h], model["model_off"][h + 1])
        dense[h, model["model_idx"][span]] = model["model_val"][span] * (model["model_max"] / 255)
    drawn = np.where(w >= model["min_weight"], w, 0.0).reshape(6, 25)
    np.testing.assert_allclose(dense, drawn, atol=w.max() / 255 / 2 + 1e-7)
    assert (dense > 0).sum() == (w >= model["min_weight"]).sum()


def test_grid_is_the_block_mean_and_says_so():
    view, w = _view(L=1, H=2, N=GRID_MAX_TOKENS + 3, seed=1)
    grid = decoded(view_data("grid", view, "unas", 0, 0))
    pooled, f = block_mean(w, GRID_MAX_TOKENS)
    assert f == 2 and grid["block"] == 2 and grid["grid"].shape == pooled.shape
    np.testing.assert_array_equal(grid["grid"], pooled)
    assert grid["title"] == "unas: attention by layer and head (means over 2x2 token blocks)"
    small, w_small = _view()
    grid = decoded(view_data("grid", small, "unas", 0, 0))
    assert grid["block"] == 1 and grid["title"] == "unas: attention by layer and head"
    np.testing.assert_array_equal(grid["grid"], w_small)


def test_nan_and_unknown_kind():
    view, w = _view(nan_row=True)
    heat = decoded(view_data("heatmap", view, "unas", 0, 0))
    assert np.isnan(heat["map"][1]).all() and np.isfinite(heat["zmax"])
    model = decoded(view_data("model_view", view, "unas", 0, 0))
    first = model["model_idx"][model["model_off"][0] : model["model_off"][1]]
    assert not ((first // 5) == 1).any()  # NaN weights (row 1 of map (0, 0)) draw no line
    long, _ = _view(L=1, H=1, N=65)
    with pytest.raises(ValueError, match="model view draws up to 64 tokens"):
        view_data("model_view", long, "unas", 0, 0)
    assert all(view_data(k, view, "unas", 0, 0)["kind"] == k for k in KINDS)
    with pytest.raises(ValueError, match="kind must be one of"):
        view_data("chart", view, "unas", 0, 0)


def test_the_app_reads_one_variant_of_lazy_weights_without_computing_the_others():
    """appkit.analysis keeps an analysis' lazy weights lazy (as numpy): Inspect, which shows one
    variant, computes that one (each is ~75 MB and ~0.2 s at 512 tokens)."""
    import torch
    from appkit.analysis import _numpy_weights

    from attnlab.hf.compute.lazy_weights import LazyWeights

    asked = []

    def compute(names):
        asked.append(names)
        return {n: torch.full((1, 1, 2, 2), float(len(n))) for n in names}

    lazy = LazyWeights(("unas", "dnas"), compute)
    weights = _numpy_weights(lazy)
    assert list(weights) == ["unas", "dnas"] and len(weights) == 2 and asked == []
    np.testing.assert_array_equal(weights["dnas"], np.full((1, 1, 2, 2), 4.0, dtype=np.float32))
    assert asked == [("dnas",)] and lazy.computed == ("dnas",)
    assert isinstance(weights["dnas"], np.ndarray)
    plain = _numpy_weights({"unas": torch.zeros(1, 1, 2, 2)})  # not lazy (swap mode, native models)
    assert isinstance(plain["unas"], np.ndarray)


def test_a_long_strip_sends_exact_masses_and_16_bit_rows():
    N = STRIP_EXACT_MAX_TOKENS + 2
    view, w = _view(L=1, H=2, N=N, seed=2)
    strip = decoded(view_data("token_mass", view, "unas", 0, None))
    assert "strip" not in strip
    np.testing.assert_allclose(strip["strip_mass"], w[0].mean(0).sum(0), rtol=1e-6)  # exact masses
    assert np.isfinite(strip["strip_mass"]).all()
    w[0, :, 5] = np.nan  # a NaN row (query 5) in both heads
    strip = decoded(view_data("token_mass", view, "unas", 0, None))
    mean = w[0].mean(0)  # (N, N): what the strip shades
    rows = strip["strip_q"].astype(np.float64) * strip["strip_max"] / 65534
    rows[strip["strip_q"] == 65535] = np.nan
    np.testing.assert_allclose(rows, mean, atol=strip["strip_max"] / 65534 / 2 + 1e-9)
    assert np.isnan(rows[5]).all() and strip["strip_max"] == pytest.approx(float(np.nanmax(mean)))
