"""Encoder-decoders (T5, BART, mBART, Pegasus, Marian) on tiny random models (2 layers, d_model 64,
4 heads, conftest's RoBERTa-style BPE), built offline and seeded:

- recompute UNAS equals the model's eager ``encoder_attentions`` / ``decoder_attentions`` /
  ``cross_attentions`` within 1e-5, zero exactly where eager's is (the decoder's causality);
- every variant equals ``attnlab.normalizers.attention_weights`` on literal scores written out from the
  modules' weights (q W_Q (k W_K)ᵀ / sqrt(D) for the BART family; T5 unscaled plus its relative
  position bias); DNAS and HNAS keep their column floors 1/N and u/N on the cross-attention;
- swap-mode UNAS gives the eager model's decoder states (the BART family); T5's swap is refused, named;
- bad input (target too long, empty, given to a model that is not an encoder-decoder; Whisper) is a
  worded ValueError naming the argument.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ARCHITECTURES, build_tiny_model

from attnlab import hf
from attnlab.hf.capture.seq2seq import KINDS
from attnlab.hf.load.seq2seq import decoder_start_id
from attnlab.normalizers import attention_weights

SEQ2SEQ = [a.key for a in ARCHITECTURES if a.seq2seq]
SOURCE = "Attention lets every word look at every other word."
TARGET = "A key that no query wants is explained away."
VARIANTS = ("unas", "dnas", "hnas", "sinkhorn", "softmax1", "sparsemax")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Factory: arch -> its tiny model, loaded (parameters redrawn at 0.3 so that heads differ)."""
    built = {}

    def make(key: str):
        if key not in built:
            directory = build_tiny_model(key, tmp_path_factory.mktemp(f"s2s-{key}"), scale=0.3)
            built[key] = hf.load_model(directory)
        return built[key]

    return make


def _eager(model, src, tgt):
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return model(input_ids=src, decoder_input_ids=tgt, output_attentions=True, use_cache=False)
    finally:
        model.set_attn_implementation("sdpa")


def _ids(result):
    return torch.tensor([result.source.input_ids]), torch.tensor([result.target.input_ids])


@pytest.mark.parametrize("arch", SEQ2SEQ)
def test_recompute_unas_equals_eager_for_every_kind(arch, tiny):
    loaded = tiny(arch)
    assert loaded.info.encoder_decoder and loaded.info.decoder_layers == 2 and loaded.info.decoder_heads == 4
    result = hf.analyze(SOURCE, loaded, ["unas", "dnas"], target=TARGET)
    ref = _eager(loaded.model, *_ids(result))
    N, M = len(result.source.tokens), len(result.target.tokens)
    assert result.target.input_ids[0] == decoder_start_id(loaded.model.config)
    shapes = {"encoder": (N, N), "decoder": (M, M), "cross": (M, N)}
    for kind, maps in zip(KINDS, (ref.encoder_attentions, ref.decoder_attentions, ref.cross_attentions),
                          strict=True):
        theirs, mine = torch.stack(maps)[:, 0], result.weights[kind]["unas"]  # (L, H, M, N)
        assert mine.shape == (2, 4, *shapes[kind])
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)
        assert torch.equal(mine == 0, theirs == 0), f"{kind}: masked entries differ from eager's"
    upper = torch.ones(M, M, dtype=torch.bool).triu(1)
    assert not result.weights["decoder"]["dnas"][..., upper].any(), "the decoder is causal"
    assert bool((result.weights["encoder"]["unas"] > 0).all()), "the encoder is bidirectional"


