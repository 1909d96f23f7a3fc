"""Beyond weights: value paths and contribution norms, sinks, attention flow (attnlab.values,
attnlab.contributions, attnlab.sinks, attnlab.flow) against literal computations.

Architecture coverage: tiny random models built from configs (conftest.TINY_CONFIGS, plus Mistral
and Qwen2 here), in memory; seeded and offline.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TINY_ARCHS, _config

from attnlab import VARIANTS, contributions, flow, hf, sinks, stats
from attnlab.hf.capture import values

EXTRA_CONFIGS = {  # GQA with 2 value heads for 4 query heads, like the tiny LLaMA
    "mistral": dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    ),
    "qwen2": dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    ),
}
ARCHS = (*TINY_ARCHS, *EXTRA_CONFIGS)


def _tiny(arch: str, vocab: int = 100):
    import transformers

    torch.manual_seed(0)
    if arch in EXTRA_CONFIGS:
        cls = {"mistral": "MistralConfig", "qwen2": "Qwen2Config"}[arch]
        config = getattr(transformers, cls)(vocab_size=vocab, **EXTRA_CONFIGS[arch])
    else:
        config = _config(arch, vocab)
    model = transformers.AutoModel.from_config(config).eval()
    for p in model.parameters():  # biases too: b_V must enter f_h(x_j)
        p.data.normal_(0.0, 0.2)
    return model


def _literal_values(model, arch: str, hidden: tuple, layer: int):
    """(v (N, H_kv, Dh), W_O (H*Dh, D) as in: attention output @ W_O) from the model's weights."""
    x = hidden[layer][0]  # (N, D) input of the layer
    if arch in ("bert", "roberta"):
        att = model.encoder.layer[layer].attention
        v = att.self.value(x)
        w_out = att.output.dense.weight.t()
    elif arch == "distilbert":
        att = model.transformer.layer[layer].attention
        v, w_out = att.v_lin(x), att.out_lin.weight.t()
    elif arch == "gpt2":
        block = model.h[layer]
        D = x.shape[-1]
        v = (block.ln_1(x) @ block.attn.c_attn.weight + block.attn.c_attn.bias)[:, 2 * D :]
        w_out = block.attn.c_proj.weight
    else:  # llama, mistral, qwen2
        block = model.layers[layer]
        v = block.self_attn.v_proj(block.input_layernorm(x))
        w_out = block.self_attn.o_proj.weight.t()
    cfg = model.config
    H = cfg.num_attention_heads
    H_kv = getattr(cfg, "num_key_value_heads", None) or H
    return v.reshape(v.shape[0], H_kv, -1), w_out, H


