"""HNAS retrofit of pretrained models (attnlab.hf.beyond.retrofit, attnlab train --recipe retrofit-hnas)
and the masked-LM head recipe (--recipe mlm-head): issue 28 items 3 and 4. Tiny random models, offline,
seeded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import CORPUS, build_tiny_model
from test_app import app_env  # noqa: F401 (a fixture)
from test_lm_loss import build_lm

from attnlab import hf
from attnlab.cli import main
from attnlab.hf.beyond.layer_swap import Swap, swapped_layers
from attnlab.hf.beyond.retrofit import HNASRetrofit, hybrid_weight, lm_loss_sum, theta_for
from attnlab.train.metrics import read_metrics
from attnlab.train.retrofit import load_retrofit, retrofit_hybrid_weights, train_hf
from attnlab.train.retrofit_config import HFRunConfig

ROOT = Path(__file__).resolve().parent.parent
TEXT = " ".join(CORPUS) * 12  # ~1,000 tokens: dozens of 16-token windows


@pytest.fixture(scope="module")
def lm_dirs(tmp_path_factory):
    """arch -> directory of a tiny model with its LM head (GPT-2 causal, BERT masked)."""
    return {arch: build_lm(arch, tmp_path_factory.mktemp(f"rlm-{arch}")) for arch in ("gpt2", "bert")}


def _batch(loaded, seed=0, B=2, N=12):
    """A seeded batch (B, N) and its labels: next-token for causal, a few masked positions for BERT."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, len(loaded.tokenizer) - 1, (B, N), generator=g)
    labels = ids.clone()
    if not loaded.info.causal:
        labels[torch.rand(B, N, generator=g) > 0.4] = -100
        labels[:, 1] = ids[:, 1]  # at least one scored token per row
        ids = ids.clone()
        ids[labels != -100] = loaded.tokenizer.mask_token_id
    return ids, labels


def _config(model_dir, steps=6, **train):
    return HFRunConfig.from_dict({
        "kind": "retrofit-hnas", "base": {"model": str(model_dir)}, "data": {"seq_len": 16},
        "train": {"steps": steps, "batch_size": 4, "lr": 0.2, "min_lr": 0.02, "warmup": 0, "eval_every": 3,
                  "eval_batches": 2, "log_every": 1, "save_every": 2, "keep_checkpoints": 1, **train}})


# ----------------------------------------------------------------------------------------------
# Math: the u-gradient, and the limits u -> 0 (the model's own attention) and u -> 1 (DNAS)
# ----------------------------------------------------------------------------------------------


def test_hybrid_weight_and_theta_are_inverse():
    assert theta_for(0.5) == 0.0
    u = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    theta = torch.tensor([theta_for(float(x)) for x in u], dtype=torch.float64)
    torch.testing.assert_close(hybrid_weight(theta), u)
    for bad in (0.0, 1.0, -0.2, True, "0.5"):
        with pytest.raises(ValueError, match="u0 must be a number in"):
            theta_for(bad)