def _literal_scores(loaded, src, tgt) -> dict:
    """kind -> [(1, H, M, N) scores per layer], written out from the attention modules' weights and the
    inputs their forward receives (hooked): T5 unscaled + its bias, the others scaled by 1/sqrt(D)."""
    model, t5 = loaded.model, loaded.info.model_type == "t5"
    inputs = {}

    def hook(name):
        def record(_module, args, kwargs):
            inputs[name] = kwargs.get("hidden_states", args[0] if args else None)
        return record

    if t5:
        enc = [b.layer[0].SelfAttention for b in model.encoder.block]
        dec = [b.layer[0].SelfAttention for b in model.decoder.block]
        cross = [b.layer[1].EncDecAttention for b in model.decoder.block]
    else:
        enc = [x.self_attn for x in model.encoder.layers]
        dec = [x.self_attn for x in model.decoder.layers]
        cross = [x.encoder_attn for x in model.decoder.layers]
    modules = {(kind, i): m for kind, stack in zip(KINDS, (enc, dec, cross), strict=True)
               for i, m in enumerate(stack)}
    handles = [m.register_forward_pre_hook(hook(k), with_kwargs=True) for k, m in modules.items()]
    try:
        with torch.no_grad():
            enc_out = model.get_encoder()(input_ids=src).last_hidden_state
            model(input_ids=src, decoder_input_ids=tgt, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    out = {k: [] for k in KINDS}
    for (kind, i), m in modules.items():
        x = inputs[(kind, i)]
        kv = enc_out if kind == "cross" else x
        q_lin, k_lin = (m.q, m.k) if t5 else (m.q_proj, m.k_proj)
        H = 4
        q = q_lin(x).view(1, x.shape[1], H, -1).transpose(1, 2)  # (1, H, M, D)
        k = k_lin(kv).view(1, kv.shape[1], H, -1).transpose(1, 2)  # (1, H, N, D)
        s = q @ k.transpose(-1, -2) * (1.0 if t5 else q.shape[-1] ** -0.5)
        if t5 and kind != "cross":  # the first layer's relative position bias, shared by the stack's layers
            first = (model.encoder if kind == "encoder" else model.decoder).block[0].layer[0].SelfAttention
            s = s + first.compute_bias(s.shape[-2], s.shape[-1])
        out[kind].append(s)
    return out


@pytest.mark.parametrize("arch", SEQ2SEQ)
def test_every_variant_equals_the_reference_on_literal_scores(arch, tiny):
    loaded = tiny(arch)
    result = hf.analyze(SOURCE, loaded, VARIANTS, target=TARGET, u=0.3)
    scores = _literal_scores(loaded, *_ids(result))
    for kind in KINDS:
        for layer, s in enumerate(scores[kind]):
            for v in VARIANTS:
                params = {"u": 0.3} if v == "hnas" else {}
                ref = attention_weights(s, v, causal=kind == "decoder", **params)[0]  # (H, M, N)
                torch.testing.assert_close(result.weights[kind][v][layer], ref, rtol=0, atol=1e-5,
                                           msg=f"{kind} layer {layer} {v}")
    N = len(result.source.tokens)
    masses = result.column_masses("cross")  # (L, H, N): what each source token receives
    assert bool((masses["dnas"] >= (1 - 1e-4) / N).all())  # 1/N for any number of target rows
    assert bool((masses["hnas"] >= (1 - 1e-4) * 0.3 / N).all())
    table = result.column_mass_table("cross")
    assert len(table) == len(VARIANTS) * 2 * 4 * N
    rows = table[table.variant == "hnas"]
    assert ((rows.floor - 0.3 / N).abs() < 1e-12).all()
    assert (rows.column_mass >= rows.floor * (1 - 1e-4)).all()
    stats = result.table()
    assert list(stats.columns[:2]) == ["kind", "variant"] and set(stats.kind) == set(KINDS)
    cross = stats[(stats.kind == "cross") & (stats.variant == "dnas")]
    cross = cross[cross.statistic == "below_dnas_bound"]
    assert (cross.value == 0).all()


@pytest.mark.parametrize("arch", SEQ2SEQ)
def test_swap_unas_equals_eager_or_is_refused_by_name(arch, tiny):
    loaded = tiny(arch)
    if arch == "t5":
        with pytest.raises(ValueError, match=r"mode='swap' is not supported for T5.*position bias"):
            hf.analyze(SOURCE, loaded, ["unas"], mode="swap", target=TARGET)
        return
    swapped = hf.analyze(SOURCE, loaded, ["unas", "dnas"], mode="swap", target=TARGET)
    src, tgt = _ids(swapped)
    ref = _eager(loaded.model, src, tgt)
    for kind, maps in zip(KINDS, (ref.encoder_attentions, ref.decoder_attentions, ref.cross_attentions),
                          strict=True):
        torch.testing.assert_close(swapped.weights[kind]["unas"], torch.stack(maps)[:, 0], rtol=0, atol=1e-5)
    with torch.no_grad(), hf.use_variant(loaded.model, "unas"):
        out = loaded.model(input_ids=src, decoder_input_ids=tgt, use_cache=False).last_hidden_state
    torch.testing.assert_close(out, ref.last_hidden_state, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=r"u: swap mode on an encoder-decoder.*expected a number"):
        hf.analyze(SOURCE, loaded, ["hnas"], mode="swap", target=TARGET, u=torch.full((2, 4), 0.3))


def test_no_target_reads_the_decoder_start_token_alone(tiny):
    loaded = tiny("bart")
    result = hf.analyze(SOURCE, loaded, ["unas"])
    assert result.target.input_ids == [decoder_start_id(loaded.model.config)]
    assert result.weights["cross"]["unas"].shape[-2:] == (1, len(result.source.tokens))
    assert any("no target" in n for n in result.notes)
    view = result.view("cross")
    assert view.weights["unas"].shape == result.weights["cross"]["unas"].shape
    assert view.tokens == result.source.tokens and not view.model.causal
    assert result.view("decoder").model.causal


def test_bad_input_is_a_worded_error_naming_the_argument(tiny, minilm, tmp_path):
    loaded = tiny("bart")
    with pytest.raises(ValueError, match=r"target is too long.*expected at most \d+ tokens.*got \d+"):
        hf.analyze(SOURCE, loaded, target="word " * 200)
    with pytest.raises(ValueError, match=r"text is too long.*expected at most"):
        hf.analyze("word " * 200, loaded, target=TARGET)
    with pytest.raises(ValueError, match=r"target is empty.*expected the text the decoder reads"):
        hf.analyze(SOURCE, loaded, target="  ")
    with pytest.raises(ValueError, match=r"target must be a str.*got int"):
        hf.analyze(SOURCE, loaded, target=3)
    with pytest.raises(ValueError, match=r"target is for encoder-decoder.*expected target=None, got a"):
        hf.analyze(SOURCE, minilm, target=TARGET)
    with pytest.raises(ValueError, match=r"window: an encoder-decoder's source and target are analysed"):
        hf.analyze(SOURCE, loaded, target=TARGET, window=16)
    with pytest.raises(ValueError, match=r"is an encoder-decoder.*expected hf.analyze\(text, model, target"):
        hf.stream_analysis(SOURCE, loaded)
    with pytest.raises(ValueError, match=r"is an encoder-decoder.*batch_weights takes one text"):
        hf.batch_weights(loaded, torch.tensor([[5, 6, 7]]), None)
    with pytest.raises(ValueError, match=r"kind must be one of encoder, decoder, cross, got 'self'"):
        hf.analyze(SOURCE, loaded, ["unas"]).view("self")
    with pytest.raises(ValueError, match=r"u must .*\(L, H\).*got shape \(3, 4\) \(the encoder of"):
        hf.analyze(SOURCE, loaded, ["hnas"], target=TARGET, u=torch.full((3, 4), 0.5))
    whisper = tmp_path / "whisper"
    whisper.mkdir()
    (whisper / "config.json").write_text(json.dumps({"model_type": "whisper", "is_encoder_decoder": True}))
    with pytest.raises(hf.ModelLoadError, match=r"encoder-decoder \(whisper\): Whisper's encoder reads "
                                                r"audio.*T5, mT5, BART, mBART, Pegasus, Marian"):
        hf.load_model(whisper)


def test_a_tensor_u_per_layer_and_head_is_applied_per_kind(tiny):
    loaded = tiny("t5")
    u = torch.tensor([[0.0] * 4, [1.0] * 4])  # layer 0 UNAS, layer 1 DNAS, in every stack
    result = hf.analyze(SOURCE, loaded, ["unas", "dnas", "hnas"], target=TARGET, u=u)
    for kind in KINDS:
        w = result.weights[kind]
        torch.testing.assert_close(w["hnas"][0], w["unas"][0], rtol=0, atol=1e-6)
        torch.testing.assert_close(w["hnas"][1], w["dnas"][1], rtol=0, atol=1e-6)


def test_sinkhorn_rounds_apply_per_kind_the_decoder_taking_its_causal_rule(tiny):
    """iters=5: the encoder's and the cross-attention's Sinkhorn run 5 rounds, the decoder's causal
    self-attention 1 (its causal rule), each equal to the reference on literal scores."""
    loaded = tiny("bart")
    result = hf.analyze(SOURCE, loaded, ["dnas", "sinkhorn"], target=TARGET, iters=5)
    assert result.iters == 5
    scores = _literal_scores(loaded, *_ids(result))
    for kind in KINDS:
        causal = kind == "decoder"
        for layer, s in enumerate(scores[kind]):
            ref = attention_weights(s, "sinkhorn", causal=causal, **({} if causal else {"iters": 5}))[0]
            torch.testing.assert_close(result.weights[kind]["sinkhorn"][layer], ref, rtol=0, atol=1e-5,
                                       msg=f"{kind} layer {layer}")
    one_round = attention_weights(scores["cross"][0], "sinkhorn", iters=1)[0]
    assert (result.weights["cross"]["sinkhorn"][0] - one_round).abs().max() > 1e-6, "5 rounds, not 1"
    torch.testing.assert_close(result.weights["decoder"]["sinkhorn"], result.weights["decoder"]["dnas"],
                               rtol=0, atol=1e-5)  # causal iters=1 is causal DNAS
    assert any("decoder's self-attention is causal: sinkhorn uses iters=1" in n for n in result.notes)
    assert any("cross-attention are not causal: they take iters=5" in n for n in result.notes)
    with pytest.raises(ValueError, match=r"iters must be 1 for causal sinkhorn"):
        hf.analyze(SOURCE, loaded, ["sinkhorn"], mode="swap", target=TARGET, iters=5)


def test_low_level_swaps_refuse_a_per_layer_tensor_and_interventions_say_what_is_supported(tiny):
    """hf.use_variant's layer counter counts every attention call (the three kinds interleave), so a
    per-layer or per-head tensor is refused on an encoder-decoder, pointing to hf.analyze(..., target=);
    a number still swaps every call; per-head interventions refuse it in words."""
    from attnlab.hf.beyond.interventions import head_interventions

    loaded = tiny("bart")
    src, tgt = torch.tensor([[0, 5, 6, 7, 2]]), torch.tensor([[2, 5, 6]])
    for u in (torch.full((2, 4), 0.3), torch.full((4,), 0.3)):
        with pytest.raises(ValueError, match=r"u: use_variant on an encoder-decoder \(bart\).*expected a "
                                             r"number, got a tensor of shape.*hf.analyze\(source, model, "
                                             r"target"):
            with hf.use_variant(loaded.model, "hnas", u=u):
                pass
    assert loaded.model.config._attn_implementation != "attnlab_hnas"  # nothing was swapped in
    with torch.no_grad(), hf.use_variant(loaded.model, "hnas", u=torch.tensor(0.3)):
        loaded.model(input_ids=src, decoder_input_ids=tgt, use_cache=False)
    with pytest.raises(ValueError, match=r"per-head interventions do not support encoder-decoders: .* is a "
                                         r"bart encoder-decoder.*Supported on it: .*not supported: one head"):
        head_interventions(loaded, SOURCE)
