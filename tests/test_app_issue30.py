"""The rough edges of issue 30 (items 1-9), each with a test that would have caught it.

AppTest drives the pages (no browser); tests/test_browser.py checks what needs one (the deep link's
requests). Offline: the embedded MiniLM and the shipped checkpoints.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("streamlit.testing.v1")
from streamlit.runtime.media_file_manager import MediaFileManager  # noqa: E402
from streamlit.testing.v1 import AppTest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
APP = str(REPO / "app" / "streamlit_app.py")
PAGES = REPO / "app" / "app_pages"
TIMEOUT = 240


@pytest.fixture
def app_env(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNLAB_DEBUG", "1")
    monkeypatch.setenv("ATTNLAB_UMAP", "off")
    monkeypatch.setenv("ATTNLAB_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("ATTNLAB_UPLOADS_DIR", str(tmp_path / "uploads"))
    monkeypatch.setenv("ATTNLAB_MODEL_ROOTS", str(tmp_path))
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    if str(REPO / "app") not in sys.path:
        sys.path.insert(0, str(REPO / "app"))
    return tmp_path


@pytest.fixture
def deferred(monkeypatch) -> dict:
    """file id -> the callable of every deferred download button made (what a click runs)."""
    made = {}
    add = MediaFileManager.add_deferred

    def record(self, data_callable, *args, **kwargs):
        file_id = add(self, data_callable, *args, **kwargs)
        made[file_id] = data_callable
        return file_id

    monkeypatch.setattr(MediaFileManager, "add_deferred", record)
    return made


def run_page(page: str | None = None, **query) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.query_params.update(query)
    at.run()
    if page:
        at.switch_page(f"app_pages/{page}.py").run()
    assert not at.exception, [e.message for e in at.exception]
    return at


def messages(at: AppTest) -> str:
    return " | ".join(e.value for kind in ("error", "warning", "info") for e in getattr(at, kind))


def click(at: AppTest, deferred: dict, key: str):
    """What a click on download button ``key`` downloads: its callable run as Streamlit runs it,
    in a server thread without the session's script context."""
    button = next(b for b in at.download_button if b.key == key)
    out = {}
    worker = threading.Thread(target=lambda: out.update(data=deferred[button.proto.deferred_file_id]()))
    worker.start()
    worker.join()
    return out["data"]


# ----------------------------------------------------------------------------------------------
# 2. Inspect's exports keep the focused token
# ----------------------------------------------------------------------------------------------


# what shows the focus in the exported figure: the heatmap's orange outline, the model view's title
@pytest.mark.parametrize(
    "figure, mark", [("heatmap", '"line":{"color":"#ff7f0e"'), ("model_view", "focus: 3: sat")]
)
def test_inspect_exports_keep_the_focus(app_env, deferred, figure, mark):
    """Seen: the manifest said "focus": null and the PNG had no outline (heatmap and model view):
    the deferred export read the focus in a thread where st.session_state is an empty stand-in."""
    at = run_page(focus="3")
    at.session_state[f"inspect_{figure}_export"] = True
    at.run()
    manifest = json.loads(click(at, deferred, f"inspect_{figure}_manifest"))
    assert manifest["figure"]["params"]["focus"] == 3
    html = click(at, deferred, f"inspect_{figure}_html").decode()  # the figure the PNG is made of
    assert mark in html


# ----------------------------------------------------------------------------------------------
# 7. Explaining away: the table's headers and formats come from the builder's columns
# ----------------------------------------------------------------------------------------------


def test_explained_away_table_labels_every_column(app_env):
    """Seen: headers read `meanrelative_mass`: the page's column_config named columns the builder
    did not have, so its labels and 3-decimal format never applied."""
    from attnlab.figures.stat_views import MOST_EXPLAINED_AWAY_COLUMNS

    at = run_page("explaining_away")
    table = next(d for d in at.dataframe if "share_of_heads" in d.value.columns)
    columns = list(table.value.columns)
    assert columns == list(MOST_EXPLAINED_AWAY_COLUMNS)
    config = json.loads(table.proto.columns)
    for name in columns:
        label, fmt = MOST_EXPLAINED_AWAY_COLUMNS[name]
        assert config[name]["label"] == label
        if fmt is not None:
            assert config[name]["type_config"]["format"] == fmt
    assert config["mean_relative_mass"]["type_config"]["format"] == "%.3f"