@pytest.mark.parametrize("arch", ARCHS)
def test_value_norms_and_gram_match_the_weights(arch):
    model = _tiny(arch)
    ids = torch.randint(3, 100, (1, 9))
    paths = values.value_paths(model)
    assert len(paths) == 2
    with torch.no_grad(), values.record_values(model, paths) as forwards:
        out = model(input_ids=ids, output_hidden_states=True)
    summary = values.summarize(forwards[0], paths)
    for layer in range(2):
        with torch.no_grad():
            v, w_out, H = _literal_values(model, arch, out.hidden_states, layer)
        H_kv, Dh = v.shape[1], v.shape[2]
        f = torch.stack(
            [v[:, h // (H // H_kv)] @ w_out[h * Dh : (h + 1) * Dh] for h in range(H)]
        )  # (H, N, D)
        torch.testing.assert_close(summary.norms[layer], f.norm(dim=-1), rtol=1e-5, atol=1e-5)
        gram = torch.einsum("hnd,knd->nhk", f, f)
        torch.testing.assert_close(summary.gram(layer), gram, rtol=1e-4, atol=1e-5)


def test_a_model_without_a_readable_value_path_is_refused():
    class Attention(torch.nn.Module):  # an attention module with no known projections
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(8, 24)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("C", (), {"num_attention_heads": 2})()
            self.attn = Attention()

    with pytest.raises(hf.UnsupportedModelError, match="no attention module attnlab can read values from"):
        values.value_paths(Model())


def test_contribution_mass_and_layer_norms_against_literal_vectors():
    torch.manual_seed(1)
    H, N, D = 3, 7, 5
    w = torch.softmax(torch.randn(H, N, N), -1)
    f = torch.randn(H, N, D)
    norms = contributions.value_norms(f)
    c = contributions.contribution_mass(w, norms)
    literal = [
        [
            sum(float(w[h, i, j]) * math.sqrt(sum(float(x) ** 2 for x in f[h, j])) for i in range(N))
            for j in range(N)
        ]
        for h in range(H)
    ]
    torch.testing.assert_close(c, torch.tensor(literal), rtol=1e-5, atol=1e-6)
    full = torch.einsum("hij,hjd->ijd", w, f).norm(dim=-1)  # the (N, N, D) tensor, for the reference only
    for rows in (1, 3, 64):
        got = contributions.layer_contribution_norms(w, contributions.value_gram(f), block_rows=rows)
        torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="gram must be"):
        contributions.layer_contribution_norms(w, torch.zeros(N, H + 1, H + 1))
    with pytest.raises(ValueError, match="norms must be"):
        contributions.contribution_mass(w, torch.ones(H, N + 1))


def test_contribution_statistics_by_hand():
    # one head, 2 queries, 4 keys: key 3 gets little weight but a large value norm
    w = torch.tensor([[[0.5, 0.3, 0.19, 0.01], [0.5, 0.3, 0.19, 0.01]]])[None]  # (1, 1, 2, 4)
    norms = torch.tensor([[[1.0, 1.0, 1.0, 50.0]]])
    st = contributions.contribution_statistics(w, norms, eps=0.01, eps_relative=0.1)
    # m = (1, .6, .38, .02); m N/M = (2, 1.2, .76, .04): key 3 explained away by weight
    # c = (1, .6, .38, 1.0); c~ N/M = c * 4 / 2.98 = (1.34, .81, .51, 1.34): not by contribution
    assert float(st["away_by_weight_not_contribution"]) == pytest.approx(0.25)
    assert float(st["contribution_explained_away_relative"]) == 0.0
    assert float(st["contribution_gini"]) == pytest.approx(
        float(stats.gini(torch.tensor([1.0, 0.6, 0.38, 1.0])))
    )


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_analyze_with_contributions_for_every_variant(tiny_model_dir, arch, mode):
    loaded = hf.load_model(tiny_model_dir(arch))
    result = hf.analyze(
        "Attention lets every word look at every other word.", loaded, VARIANTS, mode=mode, contributions=True
    )
    w = result.windows[0]
    assert set(w.values) == set(VARIANTS)
    for v in VARIANTS:
        norms = w.values[v].norms  # (L, H, N)
        assert norms.shape == w.weights[v].shape[:-2] + w.weights[v].shape[-1:]
        torch.testing.assert_close(result.contribution_mass[v], w.weights[v].sum(-2) * norms)
        full = w.layer_contribution_norms(v, 1)
        assert full.shape == w.weights[v].shape[-2:] and bool((full >= 0).all())
    table = result.table()
    for stat in contributions.CONTRIBUTION_STATISTICS:
        rows = table[table.statistic == stat]
        assert set(rows.variant) == set(VARIANTS) and len(rows) == len(VARIANTS) * 2 * 4
    if mode == "recompute":
        assert result.value_norms.shape == w.values["unas"].norms.shape
    else:
        with pytest.raises(ValueError, match="swap mode"):
            _ = result.value_norms
    plain = hf.analyze("Attention lets every word look at every other word.", loaded, VARIANTS, mode=mode)
    with pytest.raises(ValueError, match="contributions=True"):
        _ = plain.contribution_mass
    assert len(plain.table()) + len(VARIANTS) * 8 * len(contributions.CONTRIBUTION_STATISTICS) == len(table)


# ----------------------------------------------------------------------------------------------
# Sinks
# ----------------------------------------------------------------------------------------------


def test_sink_statistics_by_hand():
    # 3 queries, 4 keys; key 0 is the sink
    w = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.4, 0.6, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])[None, None]
    keys = sinks.sink_keys(4, which="first")
    assert keys.tolist() == [True, False, False, False]
    col, kept = sinks.sink_excluded_column_mass(w, keys)
    assert kept[0, 0].tolist() == [True, True, False]  # row 2 has everything on the sink
    torch.testing.assert_close(col[0, 0], torch.tensor([1 / 3 + 1.0, 1 / 3, 1 / 3]))
    st = sinks.sink_statistics(w, keys, special=torch.tensor([True, False, False, True]), eps_relative=0.5)
    assert float(st["sink_mass_first"]) == pytest.approx((0.7 + 0.4 + 1.0) / 3)
    assert float(st["sink_mass_special"]) == pytest.approx((0.8 + 0.4 + 1.0) / 3)
    # m' N'/M' = (4/3, 1/3, 1/3) * 3 / 2 = (2, .5, .5): none below 0.5
    assert float(st["explained_away_relative_no_sinks"]) == 0.0
    assert float(st["column_mass_min_no_sinks"]) == pytest.approx(1 / 3)


