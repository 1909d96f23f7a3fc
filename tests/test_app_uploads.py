"""Upload folders of app servers killed outright: the start-up sweep removes those of dead server
processes, and nothing else (appkit.sources.sweep_stale_uploads / sweep_uploads_once)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("streamlit")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "app"))

from appkit import sources  # noqa: E402

SERVER = """
import sys
from appkit.sources import SessionFolder, save_upload
folder = SessionFolder("killed-session")
save_upload([("config.json", b"{}"), ("model.safetensors", b"not really")], folder)
print("ready", flush=True)
sys.stdin.read()  # until killed
"""


@pytest.fixture
def uploads(tmp_path, monkeypatch):
    root = tmp_path / "uploads"
    monkeypatch.setenv("ATTNLAB_UPLOADS_DIR", str(root))
    return root


def _marked(root: Path, name: str, owner) -> Path:
    folder = root / name
    (folder / "0123456789abcdef").mkdir(parents=True)
    (folder / sources.OWNER_FILE).write_text(owner if isinstance(owner, str) else json.dumps(owner))
    return folder


def _state(pid: int) -> str | None:
    stat = sources._process_stat(pid)
    return stat and stat[0]


@pytest.mark.slow
def test_sweep_removes_the_folders_of_a_killed_server_only_once_it_is_dead(uploads):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "app"), str(REPO)])}
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout.readline().strip() == "ready"
        folder = uploads / "killed-session"
        owner = json.loads((folder / sources.OWNER_FILE).read_text())
        assert owner["pid"] == server.pid and len(list(folder.iterdir())) == 2  # marker + the upload
        assert sources.sweep_stale_uploads() == [] and folder.is_dir()  # its server is alive
        server.send_signal(signal.SIGKILL)  # no finalizer runs: the folder stays behind
        server.wait(30)
    finally:
        if server.poll() is None:
            server.kill()
    assert folder.is_dir()
    assert sources.sweep_stale_uploads() == [folder] and not folder.exists()


@pytest.mark.slow
def test_sweep_keeps_live_unknown_and_foreign_folders(uploads, tmp_path):
    mine = sources.SessionFolder("live-session")
    mine.create()
    me = sources._this_process()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        deadline = time.time() + 10
        while _state(sleeper.pid) is None and time.time() < deadline:
            time.sleep(0.01)
        other = {**me, "pid": sleeper.pid, "start": sources._process_stat(sleeper.pid)[1]}
        other_live = _marked(uploads, "other-live-server", other)
        reused = _marked(uploads, "pid-reused", {**me, "start": "1"})  # our pid, an older process's
        foreign = _marked(uploads, "other-container", {**me, "pid": 2**22 + 7, "pid_namespace": "elsewhere"})
        gone = _marked(uploads, "gone-server", {**me, "pid": 2**22 + 7})  # above pid_max: no such process
        garbled = _marked(uploads, "garbled", "{not json")
        unmarked = uploads / "fedcba9876543210"  # a content-hash folder of save_upload(files)
        unmarked.mkdir()
        target = _marked(tmp_path, "elsewhere", {**me, "pid": 2**22 + 7})
        (uploads / "link").symlink_to(target)
        (uploads / "a-file").write_text("x")

        removed = sources.sweep_stale_uploads(uploads)
        assert removed == [gone, reused]
        for kept in (mine.path, other_live, foreign, garbled, unmarked, target, uploads / "link"):
            assert kept.exists(), kept
        sleeper.send_signal(signal.SIGKILL)  # not reaped yet: a zombie, which is dead
        deadline = time.time() + 10
        while _state(sleeper.pid) != "Z" and time.time() < deadline:
            time.sleep(0.01)
        assert sources.sweep_stale_uploads(uploads) == [other_live]
    finally:
        sleeper.kill()
        sleeper.wait()
    assert mine.path.is_dir() and sources.sweep_stale_uploads(uploads) == []
    assert sources.sweep_stale_uploads(tmp_path / "missing") == []


def test_sweep_runs_once_per_server_process(uploads):
    dead = {**sources._this_process(), "pid": 2**22 + 7}
    first = _marked(uploads, "stale-1", dead)
    assert sources.sweep_uploads_once() == ("stale-1",) and not first.exists()
    second = _marked(uploads, "stale-2", dead)
    assert sources.sweep_uploads_once() == ("stale-1",) and second.is_dir()  # cached: not swept again


def test_the_app_entry_point_sweeps_at_start_up(uploads, monkeypatch):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("ATTNLAB_DEBUG", "1")
    monkeypatch.setenv("ATTNLAB_UMAP", "off")
    stale = _marked(uploads, "stale-session", {**sources._this_process(), "pid": 2**22 + 7})
    live = sources.SessionFolder("live-session")
    live.create()
    at = AppTest.from_file(str(REPO / "app" / "streamlit_app.py"), default_timeout=240).run()
    assert not at.exception, [e.message for e in at.exception]
    assert not stale.exists() and live.path.is_dir()