# ----------------------------------------------------------------------------------------------
# 8. Variant colours
# ----------------------------------------------------------------------------------------------


def test_every_variant_has_its_own_colour_on_corpus_curves():
    """Seen: softmax1 was drawn over UNAS in a near-identical colour."""
    import pandas as pd

    import attnlab
    from attnlab.figures.corpus import layer_curves

    rows = [
        {"variant": v, "layer": layer, "head": -1, "statistic": "explained_away_relative", "mean": 0.1,
         "ci_low": 0.0, "ci_high": 0.2, "n_documents": 3}
        for v in attnlab.VARIANTS for layer in range(2)
    ]
    fig = layer_curves(pd.DataFrame(rows), ["explained_away_relative"]).figure
    colours = {t.name: t.line.color for t in fig.data if t.name}
    assert set(colours) == set(attnlab.VARIANTS)
    rgb = {v: np.array([int(c[i : i + 2], 16) for i in (1, 3, 5)]) for v, c in colours.items()}
    for a in rgb:
        for b in rgb:
            if a < b:
                assert np.abs(rgb[a] - rgb[b]).sum() > 120, (a, b, colours[a], colours[b])


# ----------------------------------------------------------------------------------------------
# 9. Small things
# ----------------------------------------------------------------------------------------------


def test_compare_manifest_has_one_command_per_analysis():
    """Seen: three identical `attnlab analyze` commands when Compare's panels differ by variant."""
    from attnlab.figures.reproduce import manifest

    settings = {"variants": ["unas", "dnas", "hnas"], "mode": "recompute", "u": 0.5, "iters": 3, "window": 0}
    one = {"model": {"name": "MiniLM", "path": None}, "settings": settings}
    other = {"model": {"name": "enc-hnas", "path": "checkpoints/enc-hnas"}, "settings": one["settings"]}
    m = manifest("panels", {"variants": ["unas", "dnas", "hnas"]}, [one, one, one], text_sha256="0" * 64,
                 characters=3, window=0, file_name="maps.manifest.json")
    assert len(m["reproduce"]["commands"]) == 1
    assert "['attnlab-out', 'attnlab-out', 'attnlab-out']" in m["reproduce"]["python"]
    m = manifest("panels", {"variants": ["unas", "dnas", "unas"]}, [one, one, other], text_sha256="0" * 64,
                 characters=3, window=0)
    assert len(m["reproduce"]["commands"]) == 2
    assert "['attnlab-out-0', 'attnlab-out-0', 'attnlab-out-1']" in m["reproduce"]["python"]


def test_no_deploy_button():
    """Seen: Streamlit's Deploy button on every page."""
    config = tomllib.loads((REPO / ".streamlit" / "config.toml").read_text())
    assert config["client"]["toolbarMode"] in ("minimal", "viewer")


def test_ecdf_floor_labels_have_their_own_rows():
    """Seen: the labels "u/N" and "1/N" overlapped. Each label now has its own row above the plot,
    in pixels, so they cannot overlap however short the plot is."""
    from attnlab.figures.distributions import column_mass_distribution

    rng = np.random.default_rng(0)
    masses = {v: rng.dirichlet(np.ones(40), size=(2, 3)).sum(-2) for v in ("unas", "hnas")}
    for u in (0.5, 0.95):
        notes = column_mass_distribution(masses, 40, u).layout.annotations
        assert [a.text.split(" =")[0] for a in notes] == ["1/N", "u/N"]
        rows = sorted((a.yshift or 0) for a in notes)
        assert all(a.y == 1.0 and a.yref == "paper" and a.yanchor == "bottom" for a in notes)
        assert rows[1] - rows[0] >= 1.5 * notes[0].font.size


