"""attnlab.hf: loading local checkpoints, variants inside HF models, recompute/swap analysis, windows.

Real-model checks run on the embedded MiniLM-L6 (offline); architecture coverage uses tiny random
models built from configs (conftest.py). Everything is seeded and offline.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import CAUSAL_ARCHS, CORPUS, TINY_ARCHS, TINY_POSITIONS, build_tiny_model
from transformers import AttentionInterface, AttentionMaskInterface

from attnlab import DEFAULT_VARIANTS, VARIANTS, attention_weights, hf, variant_specs
from attnlab.hf.compute.weights import _POOL, _variants_unmasked

# the variants attnlab.hf's fused analysis computes (the others take the generic materialized path)
KERNEL = tuple(s.name for s in variant_specs() if s.hf_kernel)

TEXTS = ("The quick brown fox jumps over the lazy dog.", "Attention that does not explain away.")


def _padded(tokenizer, texts):
    enc = tokenizer(list(texts), padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def _valid_block(w: torch.Tensor, n: int) -> torch.Tensor:
    """(..., N, N) -> (..., n, n): the rows and columns of the first n (real) tokens."""
    return w[..., :n, :n]


@pytest.fixture(scope="module")
def batch(minilm):
    ids, mask = _padded(minilm.tokenizer, TEXTS)
    assert mask[1].sum() < mask.shape[1]  # the second text is padded
    return ids, mask


# ----------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------


def test_every_variant_is_registered_with_a_mask_function():
    for variant in VARIANTS:
        name = f"attnlab_{variant}"
        assert name in AttentionInterface._global_mapping
        assert name in AttentionMaskInterface._global_mapping  # without it padding would be ignored
    assert hf.CAPTURE in AttentionInterface._global_mapping
    assert hf.implementation_name("dnas") == "attnlab_dnas"
    with pytest.raises(ValueError, match="variant"):
        hf.implementation_name("softmax")


def test_use_variant_restores_the_implementation_even_on_error(minilm):
    model = minilm.model
    before = model.config._attn_implementation
    with pytest.raises(RuntimeError, match="boom"), hf.use_variant(model, "dnas"):
        assert model.config._attn_implementation == "attnlab_dnas"
        raise RuntimeError("boom")
    assert model.config._attn_implementation == before


def test_capture_stops_the_forward_after_the_last_layer_asked_for(minilm):
    ids = torch.tensor([minilm.tokenizer(TEXTS[0])["input_ids"]])
    ran = []
    hook = minilm.model.encoder.layer[2].output.register_forward_hook(lambda *_: ran.append(True))
    try:
        with torch.no_grad():
            with hf.capture_qk(minilm.model, stop_after=2) as first_two:
                minilm.model(input_ids=ids)
                ran.append("after the forward")  # skipped: the forward ended early
            with hf.capture_qk(minilm.model) as every:
                minilm.model(input_ids=ids)
    finally:
        hook.remove()
    assert len(first_two) == 2 and len(every) == 6
    assert ran == [True]  # layer 2's feed-forward ran in the full forward only
    for a, b in zip(first_two, every[:2], strict=True):
        assert torch.equal(a.query, b.query) and torch.equal(a.key, b.key)
    assert minilm.model.config._attn_implementation != hf.CAPTURE  # restored


def test_load_model_caches_one_copy_per_directory(minilm):
    assert hf.load_model(None) is minilm
    assert hf.load_model(hf.default_model_path()) is minilm  # the same directory, named differently
    info = minilm.info
    assert (info.n_layers, info.n_heads, info.max_length, info.causal) == (6, 12, 512, False)


# ----------------------------------------------------------------------------------------------
# MiniLM: recompute and swap against the model's own attention
# ----------------------------------------------------------------------------------------------


def test_recompute_unas_equals_eager_output_attentions_on_padded_batch(minilm, batch):
    ids, mask = batch
    weights = hf.batch_weights(minilm, ids, mask, variants=("unas",))["unas"]  # (L, B, H, N, N)
    model = minilm.model
    with minilm.lock, torch.no_grad():
        before = model.config._attn_implementation
        model.set_attn_implementation("eager")
        try:
            eager = torch.stack(model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions)
        finally:
            model.set_attn_implementation(before)
    for b in range(ids.shape[0]):
        n = int(mask[b].sum())
        torch.testing.assert_close(
            _valid_block(weights[:, b], n), _valid_block(eager[:, b], n), atol=1e-5, rtol=0
        )


def test_swap_unas_reproduces_the_stock_hidden_states(minilm, batch):
    ids, mask = batch
    with torch.no_grad():
        stock = minilm.model(input_ids=ids, attention_mask=mask).last_hidden_state
        with hf.use_variant(minilm.model, "unas"):
            swapped = minilm.model(input_ids=ids, attention_mask=mask).last_hidden_state
    valid = mask.bool()
    torch.testing.assert_close(swapped[valid], stock[valid], atol=1e-5, rtol=1e-5)


def test_swap_with_output_attentions_returns_the_variant_weights(minilm, batch):
    """Layer 0 sees the same input in both modes, so its weights agree for every variant."""
    ids, mask = batch
    recompute = hf.batch_weights(minilm, ids, mask, variants=VARIANTS, mode="recompute")
    for variant in VARIANTS:
        with hf.use_variant(minilm.model, variant, iters=3), torch.no_grad():
            out = minilm.model(input_ids=ids, attention_mask=mask, output_attentions=True)
        assert len(out.attentions) == 6
        assert all(a.shape == (ids.shape[0], 12, ids.shape[1], ids.shape[1]) for a in out.attentions)
        for b in range(ids.shape[0]):
            n = int(mask[b].sum())
            torch.testing.assert_close(
                _valid_block(out.attentions[0][b], n),
                _valid_block(recompute[variant][0, b], n),
                atol=1e-5,
                rtol=0,
            )


@pytest.mark.parametrize("mode", hf.MODES)
def test_padded_batch_gives_each_text_its_own_weights(minilm, batch, mode):
    """Padding is respected (this fails without the mask function): batch == each text alone."""
    ids, mask = batch
    together = hf.batch_weights(minilm, ids, mask, mode=mode)
    for b in range(ids.shape[0]):
        n = int(mask[b].sum())
        alone = hf.batch_weights(minilm, ids[b : b + 1, :n], None, mode=mode)
        for variant in DEFAULT_VARIANTS:
            w = together[variant][:, b]  # (L, H, N, N)
            torch.testing.assert_close(_valid_block(w, n), alone[variant][:, 0], atol=2e-5, rtol=0)
            assert w[..., n:, :].abs().sum() == 0 and w[..., :, n:].abs().sum() == 0  # padding gets nothing


def test_dnas_column_mass_bound_on_real_text(minilm, english_text):
    result = hf.analyze(english_text, minilm)
    n = len(result.tokens)
    mass = {v: w.sum(-2) for v, w in result.weights.items()}  # (L, H, N) column mass
    assert result.weights["dnas"].shape == (6, 12, n, n)
    assert bool((mass["dnas"] >= (1.0 / n) * (1 - 1e-4)).all())  # every layer, head and key
    assert bool((mass["hnas"] >= (0.5 / n) * (1 - 1e-4)).all())
    assert bool((mass["unas"] < 1.0 / n).any())  # softmax does explain keys away
    for w in result.weights.values():
        torch.testing.assert_close(w.sum(-1), torch.ones(6, 12, n), atol=1e-5, rtol=0)


@pytest.mark.parametrize("spread", ["narrow", "wide", "mixed"])  # wide: scores span > LINEAR_SPAN_MAX
def test_unmasked_fast_path_equals_attention_weights(spread):
    torch.manual_seed(0)
    L, B, H, N, D = 2, 2, 3, 17, 8
    q, k = torch.randn(L, B, H, N, D) * 2, torch.randn(L, B, H, N, D) * 2
    if spread != "narrow":
        q[:, 1 if spread == "mixed" else slice(None), 1 if spread == "mixed" else slice(None)] *= 6
    scale = [D**-0.5, 0.3]
    u = torch.rand(L, 1, H, 1, 1)
    for iters in (1, 2, 4):
        for variants in (KERNEL, ("sinkhorn",), ("hnas",)):
            fast = _variants_unmasked(q, k, scale, variants, u, iters)
            for layer in range(L):
                s = q[layer] @ k[layer].transpose(-1, -2) * scale[layer]
                for variant in variants:
                    it = iters if variant == "sinkhorn" else None
                    ref = attention_weights(s, variant, u=u[layer], iters=it)
                    torch.testing.assert_close(fast[variant][layer], ref, atol=1e-5, rtol=0)


def test_hnas_u_per_layer_and_head(minilm):
    ids = torch.tensor([minilm.tokenizer(TEXTS[0])["input_ids"]])
    u = torch.rand(6, 12, generator=torch.Generator().manual_seed(0))
    for mode in hf.MODES:
        w = hf.batch_weights(minilm, ids, variants=("unas", "dnas", "hnas"), mode=mode, u=u)
        if mode == "recompute":  # swap mode: layers > 0 see different inputs per variant
            expected = torch.lerp(w["unas"], w["dnas"], u[:, None, :, None, None])
            torch.testing.assert_close(w["hnas"], expected, atol=1e-6, rtol=0)
        else:
            torch.testing.assert_close(
                w["hnas"][0],
                torch.lerp(w["unas"][0], w["dnas"][0], u[0][None, :, None, None]),
                atol=1e-5,
                rtol=0,
            )


# ----------------------------------------------------------------------------------------------
# Long texts: windows
# ----------------------------------------------------------------------------------------------


def test_long_text_is_split_into_overlapping_windows(tiny_model_dir):
    loaded = hf.load_model(tiny_model_dir("bert"))
    text = " ".join(CORPUS * 6)
    n_text = len(loaded.tokenizer(text, add_special_tokens=False)["input_ids"])
    stream = hf.stream_analysis(text, loaded, variants=("unas", "dnas"), overlap=10)
    wd = stream.windowing
    assert (wd.window, wd.content, wd.overlap, wd.stride) == (TINY_POSITIONS, TINY_POSITIONS - 2, 10, 52)
    assert wd.n_tokens == n_text and wd.n_windows == len(wd.starts) > 2
    result = stream.collect()
    assert result.n_windows == wd.n_windows
    assert result.windows[-1].window.stop == n_text  # the last window ends at the last token
    for prev, cur in zip(result.windows, result.windows[1:], strict=False):
        assert cur.window.start - prev.window.start <= wd.stride  # consecutive windows overlap
        shared = prev.window.stop - cur.window.start
        assert shared >= wd.overlap
        assert prev.window.input_ids[-1 - shared : -1] == cur.window.input_ids[1 : 1 + shared]
    for w in result.windows:
        assert w.weights["dnas"].shape == (2, 4, TINY_POSITIONS, TINY_POSITIONS)
        assert w.tokens[0] == "[CLS]" and w.tokens[-1] == "[SEP]"
    expected = loaded.tokenizer.convert_ids_to_tokens(
        loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    )
    assert result.tokens == expected  # the text's tokens, each once
    assert len(result.word_ids) == len(expected)
    with pytest.raises(ValueError, match="windows"):
        result.weights  # noqa: B018


def test_stream_is_lazy_and_single_window_text_has_flat_surface(minilm):
    stream = hf.stream_analysis(TEXTS[0], minilm, variants=("dnas",))
    assert len(stream) == 1
    it = iter(stream)
    first = next(it)
    assert first.weights["dnas"].shape[-1] == len(first.tokens)
    result = stream.collect()
    assert result.tokens[0] == "[CLS]" and result.tokens[-1] == "[SEP]"
    assert result.special.tolist() == [True] + [False] * (len(result.tokens) - 2) + [True]
    assert result.word_ids[0] is None and result.word_ids[1] == 0
    assert result.windows[0].punctuation[-2]  # the final "."


def test_table_has_a_row_per_variant_layer_head_statistic(minilm):
    result = hf.analyze(TEXTS[1], minilm, variants=("unas", "dnas"))
    table = result.table()
    assert {"variant", "layer", "head", "statistic", "value", "window"} <= set(table.columns)
    assert set(table["variant"]) == {"unas", "dnas"} and table["layer"].nunique() == 6
    bound = table[(table.variant == "dnas") & (table.statistic == "column_mass_min_over_bound")]
    assert len(bound) == 6 * 12 and bool((bound.value >= 1 - 1e-4).all())
    summary = result.summary()
    assert {"value", "std", "n_windows"} <= set(summary.columns)


# ----------------------------------------------------------------------------------------------
# Tiny random models of every supported architecture
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("layout", "fields", "kv"), [
    ("multi-query", dict(multi_query=True), 1),  # the tiny Falcon's (its config says num_kv_heads=4)
    ("grouped", dict(new_decoder_architecture=True, num_kv_heads=2), 2),
    ("per head", dict(multi_query=False), 4),
])
def test_falcon_key_value_heads_follow_its_layout(tmp_path, tiny_model_dir, layout, fields, kv):
    from conftest import TINY_CONFIGS
    from transformers import AutoModel, AutoTokenizer, FalconConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir("falcon"))
    torch.manual_seed(0)
    config = FalconConfig(vocab_size=len(tokenizer), **{**TINY_CONFIGS["falcon"][1], **fields})
    AutoModel.from_config(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    info = hf.load_model(tmp_path).info
    assert (info.n_heads, info.n_kv_heads) == (4, kv), layout
    if layout == "multi-query":
        assert hf.load_model(tiny_model_dir("falcon")).info.n_kv_heads == 1


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_model_loads_and_analyses_in_both_modes(tiny_model_dir, arch):
    loaded = hf.load_model(tiny_model_dir(arch))
    assert loaded.info.causal == (arch in CAUSAL_ARCHS)
    assert loaded.info.max_length == TINY_POSITIONS
    if arch == "llama":
        assert (loaded.info.n_heads, loaded.info.n_kv_heads) == (4, 2)  # grouped-query attention
    text = CORPUS[0]
    for mode in hf.MODES:
        result = hf.analyze(text, loaded, mode=mode)
        n = len(result.tokens)
        for variant, w in result.weights.items():
            assert w.shape == (2, 4, n, n)
            torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, n), atol=1e-5, rtol=0)
            if loaded.info.causal:
                assert w.triu(1).abs().max() == 0, variant
        if loaded.info.causal:
            assert result.iters == 1 and result.notes  # causal sinkhorn runs with iters=1
            # later tokens never change earlier rows, in any layer (DNAS is leak-free)
            prefix = loaded.tokenizer(text)["input_ids"][: n - 4]
            short = hf.batch_weights(loaded, torch.tensor([prefix]), mode=mode)
            for variant in DEFAULT_VARIANTS:
                m = len(prefix)
                torch.testing.assert_close(
                    short[variant][:, 0], result.weights[variant][..., :m, :m], atol=1e-5, rtol=0
                )


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_model_swap_unas_matches_stock_and_padding(tiny_model_dir, arch):
    loaded = hf.load_model(tiny_model_dir(arch))
    tok = loaded.tokenizer
    seqs = [tok(CORPUS[0])["input_ids"], tok(CORPUS[1])["input_ids"][:5]]
    n = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (n - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (n - len(s)) for s in seqs])
    with torch.no_grad():
        stock = loaded.model(input_ids=ids, attention_mask=mask).last_hidden_state
        with hf.use_variant(loaded.model, "unas"):
            swapped = loaded.model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(swapped[mask.bool()], stock[mask.bool()], atol=1e-5, rtol=1e-5)
    for mode in hf.MODES:
        together = hf.batch_weights(loaded, ids, mask, variants=("dnas", "sinkhorn"), mode=mode)
        alone = hf.batch_weights(loaded, ids[1:, : len(seqs[1])], variants=("dnas", "sinkhorn"), mode=mode)
        m = len(seqs[1])
        for variant in ("dnas", "sinkhorn"):
            torch.testing.assert_close(
                together[variant][:, 1, :, :m, :m], alone[variant][:, 0], atol=1e-5, rtol=0
            )


# ----------------------------------------------------------------------------------------------
# Errors for people
# ----------------------------------------------------------------------------------------------


def test_not_a_model_directory(tmp_path):
    with pytest.raises(hf.ModelLoadError, match="does not exist"):
        hf.load_model(tmp_path / "missing")
    with pytest.raises(hf.ModelLoadError, match="no config.json"):
        hf.load_model(tmp_path)
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(hf.ModelLoadError, match="not a directory"):
        hf.load_model(tmp_path / "f.txt")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(hf.ModelLoadError, match="JSON"):
        hf.load_model(tmp_path)


def _copy_config(src, dst, **changes):
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_remote_code_and_pickle_only_checkpoints_are_refused(tiny_model_dir, tmp_path):
    src = tiny_model_dir("bert")
    remote = _copy_config(src, tmp_path / "remote", auto_map={"AutoModel": "modeling_evil.EvilModel"})
    (remote / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    with pytest.raises(hf.ModelLoadError, match="custom code"):
        hf.load_model(remote)
    pickled = _copy_config(src, tmp_path / "pickled")
    (pickled / "pytorch_model.bin").write_bytes(b"never unpickled")
    with pytest.raises(hf.ModelLoadError, match="pickle"):
        hf.load_model(pickled)
    empty = _copy_config(src, tmp_path / "noweights")
    with pytest.raises(hf.ModelLoadError, match="no weights"):
        hf.load_model(empty)
    corrupt = _copy_config(src, tmp_path / "corrupt")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (corrupt / name).write_bytes((src / name).read_bytes())
    (corrupt / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(hf.ModelLoadError, match="cannot load the model"):
        hf.load_model(corrupt)
    unknown = _copy_config(src, tmp_path / "unknown", model_type="not_a_model_type")
    (unknown / "model.safetensors").write_bytes(b"")
    with pytest.raises(hf.ModelLoadError, match="cannot read the config"):
        hf.load_model(unknown)
    # an encoder-decoder of no declared family (T5, BART, ... load: tests/test_encoder_decoder.py)
    encdec = _copy_config(src, tmp_path / "led", model_type="led", is_encoder_decoder=True)
    with pytest.raises(hf.ModelLoadError, match=r"encoder-decoder \(led\): attnlab has no declaration"):
        hf.load_model(encdec)


def test_unsupported_attention_module_is_refused(tmp_path, monkeypatch):
    """Attention outside the AttentionInterface with no score adapter (attnlab/hf/capture/score_adapters.py;
    DeBERTa-v2 with its adapter removed) is refused with the reason."""
    from transformers import AutoModel, AutoTokenizer, DebertaV2Config

    from attnlab.hf.capture import score_adapters

    monkeypatch.setattr(score_adapters, "ADAPTERS",
                        tuple(a for a in score_adapters.ADAPTERS if a.family != "DeBERTa-v2"))
    torch.manual_seed(0)
    model = AutoModel.from_config(
        DebertaV2Config(
            vocab_size=30522,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=TINY_POSITIONS,
        )
    )
    model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(hf.default_model_path(), local_files_only=True).save_pretrained(tmp_path)
    with pytest.raises(hf.ModelLoadError, match="unsupported model.*AttentionInterface"):
        hf.load_model(tmp_path)


def test_bad_arguments_name_the_argument(minilm):
    with pytest.raises(ValueError, match="empty"):
        hf.analyze("  \n\t ", minilm)
    with pytest.raises(ValueError, match="text must be a str"):
        hf.analyze(b"bytes", minilm)
    with pytest.raises(ValueError, match="variants"):
        hf.analyze("hi", minilm, variants=("softmax",))
    with pytest.raises(ValueError, match="mode"):
        hf.analyze("hi", minilm, mode="both")
    with pytest.raises(ValueError, match="u must"):
        hf.analyze("hi", minilm, u=1.5)
    with pytest.raises(ValueError, match="iters"):
        hf.analyze("hi", minilm, iters=0)
    with pytest.raises(ValueError, match="window"):
        hf.analyze("hi", minilm, window=4096)
    with pytest.raises(ValueError, match="overlap"):
        hf.analyze("hi", minilm, window=16, overlap=14)


def test_build_tiny_model_is_deterministic(tmp_path):
    from safetensors.torch import load_file

    a = load_file(build_tiny_model("gpt2", tmp_path / "a") / "model.safetensors")
    b = load_file(build_tiny_model("gpt2", tmp_path / "b") / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_hnas_u_from_a_trained_attnlab_checkpoint(tmp_path, tiny_model_dir):
    from attnlab import models

    torch.manual_seed(0)
    config = models.ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=4, variant="hnas")
    lm = models.TransformerLM(config)
    with torch.no_grad():
        for block in lm.blocks:
            block.attn.hybrid.theta.uniform_(-2, 2)
    models.save(lm, tmp_path / "ckpt")
    u = hf.hnas_u_from_checkpoint(tmp_path / "ckpt")
    torch.testing.assert_close(u, lm.hybrid_weights())
    loaded = hf.load_model(tiny_model_dir("bert"))  # 2 layers x 4 heads, like the checkpoint
    w = hf.analyze(CORPUS[0], loaded, u=u).weights
    expected = torch.lerp(w["unas"], w["dnas"], u[:, :, None, None])
    torch.testing.assert_close(w["hnas"], expected, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="broadcastable"):
        hf.analyze(CORPUS[0], loaded, u=torch.full((3, 4), 0.5))
    with pytest.raises(ValueError, match="checkpoint"):
        hf.hnas_u_from_checkpoint(tmp_path)


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_chunked_tokenization_equals_one_pass(tiny_model_dir, arch):
    from attnlab.hf.capture.windows import tokenize_text

    tok = hf.load_model(tiny_model_dir(arch)).tokenizer
    text = "  ".join(CORPUS * 4) + " end"
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    chunked = tokenize_text(tok, text, chunk_chars=40)
    assert chunked.ids.tolist() == enc["input_ids"]
    assert chunked.word_ids.tolist() == enc.word_ids()
    assert [text[a:b] for a, b in zip(chunked.starts, chunked.ends, strict=True)] == [
        text[a:b] for a, b in enc["offset_mapping"]
    ]


def test_variant_settings_from_forward_kwargs_and_module_attributes(minilm):
    ids = torch.tensor([minilm.tokenizer(TEXTS[0])["input_ids"]])
    model = minilm.model

    def layer0(variant, **kwargs):
        with hf.use_variant(model, variant), torch.no_grad():
            return model(input_ids=ids, output_attentions=True, **kwargs).attentions[0]

    torch.testing.assert_close(layer0("hnas", attnlab_u=1.0), layer0("dnas"))  # u = 1: DNAS
    torch.testing.assert_close(layer0("hnas", attnlab_u=0.0), layer0("unas"))
    attention = next(m for m in model.modules() if hasattr(m, "is_causal"))
    attention.attnlab_iters = 1  # module attribute: Sinkhorn with one round = DNAS
    try:
        torch.testing.assert_close(layer0("sinkhorn"), layer0("dnas"))
    finally:
        del attention.attnlab_iters


# ----------------------------------------------------------------------------------------------
# Statistics computed with the weights (fused path) and recycled weight memory
# ----------------------------------------------------------------------------------------------


def _assert_tables_close(fast, slow):
    assert list(fast.columns) == list(slow.columns)
    keys = ["variant", "layer", "head", "statistic"]
    assert (fast[keys].values == slow[keys].values).all()
    torch.testing.assert_close(
        torch.tensor(fast["value"].values), torch.tensor(slow["value"].values), rtol=1e-4, atol=2e-5
    )


@pytest.mark.parametrize("u", [0.5, "per_head"])
def test_fused_statistics_equal_tidy_table_on_the_weights(minilm, english_text, u):
    from attnlab import stats

    if u == "per_head":
        u = torch.linspace(0.0, 1.0, 72).reshape(6, 12)
    result = hf.analyze(english_text, minilm, window=128, u=u)
    w = result.windows[0]
    assert w._sums is not None  # the fused path ran
    assert w.punctuation.any() and not (w.punctuation & w.special).any()
    for punctuation in (True, False):  # special_mass: special tokens alone; punctuation_mass beside it
        punct = w.punctuation if punctuation else None
        slow = stats.tidy_table(w.weights, special=w.special, punctuation=punct, u=u, window=w.index)
        _assert_tables_close(w.table(punctuation=punctuation), slow)
    slow = stats.tidy_table(w.weights, special=w.special, punctuation=w.punctuation, u=0.3, eps=0.02,
                            eps_relative=0.5, window=w.index)
    _assert_tables_close(w.table(u=0.3, eps=0.02, eps_relative=0.5), slow)
    no_ref = stats.tidy_table(w.weights, special=w.special, punctuation=w.punctuation, u=u, reference="dnas",
                              window=w.index)
    _assert_tables_close(w.table(reference="dnas"), no_ref)  # not cached: recomputed


def test_stream_without_statistics_has_the_same_weights_and_table(minilm, english_text):
    """statistics=False (the app's views): no row sums in the analysis pass, each variant's weights
    computed when first read, the same weights (bitwise) and table (from the weights) as with them."""
    from attnlab.hf.compute.lazy_weights import LazyWeights

    plain = hf.stream_analysis(english_text, minilm, window=128, statistics=False).window(0)
    fused = hf.stream_analysis(english_text, minilm, window=128).window(0)
    assert plain._sums is None and fused._sums is not None
    assert isinstance(plain.weights, LazyWeights) and plain.weights.computed == ()
    assert torch.equal(plain.weights["dnas"], fused.weights["dnas"])
    assert plain.weights.computed == ("dnas",)  # the one read
    for v in fused.weights:
        assert torch.equal(plain.weights[v], fused.weights[v]), v
    _assert_tables_close(plain.table(), fused.table())
    with pytest.raises(ValueError, match="statistics must be True or False"):
        hf.stream_analysis(english_text, minilm, statistics="no")


@pytest.mark.parametrize("use_kernel", [True, False])
def test_one_variant_written_without_sums_equals_every_variant_with_sums(use_kernel):
    """The lazy weights' call (write one variant, no row sums: the kernel skips the Sinkhorn rounds,
    HNAS rows and distances it does not need) writes bitwise what the full pass writes."""
    from attnlab.hf.compute import fused_sums

    torch.manual_seed(1)
    L, H, N, D = 2, 3, 20, 8
    q, k = torch.randn(L, 1, H, N, D), torch.randn(L, 1, H, N, D)
    q[0, 0, 1] *= 10.0  # one wide head (the log-space path) among linear ones
    special = torch.zeros(N, dtype=torch.bool)
    special[[0, N - 1]] = True
    args = (q, k, [0.4, 0.35], KERNEL, 0.5, 3, [special])
    full, _ = fused_sums.variants_with_sums(*args, use_kernel=use_kernel)
    for v in KERNEL:
        one, sums = fused_sums.variants_with_sums(*args, use_kernel=use_kernel, write=[v], sums=False)
        assert sums is None and list(one) == [v]
        assert torch.equal(one[v], full[v]), v


def test_fused_path_handles_a_wide_head_and_matches_the_separate_computations():
    from attnlab import stats
    from attnlab.hf.compute.weights import _variants_with_sums

    torch.manual_seed(0)
    L, H, N, D = 2, 3, 24, 8
    q, k = torch.randn(L, 1, H, N, D), torch.randn(L, 1, H, N, D)
    q[1, 0, 2] *= 12.0  # scores spanning far more than LINEAR_SPAN_MAX nats: the log-space path
    special = torch.zeros(N, dtype=torch.bool)
    special[[0, 5]] = True
    weights, sums = _variants_with_sums(q, k, [0.5, 0.4], KERNEL, 0.5, 3, [special])
    expected = _variants_unmasked(q, k, [0.5, 0.4], KERNEL, 0.5, 3)
    ws = {v: weights[v][:, 0] for v in KERNEL}
    for v in KERNEL:
        torch.testing.assert_close(ws[v], expected[v][:, 0], atol=1e-5, rtol=0)
    fast = stats._tidy_from_row_sums(sums, (L, H, N, N), special_index=0, u=0.5, eps=0.01, eps_relative=0.1,
                                     reference="unas")
    _assert_tables_close(fast, stats.tidy_table(ws, special=special, u=0.5))


@pytest.mark.parametrize("N", [24, 64])  # 64: whole vectors, weights streamed to memory
@pytest.mark.parametrize("variants", [KERNEL, ("unas", "hnas"), ("dnas", "sinkhorn"), ("hnas",),
                                      ("softmax1",), ("softmax1", "unas"), ("sparsemax",),
                                      ("sparsemax", "unas", "softmax1")])
@pytest.mark.parametrize("iters", [1, 2, 3])
def test_kernel_and_pytorch_paths_agree(monkeypatch, variants, iters, N):
    """attnlab.hf's CPU kernel (attnlab/csrc/analysis_cpu.cpp: a whole head per call) and the PyTorch
    operations give the same weights and row sums, for every variant subset, Sinkhorn iteration count
    and u per head (u = 0 and 1 too), with a wide head (log-space fallback) among them."""
    from attnlab import kernels
    from attnlab.hf.compute import weights

    if kernels.analysis_ops() is None:
        pytest.skip(f"attnlab's CPU kernels not available: {kernels.build_error()}")
    torch.manual_seed(1)
    L, H, D = 2, 3, 8
    q, k = torch.randn(L, 1, H, N, D) * 1.5, torch.randn(L, 1, H, N, D) * 1.5
    q[1, 0, 2] *= 12.0  # one wide head (log-space fallback) among linear ones
    u = torch.tensor([[0.0, 0.3, 1.0], [0.5, 0.7, 0.2]])[:, None, :, None, None]  # (L, 1, H, 1, 1)
    special = torch.zeros(N, dtype=torch.bool)
    special[[0, 3, N - 1]] = True
    specials = [special, special.roll(1)]
    runs = {}
    for use_kernel in (True, False):
        monkeypatch.setattr(weights, "_USE_KERNEL", use_kernel)
        runs[use_kernel] = weights._variants_with_sums(q, k, [0.4, 0.35], variants, u, iters, specials)
    (w_k, sums_k), (w_t, sums_t) = runs[True], runs[False]
    for v in variants:
        torch.testing.assert_close(w_k[v], w_t[v], atol=1e-6, rtol=1e-5)
        for key, t in sums_t[v].items():
            if t is None:
                assert sums_k[v][key] is None, (v, key)
            else:
                torch.testing.assert_close(sums_k[v][key], t, atol=2e-5, rtol=1e-5, msg=f"{v} {key}")


def test_table_recomputes_after_the_weights_change(minilm):
    from attnlab import stats

    result = hf.analyze("The cat sat on the mat because it was tired.", minilm)
    w = result.windows[0]
    w.weights["dnas"].mul_(0.5)  # in place: the statistics computed with the weights are stale
    keys = {"special": w.special, "punctuation": w.punctuation}
    _assert_tables_close(w.table(), stats.tidy_table(w.weights, **keys, window=0))
    w.weights["unas"] = w.weights["unas"].clone()
    _assert_tables_close(w.table(), stats.tidy_table(w.weights, **keys, window=0))


def test_weight_memory_is_recycled_only_once_released(minilm):
    import gc

    text = "The cat sat on the mat because it was tired."
    threads = torch.get_num_threads()
    first = hf.analyze(text, minilm)
    kept = {v: t.clone() for v, t in first.weights.items()}
    second = hf.analyze(text + " It slept.", minilm)  # while `first` is alive: its memory is not lent
    for v, t in kept.items():
        assert torch.equal(first.weights[v], t)
    pointers = {t.data_ptr() for t in second.weights.values()}
    del second
    gc.collect()
    pool = {slab.ctypes.data for slab in _POOL.free}
    assert pointers <= pool  # released: back in the pool
    third = hf.analyze(text + " It slept.", minilm)  # same size: released memory is reused
    assert {t.data_ptr() for t in third.weights.values()} <= pool
    assert torch.get_num_threads() == threads


def test_variants_without_a_fused_analysis_take_the_generic_path(minilm, english_text):
    """sparsemax and softmax1 (no hf kernel) next to the fused four: the same weights as
    attention_weights on the captured q, k, and statistics for every one of them."""
    result = hf.analyze(english_text, minilm, variants=VARIANTS)
    assert tuple(result.weights) == tuple(VARIANTS)
    alone = hf.analyze(english_text, minilm, variants=DEFAULT_VARIANTS)
    for v in DEFAULT_VARIANTS:
        torch.testing.assert_close(result.weights[v], alone.weights[v], atol=2e-5, rtol=0)
    n = len(result.tokens)
    assert (result.weights["sparsemax"] == 0).any()  # exact zeros: explained away completely
    torch.testing.assert_close(result.weights["sparsemax"].sum(-1), torch.ones(6, 12, n), atol=1e-5, rtol=0)
    rows = result.weights["softmax1"].sum(-1)
    assert bool((rows <= 1 + 1e-5).all()) and bool((rows < 1 - 1e-3).any())  # the null key takes the rest
    table = result.table()
    assert set(table.variant) == set(VARIANTS)
    assert not table.value.isna().any()


@pytest.mark.parametrize("mode", hf.MODES)
def test_one_parameter_check_in_both_modes(minilm, mode):
    """recompute and swap refuse the same u (range, NaN, shape) and iters, with the same words."""
    text = "A short text."
    cases = [({"u": 1.5}, "u must be a number in [0, 1], got 1.5"),
             ({"u": float("nan")}, "u must be a number in [0, 1], got NaN"),
             ({"u": torch.full((6, 12), -0.5)}, "u must be a number in [0, 1], got values in [-0.5, -0.5]"),
             ({"u": torch.full((6, 5), 0.5)},
              "u must be a number or a tensor broadcastable to (L, H) (6, 12)"),
             ({"u": torch.full((2, 6, 12), 0.5)}, "u must be a number or a tensor broadcastable to (L, H)"),
             ({"iters": 0}, "iters must be an integer in [1, 10000], got 0"),
             ({"beta": 1}, "beta is not a parameter of any variant")]
    for params, message in cases:
        with pytest.raises(ValueError) as err:
            hf.analyze(text, minilm, mode=mode, **params)
        assert message in str(err.value), (params, str(err.value))
    import numpy as np

    a = hf.analyze(text, minilm, variants=("hnas",), mode=mode, u=np.float32(0.25))
    b = hf.analyze(text, minilm, variants=("hnas",), mode=mode, u=0.25)
    torch.testing.assert_close(a.weights["hnas"], b.weights["hnas"])


def test_batch_weights_refuses_empty_and_out_of_vocabulary_ids(minilm):
    for ids, message in [(torch.zeros(1, 0, dtype=torch.long), "input_ids must hold at least one token"),
                         (torch.tensor([[101, 10**6]]), "input_ids must be token ids in [0, 30521]"),
                         (torch.tensor([[-1, 101]]), "input_ids must be token ids in [0, 30521]"),
                         (torch.tensor([[1.0, 2.0]]), "input_ids must be an integer tensor")]:
        with pytest.raises(ValueError) as err:
            hf.batch_weights(minilm, ids)
        assert message in str(err.value)


# ----------------------------------------------------------------------------------------------
# Weights computed on first access (attnlab/hf/compute/lazy_weights.py)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_kernel", [True, False])
def test_statistics_pass_writes_no_weights_and_later_weights_are_identical(monkeypatch, use_kernel):
    """The row sums of the pass that writes no weights equal those of the pass that writes them all,
    and each variant's weights written later, alone, equal (bit for bit) the ones written together
    (kernel and PyTorch paths, a wide head among them, u per head, Sinkhorn with rounds)."""
    from attnlab import kernels
    from attnlab.hf.compute import fused_sums

    if use_kernel and kernels.analysis_ops() is None:
        pytest.skip(f"attnlab's CPU kernels not available: {kernels.build_error()}")
    torch.manual_seed(2)
    L, H, N, D = 2, 3, 64, 8
    q, k = torch.randn(L, 1, H, N, D) * 1.5, torch.randn(L, 1, H, N, D) * 1.5
    q[0, 0, 1] *= 12.0  # a wide head: the log-space fallback
    u = torch.tensor([[0.0, 0.3, 1.0], [0.5, 0.7, 0.2]])[:, None, :, None, None]
    special = torch.zeros(N, dtype=torch.bool)
    special[[0, N - 1]] = True
    args = (q, k, [0.4, 0.35], KERNEL, u, 3, [special, special.roll(2)])
    full, sums_full = fused_sums.variants_with_sums(*args, use_kernel=use_kernel)
    none, sums_none = fused_sums.variants_with_sums(*args, use_kernel=use_kernel, write=())
    assert none == {}
    for v in KERNEL:
        for key, t in sums_full[v].items():
            assert (t is None) == (sums_none[v][key] is None), (v, key)
            if t is not None:
                assert torch.equal(t, sums_none[v][key]), (v, key)
        alone, no_sums = fused_sums.variants_with_sums(*args, use_kernel=use_kernel, write=(v,), sums=False)
        assert no_sums is None and list(alone) == [v]
        assert torch.equal(alone[v], full[v]), v


def test_analysis_computes_weights_only_when_read(minilm, english_text):
    from attnlab.hf.compute.lazy_weights import LazyWeights

    result = hf.analyze(english_text, minilm)
    w = result.windows[0]
    assert isinstance(w.weights, LazyWeights) and isinstance(w.weights, dict)
    table = result.table()  # from the row sums: no weight computed
    assert w.weights.computed == ()
    assert list(w.weights) == list(DEFAULT_VARIANTS) and len(w.weights) == len(DEFAULT_VARIANTS)
    assert "dnas" in w.weights and "nothing" not in w.weights
    dnas = w.weights["dnas"]
    assert w.weights.computed == ("dnas",) and w.weights["dnas"] is dnas  # computed once, kept
    n = len(result.tokens)
    assert dnas.shape == (6, 12, n, n)
    torch.testing.assert_close(dnas.sum(-1), torch.ones(6, 12, n), atol=1e-5, rtol=0)
    eager = hf.batch_weights(minilm, torch.tensor([w.window.input_ids]))  # the materializing path
    for v, t in w.weights.items():  # every variant computed
        torch.testing.assert_close(t, eager[v][:, 0], atol=2e-5, rtol=0)
    assert set(w.weights.computed) == set(DEFAULT_VARIANTS)
    again = hf.analyze(english_text, minilm)
    plain = dict(again.weights)  # all at once (values()) = one at a time (__getitem__)
    assert type(plain) is dict
    for v in DEFAULT_VARIANTS:
        assert torch.equal(plain[v], result.weights[v]), v
    # the statistics still describe these weights: table() uses the row sums, unchanged
    from attnlab import stats

    keys = {"special": w.special, "punctuation": w.punctuation}
    _assert_tables_close(table, stats.tidy_table(plain, **keys, window=0))
    assert w._cached_sums(w.special | w.punctuation, "unas") is not None


def test_lazy_weights_behave_as_a_dict():
    import pickle

    from attnlab.hf.compute.lazy_weights import LazyWeights

    calls = []

    def compute(names):
        calls.append(names)
        return {n: torch.full((2,), float(len(n))) for n in names}

    w = LazyWeights(("ab", "cde"), compute)
    assert list(w) == ["ab", "cde"] and not calls
    assert "LazyWeights" in repr(w) and not calls
    assert torch.equal(w["ab"], torch.full((2,), 2.0)) and calls == [("ab",)]
    assert w.get("zz") is None and w.get("ab") is w["ab"]
    with pytest.raises(KeyError):
        w["zz"]
    assert set({**w}) == {"ab", "cde"} and calls == [("ab",), ("cde",)]
    assert isinstance(pickle.loads(pickle.dumps(w))["cde"], torch.Tensor)
    before = w.fingerprint()
    w["cde"].add_(1.0)  # in place: the fingerprint changes
    assert w.fingerprint() != before
    x = LazyWeights(("ab",), compute)
    start = x.fingerprint()
    x["ab"]
    assert x.fingerprint() == start  # computing is not a change
    x["ab"] = torch.zeros(2)
    assert x.fingerprint() != start
    assert x.pop("ab").sum() == 0 and len(x) == 0


# ----------------------------------------------------------------------------------------------
# The analysis path of a registered variant derives from its spec (VariantSpec.hf_kernel)
# ----------------------------------------------------------------------------------------------


def _square_norm(logits, ctx):
    """A toy normalizer: squared shifted scores, rows normalized (no fused analysis for it)."""
    w = torch.nan_to_num((logits - logits.amax(-1, keepdim=True)).exp().square(), nan=0.0)
    return w / w.sum(-1, keepdim=True)


@pytest.mark.parametrize("hf_kernel", [False, True])
def test_a_registered_variant_without_fused_analysis_takes_the_generic_path(minilm, hf_kernel):
    """A toy variant with its own normalizer: its reference function (with a one-time note), whether or
    not its spec claims hf_kernel (the fused analysis cannot compute its normalizer): its statistics
    streamed per head beside the fused unas (attnlab/hf/compute/mixed.py), its weights on access."""
    import warnings

    from attnlab import register_variant
    from attnlab.hf.compute import weights as hw
    from attnlab.normalizers import specs

    name = f"toy_square_{int(hf_kernel)}"
    register_variant(name, _square_norm, hf_kernel=hf_kernel, summary="toy")
    try:
        text = "The cat sat on the mat because it was tired."
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = hf.analyze(text, minilm, variants=("unas", name))
            hf.analyze(text, minilm, variants=("unas", name))
        notes = [c for c in caught if name in str(c.message) and "reference function" in str(c.message)]
        assert len(notes) == 1  # once
        w = result.windows[0]
        assert w._sums is not None and w.weights.computed == ()  # row sums streamed, no weights yet
        ids = torch.tensor([w.window.input_ids])
        with torch.no_grad(), hf.capture_qk(minilm.model) as captured:
            minilm.model(input_ids=ids)
        for layer, c in enumerate(captured):
            scores = c.query.float() @ c.key.float().transpose(-1, -2) * c.scaling
            torch.testing.assert_close(w.weights[name][layer], attention_weights(scores, name)[0],
                                       atol=1e-5, rtol=0)
        table = result.table()
        assert set(table.variant) == {"unas", name} and not table.value.isna().any()
    finally:
        specs.unregister_variant(name)
        hw._noted.discard(name)


def test_a_registered_variant_with_a_fused_normalizer_takes_the_fused_path(minilm):
    """A toy variant declaring hf_kernel whose normalizer the fused analysis implements (DNAS's):
    the fused path (row sums, lazy weights), its weights and statistics those of dnas."""
    from attnlab import register_variant
    from attnlab.normalizers import functions, specs

    register_variant("toy_dnas", functions.dnas, hf_kernel=True, summary="dnas again")
    try:
        text = "The cat sat on the mat because it was tired."
        toy = hf.analyze(text, minilm, variants=("unas", "toy_dnas"))
        ref = hf.analyze(text, minilm, variants=("unas", "dnas"))
        assert toy.windows[0]._sums is not None  # fused
        assert torch.equal(toy.weights["toy_dnas"], ref.weights["dnas"])
        a, b = toy.table(), ref.table()
        a = a[a.variant == "toy_dnas"].value.to_numpy()
        b = b[b.variant == "dnas"].value.to_numpy()
        assert a.shape == b.shape and (a == b).all()
    finally:
        specs.unregister_variant("toy_dnas")


@pytest.mark.parametrize("iters", [1, 3])
def test_kernel_computes_wide_heads_in_log_space(monkeypatch, iters):
    """A head whose DNAS and Sinkhorn mass comes from entries ~200 nats below their rows' maxima
    (exp(s - max) is 0 in float32 there: the linear passes would lose them) takes the kernel's log-space
    path (analysis_wide.h; the kernel says so, no PyTorch fallback runs), and its weights and every row
    sum match float64 references computed from the weights, next to a linear head."""
    from attnlab import kernels
    from attnlab.hf.compute import fused_sums
    from attnlab.stats import distance_matrix
    from attnlab.stats.engine import row_sums_dict

    ops = kernels.analysis_ops()
    if ops is None:
        pytest.skip(f"attnlab's CPU kernels not available: {kernels.build_error()}")
    linear = {}

    class Spy:
        def heads(self, *args):
            flags = ops.heads(*args)  # (M,) bool: linear, map by map
            linear.update(enumerate(flags.tolist()))
            return flags

    monkeypatch.setattr(kernels, "analysis_ops", lambda: Spy())
    monkeypatch.setattr(fused_sums, "_wide_head", lambda *a: pytest.fail("PyTorch fallback ran"))
    torch.manual_seed(5)
    N = 37  # a tail after the whole vectors
    q, k = torch.randn(1, 1, 2, N, 2), torch.randn(1, 1, 2, N, 2)
    q[0, 0, 0, :, 0], k[0, 0, 0, :, 0] = 10.0, 0.0
    k[0, 0, 0, 3, 0] = 20.0  # head 0: key 3 scores 200 above every other key of every row
    special = torch.zeros(N, dtype=torch.bool)
    special[[0, 3, N - 1]] = True
    u = torch.tensor([0.3, 0.8])[None, None, :, None, None]
    weights, sums = fused_sums.variants_with_sums(q, k, [1.0], KERNEL, u, iters, [special])
    assert linear == {0: False, 1: True}
    scores = torch.matmul(q, k.transpose(-1, -2)).double()[0]  # (1, 2, N, N)
    params = {"hnas": {"u": u[0].double()}, "sinkhorn": {"iters": iters}}
    ref = {v: attention_weights(scores, v, **params.get(v, {})) for v in KERNEL}
    assert float(ref["dnas"][0, 0, :, 3].sum()) < 1.5  # dnas spreads the mass that unas gives key 3
    dist = distance_matrix(N, N, scores)
    for v in KERNEL:
        torch.testing.assert_close(weights[v][0].double(), ref[v], atol=2e-6, rtol=1e-5, msg=v)
        expected = row_sums_dict(ref[v].reshape(2, N, N), special[:, None], dist,
                                 None if v == "unas" else ref["unas"].reshape(2, N, N))
        for key, t in expected.items():
            if t is not None:
                got = sums[v][key].reshape(t.shape).double()
                torch.testing.assert_close(got, t, atol=2e-5, rtol=1e-4, msg=f"{v} {key}")


@pytest.mark.parametrize("scale", [0.003, 0.05, 0.6, "ramp"])
def test_fused_js_distances_are_accurate_for_close_and_far_rows(scale):
    """The kernel's Jensen-Shannon terms (ln x from the factors; on AVX-512 a table of chi(ln x), no
    logarithm) against a float64 literal computation, for rows nearly equal to unas' (distances ~1e-3),
    far from them, and ("ramp") a head whose dnas weights differ from unas' by up to e^25 either way:
    scores falling 0.8 nats a key (span 50, still a linear head), nearly the same in every row, so
    that dnas spreads each row almost evenly."""
    from attnlab.hf.compute import fused_sums

    torch.manual_seed(3)
    L, H, N, D = 1, 2, 64, 16
    q, k = torch.randn(L, 1, H, N, D), torch.randn(L, 1, H, N, D)
    if scale == "ramp":
        q, k = 0.01 * q, 0.01 * k
        q[..., 0], k[..., 0] = 1.0, -0.8 * torch.arange(N, dtype=torch.float32)
        scale = 1.0
    special = torch.zeros(N, dtype=torch.bool)
    special[0] = True
    weights, sums = fused_sums.variants_with_sums(q, k, [scale], KERNEL, 0.4, 3, [special])
    pu = weights["unas"][0, 0].double()  # (H, N, N)
    for v in ("dnas", "hnas", "sinkhorn"):
        p = weights[v][0, 0].double()
        m = (p + pu) / 2
        js = 0.5 * (p * (p / m).log() + pu * (pu / m).log()).sum(-1) / math.log(2.0)
        expected = js.clamp_min(0).sqrt()  # (H, N) JS distance, base 2
        got = sums[v]["js"].reshape(H, N).double()
        torch.testing.assert_close(got, expected, rtol=2e-4, atol=2e-7, msg=f"{v} at scale {scale}")


def test_swap_mode_beyond_the_materialize_limit_is_refused_before_any_forward(tiny_model_dir, monkeypatch):
    """Swap mode keeps every variant's whole (L, H, N, N) weights (nothing streams): beyond the limit a
    streamed window materializes up to, a worded ValueError with the sizes, before the model runs (a
    causal model's whole-context window ran out of memory instead); recompute mode streams the same text."""
    from attnlab.hf.compute import head_maps

    loaded = hf.load_model(tiny_model_dir("llama"))
    text = " ".join(CORPUS)
    n = len(hf.analyze(text, loaded, ["unas"]).windows[0].tokens)
    need = 4 * 2 * 2 * 4 * n * n  # unas and dnas, 2 layers x 4 heads, float32
    monkeypatch.setattr(head_maps, "MATERIALIZE_LIMIT", need - 1)
    calls = []
    monkeypatch.setattr(loaded.model, "forward", lambda *a, **k: calls.append(1))
    with pytest.raises(ValueError, match=rf"mode='swap' keeps every variant's whole weights of a window: 2 x "
                                         rf"\(L, H, N, N\) = \(2, 4, {n}, {n}\).*use mode='recompute'"):
        hf.analyze(text, loaded, ["unas", "dnas"], mode="swap")
    assert calls == []
    monkeypatch.undo()
    monkeypatch.setattr(head_maps, "MATERIALIZE_LIMIT", need)  # at the limit: runs
    assert hf.analyze(text, loaded, ["unas", "dnas"], mode="swap").windows[0].weights["dnas"].shape[-1] == n
