"""attnlab.train: metrics, checkpoints, exact resume, crash safety, bad input, speed, multi-view."""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import attnlab.checkpoint_io
from attnlab.data import default_corpus
from attnlab.models import load, load_config
from attnlab.train import (
    CheckpointError,
    RunConfig,
    column_mass_summary,
    learning_rate,
    list_recipes,
    load_recipe,
    read_metrics,
    train,
)

ROOT = Path(__file__).resolve().parents[1]


def tiny_config(**train_kw) -> RunConfig:
    return RunConfig.from_dict({
        "name": "tiny",
        "model": {"kind": "encoder", "d_model": 16, "n_layers": 2, "n_heads": 2, "d_ff": 32,
                  "variant": ["hnas", "dnas"]},
        "data": {"tokenizer": "byte", "seq_len": 16},
        "train": {"steps": 12, "batch_size": 8, "warmup": 3, "eval_every": 4, "eval_batches": 1,
                  "log_every": 1, "save_every": 4, "seed": 0, "threads": 1, **train_kw},
    })


@pytest.fixture(scope="module")
def text():
    return default_corpus()[:20_000]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory, text):
    p = tmp_path_factory.mktemp("corpus") / "kjv.txt"
    p.write_text(text, encoding="utf-8")
    return p


def _weights(run_dir):
    return load(run_dir).state_dict()


def _same_metrics(a, b):
    drop = ("tokens_per_s",)
    return [{k: v for k, v in r.items() if k not in drop} for r in a] == \
           [{k: v for k, v in r.items() if k not in drop} for r in b]


@pytest.mark.slow  # ~1 s: .ci/run runs it, the inner loop does not
def test_training_writes_metrics_checkpoints_and_loads(tmp_path, text):
    result = train(tiny_config(), tmp_path / "run", text=text, progress=False)
    run = tmp_path / "run"
    assert result.step == 12 and (run / "latest.json").is_file() and (run / "recipe.json").is_file()
    recs = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(13))
    for r in recs[1:]:
        assert {"step", "loss", "lr", "tokens_per_s", "u"} <= set(r)
        assert len(r["u"]) == 2 and len(r["u"][0]) == 2  # (L, H)
        assert r["u"][1] == [1.0, 1.0]  # the dnas layer
    evals = [r for r in recs if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 4, 8, 12]
    assert len(evals[-1]["column_mass"]) == 2 and "explained_away" in evals[-1]["column_mass"][0]
    assert recs[3]["lr"] == pytest.approx(1e-3)  # end of warm-up
    model = load(run)
    assert model.hybrid_weights().shape == (2, 2)
    cfg = load_config(run)
    assert cfg["step"] == 12 and cfg["tokenizer"] == {"kind": "byte"}
    kept = sorted(p.name for p in run.glob("step-*"))
    assert kept == ["step-00000008", "step-00000012"]  # keep_checkpoints=2


@pytest.mark.slow  # ~1 s: .ci/run runs it, the inner loop does not
def test_resume_is_exact(tmp_path, text):
    config = tiny_config()
    train(config, tmp_path / "straight", text=text, progress=False)
    train(config, tmp_path / "resumed", text=text, progress=False, stop_after=6)
    assert json.loads((tmp_path / "resumed" / "latest.json").read_text())["step"] == 6
    train(config, tmp_path / "resumed", text=text, progress=False, resume=True)
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _same_metrics(read_metrics(tmp_path / "straight" / "metrics.jsonl"),
                         read_metrics(tmp_path / "resumed" / "metrics.jsonl"))
    # from the step-0 checkpoint (empty optimizer state) too
    train(config, tmp_path / "from0", text=text, progress=False, stop_after=0)
    train(config, tmp_path / "from0", text=text, progress=False, resume=True)
    c = _weights(tmp_path / "from0")
    assert all(torch.equal(a[k], c[k]) for k in a)
    assert _same_metrics(read_metrics(tmp_path / "straight" / "metrics.jsonl"),
                         read_metrics(tmp_path / "from0" / "metrics.jsonl"))


def test_resume_truncates_metrics_past_the_checkpoint(tmp_path, text):
    run = tmp_path / "run"
    train(tiny_config(), run, text=text, progress=False, stop_after=8)
    with open(run / "metrics.jsonl", "a") as f:  # lines a killed run wrote after its last checkpoint
        f.write(json.dumps({"step": 9, "loss": 1.0}) + "\n" + '{"step": 10, "lo')
    train(tiny_config(), run, text=text, progress=False, resume=True)
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(13))