def test_python_m_attnlab_is_the_attnlab_command():
    """Seen: `python -m attnlab` failed (no attnlab/__main__.py)."""
    out = subprocess.run([sys.executable, "-m", "attnlab", "--help"], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: attnlab") and "analyze" in out.stdout


# ----------------------------------------------------------------------------------------------
# 4. Inputs and the URL agree with the analysis
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("iters", [0, -3, 100_000])
def test_out_of_range_iterations_are_refused_with_a_message(app_env, iters):
    """Seen: Sinkhorn iterations of 0, -3 or 100000 stayed in the box (red outline) while the
    analysis and the URL silently kept the previous value."""
    at = run_page()
    at.number_input(key="inspect_sinkhorn_iters").set_value(iters).run()
    assert not at.exception
    assert "Sinkhorn iters must be from 1 to 10,000" in messages(at)
    assert at.number_input(key="inspect_sinkhorn_iters").value == iters
    assert at.query_params["sinkhorn_iters"] == str(iters)  # the URL says what the box says
    assert not [c for c in at.get("bidi_component") if c.key == "inspect_heatmap_view"]  # no analysis
    at.number_input(key="inspect_sinkhorn_iters").set_value(5).run()
    assert "must be from" not in messages(at) and at.query_params["sinkhorn_iters"] == "5"
    assert [c for c in at.get("bidi_component") if c.key == "inspect_heatmap_view"]


def test_tolerance_takes_powers_of_ten(app_env):
    """Seen: the tolerance slider (0-1 in steps of 0.05) could not set 1e-3 or 1e-6."""
    at = run_page()
    tol = at.select_slider(key="inspect_sinkhorn_tol")
    assert {"0.001", "1e-06"} <= set(tol.options)  # as shown
    tol.set_value(1e-6).run()
    assert not at.exception and at.query_params["sinkhorn_tol"] == "1e-06"
    again = run_page(sinkhorn_tol="1e-06")  # the link reopens it
    assert again.select_slider(key="inspect_sinkhorn_tol").value == 1e-6


def test_u_slider_is_disabled_for_a_checkpoint_with_learned_u(app_env):
    """Seen: the HNAS u slider stayed enabled for a checkpoint with learned u, where it did nothing."""
    at = run_page()
    assert not at.slider(key="inspect_hnas_u").disabled
    hnas = [o for o in at.selectbox(key="inspect_model").options if o.startswith("enc-hnas")]
    if not hnas:
        pytest.skip("no shipped HNAS checkpoint")
    at.selectbox(key="inspect_model").set_value(hnas[0]).run()
    assert not at.exception, [e.message for e in at.exception]
    assert at.slider(key="inspect_hnas_u").disabled
    assert any("learned u" in c.value for c in at.sidebar.caption)


# ----------------------------------------------------------------------------------------------
# 3. Uploads: the uploader states the real limit, and every oversize file gets a message
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, expected",
    [
        (b"word " * 1_040_000, "more than a text of 1,000,000 characters"),  # 5.2 MB
        (b"wordy " * 170_000 + b"x" * 1_000, "has 1,021,000 characters; the app takes up to 1,000,000"),
    ],
    ids=["5.2 MB", "1,021,000 characters"],
)
def test_oversize_upload_says_so_and_analyses_nothing(app_env, data, expected):
    """Seen: a 5.2 MB upload failed with only a red "!" on the file chip while the page went on
    analysing the sample text; the uploader said "5MB per file" where the limit is 1,000,000
    characters, and a 4.9 MB file was refused after the upload."""
    at = run_page()
    uploader = at.file_uploader(key="inspect_upload")
    assert "1,000,000 characters" in uploader.label
    from streamlit import config

    assert uploader.proto.max_upload_size_mb in (0, config.get_option("server.maxUploadSize"))
    uploader.set_value(("big.txt", data, "text/plain")).run()
    assert not at.exception
    assert expected in " | ".join(e.value for e in at.error)
    assert not [c for c in at.get("bidi_component") if c.key == "inspect_heatmap_view"]


def test_a_long_text_of_many_bytes_is_taken(app_env):
    """1,000,000 characters of 2-byte UTF-8 (2 MB) are within the limit: only characters count."""
    from appkit.controls import MAX_TEXT_CHARS, _decode_upload

    text = "é" * (MAX_TEXT_CHARS - 1)
    assert _decode_upload("long.txt", text.encode()) == text
    with pytest.raises(ValueError, match="1,000,000"):
        _decode_upload("long.txt", (text + "éé").encode())


