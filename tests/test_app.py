"""The Streamlit app, page by page, with streamlit.testing.v1.AppTest (no browser).

Each page: no exception, the expected widgets and charts, and a widget change changes a chart. Bad
input (empty text, wrong file type, binary or oversized upload, a directory that is not a model, a
checkpoint upload that does not load) ends as a message on the page. One process shares one loaded
MiniLM (st.cache_resource and attnlab.hf's cache persist across AppTest instances).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("streamlit.testing.v1")
from streamlit.testing.v1 import AppTest  # noqa: E402

APP = str(Path(__file__).resolve().parents[1] / "app" / "streamlit_app.py")
TIMEOUT = 240  # first run loads torch, transformers and MiniLM on a busy 2-core machine


@pytest.fixture
def app_env(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNLAB_DEBUG", "1")  # let exceptions reach at.exception
    monkeypatch.setenv("ATTNLAB_UMAP", "off")  # no 30 s numba warm-up in unit tests
    monkeypatch.setenv("ATTNLAB_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("ATTNLAB_UPLOADS_DIR", str(tmp_path / "uploads"))
    monkeypatch.setenv("ATTNLAB_MODEL_ROOTS", str(tmp_path))  # the tests' model folders may be loaded
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    return tmp_path


def open_page(page: str | None = None) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    if page:
        at.switch_page(f"app_pages/{page}.py").run()
    assert not at.exception, [e.message for e in at.exception]
    return at


def charts(at: AppTest) -> dict[str, dict]:
    """key -> plotly figure dict of every chart on the page (a clickable chart's key without the
    click generation appkit.show adds: "inspect_heatmap_click0" -> "inspect_heatmap")."""
    return {re.sub(r"_click\d+$", "", c.key): json.loads(c.proto.spec) for c in at.get("plotly_chart")}


def views(at: AppTest) -> dict[str, dict]:
    """key -> data of every browser-drawn token view (appkit.token_views), arrays decoded:
    "inspect_heatmap" -> {"title", "tokens", "map": (N, N), "focus", ...}."""
    from appkit.token_views import decoded

    return {
        c.key.removesuffix("_view"): decoded(json.loads(c.proto.json))
        for c in at.get("bidi_component")
        if c.proto.component_name == "attnlab.token_views"
    }


def z_of(fig: dict, trace: int = 0) -> np.ndarray:
    """The z matrix of a heatmap trace (plotly sends numpy arrays as base64 typed arrays)."""
    z = fig["data"][trace]["z"]
    if isinstance(z, dict):  # {"dtype": "f4", "bdata": "...", "shape": "r, c"}
        import base64

        arr = np.frombuffer(base64.b64decode(z["bdata"]), dtype=np.dtype(z["dtype"]))
        shape = [int(s) for s in str(z.get("shape", len(arr))).split(",")]
        return arr.reshape(shape)
    return np.asarray(z, dtype=float)


def open_exports(at: AppTest, *figures: str) -> AppTest:
    """Open the Export menus of ``figures`` ("inspect_heatmap", ...), as a click on each would (their
    buttons are made only while open: appkit.export)."""
    for name in figures:
        at.session_state[f"{name}_export"] = True
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    return at


def messages(at: AppTest) -> str:
    return " | ".join(e.value for kind in ("error", "warning", "info") for e in getattr(at, kind))


# ----------------------------------------------------------------------------------------------
# Inspect
# ----------------------------------------------------------------------------------------------


def test_inspect_shows_maps_and_reacts_to_widgets(app_env):
    at = open_page()
    for key in (
        "inspect_text",
        "inspect_model",
        "inspect_variants",
        "inspect_mode",
        "inspect_hnas_u",
        "inspect_sinkhorn_iters",
        "inspect_layer",
        "inspect_head",
    ):
        assert key in at.session_state, key
    shown = views(at)
    assert set(shown) == {
        "inspect_focus_bar",
        "inspect_heatmap",
        "inspect_head_view",
        "inspect_token_mass",
        "inspect_model_view",
        "inspect_grid",
    }
    assert not charts(at)  # no plotly chart on Inspect by default: the browser draws every view
    heat = shown["inspect_heatmap"]
    assert heat["title"] == "unas: layer 2, head 0"
    n = len(heat["tokens"])
    assert heat["map"].shape == (n, n)
    np.testing.assert_allclose(heat["map"].sum(1), 1.0, atol=1e-4)  # rows sum to 1
    kinds = ("heatmap", "head_view", "token_mass", "model_view", "grid")
    assert not at.download_button  # an Export menu's buttons exist only while it is open
    keys = {b.key for b in open_exports(at, *(f"inspect_{k}" for k in kinds)).download_button}
    formats = ("png", "svg", "pdf", "html", "csv", "npz", "manifest")
    for kind in kinds:
        assert {f"inspect_{kind}_{f}" for f in formats} <= keys

    at.slider(key="inspect_head").set_value(3).run()
    after = views(at)["inspect_heatmap"]
    assert after["title"] == "unas: layer 2, head 3"
    assert not np.allclose(after["map"], heat["map"])

    at.button_group(key="inspect_variant").set_value("dnas").run()
    dnas = views(at)["inspect_heatmap"]
    assert dnas["title"].startswith("dnas")
    assert dnas["map"].sum(0).min() >= 1.0 / n - 1e-4  # the DNAS column floor 1/N
    assert not at.exception


@pytest.mark.slow  # 1-4 s: .ci/run runs it, the inner loop does not
def test_inspect_new_text_and_settings(app_env):
    at = open_page()
    at.text_area(key="inspect_text").set_value("Giraffes rarely attend meetings.").run()
    heat = views(at)["inspect_heatmap"]
    assert any("rarely" in x for x in heat["tokens"])
    at.multiselect(key="inspect_variants").set_value(["unas", "sinkhorn"]).run()
    assert at.button_group(key="inspect_variant").options == ["unas", "sinkhorn"]
    at.radio(key="inspect_mode").set_value("swap").run()
    assert not at.exception and "inspect_heatmap" in views(at)


@pytest.mark.parametrize(
    "upload, expected",
    [
        (("notes.pdf", b"%PDF-1.4 binary", "application/pdf"), "is not a text file"),
        (("binary.txt", b"abc\x00\x01\x02", "text/plain"), "binary"),
        (("latin.txt", "café".encode("latin-1"), "text/plain"), "not UTF-8"),
        (("huge.txt", b"word " * 1_200_000, "text/plain"), "more than a text of 1,000,000 characters"),
    ],
)
@pytest.mark.slow  # ~1 s: .ci/run runs it, the inner loop does not
def test_inspect_bad_uploads_give_a_message(app_env, upload, expected):
    at = open_page()
    at.file_uploader(key="inspect_upload").set_value(upload).run()
    assert not at.exception
    assert expected in messages(at)
    assert not charts(at)


@pytest.mark.slow  # ~1 s: .ci/run runs it, the inner loop does not
def test_inspect_empty_text_and_bad_models(app_env, tmp_path):
    at = open_page()
    at.text_area(key="inspect_text").set_value("   \n").run()
    assert "Type or paste a text" in messages(at) and not charts(at)
    at.text_area(key="inspect_text").set_value("A short text.").run()

    at.selectbox(key="inspect_model").set_value("Local Hugging Face directory…").run()
    at.text_input(key="inspect_model_dir").set_value(str(tmp_path)).run()
    assert "not a model directory" in messages(at) and not at.exception

    at.selectbox(key="inspect_model").set_value("Upload a checkpoint…").run()
    at.file_uploader(key="inspect_ckpt").set_value(
        [
            ("config.json", json.dumps({"model_type": "bert"}).encode(), "application/json"),
            ("model.safetensors", b"not really safetensors", "application/octet-stream"),
        ]
    ).run()
    assert not at.exception and at.error, messages(at)
    at.file_uploader(key="inspect_ckpt").set_value(
        [("model.bin", b"pickle", "application/octet-stream")]
    ).run()
    assert "pickles are never loaded" in messages(at)


@pytest.mark.slow  # 1-4 s: .ci/run runs it, the inner loop does not
def test_inspect_long_text_is_windowed(app_env):
    at = open_page()
    at.text_area(key="inspect_text").set_value(
        "attention explains away many words. " * 120
    ).run()  # ~720 tokens
    assert not at.exception
    assert any("head view draws up to" in c.value for c in at.caption)  # 512 tokens: no head view
    assert at.slider(key="inspect_window").min == 1 and at.slider(key="inspect_window").max == 2  # 1-based
    assert any("Window 1 of 2: text tokens 1–510 of " in c.value for c in at.caption)
    assert any("model view draws up to 64 tokens" in i.value for i in at.info)
    at.slider(key="inspect_window").set_value(2).run()
    assert not at.exception and "inspect_heatmap" in views(at)
    caption = next(c.value for c in at.caption if c.value.startswith("Window 2 of 2"))
    assert "overlapping the neighbouring windows by" in caption
    at.switch_page("app_pages/explaining_away.py").run()  # the window follows the user
    assert at.slider(key="away_window").value == 2 and not at.exception


@pytest.mark.slow  # ~1 s: .ci/run runs it, the inner loop does not
def test_inspect_shipped_checkpoint(app_env):
    at = open_page()
    native = [o for o in at.selectbox(key="inspect_model").options if "(shipped)" in o]
    if not native:
        pytest.skip("no shipped checkpoints in checkpoints/")
    at.selectbox(key="inspect_model").set_value(native[0]).run()
    assert not at.exception, [e.message for e in at.exception]
    name = native[0].split(" ")[0]  # e.g. "enc-dnas": the caption names the loaded checkpoint
    assert "inspect_heatmap" in views(at) and f"**{name} (" in " ".join(c.value for c in at.caption)


@pytest.mark.slow  # ~1 s: .ci/run runs it, the inner loop does not
def test_inspect_gam_checkpoint_shows_phi_theta_and_combined(app_env):
    """The shipped GAM checkpoint goes through the library (hf.analyze) like any model; its content
    (Phi) and relative-position (Theta) maps are drawn beside the combined weights."""
    from attnlab import hf

    at = open_page()
    gam = [o for o in at.selectbox(key="inspect_model").options if o.startswith("enc-gam")]
    if not gam:
        pytest.skip("no shipped GAM checkpoint")
    at.selectbox(key="inspect_model").set_value(gam[0]).run()
    assert not at.exception, [e.message for e in at.exception]
    fig = charts(at)["inspect_gam"]
    variant = at.segmented_control(key="inspect_variant").value
    layer, head = at.slider(key="inspect_layer").value, at.slider(key="inspect_head").value
    checkpoint = Path(APP).parents[1] / "checkpoints" / "enc-gam"
    iters = next((w.value for w in at.slider if w.key == "inspect_sinkhorn_iters"), None)  # if shown
    expected = hf.analyze(at.text_area(key="inspect_text").value, checkpoint, variants=(variant,),
                          iters=iters)
    np.testing.assert_allclose(z_of(fig, 1), expected.components[variant]["theta"][layer, head].numpy(),
                               atol=1e-6)
    np.testing.assert_allclose(z_of(fig, 2), views(at)["inspect_heatmap"]["map"], atol=1e-6)
    # issue 30: one figure (over the page's width), one colour scale, named as GAM's, the variants explained
    assert [t["coloraxis"] for t in fig["data"]] == ["coloraxis"] * 3
    assert fig["layout"]["title"]["text"].startswith(f"GAM, {variant} in each brain")
    assert [a["text"] for a in fig["layout"]["annotations"]][:3] == [
        "Φ: content brains", "Θ: relative position", "combined weights"]
    assert any("GAM model: the variant normalizes each brain" in c.value for c in at.caption)


# ----------------------------------------------------------------------------------------------
# Explaining away, Compare, Embeddings
# ----------------------------------------------------------------------------------------------


def test_explaining_away_page(app_env):
    at = open_page("explaining_away")
    figs = charts(at)
    sink_views = {"away_sink_importance", "away_sink_rate", "away_first_token_mass",
                  "away_massive_activations"}
    assert set(figs) == {"away_column_mass", "away_explained_away", *sink_views}  # (appkit/sinks_view.py)
    names = [t["name"] for t in figs["away_column_mass"]["data"]]
    assert names[:4] == ["unas", "dnas", "hnas", "sinkhorn"] and any(n.startswith("1/N") for n in names)
    # the most-explained-away tokens, then the massive activations (sink views)
    assert len(at.dataframe) == 2 and len(at.dataframe[0].value) > 0
    before = [z_of(figs["away_explained_away"], k) for k in range(4)]
    at.select_slider(key="away_eps").set_value(0.5).run()
    after = [z_of(charts(at)["away_explained_away"], k) for k in range(4)]
    assert after[0].sum() > before[0].sum()  # a looser threshold explains more keys away
    assert after[0].sum() > after[1].sum()  # UNAS explains away more than DNAS
    at.radio(key="away_group").set_value("layer").run()
    assert len([t for t in charts(at)["away_column_mass"]["data"] if "layer" in t["name"]]) == 6


def test_compare_page(app_env):
    at = open_page("compare")
    figs = charts(at)
    assert {"compare_maps", "compare_diffs", "compare_js_1", "compare_js_2", "compare_overlay"} <= set(figs)
    js = z_of(figs["compare_js_1"])
    assert js.shape == (6, 12) and 0 < js.mean() <= 1
    before = z_of(figs["compare_diffs"])
    at.slider(key="compare_layer").set_value(4).run()
    assert not np.allclose(z_of(charts(at)["compare_diffs"]), before)
    at.multiselect(key="compare_panels").set_value([at.multiselect(key="compare_panels").options[0]]).run()
    assert "at least two panels" in messages(at)


def test_compare_panels_share_one_colour_scale(app_env):
    """Seen: three panels with separate colour scales (0-0.9 beside 0-0.45) and a colour bar each."""
    at = open_page("compare")
    maps = charts(at)["compare_maps"]
    heat = [t for t in maps["data"] if t["type"] == "heatmap"]
    assert len(heat) == 3 and {t["coloraxis"] for t in heat} == {"coloraxis"}  # one axis, one colour bar
    top = max(float(z_of(maps, k).max()) for k in range(3))
    assert maps["layout"]["coloraxis"]["cmax"] == pytest.approx(top, rel=1e-6)
    assert maps["layout"]["coloraxis"]["cmin"] == 0
    diffs = charts(at)["compare_diffs"]  # A - B and A - C on one diverging scale centred at 0
    lim = max(float(np.abs(z_of(diffs, k)).max()) for k in range(2))
    axis = diffs["layout"]["coloraxis"]
    assert axis["cmin"] == pytest.approx(-lim, rel=1e-6) and axis["cmax"] == pytest.approx(lim, rel=1e-6)
    assert f"±{lim:.3g}" in diffs["layout"]["title"]["text"]
    at.toggle(key="compare_shared_scale").set_value(False).run()  # the per-panel option
    maps = charts(at)["compare_maps"]
    assert {t["coloraxis"] for t in maps["data"] if t["type"] == "heatmap"} == {
        "coloraxis",
        "coloraxis2",
        "coloraxis3",
    }
    assert maps["layout"]["coloraxis2"]["cmax"] == pytest.approx(float(z_of(maps, 1).max()), rel=1e-6)


@pytest.mark.slow  # 1-4 s: .ci/run runs it, the inner loop does not
def test_compare_keeps_the_panels_when_the_model_changes(app_env):
    """Seen: changing the model on Compare cleared the chosen panels."""
    at = open_page("compare")
    options = at.multiselect(key="compare_panels").options
    pick = [o for o in options if o.endswith(("· dnas", "· sinkhorn"))]
    at.multiselect(key="compare_panels").set_value(pick).run()
    native = [o for o in at.selectbox(key="compare_model").options if o.startswith("enc-unas")]
    if not native:
        pytest.skip("no shipped checkpoints in checkpoints/")
    at.selectbox(key="compare_model").set_value(native[0]).run()
    assert not at.exception, [e.message for e in at.exception]
    chosen = at.multiselect(key="compare_panels").value
    assert [c.split(" · ")[1] for c in chosen] == ["dnas", "sinkhorn"] and all(native[0] in c for c in chosen)


@pytest.mark.slow  # 1-4 s: .ci/run runs it, the inner loop does not
def test_embeddings_page(app_env):
    at = open_page("embeddings")
    fig = charts(at)["embed_scatter"]
    assert "PCA" in fig["layout"]["title"]["text"] and len(fig["data"]) == 1
    at.radio(key="embed_what").set_value("qk").run()
    fig = charts(at)["embed_scatter"]
    assert [t["name"] for t in fig["data"]] == ["query", "key"]
    colours = fig["data"][0]["marker"]["color"]
    at.radio(key="embed_color").set_value("column mass").run()
    assert charts(at)["embed_scatter"]["data"][0]["marker"]["color"] != colours
    at.radio(key="embed_method").set_value("UMAP").run()  # UMAP off in tests: PCA and a message
    assert "ATTNLAB_UMAP=off" in messages(at) and "embed_scatter" in charts(at)


@pytest.mark.parametrize("model", ["embedded", "enc-hnas", "enc-gam"])
def test_embedding_queries_and_keys_reproduce_the_analysed_weights(app_env, model):
    """The Embeddings page's queries and keys come from the library's capture path (hf.capture_qk,
    hf.capture_attention_inputs): softmax(q k^T / sqrt(D)) of the plotted vectors (keys translated
    and scaled, AttentionViz) is the UNAS map the analysis computed, for MiniLM and a native
    checkpoint; a GAM layer (no single q and k) is a message, its standard layers work."""
    sys_path_app()
    from appkit import embeddings as emb
    from appkit.analysis import Settings, view_for
    from appkit.sources import EMBEDDED, Source

    if model == "embedded":
        source = EMBEDDED
    else:
        path = Path(APP).parents[1] / "checkpoints" / model
        if not path.is_dir():
            pytest.skip(f"no shipped checkpoint {model}")
        source = Source("native", str(path), f"{model} (shipped)")
    view = view_for(source, Settings(source, ("unas",)), "The penguin explains the zebra away, twice.")
    L, H, N = view.shape
    gam = [] if model == "embedded" else [i for i, b in enumerate(emb.load(source).model.blocks) if b.is_gam]
    for layer in (i for i in range(L) if i not in gam):  # every standard layer, the last head
        x, kinds = emb.vectors(view.key, layer, H - 1, "qk", _view=view)
        assert kinds == ["query"] * N + ["key"] * N and x.shape[0] == 2 * N
        q, k = (torch.from_numpy(a).double() for a in (x[:N], x[N:]))
        expected = torch.from_numpy(view.weights["unas"][layer, H - 1]).double()
        got = torch.softmax(q @ k.T / q.shape[-1] ** 0.5, dim=-1)
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-3)
    hidden, kinds = emb.vectors(view.key, L - 1, 0, "hidden", _view=view)
    assert kinds == ["token"] * N and hidden.shape[0] == N and np.isfinite(hidden).all()
    if gam:
        with pytest.raises(ValueError, match=f"layer {gam[0]} .* GAM layer"):
            emb.vectors(view.key, gam[0], 0, "qk", _view=view)


# ----------------------------------------------------------------------------------------------
# Hybrid weights and Train
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow  # ~1 s: .ci/run runs it, the inner loop does not
def test_hybrid_weights_page(app_env):
    at = open_page("hybrid_weights")
    options = at.selectbox(key="hybrid_source").options
    if not any("hnas" in o for o in options):
        pytest.skip("no shipped HNAS checkpoint")
    assert "hnas" in at.selectbox(key="hybrid_source").value
    figs = charts(at)
    assert set(figs) == {"hybrid_u_curves", "hybrid_u_final"}
    u = z_of(figs["hybrid_u_final"])
    assert u.ndim == 2 and ((u > 0) & (u < 1)).all()
    at.selectbox(key="hybrid_source").set_value("Upload a metrics.jsonl…").run()
    log = "\n".join(json.dumps({"step": s, "u": [[0.5 + s / 100, 0.5]]}) for s in range(0, 30, 10))
    at.file_uploader(key="hybrid_upload").set_value(("metrics.jsonl", log.encode(), "application/json")).run()
    figs = charts(at)
    assert not at.exception and "hybrid_u_curves" in figs
    np.testing.assert_allclose(z_of(figs["hybrid_u_final"]), [[0.7, 0.5]])


CORPUS = (
    "In the beginning was the word, and the word was with attention; attention was everywhere. " * 120
).encode()


def _fill_form(at: AppTest, name: str, steps: int, corpus=("corpus.txt", CORPUS, "text/plain")):
    at.text_input(key="train_name").set_value(name)
    at.number_input(key="train_layers").set_value(2)
    at.number_input(key="train_heads").set_value(2)
    at.select_slider(key="train_width").set_value(32)
    at.number_input(key="train_steps").set_value(steps)
    at.number_input(key="train_batch").set_value(4)
    at.select_slider(key="train_seq").set_value(16)
    at.radio(key="train_tokenizer").set_value("byte")
    at.file_uploader(key="train_corpus").set_value(corpus)
    at.get("form_submit_button")[0].click()
    return at.run()


def _wait(at: AppTest, done, timeout: float = 120.0) -> AppTest:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        at.run()
        if done(at):
            return at
        time.sleep(1.0)
    raise AssertionError(f"timed out; page says: {messages(at)}")


@pytest.mark.slow
def test_train_page_runs_a_model_in_the_background(app_env):
    at = open_page("train")
    assert "No runs yet" in messages(at)
    _fill_form(at, "tiny", steps=12)
    assert not at.exception and not at.error, messages(at)
    assert at.selectbox(key="train_run").value == "tiny"
    at = _wait(at, lambda a: "finished" in a.get("progress")[0].proto.text)
    figs = charts(at)
    assert set(figs) == {"train_loss", "train_u"}
    assert figs["train_loss"]["data"][0]["name"] == "train loss"
    # a fresh session (a reloaded tab) finds the run again
    again = open_page("train")
    assert (
        again.selectbox(key="train_run").value == "tiny" and "finished" in again.get("progress")[0].proto.text
    )
    # bad input: an existing name, a binary corpus
    _fill_form(again, "tiny", steps=12)
    assert "already exists" in messages(again)
    _fill_form(again, "other", steps=12, corpus=("c.txt", b"\x00\x01binary", "text/plain"))
    assert "not a text file" in messages(again) and not again.exception


@pytest.mark.slow
def test_runs_stop_and_resume(app_env):
    import sys

    sys.path.insert(0, str(Path(APP).parent))
    from appkit import runs

    config = runs.make_config(
        "long",
        kind="encoder",
        variant="hnas",
        n_layers=1,
        n_heads=2,
        d_model=32,
        steps=100_000,
        batch_size=4,
        seq_len=16,
        threads=1,
        tokenizer="byte",
    )
    config["train"]["save_every"] = 5
    run = runs.start("long", config, ("corpus.txt", CORPUS))
    try:
        t0 = time.monotonic()
        while runs.inspect(run.dir).step < 5 and time.monotonic() - t0 < 120:
            time.sleep(0.5)
        runs.stop(runs.inspect(run.dir))
        t0 = time.monotonic()
        while runs.inspect(run.dir).active and time.monotonic() - t0 < 30:
            time.sleep(0.2)
        stopped = runs.inspect(run.dir)
        assert stopped.status == "stopped" and stopped.step >= 5
        runs.resume(stopped)
        t0 = time.monotonic()
        while runs.inspect(run.dir).step <= stopped.step and time.monotonic() - t0 < 120:
            time.sleep(0.5)
        resumed = runs.inspect(run.dir)
        assert resumed.active and resumed.step > stopped.step
        steps = [r["step"] for r in resumed.records()]
        assert steps == sorted(set(steps))  # no duplicated step after the resume
    finally:
        runs.stop(runs.inspect(run.dir))


def test_inspect_uploaded_checkpoint(app_env):
    steps = sorted(Path(APP).parents[1].glob("checkpoints/*/step-*/model.safetensors"))
    if not steps:
        pytest.skip("no shipped checkpoints in checkpoints/")
    step = steps[0].parent
    files = [
        (name, (step / name).read_bytes(), "application/octet-stream")
        for name in ("config.json", "model.safetensors", "vocab.txt")
        if (step / name).is_file()
    ]
    at = open_page()
    at.selectbox(key="inspect_model").set_value("Upload a checkpoint…").run()
    at.file_uploader(key="inspect_ckpt").set_value(files).run()
    assert not at.exception and not at.error, messages(at)
    assert "inspect_heatmap" in views(at)


# ----------------------------------------------------------------------------------------------
# Round 2 (issue 14): state that survives, focus, small things
# ----------------------------------------------------------------------------------------------


def sidebar_values(at: AppTest) -> tuple:
    return (
        at.multiselect(key="inspect_variants").value,
        at.slider(key="inspect_hnas_u").value,
        at.number_input(key="inspect_sinkhorn_iters").value,
    )


@pytest.mark.slow  # 1-4 s: .ci/run runs it, the inner loop does not
def test_sidebar_survives_a_local_directory(app_env, tmp_path):
    """Seen (3/3 in Chromium): after "Local Hugging Face directory…" the sidebar showed no variants,
    u 0.00 and 1 iteration, and MiniLM then said "Pick at least one variant." The page stopped before
    rendering them; every sidebar control is now rendered, with its value, whatever is missing."""
    at = open_page()
    at.multiselect(key="inspect_variants").set_value(["unas", "hnas", "sinkhorn"]).run()
    at.slider(key="inspect_hnas_u").set_value(0.8).run()
    want = (["unas", "hnas", "sinkhorn"], 0.8, 3)
    at.selectbox(key="inspect_model").set_value("Local Hugging Face directory…").run()
    assert "Enter the path" in messages(at) and sidebar_values(at) == want
    for path in (str(tmp_path), "/no/such/dir"):
        at.text_input(key="inspect_model_dir").set_value(path).run()
        assert not at.exception and at.error and sidebar_values(at) == want, messages(at)
    at.selectbox(key="inspect_model").set_value("MiniLM-L6 (embedded)").run()
    assert sidebar_values(at) == want and "Pick at least one" not in messages(at)
    assert at.button_group(key="inspect_variant").options == ["unas", "hnas", "sinkhorn"]
    assert "inspect_heatmap" in views(at)


@pytest.mark.slow  # ~1 s: .ci/run runs it, the inner loop does not
def test_sidebar_widgets_come_from_the_variant_specs(app_env):
    sys_path_app()
    from appkit.variants import param_specs

    at = open_page()
    for variant, p in param_specs():
        widget = at.get("slider") + at.get("number_input") + at.get("select_slider")
        w = next(w for w in widget if w.key == f"inspect_{variant}_{p.name}")
        assert w.value == p.default and w.help.startswith(p.help)
        if p.low is not None and w.type == "slider":
            assert (w.min, w.max) == (p.low, p.high)
    # a parameter beyond u and iters reaches the analysis (Sinkhorn's tol), its manifest and the URL
    at.select_slider(key="inspect_sinkhorn_tol").set_value(1e-3).run()
    assert not at.exception and at.query_params["sinkhorn_tol"] == "0.001"
    snippet = next(c.value for c in open_exports(at, "inspect_heatmap").code if "attnlab analyze" in c.value)
    assert "--tol 0.001" in snippet and "--iters 3" in snippet


def sys_path_app():
    import sys

    app = str(Path(APP).parent)
    if app not in sys.path:
        sys.path.insert(0, app)


@pytest.mark.slow  # 1-4 s: .ci/run runs it, the inner loop does not
def test_uploaded_file_replaces_the_text_box_visibly(app_env):
    """Seen: an upload silently overrode the text box, which still showed the old text; an empty
    file said "Using the uploaded file empty.txt (0 characters)" and then "Type or paste a text"."""
    at = open_page()
    upload = ("notes.txt", b"Okapis attend quietly.", "text/plain")
    at.file_uploader(key="inspect_upload").set_value(upload).run()
    box = at.text_area(key="inspect_text")
    assert box.disabled and "not used while a file is uploaded" in box.label
    assert any("Using the uploaded file **notes.txt**" in c.value for c in at.caption)
    assert any("quietly" in x for x in views(at)["inspect_heatmap"]["tokens"])
    at.switch_page("app_pages/explaining_away.py").run()  # the upload follows the user
    assert at.text_area(key="away_text").disabled and not at.exception
    at.button(key="away_drop_upload").click().run()  # back to the text box
    assert not at.text_area(key="away_text").disabled
    at.switch_page("app_pages/inspect.py").run()
    assert any("cat" in x for x in views(at)["inspect_heatmap"]["tokens"])

    fresh = open_page()
    fresh.file_uploader(key="inspect_upload").set_value(("empty.txt", b"  \n", "text/plain")).run()
    said = messages(fresh)
    assert "empty.txt is empty" in said and "Using the uploaded file" not in said
    assert "Type or paste" not in said and not charts(fresh)


@pytest.mark.slow  # 1-4 s: .ci/run runs it, the inner loop does not
def test_state_lives_in_the_url(app_env, monkeypatch, tmp_path):
    """A reload (a new session with the same URL) reopens the same view, pasted text included."""
    monkeypatch.setenv("ATTNLAB_TEXTS_DIR", str(tmp_path / "texts"))
    at = open_page()
    at.text_area(key="inspect_text").set_value("Narwhals explain the krill away.").run()
    at.button_group(key="inspect_variant").set_value("dnas").run()
    at.slider(key="inspect_layer").set_value(4).run()
    at.slider(key="inspect_head").set_value(7).run()
    at.slider(key="inspect_hnas_u").set_value(0.25).run()
    url = dict(at.query_params)
    assert {"text", "variant", "layer", "head", "hnas_u"} <= set(url)
    assert "mode" not in url  # defaults are left out
    assert url["layer"] == ["4"] or url["layer"] == "4"

    again = AppTest.from_file(APP, default_timeout=TIMEOUT)
    for k, v in url.items():
        again.query_params[k] = v[0] if isinstance(v, list) else v
    again.run()
    assert not again.exception, [e.message for e in again.exception]
    assert again.text_area(key="inspect_text").value == "Narwhals explain the krill away."
    assert again.slider(key="inspect_hnas_u").value == 0.25
    assert views(again)["inspect_heatmap"]["title"] == "dnas: layer 4, head 7"
    # a link to a text this server does not have: a message and the sample, not a crash
    other = AppTest.from_file(APP, default_timeout=TIMEOUT)
    other.query_params["text"] = "0123456789abcdef"
    other.query_params["layer"] = "99"  # out of range: the default
    other.run()
    assert "not stored on this server" in messages(other) and not other.exception
    assert other.slider(key="inspect_layer").value == 2


@pytest.mark.slow  # ~1 s: .ci/run runs it, the inner loop does not
def test_focus_from_the_url_reaches_every_view(app_env):
    """Click to focus (tested with clicks in tests/test_browser.py): a link's focus reaches every
    view (the browser outlines it in the map, colours its lines in the head and model views and
    shades the strip by its row: tests/test_browser.py)."""
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.query_params["focus"] = "3"
    at.run()
    assert not at.exception
    shown = views(at)
    assert {k: v["focus"] for k, v in shown.items() if k != "inspect_grid"} == {
        "inspect_focus_bar": 3,
        "inspect_heatmap": 3,
        "inspect_head_view": 3,
        "inspect_token_mass": 3,
        "inspect_model_view": 3,
    }
    assert shown["inspect_focus_bar"]["tokens"][3] == "sat"
    assert at.query_params["focus"] == "3"


def test_export_snippet_names_the_downloaded_manifest(app_env):
    """Seen: the Python snippet read manifest.json while the file downloads as heatmap.manifest.json."""
    at = open_exports(open_page(), "inspect_heatmap")
    button = next(b for b in at.download_button if b.key == "inspect_heatmap_manifest")
    name = button.proto.file_name if hasattr(button.proto, "file_name") else "heatmap.manifest.json"
    assert name == "heatmap.manifest.json"
    snippet = next(c.value for c in at.code if "reproduce_figure" in c.value and "heatmap" in c.value)
    assert "reproduce_figure('heatmap.manifest.json'" in snippet


def test_spinner_is_pinned_in_sight(app_env):
    """Seen: the "Computing attention…" spinner sat at the top of the page, out of sight when scrolled."""
    at = open_page()
    css = " ".join(h.proto.body for h in at.get("html"))
    assert ".st-key-attnlab_busy" in css and "position: fixed" in css


def test_run_just_started_counts_as_alive(tmp_path):
    """Seen once: the Train page stayed at "starting — step 0" for 120 s while the run finished in
    17 s. Between fork and exec a child's /proc cmdline is still the server's, so a just-started run
    was called dead and the page drew it without polling."""
    import subprocess
    import sys

    sys_path_app()
    from appkit import runs

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])  # cmdline: no run dir
    try:
        runs._CHILDREN[child.pid] = child
        assert runs._alive(child.pid, tmp_path / "some-run")
        child.kill()
        child.wait()
        assert not runs._alive(child.pid, tmp_path / "some-run")
    finally:
        child.kill()
        runs._CHILDREN.pop(child.pid, None)
