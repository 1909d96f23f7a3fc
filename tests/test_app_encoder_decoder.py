"""The app on an encoder-decoder (AppTest, a tiny random BART saved in tmp_path and chosen as a local
model directory): the target box and the kind selector appear in the shared controls (and only for an
encoder-decoder), Inspect draws cross-attention's rectangular map (target rows x source columns) equal
to the library's, the kind follows the user to Explaining away and Compare, and a kind switch redraws."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from conftest import build_tiny_model

pytest.importorskip("streamlit.testing.v1")
import test_app_issue30 as base  # noqa: E402

app_env = base.app_env
messages, run_page = base.messages, base.run_page
LOCAL = "Local Hugging Face directory…"
SOURCE = "Attention lets every word look at every other word."
TARGET = "A key that no query wants is explained away."


@pytest.fixture
def bart(app_env):
    return build_tiny_model("bart", app_env / "bart", scale=0.3)  # under ATTNLAB_MODEL_ROOTS


def _z(spec: dict) -> np.ndarray:
    z = spec["data"][0]["z"]
    if isinstance(z, dict):  # plotly's typed array
        import base64

        a = np.frombuffer(base64.b64decode(z["bdata"]), dtype=z["dtype"])
        return a.reshape([int(s) for s in str(z["shape"]).split(",")])
    return np.asarray(z, dtype=np.float32)


def _open(page: str, path, **query):
    at = run_page(page, model=LOCAL, model_dir=str(path), target=TARGET, **query)
    prefix = {"explaining_away": "away", "embeddings": "embed"}.get(page, page)
    at.text_area(key=f"{prefix}_text").set_value(SOURCE).run()
    assert not at.exception, [e.message for e in at.exception]
    return at


def test_inspect_shows_the_chosen_kind_and_cross_attention_is_rectangular(bart):
    from attnlab import hf

    at = _open("inspect", bart, kind="cross", neuron="1", focus="2")
    assert at.text_area(key="inspect_target").value == TARGET
    assert at.radio(key="inspect_kind").value == "cross"
    result = hf.analyze(SOURCE, hf.load_model(str(bart)), target=TARGET)
    M, N = len(result.target.tokens), len(result.source.tokens)
    (chart,) = [c for c in at.get("plotly_chart") if "inspect_heatmap_cross" in c.proto.id]
    spec = json.loads(chart.proto.spec)
    layer, head = map(int, re.search(r"layer (\d+), head (\d+)", spec["layout"]["title"]["text"]).groups())
    z = _z(spec)
    assert z.shape == (M, N) and M != N
    np.testing.assert_allclose(z, result.weights["cross"]["unas"][layer, head].numpy(), atol=1e-6)
    assert any("encoder-decoder" in c.value for c in at.caption)
    at.toggle(key="inspect_rollout_show").set_value(True).run()  # no chain of layers across the kinds
    assert not at.exception and "is no such chain" in messages(at)
    assert "is an encoder-decoder (bart): its layers' queries and keys come in three kinds" in messages(at)
    assert "inspect_heatmap_view" not in _views(at), "the cross map is the library's figure"
    at.radio(key="inspect_kind").set_value("decoder").run()  # square: the browser views draw it
    assert not at.exception, [e.message for e in at.exception]
    assert not [c for c in at.get("plotly_chart") if "inspect_heatmap_cross" in c.proto.id]


@pytest.mark.parametrize("page, prefix", [("explaining_away", "away"), ("compare", "compare")])
def test_the_kind_follows_the_user_to_the_other_pages(bart, page, prefix):
    at = _open(page, bart, kind="cross")
    assert at.radio(key=f"{prefix}_kind").value == "cross", messages(at)
    at.radio(key=f"{prefix}_kind").set_value("encoder").run()
    assert not at.exception, [e.message for e in at.exception]


@pytest.mark.parametrize("page, words", [("embeddings", "is an encoder-decoder: Embeddings shows one text's"),
                                         ("interventions", "per-head interventions do not support "
                                                           "encoder-decoders: ")])
def test_one_text_pages_say_why_they_do_not_apply(bart, page, words):
    at = _open(page, bart, kind="decoder")
    assert words in messages(at)


def test_no_target_box_for_a_model_that_is_not_an_encoder_decoder(app_env):
    at = run_page("inspect")
    assert not [t for t in at.text_area if t.key == "inspect_target"]
    assert not [r for r in at.radio if r.key == "inspect_kind"]


def test_sinkhorn_rounds_above_one_apply_to_the_encoder_and_cross_attention(bart):
    """iters=5 is not refused (the decoder's causal rule applies to its self-attention alone): the
    cross map under Sinkhorn equals the library's with iters=5."""
    from attnlab import hf

    at = _open("inspect", bart, kind="cross", variant="sinkhorn")
    at.number_input(key="inspect_sinkhorn_iters").set_value(5).run()
    assert not at.exception, [e.message for e in at.exception]
    assert "they take iters=5" in " ".join(c.value for c in at.caption), messages(at)
    result = hf.analyze(SOURCE, hf.load_model(str(bart)), target=TARGET, iters=5)
    (chart,) = [c for c in at.get("plotly_chart") if "inspect_heatmap_cross" in c.proto.id]
    spec = json.loads(chart.proto.spec)
    title = spec["layout"]["title"]["text"]
    assert title.startswith("sinkhorn: cross-attention"), title
    layer, head = map(int, re.search(r"layer (\d+), head (\d+)", title).groups())
    np.testing.assert_allclose(_z(spec), result.weights["cross"]["sinkhorn"][layer, head].numpy(), atol=1e-6)


def _views(at) -> dict[str, dict]:
    from appkit.token_views import decoded

    return {c.key.removesuffix("_view"): decoded(json.loads(c.proto.json)) for c in at.get("bidi_component")
            if c.proto.component_name == "attnlab.token_views"}


def test_cross_head_view_and_model_view_take_target_rows_and_source_columns(bart):
    """The browser's head view and model view of cross-attention receive the (M, N) maps with the M
    target tokens (queries, left) and the N source tokens (keys, right); the focus is a source token;
    the Export builds the library's figure with both lists."""
    from appkit.token_views import view_data

    from attnlab import hf

    at = _open("inspect", bart, kind="cross", focus="3")
    result = hf.analyze(SOURCE, hf.load_model(str(bart)), target=TARGET)
    queries, keys = result.tokens("cross")
    M, N = len(queries), len(keys)
    shown = _views(at)
    head = shown["inspect_head_view"]
    assert (head["m"], head["n"]) == (M, N) and M != N
    assert head["query_tokens"] == queries and head["tokens"] == keys
    layer, h = int(re.search(r"layer (\d+)", head["title"]).group(1)), head["head_shown"]
    w = result.weights["cross"]["unas"]  # (L, H, M, N)
    np.testing.assert_allclose(head["map"], w[layer, h].numpy(), atol=1e-6)
    np.testing.assert_allclose(head["heads_map"], w[layer].numpy(), atol=1e-6)  # (H, M, N)
    assert head["focus"] == 3, "the focus: the source token 3"
    model = shown["inspect_model_view"]
    assert (model["m"], model["n"]) == (M, N) and model["query_tokens"] == queries
    dense = np.zeros((w.shape[0] * w.shape[1], M * N))
    for k in range(dense.shape[0]):
        span = slice(model["model_off"][k], model["model_off"][k + 1])
        dense[k, model["model_idx"][span]] = model["model_val"][span] * (model["model_max"] / 255)
    drawn = np.where(w.numpy() >= model["min_weight"], w.numpy(), 0.0).reshape(-1, M * N)
    np.testing.assert_allclose(dense, drawn, atol=float(w.max()) / 255 / 2 + 1e-7)
    assert "inspect_focus_bar" in shown and shown["inspect_focus_bar"]["tokens"] == keys
    assert not [c for c in at.caption if "draw self-attention only" in c.value]
    from appkit.show import bundle

    view = _kind_view(bart)  # the page's Export builds the library's figure from the same view
    b = bundle("head_view", view, {"variant": "unas", "layer": 0, "head": 1, "focus": 3, "heads": [1]})
    assert list(b.figure.data[-2].text) == queries and list(b.figure.data[-1].text) == keys
    np.testing.assert_allclose(b.arrays["unas"], w[0, 1].numpy(), atol=1e-6)  # (M, N)
    assert decoded_shape(view_data("head_view", view, "unas", 0, 1)) == (M, N)


def _kind_view(path):
    """The app's cross view (appkit.seq2seq.kind_view) of SOURCE and TARGET, outside a page."""
    from appkit.analysis import Settings
    from appkit.seq2seq import kind_view
    from appkit.sources import Source

    s = Settings(Source("hf", str(path), "bart"), ("unas", "dnas"), "recompute", 0.5, 3)
    return kind_view(s, SOURCE, TARGET, "cross")


def decoded_shape(data: dict) -> tuple:
    from appkit.token_views import decoded

    return decoded(data)["map"].shape