def test_sinks_for_every_variant_on_real_text(minilm):
    result = hf.analyze("The sink takes the mass, and the rest is spread out.", minilm, VARIANTS)
    table = result.windows[0].sinks()
    assert set(table.variant) == set(VARIANTS)
    assert set(table.statistic) == set(sinks.SINK_STATISTICS)
    assert not table.value.isna().any()
    shares = table[table.statistic != "column_mass_min_no_sinks"].value
    assert ((shares >= 0) & (shares <= 1)).all() and (table.value >= 0).all()


def test_sink_bad_inputs():
    with pytest.raises(ValueError, match="which must be one of"):
        sinks.sink_keys(4, which="cls")
    with pytest.raises(ValueError, match="needs special"):
        sinks.sink_keys(4, which="special")
    with pytest.raises(ValueError, match=r"keys must be a bool tensor of shape \(4,\)"):
        sinks.sink_mass(torch.ones(2, 4) / 4, torch.ones(3, dtype=torch.bool))


# ----------------------------------------------------------------------------------------------
# Attention flow
# ----------------------------------------------------------------------------------------------


def test_flow_on_a_hand_checked_graph():
    # inputs x0, x1 -> layer 1 -> outputs. A0 = [[1, 0], [.5, .5]], A1 = [[.5, .5], [0, 1]].
    # output 0 -> input 0: via (1,0) min(.5, 1) + via (1,1) min(.5, .5) = 1.0
    # output 0 -> input 1: via (1,0) 0 + via (1,1) min(.5, .5) = .5
    # output 1 -> input 0: via (1,1) min(1, .5) = .5; output 1 -> input 1: .5
    w = torch.tensor([[[1.0, 0.0], [0.5, 0.5]], [[0.5, 0.5], [0.0, 1.0]]])
    got = flow.attention_flow(w, add_residual=False)
    torch.testing.assert_close(got, torch.tensor([[1.0, 0.5], [0.5, 0.5]], dtype=torch.float64))
    # rollout multiplies instead: A1 A0 = [[.75, .25], [.5, .5]]
    torch.testing.assert_close(
        stats.attention_rollout(w, add_residual=False), torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    )
    torch.testing.assert_close(flow.attention_flow(w, [1], add_residual=False), got[1:])


def test_flow_is_bounded_by_each_layer_and_rows_match_subsets():
    torch.manual_seed(2)
    w = torch.softmax(torch.randn(3, 2, 6, 6) * 2, -1)
    full = flow.attention_flow(w)
    assert bool((full >= 0).all()) and bool((full <= 1 + 1e-6).all())
    caps = flow.flow_capacities(w)
    # a single-layer graph: flow from i to j is exactly the capacity A[i, j]
    torch.testing.assert_close(flow.attention_flow(w[:1]), caps[0], atol=2e-6, rtol=0)
    torch.testing.assert_close(flow.attention_flow(w, [4, 1]), full[[4, 1]])


def test_flow_refuses_work_beyond_its_limit_and_bad_outputs():
    w = torch.full((2, 1, 8, 8), 1 / 8)
    with pytest.raises(ValueError, match=r"over the limit max_work=.*at most 1 positions"):
        flow.attention_flow(w, max_work=flow.flow_work(2, 8, 1) * 1.5)
    with pytest.raises(ValueError, match="no output position fits"):
        flow.attention_flow(w, max_work=10)
    with pytest.raises(ValueError, match=r"outputs must be a non-empty list of positions in \[0, 7\]"):
        flow.attention_flow(w, [8])
    with pytest.raises(ValueError, match="outputs must be"):
        flow.attention_flow(w, [])
    with pytest.raises(ValueError, match="weights must be"):
        flow.attention_flow(torch.ones(2, 3, 4))
    assert math.isclose(flow.flow_work(6, 512, 1), 6 * 512**3)


