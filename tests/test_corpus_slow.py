"""Corpus atlas, slow parts: a run killed with SIGKILL and resumed, and the Ray Data engine on a
local Ray (ray.init(num_cpus=2)): summary identical to the local engine, a worker killed mid-run."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import CORPUS

from attnlab.corpus import analyze_corpus

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
SETTINGS = dict(variants=["unas", "dnas"], window=16, overlap=2, shard_docs=1, bootstrap=200)


def _corpus(tmp_path, n=6):
    root = tmp_path / "docs"
    root.mkdir()
    for i in range(n):
        (root / f"d{i}.txt").write_text(" ".join(CORPUS[i % 5:] + CORPUS[: i % 5]))
    return root


def _env():
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_WAIT_POLICY": "PASSIVE"}


def _assert_each_document_once(out, n):
    rows = pd.read_parquet(Path(out) / "rows", columns=["doc_index", "window", "variant", "layer", "head",
                                                        "statistic"])
    assert sorted(rows["doc_index"].unique()) == list(range(n))
    assert not rows.duplicated().any()  # no document (window, ...) written twice


def _assert_each_token_indexed_once(out):
    """The token index (attnlab corpus --index): every text token of the manifest once."""
    import json

    index = pd.read_parquet(Path(out) / "index", columns=["doc_index", "token_index"])
    documents = json.loads((Path(out) / "manifest.json").read_text())["documents"]
    assert not index.duplicated().any()
    assert index.groupby("doc_index").size().to_dict() == {d["index"]: d["tokens"] for d in documents}


def test_sigkill_then_resume_every_document_once(tmp_path):
    root = _corpus(tmp_path)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "attnlab.cli", "corpus", str(root), "--out", str(out), "--variants",
           "unas,dnas", "--window", "16", "--overlap", "2", "--shard-docs", "1", "--bootstrap", "200",
           "--quiet", "--index"]
    proc = subprocess.Popen(cmd, env=_env(), cwd=REPO, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while time.time() < deadline and not list((out / "rows").glob("shard-*.parquet")):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)  # mid-run: some shards done, one maybe half-written
    proc.wait()
    done = sorted(p.name for p in (out / "rows").glob("shard-*.parquet"))
    assert 1 <= len(done) < 6 and not (out / "summary.parquet").exists()
    stamps = {p.name: p.stat().st_mtime_ns for p in (out / "rows").glob("shard-*.parquet")}
    res = subprocess.run(cmd, env=_env(), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert {n: (out / "rows" / n).stat().st_mtime_ns for n in stamps} == stamps  # not recomputed
    assert not list((out / "rows").glob(".*.tmp")) and not list((out / "index").glob(".*.tmp"))
    _assert_each_document_once(out, 6)
    _assert_each_token_indexed_once(out)
    clean = analyze_corpus(str(root), out=tmp_path / "clean", **SETTINGS)
    pd.testing.assert_frame_equal(pd.read_parquet(out / "summary.parquet"), clean.summary())


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    os.environ["PYTHONPATH"] = _env()["PYTHONPATH"]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             runtime_env={"env_vars": {"OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": _env()["PYTHONPATH"]}})
    yield ray
    ray.shutdown()


def test_ray_summary_identical_to_local(tmp_path, local_ray):
    root = _corpus(tmp_path, 4)
    local = analyze_corpus(str(root), out=tmp_path / "local", **SETTINGS, index=True)
    on_ray = analyze_corpus(str(root), out=tmp_path / "ray", engine="ray", workers=2, **SETTINGS, index=True)
    pd.testing.assert_frame_equal(on_ray.summary(), local.summary(), check_exact=True)
    for shard in sorted((tmp_path / "local" / "rows").glob("*.parquet")):
        pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "ray" / "rows" / shard.name),
                                      pd.read_parquet(shard), check_exact=True)
    for shard in sorted((tmp_path / "local" / "index").glob("*.parquet")):  # the token index too
        a, b = pd.read_parquet(tmp_path / "ray" / "index" / shard.name), pd.read_parquet(shard)
        pd.testing.assert_frame_equal(a.drop(columns=["embedding"]), b.drop(columns=["embedding"]),
                                      check_exact=True)
        # the actors run single-threaded: the float16 hidden states agree within rounding
        np.testing.assert_allclose(np.stack(a["embedding"]), np.stack(b["embedding"]), atol=2e-2, rtol=1e-2)
    _assert_each_token_indexed_once(tmp_path / "ray")
    assert on_ray.manifest["last_run"]["shards"] == 4


def test_ray_worker_killed_mid_run_still_finishes(tmp_path, local_ray, monkeypatch):
    root = _corpus(tmp_path, 6)
    pids = tmp_path / "pids"
    pids.mkdir()
    monkeypatch.setenv("ATTNLAB_CORPUS_PID_DIR", str(pids))
    out = tmp_path / "ray"
    killed = []

    def kill_one_worker():  # once a shard is written, SIGKILL an actor that is still analysing
        deadline = time.time() + 1800  # the first shard took > 300 s on a machine at load 28
        while time.time() < deadline and not killed and not (out / "summary.parquet").exists():
            if list((out / "rows").glob("shard-*.parquet")) and list(pids.glob("*.pid")):
                pid = int(sorted(pids.glob("*.pid"))[0].stem)
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    (pids / f"{pid}.pid").unlink()
            time.sleep(0.05)

    killer = threading.Thread(target=kill_one_worker, daemon=True)
    killer.start()
    # the actors inherit the marker directory through the runtime environment of the local Ray
    local_ray.shutdown()
    local_ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                   runtime_env={"env_vars": {"OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": _env()["PYTHONPATH"],
                                             "ATTNLAB_CORPUS_PID_DIR": str(pids)}})
    result = analyze_corpus(str(root), out=out, engine="ray", workers=2, **SETTINGS)
    killer.join(timeout=5)
    assert killed, "no worker was killed"
    _assert_each_document_once(out, 6)
    clean = analyze_corpus(str(root), out=tmp_path / "clean", **SETTINGS)
    pd.testing.assert_frame_equal(result.summary(), clean.summary(), check_exact=True)


def test_unreachable_ray_address_fails_within_seconds(tmp_path):
    root = _corpus(tmp_path, 1)
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "attnlab.cli", "corpus", str(root), "--out",
                          str(tmp_path / "r"), "--engine", "ray", "--ray-address", "10.255.255.1:6379",
                          "--quiet"],
                         env=_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - t0
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0, res.stderr
    # no route: the TCP probe refuses; a network that accepts every connection (a proxy): the GCS
    # connection times out
    assert re.search(r"ray_address '10.255.255.1:6379'(: Failed to connect| is unreachable)", res.stderr)
    # a hang would run into the 120 s timeout; the start-up of a process importing the same
    # modules (torch, transformers, ray) is taken off, since a loaded machine makes it tens of seconds
    t1 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import attnlab.cli, attnlab.hf, ray, transformers"], env=_env(),
                   cwd=REPO, check=True, timeout=300)
    start_up = time.perf_counter() - t1
    assert elapsed - start_up < 45, (elapsed, start_up)
    assert not (tmp_path / "r").exists()
