"""Issue 30 items 11-13 in the app (AppTest; the browser halves are in tests/test_browser_views30.py):
the head view overlaying several heads (11), the neuron view (12), the linked embeddings (13).
Offline: the embedded MiniLM, tiny random models written here."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("streamlit.testing.v1")
import test_app_issue30 as base  # noqa: E402

app_env, deferred = base.app_env, base.deferred  # the fixtures of issue 30's first items
click, messages, run_page = base.click, base.messages, base.run_page


def _components(at) -> dict:
    from appkit.token_views import decoded

    return {c.key.removesuffix("_view"): decoded(json.loads(c.proto.json)) for c in at.get("bidi_component")}


# ----------------------------------------------------------------------------------------------
# 11. Head overlay
# ----------------------------------------------------------------------------------------------


def test_head_view_overlays_the_heads_of_the_url_in_their_colours(app_env, deferred):
    """?overlay=3,5 with head 0: the head view gets every head's map of the layer, shows heads 0, 3
    and 5, one distinct colour per head, and its export (manifest, HTML) records and draws them."""
    at = run_page(overlay="3,5", head="0", layer="1", focus="2")
    hv = _components(at)["inspect_head_view"]
    assert hv["heads_shown"] == [0, 3, 5] and hv["head_shown"] == 0
    assert hv["title"] == "unas: head view, layer 1, heads 0, 3, 5"
    assert hv["heads_map"].shape == (12, hv["n"], hv["n"]) and len(set(hv["colors"])) == 12
    assert "#ff7f0e" not in hv["colors"]  # the focus colour is no head's
    np.testing.assert_array_equal(hv["heads_map"][0], hv["map"])
    at.session_state["inspect_head_view_export"] = True
    at.run()
    manifest = json.loads(click(at, deferred, "inspect_head_view_manifest"))
    assert manifest["figure"]["params"]["heads"] == [0, 3, 5]
    assert manifest["figure"]["params"]["focus"] == 2
    html = click(at, deferred, "inspect_head_view_html").decode()
    for h, colour in ((0, hv["colors"][0]), (3, hv["colors"][3]), (5, hv["colors"][5])):
        assert f'"name":"head {h}"' in html and colour in html
    csv = click(at, deferred, "inspect_head_view_csv").decode().splitlines()
    assert csv[0] == "head,query,key,weight" and {r.split(",")[0] for r in csv[1:]} == {"0", "3", "5"}


def test_chip_click_callback_keeps_the_heads_in_session_and_url(monkeypatch):
    """What a chip click sends (trigger "heads" = {heads, head, seq}, through the focus bar) is kept
    as the heads shown besides the map's head: in the session and the URL (?overlay=); an older
    click never overwrites a newer one's sequence number."""
    import streamlit
    from appkit import token_views

    session, url = {"bar": {"heads": {"heads": [2, 7, 4], "head": 2, "seq": 3}}}, {}
    monkeypatch.setattr(streamlit, "session_state", session)
    monkeypatch.setattr(streamlit, "query_params", url)
    token_views._on_heads("bar")
    assert session["attnlab_shared"]["overlay"] == [4, 7] and url["overlay"] == "4,7"
    assert token_views.shown_heads(5, 12) == [4, 5, 7]  # the map's head is always shown
    assert token_views.shown_heads(2, 6) == [2, 4]  # heads the model lacks are dropped
    session["bar"] = {"heads": {"heads": [2], "head": 2, "seq": 1}}
    token_views._on_heads("bar")
    assert session["attnlab_shared"]["overlay_seq"] == 3 and "overlay" not in url


def test_head_view_overlay_in_the_url_survives_a_new_session(app_env):
    at = run_page(overlay="1,11", head="4")
    assert _components(at)["inspect_head_view"]["heads_shown"] == [1, 4, 11]
    at.slider(key="inspect_head").set_value(6).run()  # another map's head: the added heads stay
    assert _components(at)["inspect_head_view"]["heads_shown"] == [1, 6, 11]
    assert at.query_params["overlay"] == "1,11"


