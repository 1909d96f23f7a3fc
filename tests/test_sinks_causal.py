"""Sinks as the literature measures them (Gu et al. 2024; Sun et al. 2024) against literal float64
computations on a model's own eager attention and hidden states, and the streamed window's sink table
against the dense one. Tiny random models, seeded, offline."""

from __future__ import annotations

import pytest
import torch

from attnlab import sinks


def _eager(directory, ids):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(directory, attn_implementation="eager")
    with torch.no_grad():
        out = model(ids, output_attentions=True, output_hidden_states=True)
    return torch.stack([a[0] for a in out.attentions]).double(), out.hidden_states  # (L, H, N, N)


def _literal_importance(a: torch.Tensor) -> torch.Tensor:
    """sum_i a_ij / (N - j), loops over keys (causal: queries j..N-1 may attend key j)."""
    L, H, N, _ = a.shape
    out = torch.zeros(L, H, N, dtype=torch.float64)
    for j in range(N):
        out[..., j] = a[..., j:, j].sum(-1) / (N - j)
    return out


@pytest.mark.parametrize("arch", ["gpt2", "llama", "mistral"])
def test_importance_and_sink_rate_equal_literal_float64_on_eager_attention(arch, tiny_model_dir,
                                                                           english_text):
    from attnlab import hf

    directory = tiny_model_dir(arch)
    res = hf.analyze(english_text[:300], hf.load_model(directory), variants=("unas", "dnas"))
    win = res.windows[0]
    ids = torch.tensor([win.window.input_ids])
    a, _ = _eager(directory, ids)
    L, H, N, _ = a.shape
    literal = _literal_importance(a) if arch != "mistral" else None
    if arch == "mistral":  # sliding window of 8: key j is attended by queries j .. j+7 only
        literal = torch.stack([a[..., j:j + 8, j].sum(-1) / min(8, N - j) for j in range(N)], -1)
    assert torch.allclose(sinks.sink_importance(a, causal=True, mask=None if arch != "mistral" else
                                                (torch.arange(N)[None, :] <= torch.arange(N)[:, None])
                                                & (torch.arange(N)[:, None] - torch.arange(N)[None, :] < 8)),
                          literal, atol=1e-12)
    got = win.sink_importance()["unas"].double()
    assert torch.allclose(got, literal, atol=2e-6)
    for eps in (0.0, 0.1, 0.3):
        rate = win.sink_rate(eps=eps)["unas"]
        want = torch.tensor([sum(float(literal[layer, h, 0]) > eps for h in range(H)) / H
                             for layer in range(L)], dtype=torch.float64)
        assert torch.equal(rate, want)
        if arch != "mistral":
            assert torch.equal(sinks.sink_rate(a, eps=eps), want)


def test_sink_rate_and_importance_refuse_bad_arguments():
    w = torch.softmax(torch.randn(2, 3, 5, 5), -1)
    for bad in (-0.1, 1.5, float("nan"), True, "0.3"):
        with pytest.raises(ValueError, match="eps must be a number in \\[0, 1\\]"):
            sinks.sink_rate(w, eps=bad)
    with pytest.raises(ValueError, match="position must be an integer in \\[-5, 4\\], got 5"):
        sinks.sink_rate(w, position=5)
    with pytest.raises(ValueError, match="weights must be \\(L, H, M, N\\)"):
        sinks.sink_rate(w[0])
    # a key no query may attend gets importance 0, not NaN
    nobody = torch.zeros(4, 4, dtype=bool)
    got = sinks.sink_importance(torch.zeros(1, 4, 4), causal=True, mask=nobody)
    assert torch.equal(got, torch.zeros(1, 4))


def test_sink_rate_takes_numpy_and_tensor_numbers_and_lives_in_stats_too(tiny_model_dir, english_text):
    """numpy scalars and 0-d tensors are ordinary eps and position values (docs/DESIGN.md §4), in
    sinks.sink_rate and WindowResult.sink_rate alike; attnlab.stats.sink_importance / sink_rate (the
    names the issue gave them) are attnlab.sinks' functions."""
    import numpy as np

    from attnlab import hf, stats

    assert stats.sink_importance is sinks.sink_importance and stats.sink_rate is sinks.sink_rate
    assert {"sink_importance", "sink_rate"} <= set(stats.__all__)
    torch.manual_seed(0)
    w = torch.softmax(torch.randn(2, 3, 5, 5).masked_fill(torch.ones(5, 5).triu(1).bool(), -torch.inf), -1)
    win = hf.analyze(english_text[:200], hf.load_model(tiny_model_dir("llama")), ["unas"]).windows[0]
    for eps, position in ((np.float32(0.25), np.int64(1)), (torch.tensor(0.25), torch.tensor(1)),
                          (np.float64(0.25), np.int32(-1))):
        want_eps, want_pos = float(eps), int(position)
        assert torch.equal(stats.sink_rate(w, eps=eps, position=position),
                           sinks.sink_rate(w, eps=want_eps, position=want_pos))
        assert torch.equal(win.sink_rate(eps=eps, position=position)["unas"],
                           win.sink_rate(eps=want_eps, position=want_pos)["unas"])
    with pytest.raises(ValueError, match="position must be an integer"):
        win.sink_rate(position=np.int64(len(win.tokens)))


