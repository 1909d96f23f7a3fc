"""attnlab train --recipe causal-lm (attnlab.train.causal_lm): a small GPT-2 trained from scratch with its
own softmax attention, saved as RUN/model for hf.load_language_model and the HNAS retrofit (issue 28
item 3 on a local causal LM). A tiny arch on a 2 KB text, offline, seeded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from attnlab import hf
from attnlab.cli import main
from attnlab.data import DataPosition, load_corpus
from attnlab.train.causal_lm import STEP_FILE, causal_lm_objective
from attnlab.train.checkpoint import read_latest
from attnlab.train.hf_data import HFWindows
from attnlab.train.hf_trainer import read_step
from attnlab.train.metrics import read_metrics
from attnlab.train.retrofit import retrofit_hybrid_weights, train_hf
from attnlab.train.retrofit_config import HFRunConfig

ROOT = Path(__file__).resolve().parent.parent
ARCH = {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_inner": 64, "vocab_size": 256}
TEXT = load_corpus("kjv", 2048)  # 2 KB: ~30 windows of 16 tokens


def _config(steps=8, **train) -> HFRunConfig:
    return HFRunConfig.from_dict({
        "kind": "causal-lm", "arch": ARCH, "data": {"corpus": "kjv", "max_chars": 2048, "seq_len": 16},
        "train": {"steps": steps, "batch_size": 4, "lr": 0.01, "min_lr": 0.001, "warmup": 0, "eval_every": 4,
                  "eval_batches": 1, "log_every": 1, "save_every": 2, "keep_checkpoints": 1, "threads": 1,
                  **train}})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A trained tiny run (8 steps)."""
    out = tmp_path_factory.mktemp("causal") / "run"
    train_hf(_config(), out, text=TEXT, progress=False)
    return out


def _model_tensors(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "model" / "model.safetensors")


# ----------------------------------------------------------------------------------------------
# The recipe and its worded errors
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("change, words", [
    ({"arch": {**ARCH, "n_layer": 0}}, "arch.n_layer must be an integer in [1, 64], got 0"),
    ({"arch": {**ARCH, "n_embd": 30, "n_head": 4}},
     "arch.n_embd must be a multiple of arch.n_head (4), got 30"),
    ({"arch": {**ARCH, "n_inner": 1.5}}, "arch.n_inner must be an integer in [1, 65536], got 1.5"),
    ({"arch": {**ARCH, "vocab_size": 10}}, "arch.vocab_size must be an integer in [64, 65536], got 10"),
    ({"arch": {**ARCH, "n_head": True}}, "arch.n_head must be an integer in [1, 128], got True"),
    ({"arch": {**ARCH, "d_model": 32}}, "unknown arch keys ['d_model']"),
    ({"arch": None}, "kind 'causal-lm' needs an arch section"),
    ({"base": {"model": "/somewhere"}}, "base.model must be null for kind 'causal-lm'"),
    ({"kind": "retrofit-hnas"}, "arch is for kind 's2s-hnas' or 'causal-lm'"),
    ({"data": {"seq_len": 2}}, "data.seq_len must be an integer in [4, 65536], got 2"),
])
def test_bad_settings_get_a_worded_error(change, words):
    d = _config().to_dict() | change
    with pytest.raises(ValueError) as e:
        HFRunConfig.from_dict(d)
    assert words in str(e.value)


