"""HNAS in the encoder of an encoder-decoder (attnlab train --recipe s2s-hnas; issue 29 item 3): a tiny
random BART built by the recipe, lead-summary pairs, the encoder-only swap, training, resume, errors.
Offline, seeded, small."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from attnlab.data import DataPosition, load_corpus
from attnlab.hf.beyond.layer_swap import LAYER_SWAP
from attnlab.train.metrics import read_metrics
from attnlab.train.retrofit import retrofit_hybrid_weights, train_hf
from attnlab.train.retrofit_config import HFRunConfig
from attnlab.train.seq2seq_data import IGNORE, LeadSummaries, lead_pairs, passage_starts
from attnlab.train.seq2seq_hnas import EncoderHNAS, build_tiny_bart, load_seq2seq_lm, u_report

ROOT = Path(__file__).resolve().parent.parent
ARCH = {"encoder_layers": 3, "decoder_layers": 1, "d_model": 32, "heads": 2, "ffn_dim": 64, "vocab_size": 400}


@pytest.fixture(scope="module")
def text():
    return load_corpus("kjv", 40_000)  # ~10k tokens: a few hundred pairs of 24 tokens


@pytest.fixture(scope="module")
def bart(tmp_path_factory, text):
    """A tiny random BART with the corpus's WordPiece vocabulary, as the recipe builds it."""
    from attnlab.train.retrofit_config import Seq2SeqArch

    directory = build_tiny_bart(Seq2SeqArch(**ARCH), text, tmp_path_factory.mktemp("bart"), max_len=24,
                                seed=0)
    loaded = load_seq2seq_lm(directory)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # weights of a trained scale: at BART's init (std 0.02) every attention is
        for p in loaded.model.parameters():  # nearly uniform, and u would not change the loss
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
    return loaded


def _config(steps=6, **train) -> HFRunConfig:
    return HFRunConfig.from_dict({
        "kind": "s2s-hnas", "base": {"model": None, "train_rest": True, "rest_lr": 0.01}, "arch": ARCH,
        "data": {"corpus": "kjv", "max_chars": 40_000, "seq_len": 24, "target_len": 6},
        "train": {"steps": steps, "batch_size": 8, "lr": 0.05, "min_lr": 0.005, "warmup": 0, "eval_every": 3,
                  "eval_batches": 2, "log_every": 1, "save_every": 2, "keep_checkpoints": 1, "threads": 1,
                  **train}})


def _batch(bart, text, B=4):
    data = LeadSummaries(bart.tokenizer, text, seq_len=24, target_len=6, seed=0)
    return data.batch(1, DataPosition(), B)[0]


# ----------------------------------------------------------------------------------------------
# The pairs: passages and their lead sentence
# ----------------------------------------------------------------------------------------------


def test_lead_is_the_first_sentence_cut_at_target_len():
    lines = ["BRUTUS.", "Go home. Then come", "back soon", "[Exeunt.]", "And so it was and it was so."]
    ids = [[9], [10, 11, 1, 12, 13], [14, 15], [16], [20, 21, 22, 23, 24, 25, 26, 27, 1]]
    passages, leads = lead_pairs(lines, ids, content=6, target_len=4, ends={1})
    # "BRUTUS." and "[Exeunt.]" start no passage; the second passage starts after the cut line
    assert passages == [[10, 11, 1, 12, 13, 14], [20, 21, 22, 23, 24, 25]]
    assert leads == [[10, 11, 1], [20, 21, 22, 23]]  # up to the first '.', else cut at target_len
    assert not passage_starts("SIR ANDREW.") and passage_starts("Sir Andrew, come.")


