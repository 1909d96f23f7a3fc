"""The app's Corpus page and its background runs (app/appkit/corpus_runs.py)."""

from __future__ import annotations

import io
import json
import sys
import time
import zipfile
from pathlib import Path

import pytest
from conftest import CORPUS

pytest.importorskip("streamlit.testing.v1")
from streamlit.testing.v1 import AppTest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
APP = str(REPO / "app" / "streamlit_app.py")
sys.path.insert(0, str(REPO / "app"))


@pytest.fixture
def runs_env(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNLAB_DEBUG", "1")
    monkeypatch.setenv("ATTNLAB_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("ATTNLAB_UPLOADS_DIR", str(tmp_path / "uploads"))
    return tmp_path


def _zip(members: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, text in members.items():
            z.writestr(name, text)
    return buf.getvalue()


@pytest.mark.slow  # the app and a corpus run: ~1 min on a shared 2-core machine
def test_page_shows_a_finished_run_and_opens_a_folder(runs_env):
    from attnlab.corpus import analyze_corpus

    docs = runs_env / "docs"
    docs.mkdir()
    for i, t in enumerate(CORPUS[:3]):
        (docs / f"{i}.txt").write_text(t)
    run_dir = runs_env / "runs" / "corpus" / "done"
    run_dir.mkdir(parents=True)
    (run_dir / "app_corpus.json").write_text(json.dumps({"source": str(docs)}))
    analyze_corpus(str(docs), out=run_dir / "result", variants=["unas", "dnas"], window=16, bootstrap=50)
    at = AppTest.from_file(APP, default_timeout=240).run()
    at.switch_page("app_pages/corpus.py").run()
    assert not at.exception, [e.message for e in at.exception]
    keys = {c.key for c in at.get("plotly_chart")}
    assert {"corpus_run_Explained away", "corpus_run_Attention received", "corpus_run_heatmap"} <= keys
    at.text_input(key="corpus_folder").input(str(run_dir / "result")).run()
    assert "corpus_folder_heatmap" in {c.key for c in at.get("plotly_chart")}
    at.text_input(key="corpus_folder").input(str(docs)).run()
    assert any("is not a finished corpus run" in e.value for e in at.error)


def test_start_refuses_bad_uploads(runs_env):
    from appkit import corpus_runs

    with pytest.raises(ValueError, match="upload a .jsonl, .csv, .parquet"):
        corpus_runs.start("a", {}, upload=("x.png", b"\x89PNG"))
    with pytest.raises(ValueError, match="unsafe member path"):
        corpus_runs.start("b", {}, upload=("c.zip", _zip({"../evil.txt": "x"})))
    with pytest.raises(ValueError, match="no .txt or .md files"):
        corpus_runs.start("c", {}, upload=("c.zip", _zip({"a.bin": "x"})))
    with pytest.raises(ValueError, match="does not exist"):
        corpus_runs.start("d", {}, path=str(runs_env / "nowhere"))
    with pytest.raises(ValueError, match="run name"):
        corpus_runs.start("../x", {})
    assert not (corpus_runs.corpus_dir() / "b").exists()  # a refused upload leaves nothing


def _page() -> AppTest:
    """A fresh browser session on the Corpus page (a closed tab opened again)."""
    at = AppTest.from_file(APP, default_timeout=240).run()
    at.switch_page("app_pages/corpus.py").run()
    assert not at.exception, [e.message for e in at.exception]
    return at


def _until(what, timeout: float = 600.0, every: float = 0.25):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        value = what()
        if value:
            return value
        time.sleep(every)
    raise AssertionError("timed out")


def _run_if(run_dir, condition):
    from appkit import corpus_runs

    run = corpus_runs.inspect(run_dir)
    return run if condition(run) else None


def _progress_text(at: AppTest) -> str:
    return at.get("progress")[0].proto.text


@pytest.mark.slow  # a background `attnlab corpus` started, stopped and resumed from the page: minutes
def test_page_runs_in_background_stop_resume_and_shows_it_again(runs_env):
    from appkit import corpus_runs

    docs = runs_env / "docs"
    docs.mkdir()
    n_docs = 24
    for i in range(n_docs):
        (docs / f"{i:02d}.txt").write_text(" ".join(CORPUS[i % 5:] + CORPUS[: i % 5]))
    at = _page()
    at.text_input(key="corpus_name").set_value("bg")
    at.radio(key="corpus_kind").set_value("Server path")
    at.text_input(key="corpus_path").set_value(str(docs))
    at.multiselect(key="corpus_variants").set_value(["unas"])
    at.number_input(key="corpus_window").set_value(16)
    at.number_input(key="corpus_max_docs").set_value(0)
    at.number_input(key="corpus_shard_docs").set_value(1)
    at.get("form_submit_button")[0].click()
    at.run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    run_dir = corpus_runs.corpus_dir() / "bg"
    assert at.selectbox(key="corpus_run").value == "bg"
    rows = run_dir / "result" / "rows"
    _until(lambda: list(rows.glob("shard-*.parquet")))  # the job runs on without the page

    # another session (the tab closed and opened again) finds the run, with its progress, and stops it
    at = _page()
    assert at.selectbox(key="corpus_run").value == "bg"
    text = _progress_text(at)
    assert "running" in text and f"of {n_docs} documents" in text, text
    at.button(key="corpus_stop").click().run()
    stopped = _until(lambda: _run_if(run_dir, lambda r: not r.active), 120)
    assert stopped.status == "stopped", stopped.log_tail()
    kept = {p.name: p.stat().st_mtime_ns for p in rows.glob("shard-*.parquet")}
    assert 1 <= len(kept) < n_docs and not (run_dir / "result" / "summary.parquet").exists()
    at = _page()
    assert "stopped" in _progress_text(at)
    done = int(_progress_text(at).split("—")[1].split()[0])
    # progress.json is written just after each shard: a Stop between the two lags it by one shard
    assert len(kept) - 1 <= done <= len(kept), _progress_text(at)

    at.button(key="corpus_resume").click().run()
    finished = _until(lambda: _run_if(run_dir, lambda r: not r.active))
    assert finished.status == "finished", finished.log_tail()
    assert finished.progress["documents_done"] == n_docs
    assert {n: (rows / n).stat().st_mtime_ns for n in kept} == kept  # resumed, not recomputed
    assert len(list(rows.glob("shard-*.parquet"))) == n_docs

    at = _page()  # the finished run is drawn again in a new session
    assert "finished" in _progress_text(at)
    keys = {c.key for c in at.get("plotly_chart")}
    assert {"corpus_run_Explained away", "corpus_run_Attention received", "corpus_run_heatmap"} <= keys
    from attnlab.corpus import open_result

    assert open_result(finished.result).manifest["n_documents"] == n_docs