def test_resume_refuses_a_different_config_or_corpus(tmp_path, text):
    run = tmp_path / "run"
    train(tiny_config(), run, text=text, progress=False, stop_after=4)
    with pytest.raises(ValueError, match="already holds a run"):
        train(tiny_config(), run, text=text, progress=False)
    with pytest.raises(ValueError, match=r"different config: train.lr"):
        train(tiny_config(lr=0.01), run, text=text, progress=False, resume=True)
    with pytest.raises(ValueError, match="corpus differs"):
        train(tiny_config(), run, text=text[:-100], progress=False, resume=True)
    with pytest.raises(ValueError, match="holds no run"):
        train(tiny_config(), tmp_path / "empty", text=text, progress=False, resume=True)
    train(tiny_config(steps=14), run, text=text, progress=False, resume=True)  # more steps is fine


def test_full_disk_keeps_last_good_checkpoint(tmp_path, text, monkeypatch):
    run = tmp_path / "run"
    train(tiny_config(), run, text=text, progress=False, stop_after=4)
    good = {k: v.clone() for k, v in _weights(run).items()}

    def disk_full(f, data):  # the disk fills up when the weights file is written
        if len(data) > 4096:
            raise OSError(errno.ENOSPC, "No space left on device")
        f.write(data)

    monkeypatch.setattr(attnlab.checkpoint_io, "_write_file", disk_full)
    with pytest.raises(CheckpointError, match=r"step 8 .*No space left.*step 4\) is intact"):
        train(tiny_config(), run, text=text, progress=False, resume=True)
    monkeypatch.undo()
    assert json.loads((run / "latest.json").read_text())["step"] == 4
    assert not list(run.glob(".tmp-*"))
    again = _weights(run)
    assert all(torch.equal(good[k], again[k]) for k in good)
    train(tiny_config(), run, text=text, progress=False, resume=True)  # and it can go on
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(13))


@pytest.mark.slow
def test_sigkill_mid_run_then_resume(tmp_path, text_file):
    """Kill a training process at an arbitrary moment: the last checkpoint loads, and resuming gives
    the same weights and metrics as an uninterrupted run."""
    steps = 80
    d = tiny_config(steps=steps, save_every=2, eval_every=40, keep_checkpoints=1).to_dict()
    d["data"]["corpus"] = str(text_file)
    config = RunConfig.from_dict(d)
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text(json.dumps(config.to_dict()))
    run = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnlab.train", "--config", str(cfg_file), "--out", str(run),
         "--no-progress"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            latest = run / "latest.json"
            if latest.is_file() and json.loads(latest.read_text())["step"] >= 6:
                break
            if proc.poll() is not None:
                pytest.fail(f"training exited early: {proc.stderr.read().decode()}")
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    killed_at = json.loads((run / "latest.json").read_text())["step"]
    assert 6 <= killed_at < steps
    load(run)  # the last good checkpoint loads
    train(config, run, progress=False, resume=True)
    recs = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(steps + 1))  # no duplicated, no missing step
    train(config, tmp_path / "straight", progress=False)
    a, b = _weights(run), _weights(tmp_path / "straight")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _same_metrics(recs, read_metrics(tmp_path / "straight" / "metrics.jsonl"))


STOP_STEPS = 80


def _stop_config(text_file) -> RunConfig:
    """Checkpoints every 50 steps, so a stop before step 50 must write its own checkpoint."""
    d = tiny_config(steps=STOP_STEPS, save_every=50, eval_every=40, keep_checkpoints=1).to_dict()
    d["data"]["corpus"] = str(text_file)
    return RunConfig.from_dict(d)


