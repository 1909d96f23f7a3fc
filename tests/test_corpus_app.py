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


@pytest.mark.slow
def test_background_run_stop_resume_finish(runs_env):
    from appkit import corpus_runs

    members = {f"d/{i}.txt": " ".join(CORPUS[i:] + CORPUS[:i]) for i in range(4)}
    config = {"variants": ["unas"], "window": 16, "overlap": 0, "text_column": "text"}
    run = corpus_runs.start("bg", config, upload=("c.zip", _zip(members)))
    cmd = json.loads((run.dir / "app_process.json").read_text())["command"]
    assert cmd[cmd.index("--out") + 1] == str(run.dir / "result")
    deadline = time.time() + 300
    while corpus_runs.inspect(run.dir).active and time.time() < deadline:
        time.sleep(0.5)
    done = corpus_runs.inspect(run.dir)
    assert done.status == "finished", done.log_tail()
    assert done.progress["documents_done"] == 4
    from attnlab.corpus import open_result

    assert open_result(done.result).manifest["n_documents"] == 4