def test_lm_loss_sum_shifts_causal_labels():
    logits = torch.randn(1, 4, 7, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[1, 2, 3, -100]])
    total, n = lm_loss_sum(logits, labels, causal=True)  # positions 0, 1 score labels 2, 3
    want = -(logits[0, 0].log_softmax(-1)[2] + logits[0, 1].log_softmax(-1)[3])
    assert n == 2 and torch.allclose(total, want)
    total, n = lm_loss_sum(logits, labels, causal=False)
    want = -sum(logits[0, t].log_softmax(-1)[labels[0, t]] for t in range(3))
    assert n == 3 and torch.allclose(total, want)


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_u_gradient_matches_central_finite_differences(lm_dirs, arch):
    """d(mean LM loss)/d theta by autograd against central differences, in float64, at a random theta."""
    loaded = hf.load_language_model(lm_dirs[arch])
    model = HNASRetrofit(loaded).double()
    with torch.no_grad():
        model.theta.copy_(torch.randn(model.theta.shape, generator=torch.Generator().manual_seed(1),
                                      dtype=torch.float64))
    ids, labels = _batch(loaded)

    def mean_loss():
        total, n = model(ids, labels)
        return total / n

    mean_loss().backward()
    grad = model.theta.grad.clone()  # (L, H)
    assert grad.abs().max() > 1e-6  # u matters: the check is not of zeros
    eps = 1e-5
    fd = torch.zeros_like(grad)
    with torch.no_grad():
        for idx in [(0, 0), (0, 3), (1, 1), (1, 2)]:
            model.theta[idx] += eps
            up = mean_loss()
            model.theta[idx] -= 2 * eps
            down = mean_loss()
            model.theta[idx] += eps
            fd[idx] = (up - down) / (2 * eps)
            torch.testing.assert_close(grad[idx], fd[idx], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_u_at_the_limits_is_the_model_and_dnas(lm_dirs, arch):
    """theta -> -inf (u = 0): the model's own loss (UNAS); theta -> +inf (u = 1): DNAS in every layer."""
    loaded = hf.load_language_model(lm_dirs[arch])
    model = HNASRetrofit(loaded)
    ids, labels = _batch(loaded, seed=2)
    with torch.no_grad():
        own, n = lm_loss_sum(loaded.model(input_ids=ids).logits, labels, loaded.info.causal)
        with swapped_layers(loaded.model, model.blocks, Swap("dnas")):
            dnas, _ = lm_loss_sum(loaded.model(input_ids=ids).logits, labels, loaded.info.causal)
        model.theta.fill_(-40.0)
        at_zero, n0 = model(ids, labels)
        model.theta.fill_(40.0)
        at_one, _ = model(ids, labels)
    assert n0 == n
    assert abs(float(at_zero - own)) / n < 1e-5
    assert abs(float(at_one - dnas)) / n < 1e-5
    assert abs(float(own - dnas)) / n > 1e-3  # the two limits differ: the test can fail


def test_only_theta_trains_unless_train_rest(lm_dirs):
    loaded = hf.load_language_model(lm_dirs["gpt2"])
    model = HNASRetrofit(loaded)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["theta"]
    assert model.hybrid_weights().shape == (2, 4) and (model.hybrid_weights() == 0.5).all()
    rest = HNASRetrofit(hf.load_language_model(lm_dirs["gpt2"]), u0=0.8, train_rest=True)
    assert len(rest.rest_parameters()) > 10
    torch.testing.assert_close(rest.hybrid_weights(), torch.full((2, 4), 0.8))


# ----------------------------------------------------------------------------------------------
# Training: the loss goes down, checkpoints hold theta only, resume is exact
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_training_lowers_the_loss_and_saves_theta_only(tmp_path, lm_dirs, arch):
    run = tmp_path / "run"
    result = train_hf(_config(lm_dirs[arch]), run, text=TEXT, progress=False)
    recs = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(7))
    evals = [r["eval_loss"] for r in recs if "eval_loss" in r]
    assert evals[-1] < evals[0]  # held-out loss after 6 steps below the start (u = 0.5)
    assert all(len(r["u"]) == 2 and len(r["u"][0]) == 4 for r in recs)  # (L, H), as attnlab train logs
    u, step = retrofit_hybrid_weights(run)
    assert step == 6 and not torch.allclose(u, torch.full_like(u, 0.5))
    torch.testing.assert_close(u.float(), torch.tensor(result.hybrid_weights))
    step_dir = run / json.loads((run / "latest.json").read_text())["dir"]
    from safetensors.torch import load_file

    assert set(load_file(step_dir / "weights.safetensors")) == {"theta"}  # the checkpoint is small
    meta = json.loads((step_dir / "hf_run.json").read_text())
    assert meta["base_model"] == str(Path(lm_dirs[arch]).resolve()) and meta["kind"] == "retrofit-hnas"
    again = load_retrofit(run)
    torch.testing.assert_close(again.hybrid_weights(), u.float())