@pytest.fixture(scope="module")
def straight_stop_run(tmp_path_factory, text_file):
    run = tmp_path_factory.mktemp("straight") / "run"
    train(_stop_config(text_file), run, progress=False)
    return run


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_stop_signal_checkpoints_the_current_step_then_resume(tmp_path, text_file, straight_stop_run, sig):
    """SIGTERM (the app's Stop) or SIGINT (Ctrl-C) mid-run: the step in progress finishes, a resumable
    checkpoint of exactly that step is written, the process exits 0 with a message, and --resume
    gives the same weights and metrics as an uninterrupted run."""
    config = _stop_config(text_file)
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text(json.dumps(config.to_dict()))
    run = tmp_path / "stopped"
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnlab.train", "--config", str(cfg_file), "--out", str(run),
         "--no-progress"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            recs = read_metrics(run / "metrics.jsonl")
            if recs and recs[-1]["step"] >= 6:
                break
            if proc.poll() is not None:
                pytest.fail(f"training exited early: {proc.stderr.read()}")
            time.sleep(0.01)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    latest = json.loads((run / "latest.json").read_text())
    stopped_at = latest["step"]
    assert 6 <= stopped_at < STOP_STEPS, "the run finished before the signal arrived"
    recs = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(stopped_at + 1))  # last logged step == checkpoint
    assert f"{sig.name} received: stopped after step {stopped_at} with a checkpoint" in err
    assert json.loads(out)["step"] == stopped_at
    step_dir = run / latest["dir"]
    assert (step_dir / "optimizer.safetensors").is_file()  # resumable, not a final checkpoint
    assert json.loads((step_dir / "trainer_state.json").read_text())["step"] == stopped_at
    assert not list(run.glob(".tmp-*"))

    result = train(config, run, progress=False, resume=True)
    assert result.step == STOP_STEPS and result.stopped_by is None
    recs = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(STOP_STEPS + 1))  # every step logged exactly once
    a, b = _weights(run), _weights(straight_stop_run)
    assert all(torch.equal(a[k], b[k]) for k in a)  # bitwise
    assert _same_metrics(recs, read_metrics(straight_stop_run / "metrics.jsonl"))


def test_stop_request_handlers_main_thread_only_and_restored():
    import threading

    from attnlab.train.runtime import StopRequest as _StopRequest

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    stop = _StopRequest()
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # handled at the next bytecode: a request, no exit
        os.kill(os.getpid(), signal.SIGTERM)  # repeated: still one request
        assert stop.name == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):  # Ctrl-C after a request: abort at once
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    finally:
        stop.restore()
    assert {s: signal.getsignal(s) for s in before} == before
    other = _StopRequest()
    thread = threading.Thread(target=other.install)
    thread.start()
    thread.join()
    assert other._previous == {}  # not the main thread: the caller's handlers stay


def test_decoder_and_gam_training(tmp_path, text):
    d = tiny_config(steps=4, eval_every=2).to_dict()
    d["model"].update(kind="decoder", variant="dnas", gam=[True, False],
                      gam_options={"n_brains": 2, "rank": 4, "relative_position": True})
    result = train(RunConfig.from_dict(d), tmp_path / "dec", text=text, progress=False)
    assert result.final_eval_loss is not None and result.final_eval_loss < 6.0
    assert load(tmp_path / "dec").config.kind == "decoder"


@pytest.mark.parametrize(
    "section, kw, match",
    [
        ("train", {"lr": -1.0}, r"train.lr must be in \(0, 1\]"),
        ("train", {"steps": 0}, "train.steps must be an integer >= 1"),
        ("train", {"min_lr": 0.5}, r"train.min_lr must be in \[0, lr"),
        ("train", {"clip": -1}, "train.clip"),
        ("train", {"bogus": 1}, "unknown train keys"),
        ("data", {"seq_len": 2}, "data.seq_len"),
        ("data", {"mask_prob": 1.5}, "data.mask_prob"),
        ("data", {"tokenizer": "bpe"}, "data.tokenizer"),
        ("model", {"n_heads": 3}, "divisible by n_heads"),
        ("model", {"vocab_size": 10}, "set from the data section"),
    ],
)
def test_out_of_range_hyperparameters(section, kw, match):
    d = tiny_config().to_dict()
    d[section].update(kw)
    with pytest.raises(ValueError, match=match):
        RunConfig.from_dict(d)


def test_corpus_too_small_for_one_batch(tmp_path, text):
    with pytest.raises(ValueError, match="corpus too small"):
        train(tiny_config(), tmp_path / "a", text=text[:100], progress=False)
    assert not (tmp_path / "a" / "latest.json").exists()