def test_overlay_builder_checks_heads_and_toggles_by_legend():
    from attnlab.figures.head_overlay import head_color, head_overlay

    rng = np.random.default_rng(0)
    w = rng.dirichlet(np.ones(5), size=(3, 5)).astype(np.float32)  # (h, N, N)
    tokens = list("abcde")
    fig = head_overlay(w, tokens, [1, 4, 6], focus=2)
    legend = [t for t in fig.data if t.showlegend is not False and t.name]
    assert [t.name for t in legend] == ["head 1", "head 4", "head 6"]
    groups = {t.legendgroup for t in fig.data if t.mode == "lines"}
    assert groups == {"head 1", "head 4", "head 6"}  # a legend click toggles a head's every line
    colours = {t.legendgroup: t.line.color for t in fig.data if t.mode == "lines"}
    assert colours == {f"head {h}": head_color(h) for h in (1, 4, 6)}
    assert "(focus: 2: c)" in fig.layout.title.text
    with pytest.raises(ValueError, match="weights hold 3 heads' maps, while heads names 2"):
        head_overlay(w, tokens, [1, 4])
    with pytest.raises(ValueError, match="heads must be distinct"):
        head_overlay(w, tokens, [1, 1, 2])
    from attnlab.figures.kinds import build

    one = {"unas": w[None]}  # (1, 3, N, N): one layer of 3 heads
    with pytest.raises(ValueError, match=r"heads must be head indices in \[0, 3\)"):
        build("head_view", one, tokens, {"variant": "unas", "layer": 0, "head": 0, "heads": [9]})
    with pytest.raises(ValueError, match="must include the head shown, 1"):
        build("head_view", one, tokens, {"variant": "unas", "layer": 0, "head": 1, "heads": [2]})


# ----------------------------------------------------------------------------------------------
# 12. Neuron view
# ----------------------------------------------------------------------------------------------


def test_neuron_view_needs_a_focus(app_env):
    at = run_page(neuron="1")
    assert "Click a token to focus it" in messages(at)
    assert not [c for c in at.get("plotly_chart") if "neuron" in (c.key or "")]


def test_neuron_view_sums_to_the_score_and_shows_every_variant(app_env, deferred):
    """Focused query 3, layer 1, head 4: the key defaults to the query's strongest; the products'
    sum is the score whose row softmax is the UNAS weight (1e-5); each variant's weight is the
    analysed map's; the page says what DNAS's column normalization does."""
    at = run_page(neuron="1", focus="3", layer="1", head="4")
    key = at.selectbox(key="inspect_neuron_key").value
    hv = _components(at)["inspect_heatmap"]
    assert key == int(np.argmax(hv["map"][3]))
    page = " ".join(c.value for c in at.caption)
    assert "Score = Σ_d scale · q_d · k_d" in page and "DNAS (Eq. 5) first divides" in page
    at.session_state["inspect_neuron_view_export"] = True
    at.run()
    manifest = json.loads(click(at, deferred, "inspect_neuron_view_manifest"))
    fig = manifest["figure"]
    assert (fig["query"], fig["key"], fig["layer"], fig["head"]) == (3, key, 1, 4)
    assert set(fig["weights"]) == {"unas", "dnas", "hnas", "sinkhorn"}
    assert fig["weights"]["unas"] == pytest.approx(float(hv["map"][3, key]), abs=1e-7)
    import io

    arrays = np.load(io.BytesIO(click(at, deferred, "inspect_neuron_view_npz")))
    assert float(arrays["products"].sum()) == pytest.approx(float(arrays["score"]), abs=1e-9)
    # the score against the map: softmax of the row's scores (from the same q and the row's keys)
    from appkit.controls import SAMPLE

    from attnlab import hf
    from attnlab.hf.analysis.query_key import layer_query_key

    minilm = hf.load_model(None)
    assert minilm.tokenizer.convert_ids_to_tokens(minilm.tokenizer(SAMPLE)["input_ids"]) == hv["tokens"]
    qk = layer_query_key(minilm, minilm.tokenizer(SAMPLE)["input_ids"], 1)
    row = torch.softmax(qk.scores(4)[3], -1)
    np.testing.assert_allclose(row.numpy(), hv["map"][3], atol=1e-5)
    assert float(qk.products(4, 3, key).sum()) == pytest.approx(float(qk.scores(4)[3, key]), abs=1e-5)
    # another key
    other = (key + 1) % hv["n"]
    at.selectbox(key="inspect_neuron_key").set_value(other).run()
    assert not at.exception and at.query_params["neuron_key"] == str(other)