def test_train_rest_saves_the_rest_too(tmp_path, lm_dirs):
    d = _config(lm_dirs["gpt2"], steps=2).to_dict()
    d["base"]["train_rest"] = True
    run = tmp_path / "rest"
    train_hf(HFRunConfig.from_dict(d), run, text=TEXT, progress=False)
    before = {n: p.clone() for n, p in hf.load_language_model(lm_dirs["gpt2"]).model.named_parameters()}
    model = load_retrofit(run)
    changed = [n for n, p in model.net.named_parameters() if not torch.equal(p, before[n])]
    assert changed  # the trained rest is in the checkpoint and loaded back


def test_stop_and_resume_give_the_straight_run(tmp_path, lm_dirs):
    """Stopped after step 3 (as a kill after a checkpoint) and resumed: the same theta and metrics, each
    step logged once."""
    config = _config(lm_dirs["bert"])
    train_hf(config, tmp_path / "straight", text=TEXT, progress=False)
    train_hf(config, tmp_path / "resumed", text=TEXT, progress=False, stop_after=3)
    with (tmp_path / "resumed" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "loss": 1.0}\n{"step": 5, "lo')  # lines written after the checkpoint, a torn one
    train_hf(config, tmp_path / "resumed", text=TEXT, progress=False, resume=True)
    a, b = (retrofit_hybrid_weights(tmp_path / r)[0] for r in ("straight", "resumed"))
    assert torch.equal(a, b)
    ra, rb = (read_metrics(tmp_path / r / "metrics.jsonl") for r in ("straight", "resumed"))
    assert [r["step"] for r in rb] == list(range(7))
    def rows(recs):
        return [(r["step"], r.get("eval_loss"), r["u"]) for r in recs]

    assert rows(ra) == rows(rb)


@pytest.mark.slow  # starts a process and SIGKILLs it (~10 s)
def test_sigkill_mid_run_then_resume(tmp_path, lm_dirs):
    steps = 40
    cfg = _config(lm_dirs["gpt2"], steps=steps, save_every=2, eval_every=20).to_dict()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    cfg["data"]["corpus"] = str(corpus)
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text(json.dumps(cfg))
    run = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "attnlab.train", "--config", str(cfg_file), "--out", str(run),
           "--no-progress"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            latest = run / "latest.json"
            if latest.is_file() and json.loads(latest.read_text())["step"] >= 4:
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
    assert 4 <= json.loads((run / "latest.json").read_text())["step"] < steps
    config = HFRunConfig.from_dict(cfg)
    train_hf(config, run, progress=False, resume=True)
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(steps + 1))
    train_hf(config, tmp_path / "straight", progress=False)
    assert torch.equal(retrofit_hybrid_weights(run)[0], retrofit_hybrid_weights(tmp_path / "straight")[0])


# ----------------------------------------------------------------------------------------------
# The masked-LM head recipe
# ----------------------------------------------------------------------------------------------


def test_mlm_head_trains_a_head_that_load_language_model_loads(tmp_path):
    base = build_tiny_model("bert", tmp_path / "base", seed=3)
    with pytest.raises(ValueError, match="no LM head"):
        hf.load_language_model(base)
    config = HFRunConfig.from_dict({
        "kind": "mlm-head", "base": {"model": str(base)}, "data": {"seq_len": 16},
        "train": {"steps": 8, "batch_size": 4, "lr": 0.1, "min_lr": 0.01, "warmup": 0, "eval_every": 8,
                  "eval_batches": 2, "log_every": 4, "save_every": 4}})
    run = tmp_path / "mlm"
    train_hf(config, run, text=TEXT, progress=False)
    recs = read_metrics(run / "metrics.jsonl")
    assert recs[-1]["eval_loss"] < recs[0]["eval_loss"] and all(r["u"] is None for r in recs)
    lm = hf.load_language_model(run / "model")  # the head is in the weights now
    encoder = hf.load_model(base).model
    for name, p in encoder.named_parameters():  # the encoder was frozen (the MLM model has no pooler)
        if not name.startswith("pooler."):
            assert torch.equal(p, lm.model.base_model.get_parameter(name)), name
    assert not list((run / "model").glob("*.bin"))  # safetensors only
    assert hf.language_model_loss(CORPUS[0], lm) > 0


