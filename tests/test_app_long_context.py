"""Issue 32 item 5: Inspect on a causal model and a long text (AppTest on a tiny random LLaMA with
2,048 positions and MiniLM's tokenizer, ~1,650 tokens): one head's map sent downsampled with its
block size stated, a zoomed region equal to the map's own slice, the head view and the token strip
around the focus; and the downsampling itself against a literal computation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from attnlab.figures.long_maps import block_pool, block_size, zoom_region

pytest.importorskip("streamlit.testing.v1")
import test_app_issue30 as base  # noqa: E402

app_env, deferred = base.app_env, base.deferred
click, messages, run_page = base.click, base.messages, base.run_page
TEXT = " ".join(["The cat sat on the mat because it was tired and the dog barked at it."] * 100)


# ----------------------------------------------------------------------------------------------
# The downsampling (a pure function)
# ----------------------------------------------------------------------------------------------


def _literal(w: np.ndarray, b: int, how: str) -> np.ndarray:
    M, N = w.shape
    out = np.zeros((-(-M // b), -(-N // b)))
    for r in range(out.shape[0]):
        for c in range(out.shape[1]):
            cell = w[r * b:(r + 1) * b, c * b:(c + 1) * b].astype(np.float64)
            out[r, c] = cell.mean() if how == "mean" else cell.max()
    return out


@pytest.mark.parametrize("how", ["mean", "max"])
@pytest.mark.parametrize("shape, block", [((20, 20), 4), ((23, 23), 5), ((7, 11), 3), ((5, 5), 1)])
def test_block_pool_equals_a_literal_computation(shape, block, how):
    """Each cell is the mean (max) of its block, a ragged last block row / column over what it holds."""
    w = np.random.default_rng(0).random(shape, dtype=np.float32)
    got = block_pool(w, block, how)
    assert got.dtype == np.float32 and got.shape == (-(-shape[0] // block), -(-shape[1] // block))
    np.testing.assert_allclose(got, _literal(w, block, how), rtol=1e-6)


def test_block_pool_of_a_view_equals_its_copy_bit_for_bit():
    """A strided view (a transposed, reversed slice) pools as its contiguous copy, in float64 sums."""
    w = np.random.default_rng(1).random((40, 37), dtype=np.float32)
    view = w[::-1, 3:].T  # (34, 40), negative and non-unit strides
    copy = np.ascontiguousarray(view)
    for how in ("mean", "max"):
        np.testing.assert_array_equal(block_pool(view, 6, how), block_pool(copy, 6, how))
    np.testing.assert_allclose(block_pool(view, 6), _literal(copy, 6, "mean"), rtol=1e-6)


def test_block_pool_keeps_nan_and_checks_its_arguments():
    w = np.ones((6, 6), np.float32)
    w[4, 1] = np.nan
    got = block_pool(w, 4)
    assert np.isnan(got[1, 0]) and np.isfinite(np.delete(got.ravel(), 2)).all()
    assert block_size(8192) == 16 and block_size(512) == 1 and block_size(1650) == 4
    with pytest.raises(ValueError, match="how must be one of"):
        block_pool(w, 2, "median")
    with pytest.raises(ValueError, match="block must be an integer >= 1"):
        block_pool(w, 0)
    with pytest.raises(ValueError, match="at most 512 tokens"):
        zoom_region(2048, (0, 600), (0, 10))
    with pytest.raises(ValueError, match=r"rows must be a range"):
        zoom_region(100, (90, 120), (0, 10))


@pytest.mark.parametrize("exclude", [False, True])
@pytest.mark.parametrize("by_contribution", [False, True])
def test_explained_away_by_streams_a_streamed_window(tiny_model_dir, english_text, exclude, by_contribution):
    """attnlab.contributions.explained_away_fraction_by on a streamed window's HeadMaps (column masses
    and sink sums streamed, no map computed) equals it on the materialized weights."""
    from attnlab import contributions, hf, sinks

    plan = hf.stream_analysis(english_text, hf.load_model(str(tiny_model_dir("llama"))), ("unas", "dnas"),
                              statistics=False)
    for v in ("unas", "dnas"):
        w = plan.window(0).weights[v]
        L, H, N, _ = w.shape
        dense = torch.stack([w.layer(k) for k in range(L)])  # (L, H, N, N)
        keys = sinks.sink_keys(N, torch.zeros(N, dtype=torch.bool)) if exclude else None
        seeded = torch.Generator().manual_seed(0)
        norms = torch.rand(L, H, N, generator=seeded) + 0.1 if by_contribution else None
        got = contributions.explained_away_fraction_by(w, 0.5, norms=norms, exclude=keys)
        want = contributions.explained_away_fraction_by(dense, 0.5, norms=norms, exclude=keys)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------------------------
# The app on a long causal text
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def long_llama(app_env):
    """A tiny random LLaMA (2 layers, 4 heads on 2 key heads) with 2,048 positions and MiniLM's
    WordPiece tokenizer, saved under the app's model roots."""
    return build_long_llama(app_env / "long-llama")


