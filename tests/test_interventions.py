"""Per-head interventions and faithfulness (attnlab.hf.beyond: interventions, faithfulness) against
a literal one-head-swapped forward, on tiny random models (encoder; causal LMs with their LM head,
GPT-2 and LLaMA with grouped-query attention). Seeded and offline."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import CORPUS, _bpe_tokenizer, _config, build_tiny_model
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

from attnlab import VARIANTS, attention_weights, hf
from attnlab.hf.beyond import faithfulness as fa
from attnlab.hf.beyond import interventions as iv

TEXT = "Attention lets every word look at every other word."

# ----------------------------------------------------------------------------------------------
# A literal reference: eager attention, one (layer, head) replaced by a variant, one forward per head
# ----------------------------------------------------------------------------------------------

_REF = {"target": None, "variant": "dnas", "calls": 0}


def _reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    layer = _REF["calls"]
    _REF["calls"] += 1
    n_rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(n_rep, 1), value.repeat_interleave(n_rep, 1)  # (B, H, N, D)
    scores = query @ key.transpose(-1, -2) * (scaling or query.shape[-1] ** -0.5)
    N = key.shape[-2]
    causal = bool(getattr(module, "is_causal", False)) and query.shape[-2] == N
    mask = torch.ones(N, N, dtype=torch.bool).tril() if causal else None
    weights = attention_weights(scores, "unas", mask=mask)
    if _REF["target"] is not None and _REF["target"][0] == layer:
        h = _REF["target"][1]
        extra = {"hnas": {"u": 0.5}, "sinkhorn": {"iters": 1 if causal else 3}}.get(_REF["variant"], {})
        weights[:, h] = attention_weights(scores[:, h], _REF["variant"], mask=mask, causal=causal, **extra)
    return (weights @ value).transpose(1, 2).contiguous(), None


AttentionInterface.register("test_reference_head", _reference_attention)
AttentionMaskInterface.register("test_reference_head", sdpa_mask)


def _reference_run(net, ids, target, variant, lm: bool):
    _REF.update(target=target, variant=variant, calls=0)
    previous = net.config._attn_implementation
    net.set_attn_implementation("test_reference_head")
    try:
        with torch.no_grad():
            out = net(input_ids=ids, use_cache=False, output_hidden_states=True)
    finally:
        net.set_attn_implementation(previous)
    if lm:
        logp = torch.log_softmax(out.logits[0, :-1].double(), -1)
        return logp.gather(-1, ids[0, 1:, None])[:, 0].mean()
    return out.hidden_states[-1][0].double()  # (N, D)


def _sharpen(model, seed: int = 0):
    """Matrices ~ N(0, 0.5): peaked attention, so that a variant's swap changes the output (the default
    initialization, std 0.02, gives near-uniform maps on which every variant agrees). Norms stay 1."""
    torch.manual_seed(seed)
    for p in model.parameters():
        if p.dim() == 2:
            p.data.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module")
def lm_dirs(tmp_path_factory):
    """arch -> directory of a tiny causal LM saved with its LM head (GPT-2 ties it, LLaMA does not)."""
    import transformers

    out = {}
    for arch, cls in (("gpt2", "GPT2LMHeadModel"), ("llama", "LlamaForCausalLM")):
        tok = _bpe_tokenizer(arch)
        model = _sharpen(getattr(transformers, cls)(_config(arch, len(tok))))
        directory = tmp_path_factory.mktemp(f"lm-{arch}")
        model.save_pretrained(directory)
        tok.save_pretrained(directory)
        out[arch] = directory
    return out


@pytest.fixture(scope="module")
def sharp_dir(tmp_path_factory):
    """arch -> a tiny encoder (conftest's, tokenizer included) with sharpened weights."""
    from transformers import AutoModel

    built = {}

    def make(arch: str):
        if arch not in built:
            directory = build_tiny_model(arch, tmp_path_factory.mktemp(f"sharp-{arch}"))
            _sharpen(AutoModel.from_pretrained(directory)).save_pretrained(directory)
            built[arch] = directory
        return built[arch]

    return make


def test_encoder_interventions_match_the_literal_one_head_swap(sharp_dir):
    loaded = hf.load_model(sharp_dir("bert"))
    ids = loaded.tokenizer(TEXT, return_tensors="pt")["input_ids"]
    result = iv.head_interventions(loaded, TEXT, "dnas", batch_size=3)  # heads split over batches
    base = _reference_run(loaded.model, ids, None, "dnas", lm=False)
    for layer, head in ((0, 0), (0, 3), (1, 2)):
        y = _reference_run(loaded.model, ids, (layer, head), "dnas", lm=False)
        hidden = (1 - torch.nn.functional.cosine_similarity(y, base, dim=-1)).mean()
        pooled = 1 - torch.nn.functional.cosine_similarity(y.mean(0), base.mean(0), dim=0)
        assert float(result.measures["hidden_cosine"][layer, head]) == pytest.approx(float(hidden), abs=1e-6)
        assert float(result.measures["pooled_cosine"][layer, head]) == pytest.approx(float(pooled), abs=1e-6)
    assert float(result.measures["hidden_cosine"].max()) > 1e-4  # swapping to DNAS changes something
    assert loaded.model.config._attn_implementation != iv.INTERVENE  # restored
    assert all("forward" not in b.__dict__ for b in loaded.model.encoder.layer)


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_can_be_swapped_in_and_unas_changes_nothing(sharp_dir, variant):
    loaded = hf.load_model(sharp_dir("distilbert"))
    result = iv.head_interventions(loaded, TEXT, variant)
    for name, m in result.measures.items():
        assert m.shape == (2, 4) and not bool(m.isnan().any())
        if variant == "unas":  # the model's own softmax: no change up to rounding
            assert float(m.abs().max()) < 1e-6, name
        else:
            assert float(m.max()) > 1e-5, name
    table = result.table()
    assert set(table.measure) == set(iv.ENCODER_MEASURES) and len(table) == 2 * 8


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_causal_lm_interventions_match_the_literal_log_likelihood(lm_dirs, arch):
    loaded = iv.load_with_lm_head(lm_dirs[arch])
    assert iv.has_lm_head(loaded.model)
    ids = loaded.tokenizer(CORPUS[1], return_tensors="pt")["input_ids"]
    result = iv.head_interventions(loaded, CORPUS[1], "dnas")
    base = _reference_run(loaded.model, ids, None, "dnas", lm=True)
    assert result.baseline["loglik_per_token"] == pytest.approx(float(base), abs=1e-5)
    for layer, head in ((0, 1), (1, 3)):  # LLaMA: heads 0, 1 share value head 0; 2, 3 value head 1
        change = _reference_run(loaded.model, ids, (layer, head), "dnas", lm=True) - base
        assert float(result.measures["loglik_change"][layer, head]) == pytest.approx(float(change), abs=1e-5)


def test_intervention_bad_inputs(tiny_model_dir, lm_dirs):
    base_causal = hf.load_model(tiny_model_dir("gpt2"))  # no LM head
    with pytest.raises(ValueError, match="needs the LM head.*load_with_lm_head"):
        iv.head_interventions(base_causal, TEXT, "dnas")
    lm = iv.load_with_lm_head(lm_dirs["gpt2"])
    one = lm.tokenizer("Attention", return_tensors="pt")["input_ids"][:, :1]
    with pytest.raises(ValueError, match="at least 2"):
        iv.head_interventions(lm, one, "dnas")
    enc = hf.load_model(tiny_model_dir("bert"))
    with pytest.raises(ValueError, match="variant must be one of"):
        iv.head_interventions(enc, TEXT, "softmax")
    with pytest.raises(ValueError, match="batch_size"):
        iv.head_interventions(enc, TEXT, "dnas", batch_size=0)
    with pytest.raises(ValueError, match=r"u must be a number in \[0, 1\]"):
        iv.head_interventions(enc, TEXT, "hnas", {"u": 2.0})
    with pytest.raises(ValueError, match="empty"):
        iv.head_interventions(enc, "   ", "dnas")
    with pytest.raises(ValueError, match="not a causal LM"):
        iv.load_with_lm_head(tiny_model_dir("bert"))


# ----------------------------------------------------------------------------------------------
# Faithfulness
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow  # 1-4 s: .ci/run runs it, the inner loop does not
def test_faithfulness_table_and_literal_leave_one_out(sharp_dir):
    from scipy.stats import kendalltau

    loaded = hf.load_model(sharp_dir("bert"))
    result = fa.faithfulness(loaded, TEXT, batch_size=4)
    assert set(result.table.variant) == set(VARIANTS)
    assert set(result.table.measure) == set(fa.MEASURES)
    n = len(result.positions)
    assert (result.table.n_tokens == n).all() and n == len(result.tokens)
    # leave-one-out for one token, literally: the model with DNAS, token p masked
    enc = loaded.tokenizer(TEXT, return_tensors="pt")
    ids = enc["input_ids"]
    p = result.positions[2]
    keep = torch.ones_like(ids)
    keep[0, p] = 0
    with torch.no_grad(), hf.use_variant(loaded.model, "dnas"):
        a = loaded.model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0]
        b = loaded.model(input_ids=ids, attention_mask=keep).last_hidden_state[0]
    others = keep[0].bool()
    expect = 1 - torch.nn.functional.cosine_similarity(
        a[others].mean(0).double(), b[others].mean(0).double(), dim=0
    )
    assert float(result.leave_one_out["dnas"][2]) == pytest.approx(float(expect), abs=1e-6)
    row = result.table[(result.table.variant == "dnas") & (result.table.measure == "column_mass")].iloc[0]
    tau = kendalltau(result.importance["dnas"]["column_mass"].numpy(), result.leave_one_out["dnas"].numpy())
    assert row.tau == pytest.approx(tau.statistic)


