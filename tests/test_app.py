"""The Streamlit app, page by page, with streamlit.testing.v1.AppTest (no browser).

Each page: no exception, the expected widgets and charts, and a widget change changes a chart. Bad
input (empty text, wrong file type, binary or oversized upload, a directory that is not a model, a
checkpoint upload that does not load) ends as a message on the page. One process shares one loaded
MiniLM (st.cache_resource and attnlab.hf's cache persist across AppTest instances).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

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
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    return tmp_path


def open_page(page: str | None = None) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    if page:
        at.switch_page(f"app_pages/{page}.py").run()
    assert not at.exception, [e.message for e in at.exception]
    return at


def charts(at: AppTest) -> dict[str, dict]:
    """key -> plotly figure dict of every chart on the page."""
    return {c.key: json.loads(c.proto.spec) for c in at.get("plotly_chart")}


def z_of(fig: dict, trace: int = 0) -> np.ndarray:
    """The z matrix of a heatmap trace (plotly sends numpy arrays as base64 typed arrays)."""
    z = fig["data"][trace]["z"]
    if isinstance(z, dict):  # {"dtype": "f4", "bdata": "...", "shape": "r, c"}
        import base64

        arr = np.frombuffer(base64.b64decode(z["bdata"]), dtype=np.dtype(z["dtype"]))
        shape = [int(s) for s in str(z.get("shape", len(arr))).split(",")]
        return arr.reshape(shape)
    return np.asarray(z, dtype=float)


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
        "inspect_u",
        "inspect_iters",
        "inspect_layer",
        "inspect_head",
    ):
        assert key in at.session_state, key
    figs = charts(at)
    assert set(figs) == {"inspect_heatmap", "inspect_head_view", "inspect_token_mass", "inspect_grid"}
    heat = figs["inspect_heatmap"]
    assert heat["layout"]["title"]["text"] == "unas: layer 2, head 0"
    n = len(heat["data"][0]["x"])
    assert z_of(heat).shape == (n, n)
    np.testing.assert_allclose(z_of(heat).sum(1), 1.0, atol=1e-4)  # rows sum to 1
    keys = {b.key for b in at.download_button}
    assert {f"inspect_heatmap_{f}" for f in ("png", "svg", "pdf", "html", "csv", "npz", "manifest")} <= keys

    at.slider(key="inspect_head").set_value(3).run()
    after = charts(at)["inspect_heatmap"]
    assert after["layout"]["title"]["text"] == "unas: layer 2, head 3"
    assert not np.allclose(z_of(after), z_of(heat))

    at.button_group(key="inspect_variant").set_value("dnas").run()
    dnas = charts(at)["inspect_heatmap"]
    assert dnas["layout"]["title"]["text"].startswith("dnas")
    assert z_of(dnas).sum(0).min() >= 1.0 / n - 1e-4  # the DNAS column floor 1/N
    assert not at.exception


def test_inspect_new_text_and_settings(app_env):
    at = open_page()
    at.text_area(key="inspect_text").set_value("Giraffes rarely attend meetings.").run()
    heat = charts(at)["inspect_heatmap"]
    assert any("rarely" in x for x in heat["data"][0]["x"])
    at.multiselect(key="inspect_variants").set_value(["unas", "sinkhorn"]).run()
    assert at.button_group(key="inspect_variant").options == ["unas", "sinkhorn"]
    at.radio(key="inspect_mode").set_value("swap").run()
    assert not at.exception and "inspect_heatmap" in charts(at)


@pytest.mark.parametrize(
    "upload, expected",
    [
        (("notes.pdf", b"%PDF-1.4 binary", "application/pdf"), "is not a text file"),
        (("binary.txt", b"abc\x00\x01\x02", "text/plain"), "binary"),
        (("latin.txt", "café".encode("latin-1"), "text/plain"), "not UTF-8"),
        (("huge.txt", b"word " * 1_200_000, "text/plain"), "the limit is 5 MB"),
    ],
)
def test_inspect_bad_uploads_give_a_message(app_env, upload, expected):
    at = open_page()
    at.file_uploader(key="inspect_upload").set_value(upload).run()
    assert not at.exception
    assert expected in messages(at)
    assert not charts(at)


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


def test_inspect_long_text_is_windowed(app_env):
    at = open_page()
    at.text_area(key="inspect_text").set_value(
        "attention explains away many words. " * 120
    ).run()  # ~720 tokens
    assert not at.exception
    assert at.slider(key="inspect_window").max == 1
    assert any("head view draws up to" in c.value for c in at.caption)  # 512 tokens: no head view
    at.slider(key="inspect_window").set_value(1).run()
    assert not at.exception and "inspect_heatmap" in charts(at)


def test_inspect_shipped_checkpoint(app_env):
    at = open_page()
    native = [o for o in at.selectbox(key="inspect_model").options if "(shipped)" in o]
    if not native:
        pytest.skip("no shipped checkpoints in checkpoints/")
    at.selectbox(key="inspect_model").set_value(native[0]).run()
    assert not at.exception, [e.message for e in at.exception]
    name = native[0].split(" ")[0]  # e.g. "enc-dnas": the caption names the loaded checkpoint
    assert "inspect_heatmap" in charts(at) and f"**{name} (" in " ".join(c.value for c in at.caption)


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
    figs = charts(at)
    assert {"inspect_gam_phi", "inspect_gam_theta", "inspect_gam_combined"} <= set(figs)
    variant = at.segmented_control(key="inspect_variant").value
    layer, head = at.slider(key="inspect_layer").value, at.slider(key="inspect_head").value
    checkpoint = Path(APP).parents[1] / "checkpoints" / "enc-gam"
    expected = hf.analyze(at.text_area(key="inspect_text").value, checkpoint, variants=(variant,),
                          iters=at.slider(key="inspect_iters").value)
    np.testing.assert_allclose(z_of(figs["inspect_gam_theta"]),
                               expected.components[variant]["theta"][layer, head].numpy(), atol=1e-6)
    np.testing.assert_allclose(z_of(figs["inspect_gam_combined"]), z_of(figs["inspect_heatmap"]), atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Explaining away, Compare, Embeddings
# ----------------------------------------------------------------------------------------------


def test_explaining_away_page(app_env):
    at = open_page("explaining_away")
    figs = charts(at)
    assert set(figs) == {"away_column_mass", "away_explained_away"}
    names = [t["name"] for t in figs["away_column_mass"]["data"]]
    assert names[:4] == ["unas", "dnas", "hnas", "sinkhorn"] and any(n.startswith("1/N") for n in names)
    assert len(at.dataframe) == 1 and len(at.dataframe[0].value) > 0
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
    assert {
        "compare_map_0",
        "compare_map_1",
        "compare_map_2",
        "compare_diff_1",
        "compare_js_1",
        "compare_overlay",
    } <= set(figs)
    js = z_of(figs["compare_js_1"])
    assert js.shape == (6, 12) and 0 < js.mean() <= 1
    before = z_of(figs["compare_diff_1"])
    at.slider(key="compare_layer").set_value(4).run()
    assert not np.allclose(z_of(charts(at)["compare_diff_1"]), before)
    at.multiselect(key="compare_panels").set_value([at.multiselect(key="compare_panels").options[0]]).run()
    assert "at least two panels" in messages(at)


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


# ----------------------------------------------------------------------------------------------
# Hybrid weights and Train
# ----------------------------------------------------------------------------------------------


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
    assert "inspect_heatmap" in charts(at)