def test_per_layer_figures_draw_one_curve_per_variant_and_measure():
    import pandas as pd

    from attnlab.figures import beyond as fb

    rows = [dict(variant=v, layer=layer, head=h, statistic=s, value=0.1 * layer + (0.5 if v == "dnas" else 0))
            for v in ("unas", "dnas") for layer in range(3) for h in range(2)
            for s in (fb.WEIGHT_STAT, fb.CONTRIBUTION_STAT, "sink_mass", "sink_mass_first")]
    table = pd.DataFrame(rows)
    for bundle, names in ((fb.weight_vs_contribution(table), ["unas by weight", "unas by contribution"]),
                          (fb.sink_mass_by_layer(table), ["unas: sinks", "unas: first position"])):
        traces = bundle.figure.data
        assert [t.name for t in traces[:2]] == names and len(traces) == 4
        assert list(traces[2].y) == pytest.approx([0.5, 0.6, 0.7])  # dnas, mean over heads per layer
        assert traces[0].line.color == traces[1].line.color != traces[2].line.color


def _head_maps(w: torch.Tensor, reads: list | None = None):
    """A causal window's lazy weights (HeadMaps) over the (L, H, N, N) tensor ``w``; ``reads`` logs
    every (layer, head) computed."""
    from attnlab.hf.compute.head_maps import HeadMaps

    def head(layer, h):
        if reads is not None:
            reads.append((layer, h))
        return w[layer, h].clone()

    return HeadMaps("dnas", tuple(w.shape), head)


def test_rollout_and_flow_read_head_maps_one_layer_at_a_time():
    # a causal window's weights are HeadMaps (--flow once failed: "weights must be a torch.Tensor")
    torch.manual_seed(0)
    L, H, N = 3, 2, 6
    w = torch.softmax(torch.randn(L, H, N, N), -1).tril()
    w = w / w.sum(-1, keepdim=True)
    reads = []
    maps = _head_maps(w, reads)
    mask = torch.rand(N, N) > 0.2
    torch.testing.assert_close(stats.attention_rollout(maps), stats.attention_rollout(w))
    torch.testing.assert_close(stats.attention_rollout(maps, mask=mask, all_layers=True),
                               stats.attention_rollout(w, mask=mask, all_layers=True))
    torch.testing.assert_close(flow.flow_capacities(maps), flow.flow_capacities(w))
    torch.testing.assert_close(flow.attention_flow(maps, [0, 4]), flow.attention_flow(w, [0, 4]))
    assert maps._whole is None and len(reads) == 4 * L * H  # per layer, never the whole (L, H, N, N)


def test_whole_weight_measures_take_head_maps_up_to_the_materialize_limit(monkeypatch):
    from attnlab.hf.compute import head_maps

    torch.manual_seed(1)
    w = torch.softmax(torch.randn(2, 2, 5, 5), -1)
    norms = torch.rand(2, 2, 5)
    torch.testing.assert_close(stats.column_mass(_head_maps(w)), stats.column_mass(w))
    torch.testing.assert_close(contributions.contribution_mass(_head_maps(w), norms),
                               contributions.contribution_mass(w, norms))
    keys = sinks.sink_keys(5, which="first")
    torch.testing.assert_close(sinks.sink_mass(_head_maps(w), keys), sinks.sink_mass(w, keys))
    monkeypatch.setattr(head_maps, "MATERIALIZE_LIMIT", 64)
    for measure in (lambda m: stats.column_mass(m), lambda m: contributions.contribution_mass(m, norms),
                    lambda m: sinks.sink_mass(m, keys)):
        with pytest.raises(ValueError, match=r"\(L, H, N, N\) = \(2, 2, 5, 5\).*over the 0 MiB limit"):
            measure(_head_maps(w))
    torch.testing.assert_close(stats.attention_rollout(_head_maps(w)), stats.attention_rollout(w))