def build_long_llama(path):
    """Write :func:`long_llama`'s model to ``path``; returns it (also tests/test_browser_long.py's)."""
    import transformers
    from conftest import TINY_CONFIGS
    from transformers import AutoTokenizer

    from attnlab import hf

    tokenizer = AutoTokenizer.from_pretrained(hf.default_model_path(), local_files_only=True)
    tokenizer.model_max_length = 2048
    config = transformers.LlamaConfig(vocab_size=len(tokenizer),
                                      **{**TINY_CONFIGS["llama"][1], "max_position_embeddings": 2048})
    torch.manual_seed(0)
    transformers.AutoModel.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _page(path, monkeypatch, page=None, **query):
    """A page on the long text, opened from a link (?text=, stored on this server, so that the
    link's focus applies to it). No variant's whole (L, H, N, N) weights may be computed."""
    from appkit import state

    from attnlab.hf.compute.head_maps import HeadMaps

    def refuse(self):
        raise AssertionError(f"{self.variant}'s whole (L, H, N, N) weights were computed")

    monkeypatch.setattr(HeadMaps, "materialize", refuse)
    monkeypatch.setenv("ATTNLAB_TEXTS_DIR", str(path.parent / "texts"))
    return run_page(page, model="Local Hugging Face directory…", model_dir=str(path),
                    text=state.store_text(TEXT), **query)


def _chart(at, name: str) -> dict:
    (chart,) = [c for c in at.get("plotly_chart") if c.proto.id and name in c.proto.id]
    return json.loads(chart.proto.spec)


def _z(trace: dict) -> np.ndarray:
    z = trace["z"]
    if isinstance(z, dict):  # plotly's typed array: {"dtype", "bdata", "shape"}
        import base64

        a = np.frombuffer(base64.b64decode(z["bdata"]), dtype=z["dtype"])
        return a.reshape([int(s) for s in str(z["shape"]).split(",")])
    return np.asarray(z, dtype=np.float32)


def _layer(path, layer: int) -> np.ndarray:
    from attnlab import hf

    plan = hf.stream_analysis(TEXT, hf.load_model(str(path)), ("unas",), statistics=False)
    assert len(plan) == 1  # the whole text in one window (2,048 positions)
    return plan.window(0).weights["unas"].layer(layer).numpy()  # (H, N, N)