# ----------------------------------------------------------------------------------------------
# Bad input: a worded error naming the argument
# ----------------------------------------------------------------------------------------------


def test_bad_input_gets_a_worded_error(tmp_path, lm_dirs, capsys):
    base = build_tiny_model("bert", tmp_path / "headless", seed=4)
    with pytest.raises(ValueError, match=r"--model .*no LM head.*mlm-head"):
        train_hf(_config(base), tmp_path / "a", text=TEXT, progress=False)
    with pytest.raises(ValueError, match=r"data.corpus .* is empty"):
        train_hf(_config(lm_dirs["gpt2"]), tmp_path / "b", text="  \n", progress=False)
    with pytest.raises(ValueError, match=r"data.corpus .* too small"):
        train_hf(_config(lm_dirs["gpt2"]), tmp_path / "c", text=CORPUS[0], progress=False)
    with pytest.raises(ValueError, match=r"--model \(base.model\) must be a model directory"):
        train_hf(_config(tmp_path / "nowhere"), tmp_path / "d", text=TEXT, progress=False)
    with pytest.raises(ValueError, match=r"base.u0 must be a number in \(0, 1\), got 1.5"):
        HFRunConfig.from_dict({"kind": "retrofit-hnas", "base": {"u0": 1.5}})
    with pytest.raises(ValueError, match=r"kind must be one of"):
        HFRunConfig.from_dict({"kind": "retrofit-gam"})
    with pytest.raises(ValueError, match=r"mlm-head.*encoder, but .* causal"):
        train_hf(HFRunConfig.from_dict({"kind": "mlm-head", "base": {"model": str(lm_dirs["gpt2"])}}),
                 tmp_path / "e", text=TEXT, progress=False)

    def cli(*args) -> str:
        capsys.readouterr()  # (model building's progress bars)
        assert main(["train", *args, "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("attnlab train: error: ") and len(err.strip().splitlines()) == 1
        return err

    err = cli("--recipe", "retrofit-nope", "--out", str(tmp_path / "f"))
    assert "--recipe: unknown recipe 'retrofit-nope'" in err
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert "empty.txt is empty" in cli("--recipe", "retrofit-hnas", "--model", str(lm_dirs["gpt2"]),
                                       "--corpus", str(empty), "--out", str(tmp_path / "g"))
    assert "--model is for the pretrained-model recipes" in cli("--recipe", "enc-hnas", "--model", "x",
                                                                 "--out", str(tmp_path / "h"))
    err = cli("--recipe", "retrofit-hnas", "--model", str(base), "--out", str(tmp_path / "i"))
    assert "no LM head" in err


def test_recipes_are_listed_apart(capsys):
    from attnlab.train import list_recipes

    assert {"retrofit-hnas", "mlm-head"} <= set(list_recipes(pretrained=True))
    assert not {"retrofit-hnas", "mlm-head"} & set(list_recipes())
    assert main(["train", "list"]) == 0
    out = capsys.readouterr().out
    assert "retrofit-hnas" in out and "enc-hnas" in out
    assert HFRunConfig.from_file(ROOT / "attnlab/recipes/retrofit-hnas.json").base.u0 == 0.5


# ----------------------------------------------------------------------------------------------
# The app's Hybrid weights page shows a retrofit run
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow  # the Streamlit page (~3 s)
def test_hybrid_weights_page_shows_a_retrofit_run(app_env, lm_dirs):  # noqa: F811 (the fixture)
    import numpy as np
    from test_app import charts, open_page, z_of

    run = app_env / "runs" / "retro"
    train_hf(_config(lm_dirs["gpt2"], steps=2), run, text=TEXT, progress=False)
    at = open_page("hybrid_weights")
    box = at.selectbox(key="hybrid_source")
    label = next(o for o in box.options if o.startswith("retro (retrofit"))
    assert label == "retro (retrofit, finished)"
    box.set_value(label).run()
    assert not at.exception, [e.message for e in at.exception]
    figs = charts(at)
    assert set(figs) == {"hybrid_u_curves", "hybrid_u_final"}
    u = retrofit_hybrid_weights(run)[0].numpy()
    np.testing.assert_allclose(z_of(figs["hybrid_u_final"]), u, rtol=1e-6)

    # an s2s-hnas run (HNAS in an encoder-decoder's encoder) is labelled as one, not as a retrofit
    s2s = app_env / "runs" / "sum"
    s2s.mkdir()
    (s2s / "recipe.json").write_text(json.dumps({"kind": "s2s-hnas", "name": "s2s-hnas"}))
    at = open_page("hybrid_weights")
    assert any(o.startswith("sum (seq2seq encoder, ") for o in at.selectbox(key="hybrid_source").options)


def test_a_shell_started_retrofit_run_counts_as_running_while_it_writes(tmp_path, lm_dirs, monkeypatch):
    sys.path.insert(0, str(ROOT / "app"))
    from appkit import runs

    monkeypatch.setenv("ATTNLAB_RUNS_DIR", str(tmp_path))
    train_hf(_config(lm_dirs["gpt2"], steps=4), tmp_path / "r", text=TEXT, progress=False, stop_after=2)
    assert [r.status for r in runs.recipe_runs()[0]] == ["running"]  # metrics written just now
    old = time.time() - 2 * runs.RECENT_S
    os.utime(tmp_path / "r" / "metrics.jsonl", (old, old))
    assert [r.status for r in runs.recipe_runs()[0]] == ["stopped"]


def test_u_by_layer_averages_heads_and_gives_a_t_interval_over_runs(tmp_path, lm_dirs):
    from scipy import stats

    from attnlab.train.retrofit import main as summary_main
    from attnlab.train.retrofit import u_by_layer

    runs = []
    for seed in (0, 1, 2):
        runs.append(tmp_path / f"s{seed}")
        train_hf(_config(lm_dirs["gpt2"], steps=2, seed=seed), runs[-1], text=TEXT, progress=False)
    rows = u_by_layer(runs)
    per_run = torch.stack([retrofit_hybrid_weights(r)[0].mean(-1) for r in runs])  # (3, L)
    assert [r["layer"] for r in rows] == [0, 1] and all(r["step"] == [2, 2, 2] for r in rows)
    for la, row in enumerate(rows):
        x = per_run[:, la]
        half = stats.t.ppf(0.975, 2) * float(x.std()) / 3**0.5
        assert row["mean"] == pytest.approx(float(x.mean()))
        assert row["ci_low"] == pytest.approx(float(x.mean()) - half)
        assert row["ci_high"] == pytest.approx(float(x.mean()) + half)
    assert u_by_layer(runs[:1])[0]["ci_low"] is None
    with pytest.raises(ValueError, match="at least one retrofit run"):
        u_by_layer([])
    assert summary_main([str(tmp_path / "nowhere")]) == 2


def test_held_out_losses_match_the_logged_eval_loss(tmp_path, lm_dirs):
    from attnlab.train.retrofit import held_out_losses

    run = tmp_path / "run"
    train_hf(_config(lm_dirs["bert"], steps=3), run, text=TEXT, progress=False)
    losses = held_out_losses(run, text=TEXT)
    recs = read_metrics(run / "metrics.jsonl")
    assert losses["u=0.5 (start)"] == pytest.approx(recs[0]["eval_loss"], rel=1e-6)
    assert losses["trained u"] == pytest.approx(recs[-1]["eval_loss"], rel=1e-6)
    assert losses["u=0 (model)"] != pytest.approx(losses["u=1 (DNAS)"], rel=1e-4)
