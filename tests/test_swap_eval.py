"""attnlab swap-eval: its losses are hf.language_model_loss's, the bootstrap CI covers a known delta,
resume after SIGKILL counts every document once, changed settings are refused, bad input is worded."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import CORPUS
from test_lm_loss import build_lm

from attnlab import hf
from attnlab.cli import main
from attnlab.corpus.summary import bootstrap_counts
from attnlab.swap_eval import open_result, swap_eval
from attnlab.swap_eval.summary import ratio_bootstrap

REPO = Path(__file__).resolve().parents[1]
FAST = dict(variants=["dnas"], layers="each,all", bootstrap=200)


def _docs(root: Path, n: int) -> Path:
    root.mkdir()
    for i in range(n):
        (root / f"d{i}.txt").write_text(" ".join(CORPUS[i % 5 :] + CORPUS[: i % 5]))
    return root


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    return {arch: build_lm(arch, tmp_path_factory.mktemp(f"swap-{arch}")) for arch in ("gpt2", "bert")}


def test_bootstrap_ci_covers_a_known_delta():
    """Documents with known per-document losses: the 95 % CI of the token-weighted delta covers the true
    delta in about 95 % of 300 synthetic corpora (binomial: 0.90 .. 0.99 holds with p > 0.999)."""
    rng = np.random.Generator(np.random.PCG64(7))
    D, true_delta, covered = 60, 0.2, 0
    for rep in range(300):
        tokens = rng.integers(50, 150, size=D).astype(float)  # (D,)
        base = rng.normal(3.0, 1.0, size=D)  # per-document mean loss, model
        swapped = base + rng.normal(true_delta, 0.5, size=D)  # the swap costs 0.2 nats per token on average
        sums = np.stack([base * tokens, swapped * tokens], axis=1)  # (D, 2)
        boot = ratio_bootstrap(sums, tokens, bootstrap_counts(D, 400, rep))  # (B, 2)
        low, high = np.quantile(boot[:, 1] - boot[:, 0], [0.025, 0.975])
        covered += low <= true_delta <= high
    assert 0.90 <= covered / 300 <= 0.99, covered


@pytest.mark.parametrize("arch", ["gpt2", pytest.param("bert", marks=pytest.mark.slow)])
def test_losses_are_language_model_loss_per_swap(tmp_path, lm_dir, arch):
    docs = _docs(tmp_path / "docs", 3)
    result = swap_eval(str(docs), lm_dir[arch], out=tmp_path / "run", shard_docs=2, **FAST)
    table = result.loss_delta().set_index(["variant", "layer"])
    lm = hf.load_language_model(lm_dir[arch])
    texts = [(docs / f"d{i}.txt").read_text() for i in range(3)]  # doc_index = text index: the same masks
    base = hf.language_model_loss(texts, lm)
    assert table.loc[("model", -1), "loss"] == pytest.approx(base, abs=1e-9)
    for layer, layers in ((0, [0]), (1, [1]), (-1, None)):
        expected = hf.language_model_loss(texts, lm, "dnas", layers=layers)
        row = table.loc[("dnas", layer)]
        assert row["loss"] == pytest.approx(expected, abs=1e-9)
        assert row["delta"] == pytest.approx(expected - base, abs=1e-9)
        assert row["ci_low"] <= row["delta"] <= row["ci_high"]
    positions = result.loss_by_position()
    per_swap = positions.assign(s=positions["loss"] * positions["n_tokens"]).groupby(["variant", "layer"])
    totals = per_swap["s"].sum() / per_swap["n_tokens"].sum()
    np.testing.assert_allclose(totals.loc[("dnas", 0)], table.loc[("dnas", 0), "loss"], atol=1e-9)
    assert {"loss_delta.html", "loss_by_position.html"} <= {
        p.name for p in (result.out / "figures").iterdir()
    }
    assert open_result(result.out).manifest["n_documents"] == 3
    # the same command again: nothing rescored; other settings: refused
    stamps = {p.name: p.stat().st_mtime_ns for p in result.rows.glob("*.parquet")}
    again = swap_eval(str(docs), lm_dir[arch], out=tmp_path / "run", shard_docs=2, **FAST)
    assert again.manifest["last_run"]["shards"] == 0
    assert {p.name: p.stat().st_mtime_ns for p in result.rows.glob("*.parquet")} == stamps
    with pytest.raises(ValueError, match="other settings.*layers: 'each,all' -> 'all'"):
        swap_eval(str(docs), lm_dir[arch], out=tmp_path / "run", shard_docs=2, **{**FAST, "layers": "all"})


def test_bad_inputs_are_worded(tmp_path, lm_dir, tiny_model_dir, capsys):
    docs = _docs(tmp_path / "docs", 1)
    gpt2 = lm_dir["gpt2"]
    with pytest.raises(ValueError, match="variant"):
        swap_eval(str(docs), gpt2, ["softmax"], out=tmp_path / "a")
    with pytest.raises(ValueError, match="layers must be one of"):
        swap_eval(str(docs), gpt2, ["dnas"], "some", out=tmp_path / "a")
    with pytest.raises(ValueError, match="no LM head.*supported heads"):
        swap_eval(str(docs), tiny_model_dir("llama"), ["dnas"], out=tmp_path / "a")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("   \n")
    with pytest.raises(ValueError, match="has no documents"):
        swap_eval(str(empty), gpt2, ["dnas"], out=tmp_path / "b")
    with pytest.raises(ValueError, match="ray_address needs engine='ray'"):
        swap_eval(str(docs), gpt2, ["dnas"], out=tmp_path / "c", engine="local", ray_address="localhost:1")
    capsys.readouterr()
    rc = main(
        [
            "swap-eval",
            "--model",
            str(gpt2),
            "--corpus",
            str(tmp_path / "missing"),
            "--out",
            str(tmp_path / "d"),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("attnlab swap-eval: error: source") and "\n" not in err


@contextlib.contextmanager
def _torch_threads(n: int):
    """torch's CPU threads set to n, restored on exit: a run's floats are bitwise the same only at one
    thread count (BLAS splits its sums by thread; Ray's workers run one thread each)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _env():
    path = os.pathsep.join(filter(None, [str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_WAIT_POLICY": "PASSIVE"}


@pytest.mark.slow
def test_sigkill_then_resume_counts_every_document_once(tmp_path, lm_dir):
    docs = _docs(tmp_path / "docs", 6)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "attnlab.cli", "swap-eval", "--model", str(lm_dir["bert"]),
           "--corpus", str(docs), "--out", str(out), "--variants", "dnas,softmax1", "--layers", "each,all",
           "--shard-docs", "1", "--bootstrap", "200", "--quiet", "--threads", "1"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=_env(), cwd=REPO, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while time.time() < deadline and not list((out / "rows").glob("shard-*.parquet")):
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)  # mid-run: some shards done, one maybe half-written
    proc.wait()
    done = sorted((out / "rows").glob("shard-*.parquet"))
    assert 1 <= len(done) < 6 and not (out / "loss_delta.parquet").exists()
    stamps = {p.name: p.stat().st_mtime_ns for p in done}
    res = subprocess.run(cmd, env=_env(), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert {n: (out / "rows" / n).stat().st_mtime_ns for n in stamps} == stamps  # not rescored
    assert not list((out / "rows").glob(".*.tmp"))
    rows = pd.read_parquet(out / "rows")
    assert sorted(rows["doc_index"].unique()) == list(range(6))
    assert not rows.duplicated(["doc_index", "variant", "layer", "position"]).any()  # nothing counted twice
    clean = tmp_path / "clean"  # an uninterrupted run, in this process
    args = cmd[3:]
    args[args.index("--out") + 1] = str(clean)
    with _torch_threads(1):  # (main sets --threads 1 in this process too)
        assert main(args) == 0
    for name in ("loss_delta.parquet", "loss_by_position.parquet"):
        pd.testing.assert_frame_equal(
            pd.read_parquet(out / name), pd.read_parquet(clean / name), check_exact=True
        )


@pytest.mark.slow
def test_ray_engine_writes_the_local_rows(tmp_path, lm_dir):
    ray = pytest.importorskip("ray")
    os.environ["PYTHONPATH"] = _env()["PYTHONPATH"]
    docs = _docs(tmp_path / "docs", 3)
    with _torch_threads(1):  # the workers' thread count: the same floats
        local = swap_eval(str(docs), lm_dir["gpt2"], out=tmp_path / "local", shard_docs=1, **FAST)
    try:
        on_ray = swap_eval(str(docs), lm_dir["gpt2"], out=tmp_path / "ray", shard_docs=1, engine="ray",
                           workers=2, **FAST)  # fmt: skip
    finally:
        ray.shutdown()
    assert on_ray.manifest["engine"] == "ray" and on_ray.manifest["last_run"]["shards"] == 3
    pd.testing.assert_frame_equal(on_ray.loss_delta(), local.loss_delta(), check_exact=True)
    for shard in sorted(local.rows.glob("*.parquet")):
        pd.testing.assert_frame_equal(pd.read_parquet(on_ray.rows / shard.name), pd.read_parquet(shard),
                                      check_exact=True)  # fmt: skip