def test_the_recipe_is_listed_and_valid(tmp_path, capsys):
    from attnlab.train.config import list_recipes, recipe_path

    config = HFRunConfig.from_file(recipe_path("causal-lm"))
    assert "causal-lm" in list_recipes(pretrained=True) and config.kind == "causal-lm"
    arch = config.arch
    assert (arch.n_layer, arch.n_embd, arch.n_head, arch.n_inner, arch.vocab_size) == (4, 256, 4, 1024, 4096)
    assert (config.data.seq_len, config.data.corpus, config.train.batch_size) == (128, "kjv+shakespeare", 16)
    assert "4,240,896 parameters" in config.description and "passes" in config.description
    assert main(["train", "--recipe", "causal-lm", "--model", str(tmp_path), "--out", str(tmp_path / "x"),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnlab train: error: base.model must be null for kind 'causal-lm'")


# ----------------------------------------------------------------------------------------------
# Training, the exported model, resume
# ----------------------------------------------------------------------------------------------


def test_training_lowers_the_held_out_loss_and_writes_model(run):
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(9)) and all(r["u"] is None for r in rows)
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert len(evals) == 3 and evals[-1] < evals[0] - 0.3  # from ~ln(V)
    assert json.loads((run / "model" / STEP_FILE).read_text())["step"] == 8
    assert not list((run / "model").glob("*.bin")) and not list(run.glob(".model.*"))
    step_dir = run / read_latest(run)["dir"]
    meta, tensors = read_step(step_dir)
    assert meta["kind"] == "causal-lm" and meta["causal"] and meta["n_layers"] == 2
    model = _model_tensors(run)  # RUN/model is the latest checkpoint's model
    assert {f"model.{k}" for k in model} == set(tensors)  # the tied output layer is stored once in both
    assert all(torch.equal(tensors[f"model.{k}"], v) for k, v in model.items())
    assert "model.transformer.h.0.attn.c_attn.weight" in tensors


def test_load_language_model_gives_the_trainers_own_loss(run):
    lm = hf.load_language_model(run / "model")
    assert lm.info.causal and lm.info.model_type == "gpt2" and lm.info.n_layers == 2
    config = HFRunConfig.from_file(run / "recipe.json")
    objective = causal_lm_objective(config, run, True, torch.device("cpu"), TEXT)
    objective.load_tensors(read_step(run / read_latest(run)["dir"])[1])
    data = HFWindows(lm.tokenizer, TEXT, seq_len=16, causal=True, vocab_size=len(lm.tokenizer))
    batch = data.batch(1, DataPosition(), 4)[0]
    with torch.no_grad():
        total, n = objective.loss(batch["input_ids"], batch["labels"])
        theirs = lm.model(batch["input_ids"], labels=batch["input_ids"]).loss
    assert n == 4 * 15 and abs(float(total) / n - float(theirs)) < 1e-5
    # the logged held-out loss of the last step is the exported model's loss on the held-out windows
    held = data.eval_batches(4, 1)[0]["input_ids"]
    with torch.no_grad():
        exported = float(lm.model(held, labels=held).loss)
    assert abs(read_metrics(run / "metrics.jsonl")[-1]["eval_loss"] - exported) < 1e-5


def test_stop_and_resume_give_the_straight_run(tmp_path, run):
    config = _config()
    train_hf(config, tmp_path / "resumed", text=TEXT, progress=False, stop_after=3)
    for leftover in (".model.tmp", ".model.old"):  # what a kill inside the model/ swap can leave
        (tmp_path / "resumed" / leftover).mkdir()
    train_hf(config, tmp_path / "resumed", text=TEXT, progress=False, resume=True)
    a, b = (load_file(r / "step-00000008" / "weights.safetensors") for r in (run, tmp_path / "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ma, mb = _model_tensors(run), _model_tensors(tmp_path / "resumed")
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
    ra, rb = (read_metrics(r / "metrics.jsonl") for r in (run, tmp_path / "resumed"))
    assert [(r["step"], r.get("loss"), r.get("eval_loss")) for r in ra] == \
        [(r["step"], r.get("loss"), r.get("eval_loss")) for r in rb]
    assert not list((tmp_path / "resumed").glob(".model.*"))
    with pytest.raises(ValueError, match="already holds a run .*; pass --resume"):
        train_hf(config, tmp_path / "resumed", text=TEXT, progress=False)
    with pytest.raises(ValueError, match="--resume: .* has no base-model/"):
        train_hf(config, tmp_path / "never", text=TEXT, progress=False, resume=True)


# ----------------------------------------------------------------------------------------------
# The point of it: the HNAS retrofit runs on the trained model
# ----------------------------------------------------------------------------------------------


def test_retrofit_hnas_runs_on_the_trained_model_and_moves_u(tmp_path, run):
    config = HFRunConfig.from_dict({
        "kind": "retrofit-hnas", "base": {"model": str(run / "model")}, "data": {"seq_len": 16},
        "train": {"steps": 2, "batch_size": 4, "lr": 0.2, "min_lr": 0.02, "warmup": 0, "eval_every": 2,
                  "eval_batches": 1, "log_every": 1, "save_every": 2, "threads": 1}})
    train_hf(config, tmp_path / "hnas", text=TEXT, progress=False)
    u, step = retrofit_hybrid_weights(tmp_path / "hnas")
    assert step == 2 and u.shape == (2, 2) and (u - 0.5).abs().max() > 1e-3