def test_massive_activations_equal_literal_float64_on_hidden_states(tiny_model_dir, english_text):
    from attnlab import hf

    directory = tiny_model_dir("gpt2")
    loaded = hf.load_model(directory)
    table = hf.massive_activations(english_text[:200], loaded)
    ids = loaded.tokenizer(english_text[:200], return_tensors="pt")["input_ids"]
    _, hidden = _eager(directory, ids)
    L = len(table)
    assert L == len(hidden) - 1
    for layer in range(L - 1):  # the model's last hidden state has its final norm applied; a layer's has not
        h = hidden[layer + 1][0].double().abs()  # (N, d): the residual stream after layer `layer`
        top = h.max()
        token, dim = divmod(int(h.argmax()), h.shape[1])
        row = table.iloc[layer]
        assert row.max_abs == pytest.approx(float(top), rel=1e-6)
        assert (row.token_index, row.dim) == (token, dim)
        assert row.median_abs == pytest.approx(float(h.flatten().median()), rel=1e-6)
        assert row.ratio == pytest.approx(float(top / h.flatten().median()), rel=1e-6)
    nan = sinks.massive_activations(torch.full((1, 2, 3), float("nan")))
    assert torch.isnan(nan["max_abs"]).all() and torch.isnan(nan["ratio"]).all()
    with pytest.raises(ValueError, match="hidden must"):
        sinks.massive_activations(torch.zeros(2, 0, 3))


@pytest.mark.parametrize("which", ["first", "first+special"])
def test_streamed_sink_table_equals_the_dense_one(which, tiny_model_dir, english_text):
    from attnlab import hf

    loaded = hf.load_model(tiny_model_dir("llama"))
    res = hf.analyze(english_text[:300], loaded, variants=("unas", "dnas", "hnas", "sparsemax"))
    win = res.windows[0]
    got = win.sinks(which=which)
    ids = torch.tensor([win.window.input_ids])
    ref = hf.batch_weights(loaded, ids, variants=("unas", "dnas", "hnas", "sparsemax"))
    want = sinks.sink_table({v: w[:, 0] for v, w in ref.items()}, win.special, which=which, window=win.index)
    keys = ["variant", "layer", "head", "statistic"]
    both = got.merge(want, on=keys, suffixes=("", "_ref"))
    assert len(both) == len(want) == len(got)
    gap = (both.value - both.value_ref).abs()
    assert (gap <= 2e-5).all(), both[gap > 2e-5]


def test_a_native_decoders_importance_counts_only_the_queries_that_see_each_key(tmp_path):
    """attnlab's own causal checkpoint (weights materialized, not streamed): I_j divides by N - j, as
    sinks.sink_importance(causal=True) on its weights; a bidirectional window divides by N."""
    from attnlab import hf
    from attnlab.train import RunConfig, train

    text = "In the beginning God created the heaven and the earth. " * 80
    cfg = RunConfig.from_dict({
        "name": "dec", "model": {"kind": "decoder", "d_model": 16, "n_layers": 2, "n_heads": 2, "d_ff": 32},
        "data": {"tokenizer": "byte", "seq_len": 32},
        "train": {"steps": 2, "batch_size": 4, "warmup": 1, "eval_every": 2, "eval_batches": 1},
    })
    train(cfg, tmp_path / "dec", text=text, progress=False)
    win = hf.analyze("And God said, Let there be light.", hf.load_model(tmp_path / "dec")).windows[0]
    assert win.causal
    for v, got in win.sink_importance().items():
        want = sinks.sink_importance(win.weights[v].double(), causal=True)
        torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)
    win.causal = False  # the bidirectional rule, on the same weights
    for v, got in win.sink_importance().items():
        torch.testing.assert_close(got.double(), win.weights[v].double().sum(-2) / win.weights[v].shape[-2],
                                   atol=1e-6, rtol=1e-5)