def test_pairs_have_fixed_sources_and_bracketed_leads(bart, text):
    data = LeadSummaries(bart.tokenizer, text, seq_len=24, target_len=6, seed=0)
    tok = bart.tokenizer
    assert data.windows.shape[1] == 24 and len(data.eval_rows) >= 1 and data.n_train >= 100
    assert (data.windows[:, 0] == tok.cls_token_id).all() and (data.windows[:, -1] == tok.sep_token_id).all()
    for row in range(20):
        lab = data.labels[row][data.labels[row] != IGNORE]
        assert lab[0] == tok.cls_token_id and lab[-1] == tok.sep_token_id and 3 <= len(lab) <= 8
        assert torch.equal(lab[1:-1], data.windows[row, 1 : len(lab) - 1])  # the passage's own start
    a, pos = data.batch(5, DataPosition(), 8)
    assert torch.equal(a["input_ids"], data.batch(5, DataPosition(), 8)[0]["input_ids"])  # pure function
    assert pos == DataPosition(0, 8)


# ----------------------------------------------------------------------------------------------
# The model: HNAS in the encoder only; u = 0 is the model itself; the u-gradient
# ----------------------------------------------------------------------------------------------


def test_encoder_self_attention_is_hnas_and_the_decoder_is_not(bart, text):
    model = EncoderHNAS(bart)
    assert model.theta.shape == (3, 2)
    seen = []
    swap = ALL_ATTENTION_FUNCTIONS[LAYER_SWAP]

    def recording(module, *args, **kwargs):
        seen.append(module)
        return swap(module, *args, **kwargs)

    AttentionInterface.register(LAYER_SWAP, recording)
    try:
        b = _batch(bart, text)
        model(b["input_ids"], b["labels"])
    finally:
        AttentionInterface.register(LAYER_SWAP, swap)
    net = bart.model.model
    assert seen == [layer.self_attn for layer in net.encoder.layers]
    decoder = {id(m) for layer in net.decoder.layers for m in (layer.self_attn, layer.encoder_attn)}
    assert not decoder & {id(m) for m in seen}
    assert all(m.config._attn_implementation != LAYER_SWAP for m in bart.model.modules()
               if getattr(m, "config", None) is not None)  # restored after the forward


def test_u_zero_is_the_unwrapped_models_own_loss(bart, text):
    model = EncoderHNAS(bart)
    b = _batch(bart, text)
    with torch.no_grad():
        total, n = model(b["input_ids"], b["labels"], u=torch.zeros(3, 2))
        own = bart.model(input_ids=b["input_ids"], labels=b["labels"]).loss
        half, _ = model(b["input_ids"], b["labels"])  # u = 0.5: not the model's own attention
    assert n == int((b["labels"] != IGNORE).sum())
    assert abs(float(total) / n - float(own)) < 1e-5
    assert abs(float(half) / n - float(own)) > 1e-4


def test_u_gradient_matches_central_finite_differences(bart, text):
    """d(mean loss)/d theta by autograd against central differences, float64, at a random theta."""
    model = EncoderHNAS(bart).double()
    b = _batch(bart, text, B=2)
    with torch.no_grad():
        model.theta.copy_(torch.randn(3, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64))

    def mean_loss():
        total, n = model(b["input_ids"], b["labels"])
        return total / n

    mean_loss().backward()
    grad, eps = model.theta.grad.clone(), 1e-6
    numeric = torch.zeros_like(grad)
    with torch.no_grad():
        for idx in [(0, 0), (1, 1), (2, 0), (2, 1)]:
            model.theta[idx] += eps
            up = float(mean_loss())
            model.theta[idx] -= 2 * eps
            down = float(mean_loss())
            model.theta[idx] += eps
            numeric[idx] = (up - down) / (2 * eps)
            assert abs(float(grad[idx]) - float(numeric[idx])) <= 1e-6 + 1e-4 * abs(float(numeric[idx]))
    assert grad.abs().max() > 1e-6  # a gradient that could be wrong
    bart.model.float()


# ----------------------------------------------------------------------------------------------
# Training through attnlab train's HF loop: u moves, the loss drops, resume is exact
# ----------------------------------------------------------------------------------------------