# ----------------------------------------------------------------------------------------------
# 1. Live fragments: one per page, polling only while their run is active
# ----------------------------------------------------------------------------------------------


def _fragments(page: Path) -> list[str]:
    """Names of the functions a page decorates with @st.fragment."""
    out = []
    for node in ast.walk(ast.parse(page.read_text())):
        if isinstance(node, ast.FunctionDef):
            for d in node.decorator_list:
                target = d.func if isinstance(d, ast.Call) else d
                if isinstance(target, ast.Attribute) and target.attr == "fragment":
                    out.append(node.name)
    return out


def test_every_page_fragment_has_its_own_name():
    """Streamlit names a fragment by its function's module + name + place, and every page runs as
    __main__: Train's and Corpus's `live` were one fragment id, so one page's `run_every` timer could
    rerun the other page's fragment after a page change."""
    names = [name for page in sorted(PAGES.glob("*.py")) for name in _fragments(page)]
    assert {"train_live", "corpus_live", "hybrid_live"} <= set(names)
    assert len(names) == len(set(names)), names


@pytest.fixture
def auto_reruns(monkeypatch) -> list[str]:
    """The fragment ids of the `run_every` timers the pages start (their auto_rerun messages)."""
    from streamlit.runtime.scriptrunner_utils.script_run_context import ScriptRunContext

    seen = []
    enqueue = ScriptRunContext.enqueue

    def record(self, msg):
        if msg.WhichOneof("type") == "auto_rerun":
            seen.append(msg.auto_rerun.fragment_id)
        return enqueue(self, msg)

    monkeypatch.setattr(ScriptRunContext, "enqueue", record)
    return seen


def test_live_fragments_poll_only_while_their_run_is_active(app_env, auto_reruns):
    """A Train run and a Corpus run, both active: each page polls with its own fragment; once the
    runs have ended, no page polls."""
    from appkit import corpus_runs, runs

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        train_dir = runs.runs_dir() / "live-train"
        corpus_dir = corpus_runs.corpus_dir() / "live-corpus"
        for d, config in ((train_dir, runs.CONFIG), (corpus_dir, corpus_runs.CONFIG)):
            d.mkdir(parents=True)
            (d / config).write_text(json.dumps({"train": {"steps": 10}}))
            (d / runs.PROCESS).write_text(json.dumps({"pid": child.pid, "started": 0}))
        runs._CHILDREN[child.pid] = child
        polling = {}
        for page in ("train", "corpus", "hybrid_weights"):
            auto_reruns.clear()
            at = run_page(page)
            if page == "hybrid_weights":
                at.selectbox(key="hybrid_source").set_value("live-train (run, starting)").run()
            polling[page] = set(auto_reruns)
        assert all(polling.values()), polling
        assert len(set.union(*polling.values())) == 3, polling  # three fragments, three ids
        child.kill()
        child.wait()
        for page in ("train", "corpus"):
            auto_reruns.clear()
            run_page(page)
            assert not auto_reruns, page
    finally:
        child.kill()
        runs._CHILDREN.pop(child.pid, None)


# ----------------------------------------------------------------------------------------------
# 8. Corpus progress: "starting…" until this process has a rate; no stale rate after a Resume
# ----------------------------------------------------------------------------------------------


def test_corpus_progress_says_starting_until_it_has_a_rate(app_env):
    """Seen: "0 of 24 documents, 0 tokens/s" for the first ~30 s, and the old rate and ETA after a
    Resume."""
    from appkit.corpus_runs import CorpusRun, progress_line

    def line(status, progress, started=100.0):
        return progress_line(CorpusRun(Path("r"), status, progress, 1, started))[1]

    assert "starting…" in line("starting", {})
    first = {"documents_done": 0, "documents": 24, "tokens_per_s": 0.0, "eta_s": None, "updated": 101.0}
    assert "starting…" in line("running", first) and "tokens/s" not in line("running", first)
    before_resume = {"documents_done": 8, "documents": 24, "tokens_per_s": 900.0, "eta_s": 40.0,
                     "updated": 50.0}  # written by the process before the Resume (started at 100)
    resumed = line("running", before_resume)
    assert "starting…" in resumed and "8 of 24 documents done before" in resumed
    assert "tokens/s" not in resumed and "ETA" not in resumed
    fresh = {**before_resume, "documents_done": 16, "updated": 130.0}
    assert line("running", fresh) == "**running** — 16 of 24 documents, 900 tokens/s, ETA 40 s"
    assert line("stopped", fresh) == "**stopped** — 16 of 24 documents"