def test_cli_errors_are_clear(tmp_path, capsys):
    from attnlab.cli import main

    binary = tmp_path / "photo.txt"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00" + bytes(range(256)))
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(tiny_config().to_dict()))
    assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "r"), "--corpus", str(binary)]) == 2
    assert "not a text file" in capsys.readouterr().err
    assert main(["train", "--recipe", "nope", "--out", str(tmp_path / "r")]) == 2
    assert "unknown recipe 'nope'" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["train", "--config", str(bad), "--out", str(tmp_path / "r")]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_shipped_recipes_are_valid():
    names = list_recipes()
    assert {"enc-unas", "enc-dnas", "enc-hnas", "enc-gam"} <= set(names)
    variants = {n: load_recipe(n).model_config(4096).layer_variants() for n in names}
    assert variants["enc-hnas"] == ["hnas"] * 4
    same = {n: {k: v for k, v in load_recipe(n).to_dict()["model"].items() if k != "variant"}
            for n in ("enc-unas", "enc-dnas", "enc-hnas")}
    assert same["enc-unas"] == same["enc-dnas"] == same["enc-hnas"]  # the same encoder


def test_scale_recipes_are_one_encoder_that_ships_under_25_mb():
    """enc8-*: the runs of scripts/hnas_scale.sh (issue 29): >= 6 layers, >= 10,000 steps, resumable to
    the end, the same encoder for every variant, and float32 weights of at most 25 MB."""
    from attnlab.models import TransformerLM

    configs = {v: load_recipe(f"enc8-{v}") for v in ("unas", "dnas", "hnas")}
    shape = {v: {k: x for k, x in c.to_dict()["model"].items() if k != "variant"} for v, c in configs.items()}
    assert shape["unas"] == shape["dnas"] == shape["hnas"]
    for v, c in configs.items():
        mc = c.model_config(c.data.vocab_size)
        assert mc.n_layers >= 6 and c.train.steps >= 10_000 and c.train.keep_optimizer
        assert c.data.corpus == "kjv+shakespeare" and c.train.threads == 1
        assert mc.layer_variants() == [v] * mc.n_layers
        n_params = sum(p.numel() for p in TransformerLM(mc).parameters())
        assert n_params * 4 <= 25_000_000, (v, n_params)


def test_learning_rate_schedule():
    cfg = tiny_config(steps=100, warmup=10, lr=1e-3, min_lr=1e-4).train
    assert learning_rate(5, cfg) == pytest.approx(5e-4)
    assert learning_rate(10, cfg) == pytest.approx(1e-3)
    assert learning_rate(100, cfg) == pytest.approx(1e-4)
    assert all(learning_rate(s, cfg) >= learning_rate(s + 1, cfg) for s in range(10, 100))


def test_column_mass_summary():
    w = torch.zeros(1, 1, 4, 4)
    w[..., 0] = 1.0  # every query on key 0: three keys explained away
    s = column_mass_summary([w])[0]
    assert s["explained_away"] == pytest.approx(0.75) and s["min"] == 0.0 and s["dnas_bound"] == 0.25


def test_speed_and_multiview_smoke():
    from attnlab.train.results import multiview_run
    from attnlab.train.speed import format_table, training_speed

    res = training_speed(tiny_config(), steps=1, rounds=1, warmup=1)
    assert set(res["results"]) == {"unas", "dnas", "hnas"} and res["setup"]["baseline"] == "unas"
    s = res["setup"]
    for v, row in res["results"].items():  # tokens/s, ms/step and the ratio describe one timing
        assert row["tokens_per_s"] == pytest.approx(s["batch_size"] * s["seq_len"] * 1000 / row["step_ms"])
        assert row["ratio"] == pytest.approx(row["tokens_per_s"] / res["results"]["unas"]["tokens_per_s"])
        assert f"| {v} | {row['tokens_per_s']:.0f} |" in format_table(res)
    r = multiview_run("hnas", seed=0, steps=3, batch_size=16, n_eval=64)
    assert r == multiview_run("hnas", seed=0, steps=3, batch_size=16, n_eval=64)  # seeded
    for key, n in (("accuracy", 64), ("query_accuracy", 64 * 6)):  # fractions of 64 scenes (x 6 queries)
        assert r[key] * n == pytest.approx(round(r[key] * n), abs=1e-4), (key, r[key])
    assert r["u"] != 0.5 and 0.0 < r["u"] < 1.0  # three steps moved theta away from its start