def test_inspect_draws_a_long_causal_text_downsampled_with_a_zoom(long_llama, deferred, monkeypatch):
    """~1,650 tokens: the page runs; the map is sent as 4 x 4 token blocks (block size stated on the
    page, in the title and the manifest), its cells the block means of the head's map; the zoom is
    the map's own slice; the head view and the strip get 129 tokens around the focus; the grid is
    not drawn."""
    at = _page(long_llama, monkeypatch, variant="unas", layer="1", head="2", focus="900")
    page = " ".join(c.value for c in at.caption)
    assert "each cell = 4 × 4 tokens (mean)" in page, page
    layer = _layer(long_llama, 1)  # (H, N, N)
    full = layer[2]
    N = full.shape[0]
    assert 1500 < N <= 2048
    blocks = _chart(at, "inspect_heatmap_blocks")
    z = _z(blocks["data"][0])
    assert z.shape == (-(-N // 4), -(-N // 4)) and z.size <= 512 * 512  # bounded: not N x N
    np.testing.assert_allclose(z, block_pool(full, 4), rtol=1e-5, atol=1e-7)
    assert "each cell = 4 × 4 tokens (mean)" in blocks["layout"]["title"]["text"]
    # the zoom: 128 x 128 around the focus, the map's own values, labelled with positions in the text
    zoom = _chart(at, "inspect_heatmap_zoom")
    q0 = 900 - 64
    np.testing.assert_array_equal(_z(zoom["data"][0]), full[q0:q0 + 128, q0:q0 + 128])
    assert zoom["data"][0]["y"][0].startswith(f"{q0}: ")
    at.number_input(key="inspect_zoom_rows").set_value(1600).run()
    at.number_input(key="inspect_zoom_cols").set_value(0).run()
    zoom = _chart(at, "inspect_heatmap_zoom")
    np.testing.assert_array_equal(_z(zoom["data"][0]), full[N - 128:N, 0:128])  # moved inside the text
    # the head view and the strip: tokens 836..964 around the focus
    from appkit.token_views import decoded

    views = {c.key.removesuffix("_view"): decoded(json.loads(c.proto.json)) for c in at.get("bidi_component")}
    hv, strip = views["inspect_head_view"], views["inspect_token_mass"]
    assert hv["n"] == strip["n"] == 129 and hv["focus"] == 64
    np.testing.assert_array_equal(hv["map"], full[836:965, 836:965])
    # the strip's column masses are the whole text's (mean over the layer's heads), not the span's
    np.testing.assert_allclose(strip["strip_mass"], layer.sum(1).mean(0)[836:965], rtol=1e-5)
    assert "tokens 836–964 of" in " ".join(c.value for c in at.caption)
    assert "inspect_grid" not in views and "grid, rollout and attention flow draw" in messages(at)
    # the export's manifest names the block size and the region
    at.session_state["inspect_heatmap_blocks_export"] = True
    at.run()
    params = json.loads(click(at, deferred, "inspect_heatmap_blocks_manifest"))["figure"]["params"]
    assert params["block"] == 4 and params["how"] == "mean" and params["rows"] == [N - 128, N]
    # a shorter long text keeps the region inside it (no widget value out of its bounds)
    at.text_area(key="inspect_text").set_value(TEXT[: len(TEXT) * 2 // 5]).run()
    assert not at.exception, [e.message for e in at.exception]
    zoom = _chart(at, "inspect_heatmap_zoom")
    assert int(zoom["data"][0]["y"][-1].split(":")[0]) < N * 2 // 5 + 64


def test_explaining_away_on_a_long_causal_text_streams_its_statistics(long_llama, monkeypatch, deferred):
    """The Explaining-away page on ~1,650 tokens: column-mass distributions, the explained-away
    fractions (by weight, and without sink keys) and the most explained-away tokens, all from the
    streamed column masses and sink sums (no variant's whole weights computed); the fractions equal
    the literal ones of the materialized maps."""
    at = _page(long_llama, monkeypatch, "explaining_away")
    assert not at.exception and not at.error, messages(at)
    fig = _chart(at, "away_explained_away")
    from attnlab import hf
    from attnlab.stats import explained_away_fraction

    plan = hf.stream_analysis(TEXT, hf.load_model(str(long_llama)), ("unas",), statistics=False)
    w = plan.window(0).weights["unas"]
    want = explained_away_fraction(torch.stack([w.layer(k) for k in range(2)]), 0.1, relative=True)
    unas = _z(fig["data"][0])  # the first panel: unas, (L, H)
    np.testing.assert_allclose(unas, want.numpy(), atol=1e-6)
    at.toggle(key="away_no_sinks").set_value(True).run()
    assert not at.exception and not at.error, messages(at)
    at.segmented_control(key="away_by").set_value("contribution").run()
    assert not at.exception and not at.error, messages(at)
    # every statistic as CSV: from a second, streamed capture forward (no weights); its explained-away
    # fractions are the ones above
    import io

    import pandas as pd

    table = pd.read_csv(io.StringIO(click(at, deferred, "away_stats_csv")))
    assert set(table["variant"]) == {"unas", "dnas", "hnas", "sinkhorn"}
    rows = table[(table["variant"] == "unas") & (table["statistic"] == "explained_away_relative")]
    got = rows.sort_values(["layer", "head"])["value"].to_numpy().reshape(2, 4)
    np.testing.assert_allclose(got, want.numpy(), atol=1e-6)


def test_compare_on_a_long_causal_text_pools_the_panels_and_their_differences(long_llama, monkeypatch):
    """Compare on ~1,650 tokens: each panel is its variant's one head pooled into 4 x 4 token blocks
    (block size in the title; the chart is bounded, not N x N per panel: it was 159 MB of JSON at 2,424
    tokens), each difference map the difference of the pooled maps, the axes the blocks' token ranges;
    no variant's whole (L, H, N, N) weights are computed (the per-head Jensen-Shannon map needs them: a
    message says so)."""
    at = _page(long_llama, monkeypatch, "compare", layer="1", head="2")
    assert not at.exception and not at.error, messages(at)
    assert any("Jensen-Shannon distance per layer and head is drawn for windows of up to 512" in i.value
               for i in at.info)
    from attnlab import hf

    stream = hf.stream_analysis(TEXT, hf.load_model(str(long_llama)), ("unas", "dnas", "hnas"),
                                statistics=False)
    w = stream.window(0).weights
    want = {v: block_pool(w[v].head(1, 2).numpy(), 4) for v in ("unas", "dnas", "hnas")}
    N = w["unas"].shape[-1]
    panels = _chart(at, "compare_maps")
    assert "each cell = 4 × 4 tokens (mean)" in panels["layout"]["title"]["text"]
    for trace, v in zip(panels["data"], ("unas", "dnas", "hnas"), strict=True):
        np.testing.assert_allclose(_z(trace), want[v], rtol=1e-5, atol=1e-7)
        assert trace["x"][0] == "0–3" and trace["x"][-1] == f"{(N - 1) // 4 * 4}–{N - 1}"
    diffs = _chart(at, "compare_diffs")
    for trace, v in zip(diffs["data"], ("dnas", "hnas"), strict=True):
        np.testing.assert_allclose(_z(trace), want["unas"] - want[v], atol=1e-6)
    assert len(json.dumps(panels)) < 8 * 2**20