def test_index_html_names_the_server_root(app_env, tmp_path):
    """Seen: a deep link such as /corpus requested /corpus/_stcore/health (404) before
    /_stcore/health. app/serve.py serves index.html with Streamlit's window.__streamlit base URLs
    set (tests/test_browser.py checks the requests in Chromium)."""
    import serve
    from streamlit import file_util

    static = Path(file_util.get_static_dir())
    out = serve.static_dir_with_base_url(static, "/lab/", tmp_path / "static")
    html = (out / "index.html").read_text()
    script, module = html.index("window.__streamlit"), html.index('<script type="module"')
    assert script < module and 'window.location.origin + "/lab"' in html
    assert "BACKEND_BASE_URL: base, MAIN_PAGE_BASE_URL: base" in html
    assert {p.name for p in out.iterdir()} == {p.name for p in static.iterdir()}
    assert (out / "static").resolve() == (static / "static").resolve()


# ----------------------------------------------------------------------------------------------
# 10. Drill down: a head of the grid or the model view becomes the page's layer and head
# ----------------------------------------------------------------------------------------------


def test_grid_and_model_view_know_the_shown_head_and_the_focus(app_env):
    """The browser draws the shown head framed in the grid and the model view (a click on another
    drills down: tests/test_browser.py), and the grid outlines the focused token like every view."""
    from appkit.token_views import decoded

    at = run_page(focus="3", layer="4", head="5")
    shown = {c.key.removesuffix("_view"): decoded(json.loads(c.proto.json)) for c in at.get("bidi_component")}
    for key in ("inspect_grid", "inspect_model_view"):
        assert (shown[key]["layer_shown"], shown[key]["head_shown"], shown[key]["focus"]) == (4, 5, 3)


def test_grid_export_outlines_the_focus_in_every_map():
    from attnlab.figures.attention import FOCUS_COLOR, attention_grid

    rng = np.random.default_rng(0)
    w = rng.dirichlet(np.ones(6), size=(2, 3, 6)).astype(np.float32)  # (L, H, N, N)
    tokens = ["a", "b", "c", "d", "e", "f"]
    fig = attention_grid(w, tokens, focus=2)
    assert "(focus: 2: c)" in fig.layout.title.text
    shapes = fig.layout.shapes
    assert len(shapes) == 2 * 2 * 3 and all(s.line.color == FOCUS_COLOR for s in shapes)
    rows = sorted({(s.y0, s.y1) for s in shapes if s.x1 - s.x0 > 1})  # the row outlines, per layer
    assert rows == [(1.5, 2.5), (8.5, 9.5)]  # layer 1's map starts at row N + 1 = 7
    assert attention_grid(w, tokens).layout.shapes == ()


# ----------------------------------------------------------------------------------------------
# The screenshot walk (scripts/screenshots.py): what the screenshots showed
# ----------------------------------------------------------------------------------------------


def test_compare_overlay_names_each_panel_once():
    """Seen: the overlaid ECDF's legend read "MiniLM-L6 (embedded) · unas · unas": the page passed
    the panel names (model · variant) as the sources' labels, and the figure adds the variant."""
    at = run_page("compare")
    names = [t["name"] for t in json.loads(next(c for c in at.get("plotly_chart")
                                                 if c.key == "compare_overlay").proto.spec)["data"]]
    panels = at.multiselect(key="compare_panels").value
    assert names[: len(panels)] == list(panels)  # "MiniLM-L6 (embedded) · unas", ... (the legend)
    assert not any(n.endswith(f" · {v} · {v}") for n in names for v in ("unas", "dnas", "hnas"))