def test_neuron_view_on_grouped_query_model_reads_its_key_head(app_env, tmp_path):
    """A causal LLaMA with 4 query heads on 2 key heads: head 3 reads key head 1, said on the page;
    a key after the query is refused with a message."""
    from conftest import build_tiny_model

    path = build_tiny_model("llama", tmp_path / "llama")
    at = run_page(
        model="Local Hugging Face directory…",
        model_dir=str(path),
        neuron="1",
        focus="4",
        layer="1",
        head="3",
        neuron_key="2",
    )
    page = " ".join(c.value for c in at.caption)
    assert "head 3 reads key head 1" in page, messages(at)
    at.selectbox(key="inspect_neuron_key").set_value(6).run()
    assert "The model's mask keeps query 4" in messages(at)


def test_neuron_view_on_a_model_captured_at_the_score_level_says_why_it_has_no_vectors(app_env, tmp_path):
    """BLOOM's attention is captured as scores after its ALiBi bias, with no q and k vectors: the page
    says so (naming the family) instead of drawing an identity key."""
    from conftest import build_tiny_model

    path = build_tiny_model("bloom", tmp_path / "bloom")
    at = run_page(model="Local Hugging Face directory…", model_dir=str(path), neuron="1", focus="3")
    assert not at.exception, [e.message for e in at.exception]
    assert "Neuron view: " in messages(at) and "is a BLOOM model" in messages(at), messages(at)
    assert "after the model's own biases" in messages(at)
    assert "Score = Σ_d scale · q_d · k_d" not in " ".join(c.value for c in at.caption)


# ----------------------------------------------------------------------------------------------
# 13. Linked embeddings
# ----------------------------------------------------------------------------------------------


def _scatter(at) -> dict:
    (chart,) = [c for c in at.get("plotly_chart") if c.proto.id and "embed_scatter" in c.proto.id]
    return json.loads(chart.proto.spec)


def _finished_corpus_run(root, docs: dict[str, str]):
    """A finished corpus run of the app (what appkit.corpus_runs reads) over a folder of documents."""
    folder = root / "docs"
    folder.mkdir(parents=True)
    for name, text in docs.items():
        (folder / f"{name}.txt").write_text(text)
    run = root / "runs" / "corpus" / "demo"
    (run / "result").mkdir(parents=True)
    (run / "app_corpus.json").write_text("{}")
    (run / "result" / "progress.json").write_text(json.dumps({"status": "finished"}))
    (run / "result" / "summary.parquet").write_bytes(b"")
    source = {"kind": "folder", "path": str(folder), "text_column": "text", "id_column": None}
    (run / "result" / "manifest.json").write_text(json.dumps({"source": source}))


def test_embeddings_ring_the_focus_of_inspect(app_env):
    """The focus set on Inspect (here the URL's) rings that token's points in the scatter: its
    query and its key point of this text, on top, in the focus colour."""
    at = run_page("embeddings", focus="5")
    at.radio(key="embed_what").set_value("qk").run()
    fig = _scatter(at)
    ring = fig["data"][-1]
    assert ring["name"].startswith("focus: 5: ") and ring["marker"]["line"]["color"] == "#ff7f0e"
    assert len(ring["x"]) == 2  # its query and its key
    assert "focused" in " ".join(c.value for c in at.caption)