def test_faithfulness_reports_progress_and_keeps_no_record_of_the_masked_copies(tiny_model_dir, monkeypatch):
    """One step per masked copy (N forwards of N tokens per variant: the cost a long window has), to a
    callback and a tqdm bar; the values recorded for contribution_mass are the one unmasked forward's."""
    loaded = hf.load_model(tiny_model_dir("bert"))
    recorded = []
    real = fa.record_values

    @contextlib.contextmanager
    def spy(model, paths):
        with real(model, paths) as forwards:
            yield forwards
        recorded.append(len(forwards))

    monkeypatch.setattr(fa, "record_values", spy)
    seen = []
    res = fa.faithfulness(loaded, TEXT, ("unas", "dnas"), batch_size=3, progress=True,
                          on_progress=lambda done, total: seen.append((done, total)))
    n = len(res.positions)
    assert seen[-1] == (2 * n, 2 * n) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert len(seen) == 2 * -(-n // 3)  # one call per batch of 3 copies, per variant
    assert recorded == [1, 1]  # per variant: the unmasked forward only


def test_faithfulness_reads_value_paths_under_the_model_lock(tiny_model_dir, monkeypatch):
    # a traced model's first value_paths runs a forward: it must hold loaded.lock as the other callers do
    import threading

    loaded = hf.load_model(tiny_model_dir("bert"))
    held, real = [], fa.value_paths

    def probe():  # another thread: the lock is free unless the caller holds it
        free = loaded.lock.acquire(blocking=False)
        if free:
            loaded.lock.release()
        held.append(not free)

    def spy(model):
        t = threading.Thread(target=probe)
        t.start()
        t.join()
        return real(model)

    monkeypatch.setattr(fa, "value_paths", spy)
    fa.faithfulness(loaded, TEXT, ("unas",), measures=("contribution_mass",), batch_size=8)
    assert held == [True]


def test_faithfulness_bad_inputs(tiny_model_dir):
    loaded = hf.load_model(tiny_model_dir("bert"))
    with pytest.raises(ValueError, match="at least 2 tokens"):
        fa.faithfulness(loaded, "word")
    with pytest.raises(ValueError, match="non-empty"):
        fa.faithfulness(loaded, "")
    with pytest.raises(ValueError, match="measures must be"):
        fa.faithfulness(loaded, TEXT, measures=("attention",))
    with pytest.raises(ValueError, match="variants must be among"):
        fa.faithfulness(loaded, TEXT, variants=("nope",))


# ----------------------------------------------------------------------------------------------
# Batched swaps = one head at a time, for every head; what the batching skips; windows
# ----------------------------------------------------------------------------------------------

LONG = " ".join(CORPUS * 6)  # several 64-token windows of the tiny models


def _reference_map(loaded, ids, lm: bool) -> dict[str, torch.Tensor]:
    """Every (layer, head) swapped literally, one full forward each."""
    L, H = loaded.info.n_layers, loaded.info.n_heads
    base = _reference_run(loaded.model, ids, None, "dnas", lm=lm)
    names = iv.LM_MEASURES if lm else iv.ENCODER_MEASURES
    out = {name: torch.zeros(L, H, dtype=torch.float64) for name in names}
    cos = torch.nn.functional.cosine_similarity
    for layer in range(L):
        for head in range(H):
            y = _reference_run(loaded.model, ids, (layer, head), "dnas", lm=lm)
            if lm:
                out["loglik_change"][layer, head] = y - base
            else:
                out["hidden_cosine"][layer, head] = (1 - cos(y, base, dim=-1)).mean()
                out["pooled_cosine"][layer, head] = 1 - cos(y.mean(0), base.mean(0), dim=0)
    return out


@pytest.mark.parametrize("arch", ["bert", "gpt2", "llama"])
def test_batched_swaps_equal_one_head_at_a_time_for_every_head(sharp_dir, lm_dirs, arch):
    lm = arch in lm_dirs
    loaded = iv.load_with_lm_head(lm_dirs[arch]) if lm else hf.load_model(sharp_dir(arch))
    ids = loaded.tokenizer(CORPUS[1], return_tensors="pt")["input_ids"]
    expected = _reference_map(loaded, ids, lm)
    for batch_size in (1, 3, None):  # one head per forward, heads split unevenly, a whole layer
        result = iv.head_interventions(loaded, ids, "dnas", batch_size=batch_size)
        for name, m in expected.items():
            torch.testing.assert_close(result.measures[name], m, atol=1e-6 if not lm else 1e-5, rtol=0)
    assert float(next(iter(expected.values())).abs().max()) > 1e-4  # the swaps do change the output


def test_swaps_skip_the_layers_below_and_share_the_swapped_layers_projections(sharp_dir):
    loaded = hf.load_model(sharp_dir("bert"))
    layers = loaded.model.encoder.layer  # 2 layers x 4 heads
    calls = {0: [], 1: []}
    hooks = [
        layers[i].attention.self.query.register_forward_hook(
            lambda _m, _i, out, i=i: calls[i].append((out.shape[0], out.stride(0)))
        )
        for i in (0, 1)
    ]
    try:
        iv.head_interventions(loaded, TEXT, "dnas", batch_size=2)
    finally:
        for h in hooks:
            h.remove()
    # layer 0: the unmodified forward, then its 2 swap batches (computed once per batch: stride 0);
    # layer 1: the unmodified forward, layer 0's 2 batches (4 different rows each), its own 2 batches
    assert calls[0] == [(1, calls[0][0][1]), (2, 0), (2, 0)]
    assert [b for b, _ in calls[1]] == [1, 2, 2, 2, 2]
    assert [s == 0 for _, s in calls[1][1:]] == [False, False, True, True]


def test_interventions_describe_the_chosen_window(sharp_dir):
    loaded = hf.load_model(sharp_dir("bert"))
    stream = hf.stream_analysis(LONG, loaded, ("unas",))
    assert stream.windowing.n_windows >= 3
    win = stream.window(2).window
    by_index = iv.head_interventions(loaded, LONG, "dnas", window_index=2)
    by_ids = iv.head_interventions(loaded, torch.tensor([win.input_ids]), "dnas")
    by_window = iv.head_interventions(loaded, win, "dnas")
    assert by_index.tokens == win.tokens
    for name in iv.ENCODER_MEASURES:
        torch.testing.assert_close(by_index.measures[name], by_ids.measures[name], atol=0, rtol=0)
        torch.testing.assert_close(by_window.measures[name], by_ids.measures[name], atol=0, rtol=0)
    n = stream.windowing.n_windows
    with pytest.raises(ValueError, match=rf"window_index must be an integer in \[0, {n - 1}\].*{n} window"):
        iv.head_interventions(loaded, LONG, "dnas", window_index=n)
    with pytest.raises(ValueError, match="window_index"):
        iv.head_interventions(loaded, LONG, "dnas", window_index=-1)


def test_faithfulness_and_flow_describe_the_chosen_window(tiny_model_dir):
    from attnlab import flow
    from attnlab.hf.analysis.one_window import text_window, window_flow

    loaded = hf.load_model(tiny_model_dir("bert"))
    stream = hf.stream_analysis(LONG, loaded, ("unas", "dnas"))
    n = stream.windowing.n_windows
    win = text_window(loaded, LONG, 1)
    assert win.input_ids == stream.window(1).window.input_ids
    a = fa.faithfulness(loaded, LONG, ("dnas",), measures=("column_mass",), window_index=1)
    b = fa.faithfulness(loaded, win, ("dnas",), measures=("column_mass",))
    assert a.tokens == b.tokens and a.table.tau.tolist() == b.table.tau.tolist()
    with pytest.raises(ValueError, match=rf"window_index must be an integer in \[0, {n - 1}\]"):
        fa.faithfulness(loaded, LONG, ("dnas",), window_index=n)
    f, w = window_flow(loaded, LONG, "dnas", [0, 3], window_index=1)
    expect = flow.attention_flow(stream.window(1).weights["dnas"], [0, 3])
    assert w.index == 1 and torch.equal(f, expect)
    with pytest.raises(ValueError, match="window_index"):
        window_flow(loaded, LONG, "dnas", [0], window_index=n)
    with pytest.raises(ValueError, match="outputs: the flow of 6400 output.*over attnlab.flow.MAX_FLOW_WORK"):
        window_flow(loaded, LONG, "dnas", list(range(64)) * 100, window_index=0)