def test_training_moves_u_and_lowers_the_loss(tmp_path):
    run = tmp_path / "run"
    result = train_hf(_config(steps=8), run, progress=False)
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(9))
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert evals[-1] < evals[0] - 0.5  # from ln(V) ~ 6 down
    u, step = retrofit_hybrid_weights(run)
    assert step == 8 and u.shape == (3, 2) and (u - 0.5).abs().max() > 1e-3
    assert torch.allclose(u.float(), torch.tensor(result.hybrid_weights))
    step_dir = run / json.loads((run / "latest.json").read_text())["dir"]
    names = set(load_file(step_dir / "weights.safetensors"))
    assert "theta" in names and "rest.model.encoder.layers.0.self_attn.q_proj.weight" in names
    exported = load_seq2seq_lm(run / "model")  # the trained model loads as an encoder-decoder
    assert exported.info.encoder_decoder and exported.info.n_layers == 3
    assert json.loads((run / "model" / "hnas_u.json").read_text())["u"] == result.hybrid_weights
    report = u_report([run])
    assert len(report["u_per_layer"]["layers"]) == 3 and report["step"] == {str(run): 8}


def test_stop_and_resume_give_the_straight_run(tmp_path):
    config = _config(steps=6)
    train_hf(config, tmp_path / "straight", progress=False)
    train_hf(config, tmp_path / "resumed", progress=False, stop_after=3)
    train_hf(config, tmp_path / "resumed", progress=False, resume=True)
    a, b = (load_file(tmp_path / r / "step-00000006" / "weights.safetensors")
            for r in ("straight", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = (read_metrics(tmp_path / r / "metrics.jsonl") for r in ("straight", "resumed"))
    assert [(r["step"], r.get("loss"), r.get("eval_loss"), r["u"]) for r in ra] == \
        [(r["step"], r.get("loss"), r.get("eval_loss"), r["u"]) for r in rb]


# ----------------------------------------------------------------------------------------------
# Errors in words
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("change, words", [
    ({"arch": {**ARCH, "d_model": 30, "heads": 4}}, "arch.d_model must be a multiple of arch.heads"),
    ({"arch": None}, "needs base.model (an encoder-decoder directory) or an arch section"),
    ({"base": {"train_rest": False}}, "base.train_rest must be true for kind 's2s-hnas' built from scratch"),
    ({"kind": "retrofit-hnas"}, "arch is for kind 's2s-hnas'"),
    ({"data": {"target_len": 0}}, "data.target_len must be an integer in [1, 1024], got 0"),
    ({"arch": {**ARCH, "encoder_layers": 0}}, "arch.encoder_layers must be an integer in [1, 64], got 0"),
    ({"arch": {**ARCH, "layers": 4}}, "unknown arch keys ['layers']"),
])
def test_bad_settings_get_a_worded_error(change, words):
    d = _config().to_dict() | change
    with pytest.raises(ValueError) as e:
        HFRunConfig.from_dict(d)
    assert words in str(e.value)


def test_bad_models_and_runs_get_a_worded_error(tmp_path, bart, text):
    with pytest.raises(ValueError, match="must leave room for at least 1 text token"):
        LeadSummaries(bart.tokenizer, text, seq_len=2, target_len=4)
    with pytest.raises(ValueError, match="--resume: .* has no base-model/"):
        train_hf(_config(), tmp_path / "never", progress=False, resume=True)
    train_hf(_config(steps=1), tmp_path / "once", progress=False)
    with pytest.raises(ValueError, match="already holds a run .*; pass --resume"):
        train_hf(_config(steps=1), tmp_path / "once", progress=False)


def test_the_recipe_is_listed_and_valid():
    from attnlab.train.config import list_recipes

    config = HFRunConfig.from_file(ROOT / "attnlab/recipes/s2s-hnas.json")
    assert "s2s-hnas" in list_recipes(pretrained=True) and config.kind == "s2s-hnas"
    assert config.arch.encoder_layers >= 3 and config.base.train_rest and config.train.steps >= 2000