def test_embeddings_pool_layers_heads_and_corpus_documents(app_env, deferred):
    """Pooled over 2 layers x 2 heads and 2 documents of a finished corpus run: 2N points per text,
    layer and head; coloured by text; the export's manifest names layers, heads and texts."""
    _finished_corpus_run(app_env, {"a": "A zebra met a penguin near the shore.", "b": "Cats sleep all day."})
    at = run_page("embeddings", layer="1", head="2")
    at.radio(key="embed_what").set_value("qk").run()
    at.multiselect(key="embed_pool_layers").set_value([3]).run()
    at.multiselect(key="embed_pool_heads").set_value([2, 7]).run()
    at.selectbox(key="embed_pool_run").set_value("demo").run()
    at.slider(key="embed_pool_docs").set_value(2).run()
    at.radio(key="embed_color").set_value("text").run()
    assert not at.exception, [e.message for e in at.exception]
    fig = _scatter(at)
    n_points = sum(len(t["customdata"]) for t in fig["data"] if t["name"] in ("query", "key"))
    from appkit import pooled

    texts = ["this text", "demo: a.txt", "demo: b.txt"]
    at.session_state["embed_scatter_export"] = True
    at.run()
    manifest = json.loads(click(at, deferred, "embed_scatter_manifest"))
    assert manifest["layers"] == [1, 3] and manifest["heads"] == [2, 7] and manifest["texts"] == texts
    import io

    import pandas as pd

    table = pd.read_csv(io.BytesIO(click(at, deferred, "embed_scatter_csv")))
    assert len(table) == n_points
    per_text = table.groupby("text").size()
    assert set(per_text.index) == set(texts) and (per_text % 8 == 0).all()  # 2 layers x 2 heads x q, k
    assert table.groupby(["text", "layer", "head", "kind"]).size().groupby("text").nunique().eq(1).all()
    assert pooled.DOC_TOKENS >= 8
    at.radio(key="embed_color").set_value("column mass").run()
    assert "column mass is known for this text's points only" in messages(at)


def test_a_selection_focuses_its_first_token_of_this_text(monkeypatch):
    """What a selection in the scatter does (the browser test makes a real one): the points of this
    text focus their first token for every page; a selection seen before does nothing again (so a
    focus set later on Inspect is not overwritten); points of other texts focus nothing."""
    import pandas as pd
    import streamlit
    from appkit import pooled

    session = {}
    monkeypatch.setattr(streamlit, "session_state", session)
    view = type("V", (), {"key": "k", "shape": (2, 2, 6), "tokens": list("abcdef")})()
    points = pd.DataFrame(
        [("query", "c", 2, 0, 0, "this text", True), ("key", "e", 4, 0, 0, "this text", True),
         ("query", "x", 1, 0, 0, "run: d", False)],
        columns=list(pooled.POINT_COLUMNS),
    )  # fmt: skip
    assert pooled.take_selection(view, points, [1, 0, 2]) == [2, 4]
    assert session["attnlab_shared"]["focus"] == {"view": "k", "position": 2}
    session["attnlab_shared"]["focus"]["position"] = 5  # a click on Inspect later
    pooled.take_selection(view, points, [1, 0, 2])
    assert session["attnlab_shared"]["focus"]["position"] == 5
    assert pooled.take_selection(view, points, [2]) == []
    assert session["attnlab_shared"]["focus"]["position"] == 5


@pytest.mark.parametrize("checkpoint", ["enc-hnas", "enc-gam"])
def test_neuron_view_on_native_checkpoints(app_env, checkpoint):
    """A native attnlab checkpoint: its own capture path (capture_attention_inputs); a GAM layer has
    no single query and key, which the page says instead of drawing."""
    from attnlab import hf

    names = [o for o in run_page().selectbox(key="inspect_model").options if o.startswith(checkpoint)]
    if not names:
        pytest.skip(f"no shipped checkpoint {checkpoint}")
    at = run_page(model=names[0], neuron="1", focus="2")  # a focus belongs to one model's analysis
    assert at.selectbox(key="inspect_model").value == names[0]
    if checkpoint == "enc-gam":
        assert any(b.is_gam for b in hf.load_native(base.REPO / "checkpoints" / checkpoint).model.blocks)
    blocks = hf.load_native(base.REPO / "checkpoints" / checkpoint).model.blocks
    for layer in range(len(blocks)):
        at.slider(key="inspect_layer").set_value(layer).run()
        assert not at.exception, [e.message for e in at.exception]
        page = " ".join(c.value for c in at.caption)
        if blocks[layer].is_gam:
            assert "GAM layer" in messages(at)
        else:
            assert "Score = Σ_d scale · q_d · k_d" in page, messages(at)
