"""Issue 30 item 12, the neuron view: a (query, key) pair's score as the sum of its per-dimension
products q_d k_d (times the scale), from the analysis' capture path
(attnlab.hf.analysis.query_key), and its figure (attnlab.figures.neuron_view).

The sum is the model's score: softmax over a row of the scores is the UNAS map hf.analyze gives
(1e-5), on an encoder (MiniLM), grouped-query causal LLaMA (key head = head // group), Gemma 2
(softcap, sliding windows) and a native attnlab checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ARCHITECTURES

from attnlab import hf
from attnlab.hf.analysis.query_key import check_query_key_vectors, layer_query_key

REPO = Path(__file__).resolve().parents[1]
TEXT = "The cat sat on the mat because it was tired, and the dog watched it."


def _model(name, tiny_model_dir, minilm):
    if name == "minilm":
        return minilm
    if name == "native":
        return hf.load_native(REPO / "checkpoints" / "enc-hnas")
    return hf.load_model(tiny_model_dir(name))


@pytest.mark.parametrize("name", ["minilm", "llama", "gemma2", "native"])
def test_sum_of_products_is_the_score_behind_the_unas_map(name, tiny_model_dir, minilm):
    model = _model(name, tiny_model_dir, minilm)
    result = hf.analyze(TEXT, model, variants=["unas"])
    window = result.windows[0]
    unas = window.weights["unas"]  # (L, H, N, N)
    L, H, N, _ = unas.shape
    for layer in range(L):
        qk = layer_query_key(model, window.window.input_ids, layer)
        assert qk.query.shape[:2] == (H, N)
        for head in range(H):
            s = qk.scores(head)  # (N, N)
            torch.testing.assert_close(torch.softmax(s, -1), unas[layer, head].float(), atol=1e-5, rtol=0)
            i = N - 1
            j = N // 3 if qk.mask is None else int(torch.nonzero(qk.mask[i])[0])  # a pair the mask allows
            total = float(qk.products(head, i, j).sum())
            raw = float((qk.query[head, i] @ qk.key_heads[qk.key_head(head), j]) * qk.scaling)
            assert total == pytest.approx(raw, abs=1e-5)
            capped = total if qk.softcap is None else qk.softcap * np.tanh(total / qk.softcap)
            assert capped == pytest.approx(float(s[i, j]), abs=1e-5)


def test_grouped_query_heads_read_their_key_head(tiny_model_dir):
    model = hf.load_model(tiny_model_dir("llama"))  # 4 query heads, 2 key/value heads
    ids = hf.analyze(TEXT, model, variants=["unas"]).windows[0].window.input_ids
    qk = layer_query_key(model, ids, 1)
    assert qk.key_heads.shape[0] == 2 and qk.group == 2
    assert [qk.key_head(h) for h in range(4)] == [0, 0, 1, 1]
    assert qk.mask is not None and not qk.mask[0, 1]  # causal: j <= i


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda qk: qk.products(0, 99, 0), "query must be an int in"),
        (lambda qk: qk.products(0, 0, -1), "key must be an int in"),
        (lambda qk: qk.products(12, 0, 0), "head must be an int in"),
    ],
)
def test_bad_positions_are_refused_by_name(minilm, call, message):
    qk = layer_query_key(minilm, minilm.tokenizer("a cat")["input_ids"], 0)
    with pytest.raises(ValueError, match=message):
        call(qk)


def test_bad_layer_and_gam_layer_are_refused(minilm):
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 6\)"):
        layer_query_key(minilm, [101, 102], 6)
    gam = hf.load_native(REPO / "checkpoints" / "enc-gam")
    layers = [i for i, b in enumerate(gam.model.blocks) if b.is_gam]
    with pytest.raises(ValueError, match="GAM layer"):
        layer_query_key(gam, gam.tokenizer("a cat sat")["input_ids"], layers[0])


@pytest.mark.parametrize("arch", [a.key for a in ARCHITECTURES if a.at_scores()])
def test_models_captured_at_the_score_level_are_refused_by_name(arch, tiny_model_dir):
    # their captured "query" is the score matrix (after the model's own biases) and their "key" an
    # identity: a neuron view of those would show meaningless vectors
    from attnlab.hf.capture.score_adapters import adapter_for

    model = hf.load_model(tiny_model_dir(arch))
    family = adapter_for(model.model).family
    ids = model.tokenizer("a cat sat")["input_ids"]
    message = rf"is a {family} model: .*after the model's own biases.*no query and key"
    for call in (lambda: layer_query_key(model, ids, 0), lambda: check_query_key_vectors(model)):
        with pytest.raises(ValueError, match=message):
            call()
    check_query_key_vectors(hf.load_model(tiny_model_dir("gpt2")))  # the AttentionInterface path: q and k
