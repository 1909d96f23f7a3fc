"""hf.language_model_loss: transformers' own LM losses reproduced, per-layer and per-head swaps against a
hand-swapped reference, the MLM mask rule, worded errors. Tiny models with LM heads built from configs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import CORPUS, build_tiny_model
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

import attnlab
from attnlab import hf
from attnlab.hf.beyond import lm_loss as ll

HEADS = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "bert": "BertForMaskedLM"}
TEXTS = [" ".join(CORPUS), CORPUS[1], CORPUS[3] + " " + CORPUS[0]]  # the first spans 2 windows of 64


def build_lm(arch: str, directory, seed: int = 0, scale: float = 1.0):
    """A tiny ``arch`` model with its LM head (conftest's config and tokenizer), every weight from
    N(0, scale^2): sharp predictions."""
    import transformers
    from transformers.utils import logging

    build_tiny_model(arch, directory, seed=seed)
    torch.manual_seed(seed)
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # the head is missing from the base model's weights: initialized here
    try:
        model = getattr(transformers, HEADS[arch]).from_pretrained(directory)
    finally:
        logging.set_verbosity(verbosity)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, scale)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def lms(tmp_path_factory):
    """arch -> LoadedModel with its LM head (GPT-2 and LLaMA causal, BERT masked)."""
    return {
        arch: hf.load_language_model(build_lm(arch, tmp_path_factory.mktemp(f"lm-{arch}"))) for arch in HEADS
    }


def _windows(loaded, texts, seed=0):
    """(text index, window index, inputs (1, N), labels (1, N), scored tokens) as lm_loss cuts them."""
    for i, text in enumerate(texts):
        for w, (ids, special) in enumerate(ll.text_windows(loaded.tokenizer, text, loaded.info.max_length)):
            inputs, labels = ll.lm_inputs(
                loaded, ids, special, causal=loaded.info.causal, seed=seed, text=i, window=w
            )
            n = len(ids) - 1 if loaded.info.causal else int((labels != -100).sum())
            yield inputs[None], labels[None], n


def _transformers_loss(loaded, texts, seed=0) -> float:
    """transformers' own model(ids, labels=...).loss per window, token-weighted."""
    total = count = 0
    with torch.no_grad():
        for inputs, labels, n in _windows(loaded, texts, seed):
            total += float(loaded.model(input_ids=inputs, labels=labels, use_cache=False).loss) * n
            count += n
    return total / count


def _hand_swapped_loss(loaded, texts, variant: str, layer: int, heads=None) -> float:
    """Layer ``layer``'s attention (``heads`` of it, all when None) replaced by attnlab.attend on the same
    q, k, v by a test-local attention function counting calls: no machinery of lm_loss involved."""
    L = loaded.info.n_layers
    calls = []

    def attention(module, q, k, v, mask, scaling=None, dropout=0.0, **kwargs):
        own, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=scaling, dropout=dropout, **kwargs)
        calls.append(1)
        if (len(calls) - 1) % L != layer:
            return own, None
        n_rep = q.shape[1] // k.shape[1]
        out = attnlab.attend(
            q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), variant, causal=loaded.info.causal, scale=scaling
        ).transpose(1, 2)  # (1, N, H, D)
        if heads is not None:
            own = own.clone()
            own[:, :, heads] = out[:, :, heads]
            out = own
        return out, None

    AttentionInterface.register("test_hand_swap", attention)
    AttentionMaskInterface.register("test_hand_swap", sdpa_mask)
    net = loaded.model
    previous = net.config._attn_implementation
    net.set_attn_implementation("test_hand_swap")
    try:
        return _transformers_loss(loaded, texts)
    finally:
        net.set_attn_implementation(previous)


@pytest.mark.parametrize("arch", list(HEADS))
def test_equals_transformers_own_loss_unswapped_and_with_unas(lms, arch):
    loaded = lms[arch]
    expected = _transformers_loss(loaded, TEXTS)
    assert 1.0 < expected < 100.0 and np.isfinite(expected)
    assert hf.language_model_loss(TEXTS, loaded) == pytest.approx(expected, abs=1e-4)
    assert hf.language_model_loss(TEXTS, loaded, "unas") == pytest.approx(expected, abs=1e-4)
    assert hf.language_model_loss(TEXTS, loaded, "unas", layers=[1], heads=[0, 2]) == pytest.approx(
        expected, abs=1e-4
    )


@pytest.mark.parametrize("arch", ["gpt2", pytest.param("llama", marks=pytest.mark.slow), "bert"])
def test_layer_and_head_swaps_equal_a_hand_swapped_model(lms, arch):
    loaded = lms[arch]
    for layer in range(loaded.info.n_layers):
        got = hf.language_model_loss(TEXTS, loaded, "dnas", layers=[layer])
        assert got == pytest.approx(_hand_swapped_loss(loaded, TEXTS, "dnas", layer), abs=1e-4)
    one_head = hf.language_model_loss(TEXTS, loaded, "dnas", layers=1, heads=[2])
    assert one_head == pytest.approx(_hand_swapped_loss(loaded, TEXTS, "dnas", 1, heads=[2]), abs=1e-4)
    every_head = hf.language_model_loss(TEXTS, loaded, "dnas", layers=[1], heads=range(loaded.info.n_heads))
    assert every_head == pytest.approx(hf.language_model_loss(TEXTS, loaded, "dnas", layers=[1]), abs=1e-6)
    base = hf.language_model_loss(TEXTS, loaded)
    assert abs(hf.language_model_loss(TEXTS, loaded, "dnas") - base) > 1e-3  # the swap matters here