def test_one_difference_map_is_titled_once():
    """Seen on Interventions: "after (dnas) minus before (softmax): layer 0, head 0" twice, as the
    figure's title and its single panel's, the second line over the first and the map's top."""
    from attnlab.figures import app_views
    from attnlab.figures.views import difference_heatmap, panel_heatmaps

    rng = np.random.default_rng(0)
    w = rng.dirichlet(np.ones(5), size=(1, 2, 5)).astype(np.float32)  # (L, H, N, N)
    tokens = list("abcde")
    fig = difference_heatmap(w[0, 0], w[0, 1], tokens, title="A minus B")
    assert fig.layout.title.text == "A minus B" and not fig.layout.annotations
    assert "A minus B" in fig.data[0].hovertemplate  # the hover still names the map
    b = app_views.build("difference", [{"dnas": w}, {"unas": w}], tokens,
                        {"layer": 0, "head": 0, "variants": ["dnas", "unas"]}, labels=["after", "before"])
    texts = [b.figure.layout.title.text] + [a.text for a in b.figure.layout.annotations]
    assert sum("after minus before" in t for t in texts) == 1
    two = panel_heatmaps([w[0, 0], w[0, 1]], tokens, ["A", "B"], title="A and B")  # panels keep their names
    assert [a.text for a in two.layout.annotations] == ["A", "B"]


def test_long_map_title_clears_the_key_axis_on_top():
    """Seen on a 1,702-token causal text: the block map's title "unas: layer 1, head 0 (each cell =
    4 × 4 tokens (mean))" drawn over the key axis' title, both in the middle of the top margin (the
    key axis is on top). The title now hangs from the figure's top, and the margin below it holds
    the axis' title and tick labels (plotly's fonts: title 17 px, axis title 14 px, ticks 12 px)."""
    from attnlab.figures.long_maps import overview_heatmap

    fig = overview_heatmap(np.random.default_rng(0).random((10, 10)), 4, 40, title="unas: layer 1, head 0")
    lay = fig.layout
    assert lay.xaxis.side == "top" and lay.xaxis.title.text
    assert (lay.title.yref, lay.title.y, lay.title.yanchor) == ("container", 1, "top")
    title_bottom = lay.title.pad.t + 1.3 * 17
    axis_room = 1.3 * 14 + 1.3 * 12 + 2 * 6  # its title, its tick labels, their gaps
    assert lay.margin.t - title_bottom >= axis_room


STREAMLIT_PLACEHOLDER = r"#0000(0[1-9]|[1-3][0-9]|40)\b"  # theme colours Streamlit's browser swaps in


def test_no_figure_colour_is_a_streamlit_theme_placeholder():
    """Seen: the lowest cells of the Interventions map and the Jensen-Shannon maps lilac, lighter than
    the black just above them: Magma starts at #000004, one of the colours #000001-#000040 that
    Streamlit's browser code replaces with its theme's anywhere in a plotly figure (even theme=None)."""
    import re

    from attnlab.figures import app_views
    from attnlab.figures import beyond as beyond_figs
    from attnlab.figures.views import js_distance_heatmap

    rng = np.random.default_rng(0)
    w = {v: rng.dirichlet(np.ones(6), size=(2, 3, 6)).astype(np.float32) for v in ("unas", "dnas")}
    tokens = list("abcdef")
    figures = [
        beyond_figs.intervention_heatmap({"hidden_cosine": rng.random((2, 3))}, "dnas").figure,
        js_distance_heatmap(rng.random((2, 3))),
        app_views.build("panels", [w, w], tokens, {"layer": 0, "head": 0, "variants": ["unas", "dnas"]},
                        labels=["A", "B"]).figure,
        app_views.build("differences", [w, w, w], tokens, {"layer": 0, "head": 0,
                        "variants": ["unas", "dnas", "unas"]}, labels=["A", "B", "C"]).figure,
        app_views.build("column_mass", w, tokens, {"variants": ["unas", "dnas"], "layer": None},
                        u=0.5).figure,
    ]
    for fig in figures:
        spec = json.loads(fig.to_json())
        spec["layout"].pop("template", None)  # Streamlit's own template: its placeholders are meant
        found = re.search(STREAMLIT_PLACEHOLDER, json.dumps(spec), re.IGNORECASE)
        assert found is None, (fig.layout.title.text, found.group(0))