def test_all_layers_equal_use_variant_with_parameters(lms):
    loaded = lms["llama"]
    with hf.use_variant(loaded.model, "hnas", u=0.3):
        expected = _transformers_loss(loaded, TEXTS)
    assert hf.language_model_loss(TEXTS, loaded, "hnas", u=0.3) == pytest.approx(expected, abs=1e-4)
    u = torch.tensor([[0.0, 0.2, 0.9, 1.0], [0.5, 0.1, 0.7, 0.3]])  # (L, H): one u per layer and head
    with hf.use_variant(loaded.model, "hnas", u=u):
        expected = _transformers_loss(loaded, TEXTS)
    assert hf.language_model_loss(TEXTS, loaded, "hnas", u=u) == pytest.approx(expected, abs=1e-4)
    assert loaded.model.config._attn_implementation == "sdpa"  # restored


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_cached_blocks_below_the_swap_change_nothing(lms, arch):
    """window_losses: swaps after the unswapped forward reuse its block outputs, exactly."""
    loaded = lms[arch]
    ids, special = ll.text_windows(loaded.tokenizer, TEXTS[0], 64)[0]
    swaps = [
        ll.check_swap(loaded.info, v, lay) for v, lay in ((None, None), ("dnas", 1), ("sinkhorn", [0, 1]))
    ]
    cached = ll.window_losses(loaded, ids, special, swaps, seed=3)
    for swap, got in zip(swaps, cached, strict=True):
        (alone,) = ll.window_losses(loaded, ids, special, [swap], seed=3)
        np.testing.assert_array_equal(got.positions, alone.positions)
        np.testing.assert_allclose(got.losses, alone.losses, atol=1e-6)


def test_mask_rule_is_berts_and_seeded():
    ids = np.arange(1000, 3000, dtype=np.int64)
    special = np.zeros(len(ids), bool)
    special[[0, -1]] = True

    def draw(seed):
        return ll.mask_tokens(
            ids, special, np.random.Generator(np.random.PCG64(seed)), mask_id=7, vocab_size=50
        )

    inputs, labels = draw(0)
    scored = labels != -100
    assert not scored[special].any() and (labels[scored] == ids[scored]).all()
    assert 0.13 < scored.mean() < 0.17  # 15 % of 2000 tokens
    masked = (inputs == 7) & scored
    rand = scored & (inputs < 50) & ~masked
    assert 0.75 < masked.sum() / scored.sum() < 0.85 and 0.05 < rand.sum() / scored.sum() < 0.15
    assert (inputs[~scored] == ids[~scored]).all()
    again, labels2 = draw(0)
    assert (again == inputs).all() and (labels2 == labels).all()
    assert not (draw(1)[1] == labels).all()
    short = ll.mask_tokens(
        ids[:3],
        np.array([True, False, True]),
        np.random.Generator(np.random.PCG64(0)),
        mask_id=7,
        vocab_size=50,
        rate=1e-9,
    )
    assert (short[1] != -100).sum() == 1  # at least one scored token per window


def test_bad_inputs_are_worded(lms, tiny_model_dir):
    gpt2 = lms["gpt2"]
    with pytest.raises(ValueError, match="no LM head.*supported heads: causal"):
        hf.load_language_model(None)  # MiniLM ships without its MLM head
    with pytest.raises(ValueError, match="no LM head.*supported heads"):
        hf.load_language_model(tiny_model_dir("llama"))  # saved without its (untied) LM head
    with pytest.raises(ValueError, match="loaded without an LM head.*supported heads"):
        hf.language_model_loss(TEXTS, hf.load_model(tiny_model_dir("bert")))
    with pytest.raises(ValueError, match=r"layers must be .* in \[0, 1\] \(the model has 2\), got \[2\]"):
        hf.language_model_loss(TEXTS, gpt2, "dnas", layers=[2])
    with pytest.raises(ValueError, match=r"heads must be .* in \[0, 3\]"):
        hf.language_model_loss(TEXTS, gpt2, "dnas", heads=[-1])
    with pytest.raises(ValueError, match="variant must be one of"):
        hf.language_model_loss(TEXTS, gpt2, "softmax")
    with pytest.raises(ValueError, match="need a variant"):
        hf.language_model_loss(TEXTS, gpt2, layers=[0])
    with pytest.raises(ValueError, match="texts must be a text or a non-empty sequence"):
        hf.language_model_loss([], gpt2)
    with pytest.raises(ValueError, match=r"texts\[1\] is empty"):
        hf.language_model_loss(["A text.", "  "], gpt2)
    with pytest.raises(ValueError, match=r"u must be a number in \[0, 1\]"):
        hf.language_model_loss(TEXTS, gpt2, "hnas", u=2.0)
    with pytest.raises(ValueError, match=r"window must be an integer in \[1, 64\]"):
        hf.language_model_loss(TEXTS, gpt2, window=65)
