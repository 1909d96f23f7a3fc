"""attnlab.stats: each statistic against hand-computed values and literal loops, masks, no NaN."""

from __future__ import annotations

import io
import json
import math

import pandas as pd
import pytest
import torch

import attnlab
from attnlab import stats

# Rows sum to 1. Column masses (0.7, 0.8, 1.5).
W3 = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.0, 0.0, 1.0]], dtype=torch.float64)
# Rows 0 and 1 are real tokens, token 2 is padding.
VALID3 = torch.tensor([True, True, False])


def softmax_weights(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(*shape, generator=g, dtype=dtype) * 2, -1)


def padded_mask(n, n_valid):
    valid = torch.arange(n) < n_valid
    return valid, stats.pair_mask(valid)


# ----------------------------------------------------------------------------------------------
# Column mass and explaining away
# ----------------------------------------------------------------------------------------------


def test_column_mass_hand_values():
    assert torch.allclose(stats.column_mass(W3), torch.tensor([0.7, 0.8, 1.5], dtype=torch.float64))
    masked = stats.column_mass(W3, stats.pair_mask(VALID3))
    assert torch.allclose(masked, torch.tensor([0.7, 0.8, 0.0], dtype=torch.float64))


def test_column_mass_matches_literal_loop_with_mask():
    w = softmax_weights(2, 3, 5, 5)
    valid = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    mask = stats.pair_mask(valid)[:, None]  # (B, 1, M, N)
    got = stats.column_mass(w, mask)
    for b in range(2):
        for h in range(3):
            for j in range(5):
                want = sum(float(w[b, h, i, j]) for i in range(5) if valid[b, i] and valid[b, j])
                assert got[b, h, j].item() == pytest.approx(want, abs=1e-6)


def test_relative_column_mass_hand_values():
    w = torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]])  # M = 2, N = 3: masses 0.6, 0.35, 1.05
    rel = stats.relative_column_mass(w)
    assert torch.allclose(rel, torch.tensor([0.9, 0.525, 1.575]))
    assert rel.mean().item() == pytest.approx(1.0)
    masked = stats.relative_column_mass(W3, stats.pair_mask(VALID3))  # N_valid / M_valid = 1
    assert torch.allclose(masked, torch.tensor([0.7, 0.8, 0.0], dtype=torch.float64))


def test_explained_away_fraction_hand_values():
    assert stats.explained_away_fraction(W3, 0.75).item() == pytest.approx(1 / 3)
    assert stats.explained_away_fraction(W3, 0.85).item() == pytest.approx(2 / 3)
    assert stats.explained_away_fraction(W3, 0.1).item() == 0.0
    w = torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]])  # relative masses 0.9, 0.525, 1.575
    assert stats.explained_away_fraction(w, 0.61).item() == pytest.approx(2 / 3)  # absolute
    assert stats.explained_away_fraction(w, 0.61, relative=True).item() == pytest.approx(1 / 3)
    # masked: valid keys 0 and 1 with masses 0.7, 0.8
    mask = stats.pair_mask(VALID3)
    assert stats.explained_away_fraction(W3, 0.75, mask).item() == pytest.approx(1 / 2)


def test_bounds():
    assert stats.dnas_bound(4) == 0.25
    assert stats.hnas_bound(0.5, 4) == 0.125
    assert stats.dnas_bound(0) == 0.0
    t = stats.dnas_bound(torch.tensor([4, 0]))
    assert torch.equal(t, torch.tensor([0.25, 0.0]))
    assert torch.allclose(stats.hnas_bound(torch.tensor([0.5, 1.0]), 4), torch.tensor([0.125, 0.25]))
    with pytest.raises(ValueError, match="u must"):
        stats.hnas_bound(1.5, 4)
    with pytest.raises(ValueError, match="n_valid"):
        stats.dnas_bound(-1)


@pytest.mark.parametrize("variant", ["dnas", "hnas", "sinkhorn"])
def test_dnas_family_column_mass_floor(variant):
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(2, 4, 9, 9, generator=g) * 4
    valid = torch.tensor([[True] * 9, [True] * 6 + [False] * 3])
    mask = stats.pair_mask(valid)[:, None]  # (B, 1, N, N)
    u = 0.3
    w = attnlab.attention_weights(scores, variant, mask=mask, u=u)
    m = stats.column_mass(w, mask)  # (B, H, N)
    n_valid = valid.sum(-1)  # (B,)
    floor = stats.dnas_bound(n_valid) if variant != "hnas" else stats.hnas_bound(u, n_valid)
    keys = valid[:, None, :].expand_as(m)
    assert bool((m[keys] >= (floor[:, None, None].expand_as(m)[keys] - 1e-6)).all())
    assert bool((m[~keys] == 0).all())


def test_unas_explains_away_below_the_floor():
    scores = torch.zeros(1, 1, 4, 4)
    scores[..., 0] = 10.0  # every query attends to key 0
    w = attnlab.attention_weights(scores, "unas")
    m = stats.column_mass(w)[0, 0]
    assert bool((m[1:] < stats.dnas_bound(4)).all())
    assert stats.explained_away_fraction(w, stats.dnas_bound(4)).item() == pytest.approx(0.75)


# ----------------------------------------------------------------------------------------------
# Row statistics
# ----------------------------------------------------------------------------------------------


def test_row_entropy_hand_values():
    w = torch.tensor([[0.5, 0.5], [1.0, 0.0]])
    assert stats.row_entropy(w).item() == pytest.approx(math.log(2) / 2)
    per_row = stats.row_entropy(w, reduce=False)
    assert torch.allclose(per_row, torch.tensor([math.log(2), 0.0]))


def test_row_entropy_literal_loop_with_mask():
    w = softmax_weights(3, 6, 6, dtype=torch.float64)
    valid, mask = padded_mask(6, 4)
    got = stats.row_entropy(w, mask)
    for h in range(3):
        rows = []
        for i in range(4):
            rows.append(-sum(float(w[h, i, j]) * math.log(float(w[h, i, j])) for j in range(4)))
        assert got[h].item() == pytest.approx(sum(rows) / 4)


def test_mean_attention_distance_hand_values():
    # row 0: 0.5*1 = 0.5; row 1: 0.2*1 + 0.5*1 = 0.7; row 2: 0
    assert stats.mean_attention_distance(W3).item() == pytest.approx(0.4)
    # padding token 2 masked: row 0: 0.5, row 1: 0.2
    assert stats.mean_attention_distance(W3, stats.pair_mask(VALID3)).item() == pytest.approx(0.35)


def test_special_token_mass_hand_values():
    special = torch.tensor([True, False, False])
    assert stats.special_token_mass(W3, special).item() == pytest.approx((0.5 + 0.2 + 0.0) / 3)
    special = torch.tensor([False, False, True])
    masked = stats.special_token_mass(W3, special, stats.pair_mask(VALID3))
    assert masked.item() == 0.0


# ----------------------------------------------------------------------------------------------
# Gini, doubly stochastic deviation, rollout
# ----------------------------------------------------------------------------------------------


def gini_literal(xs):
    n, mean = len(xs), sum(xs) / len(xs)
    return sum(abs(a - b) for a in xs for b in xs) / (2 * n * n * mean)


def test_gini_hand_values():
    assert stats.gini(torch.tensor([1.0, 2.0, 3.0, 4.0])).item() == pytest.approx(0.25)
    assert stats.gini(torch.tensor([0.0, 0.0, 0.0, 1.0])).item() == pytest.approx(0.75)
    assert stats.gini(torch.tensor([2.0, 2.0, 2.0])).item() == pytest.approx(0.0, abs=1e-7)
    assert stats.gini(torch.zeros(3)).item() == 0.0
    valid = torch.tensor([True, True, True, True, False])
    assert stats.gini(torch.tensor([1.0, 2.0, 3.0, 4.0, 100.0]), valid).item() == pytest.approx(0.25)
    x = torch.rand(2, 7, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    got = stats.gini(x)
    for b in range(2):
        assert got[b].item() == pytest.approx(gini_literal(x[b].tolist()))


def test_doubly_stochastic_deviation_hand_values():
    dev = stats.doubly_stochastic_deviation(W3)  # masses 0.7, 0.8, 1.5 vs target 1
    assert dev.column_max.item() == pytest.approx(0.5)
    assert dev.column_mean.item() == pytest.approx(1 / 3)
    assert dev.row_max.item() == pytest.approx(0.0, abs=1e-12)
    w = torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]])  # M/N = 2/3, masses 0.6, 0.35, 1.05
    dev = stats.doubly_stochastic_deviation(w)
    assert dev.column_max.item() == pytest.approx(1.05 - 2 / 3)
    want = (abs(0.6 - 2 / 3) + abs(0.35 - 2 / 3) + (1.05 - 2 / 3)) / 3
    assert dev.column_mean.item() == pytest.approx(want)


def test_sinkhorn_approaches_doubly_stochastic():
    scores = torch.randn(1, 2, 8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    devs = [
        stats.doubly_stochastic_deviation(attnlab.attention_weights(scores, "sinkhorn", iters=k)).column_max
        for k in (1, 5, 50)
    ]
    assert bool((devs[2] < devs[1]).all()) and bool((devs[1] < devs[0]).all())
    assert devs[2].max().item() < 1e-6


def test_rollout_identity_is_identity():
    eye = torch.eye(5).expand(3, 4, 5, 5)  # (L, H, N, N)
    assert torch.allclose(stats.attention_rollout(eye), torch.eye(5))
    assert torch.allclose(stats.attention_rollout(eye, add_residual=False), torch.eye(5))


def test_rollout_hand_values():
    swap = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    # heads [I, swap] averaged -> all 0.5; with the residual 0.5*A + 0.5*I -> [[.75, .25], [.25, .75]]
    w = torch.stack([torch.eye(2), swap])[None]  # (L=1, H=2, 2, 2)
    assert torch.allclose(stats.attention_rollout(w), torch.tensor([[0.75, 0.25], [0.25, 0.75]]))
    # (L, N, N): two swaps without residual -> identity; with residual -> all 0.5
    two = torch.stack([swap, swap])
    assert torch.allclose(stats.attention_rollout(two, add_residual=False), torch.eye(2))
    assert torch.allclose(stats.attention_rollout(two), torch.full((2, 2), 0.5))
    per_layer = stats.attention_rollout(two, add_residual=False, all_layers=True)
    assert torch.allclose(per_layer[0], swap) and torch.allclose(per_layer[1], torch.eye(2))


def test_rollout_literal_product():
    w = softmax_weights(3, 2, 4, 4, dtype=torch.float64)  # (L, H, N, N)
    a = [0.5 * w[layer].mean(0) + 0.5 * torch.eye(4, dtype=torch.float64) for layer in range(3)]
    a = [x / x.sum(-1, keepdim=True) for x in a]
    assert torch.allclose(stats.attention_rollout(w), a[2] @ a[1] @ a[0])


# ----------------------------------------------------------------------------------------------
# Jensen-Shannon distance
# ----------------------------------------------------------------------------------------------


def js_literal(p, q):
    m = [(a + b) / 2 for a, b in zip(p, q, strict=True)]
    kl = lambda x, y: sum(a * math.log2(a / b) for a, b in zip(x, y, strict=True) if a > 0)  # noqa: E731
    return math.sqrt(0.5 * kl(p, m) + 0.5 * kl(q, m))


def test_js_distance_hand_values():
    p = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    q = torch.tensor([[0.5, 0.5]], dtype=torch.float64)
    want = math.sqrt((-(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25))) - 0.5)
    assert stats.js_distance(p, q).item() == pytest.approx(want)
    assert want == pytest.approx(js_literal([1.0, 0.0], [0.5, 0.5]))


def test_js_distance_properties():
    p, q = softmax_weights(2, 3, 6, 6, seed=1), softmax_weights(2, 3, 6, 6, seed=2)
    assert torch.equal(stats.js_distance(p, q), stats.js_distance(q, p))  # symmetric bit for bit
    assert torch.equal(stats.js_distance(p, p), torch.zeros(2, 3))
    a = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    b = torch.tensor([[0.0, 0.0, 0.25, 0.75]])
    assert stats.js_distance(a, b).item() == pytest.approx(1.0)
    d = stats.js_distance(p.double(), q.double(), reduce=False)
    for i in range(6):
        want = js_literal(p[0, 0, i].tolist(), q[0, 0, i].tolist())
        assert d[0, 0, i].item() == pytest.approx(want, abs=1e-6)


def test_js_distance_masked_rows():
    p, q = softmax_weights(4, 4, seed=1), softmax_weights(4, 4, seed=2)
    valid, mask = padded_mask(4, 2)
    # masked entries are zeroed, not renormalized: the literal JS of the zeroed rows, mean of 2 rows
    want = sum(js_literal(p[i, :2].tolist(), q[i, :2].tolist()) for i in range(2)) / 2
    assert stats.js_distance(p, q, mask).item() == pytest.approx(want, abs=1e-5)


def test_head_and_variant_js_matrices_match_pairwise():
    w = softmax_weights(2, 4, 5, 5, seed=3, dtype=torch.float64)  # (L, H, N, N)
    mat = stats.head_js_matrix(w)
    assert mat.shape == (2, 4, 4)
    for a in range(4):
        for b in range(4):
            assert mat[:, a, b].tolist() == pytest.approx(stats.js_distance(w[:, a], w[:, b]).tolist())
    scores = torch.randn(1, 2, 5, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ws = {v: attnlab.attention_weights(scores, v) for v in ("unas", "dnas", "hnas")}
    vm = stats.variant_js_matrix(ws)
    assert vm.shape == (3, 3, 1, 2)
    assert torch.allclose(vm[0, 1], stats.js_distance(ws["unas"], ws["dnas"]))
    assert torch.equal(vm[1, 0], vm[0, 1]) and bool((vm[range(3), range(3)] == 0).all())


# ----------------------------------------------------------------------------------------------
# No NaN on fully masked rows and columns
# ----------------------------------------------------------------------------------------------


def test_fully_masked_rows_and_columns_give_no_nan():
    scores = torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(0))
    valid = torch.tensor([[True, True, True, False, False], [False] * 5])  # example 2: nothing valid
    mask = stats.pair_mask(valid)[:, None]
    w = attnlab.attention_weights(scores, "dnas", mask=mask)
    special = torch.tensor([True, False, False, False, True])
    outs = [
        stats.column_mass(w, mask),
        stats.relative_column_mass(w, mask),
        stats.explained_away_fraction(w, 0.1, mask),
        stats.explained_away_fraction(w, 0.1, mask, relative=True),
        stats.row_entropy(w, mask),
        stats.row_entropy(w, mask, reduce=False),
        stats.mean_attention_distance(w, mask),
        stats.special_token_mass(w, special, mask),
        stats.gini(stats.column_mass(w, mask), valid[:, None]),
        *vars(stats.doubly_stochastic_deviation(w, mask)).values(),
        stats.js_distance(w, w.flip(-1), mask),
        stats.head_js_matrix(w, mask),
        stats.attention_rollout(w, mask=mask),
        stats.attention_rollout(w, add_residual=False, mask=mask),
    ]
    for out in outs:
        assert not bool(out.isnan().any())
    assert bool((stats.row_entropy(w, mask)[1] == 0).all())
    # NaN in masked entries is ignored too
    nan_w = w.masked_fill(~mask, float("nan"))
    assert not bool(stats.column_mass(nan_w, mask).isnan().any())


def test_float64_in_float64_out():
    w = W3[None]
    assert stats.column_mass(w).dtype == torch.float64
    assert stats.row_entropy(w).dtype == torch.float64
    assert stats.js_distance(w, w).dtype == torch.float64
    assert stats.column_mass(w.half()).dtype == torch.float32  # half precision is upcast


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="weights must be a floating"):
        stats.column_mass(torch.ones(3, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="mask of shape"):
        stats.column_mass(W3, torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask must be a boolean"):
        stats.column_mass(W3, torch.ones(3, 3))
    with pytest.raises(ValueError, match="eps"):
        stats.explained_away_fraction(W3, -1.0)
    with pytest.raises(ValueError, match="p and q"):
        stats.js_distance(W3, W3[:2])


# ----------------------------------------------------------------------------------------------
# Word-level aggregation
# ----------------------------------------------------------------------------------------------


def test_word_aggregate_convention():
    word_ids = [None, 0, 0, 1, None]  # [CLS] play ##ing well [SEP]
    assert stats.word_units(word_ids) == [[0], [1, 2], [3], [4]]
    w = softmax_weights(2, 5, 5, seed=4, dtype=torch.float64)
    agg = stats.word_aggregate(w, word_ids)
    units = stats.word_units(word_ids)
    assert agg.shape == (2, 4, 4)
    for h in range(2):
        for a, ua in enumerate(units):
            for b, ub in enumerate(units):
                want = sum(sum(float(w[h, i, j]) for j in ub) for i in ua) / len(ua)
                assert agg[h, a, b].item() == pytest.approx(want)
    assert torch.allclose(agg.sum(-1), torch.ones(2, 4, dtype=torch.float64))  # rows still sum to 1


def test_word_aggregate_rejects_mismatched_word_ids():
    with pytest.raises(ValueError, match="word_ids"):
        stats.word_aggregate(torch.eye(3), [0, 1])


def test_merge_tokens_wordpiece_and_bpe():
    assert stats.merge_tokens(["[CLS]", "play", "##ing", "well", "[SEP]"], [None, 0, 0, 1, None]) == [
        "[CLS]", "playing", "well", "[SEP]"
    ]
    bpe = ["<s>", "Ġplay", "ing", "Ġwell", "</s>"]
    assert stats.merge_tokens(bpe, [None, 0, 0, 1, None]) == ["<s>", "playing", "well", "</s>"]
    assert stats.merge_tokens(["Ġcaf", "Ã©"], [0, 0]) == ["café"]  # byte-level BPE decoded
    assert stats.merge_tokens(["▁hel", "lo"], [0, 0]) == ["hello"]  # SentencePiece


# ----------------------------------------------------------------------------------------------
# Tidy table
# ----------------------------------------------------------------------------------------------


def variant_weights(L=2, H=3, N=7, seed=0, mask=None, dtype=torch.float32):
    scores = torch.randn(L, H, N, N, generator=torch.Generator().manual_seed(seed), dtype=dtype) * 2
    return {v: attnlab.attention_weights(scores, v, mask=mask, iters=3 if v == "sinkhorn" else None)
            for v in attnlab.VARIANTS}


def test_tidy_table_columns_rows_and_round_trips():
    L, H, N = 2, 3, 7
    ws = variant_weights(L, H, N)
    special = torch.zeros(N, dtype=torch.bool)
    special[0] = True
    df = stats.tidy_table(ws, special=special, punctuation=torch.arange(N) == 3)
    assert list(df.columns) == ["variant", "layer", "head", "statistic", "value"]
    names = set(df["statistic"])
    expected = {k for k in stats.STATISTICS if not k.startswith("js_to_")} | {"js_to_unas"}
    assert names == expected
    assert len(df) == len(attnlab.VARIANTS) * L * H * len(expected)
    assert not df["value"].isna().any()
    assert not df.duplicated(["variant", "layer", "head", "statistic"]).any()
    back = pd.read_csv(io.StringIO(df.to_csv(index=False)))
    pd.testing.assert_frame_equal(back, df, check_exact=False, rtol=1e-12)
    records = json.loads(json.dumps(df.to_dict(orient="records")))
    assert records[0].keys() == {"variant", "layer", "head", "statistic", "value"}
    windowed = stats.tidy_table(ws, window=3)
    assert list(windowed.columns) == ["variant", "layer", "head", "statistic", "value", "window"]
    assert set(windowed["window"]) == {3}
    no_ref = stats.tidy_table(ws, reference=None)
    assert not any(s.startswith("js_to_") for s in no_ref["statistic"])
    assert not {"special_mass", "punctuation_mass"} & set(no_ref["statistic"])
    only_special = set(stats.tidy_table(ws, special=special)["statistic"])
    assert "special_mass" in only_special and "punctuation_mass" not in only_special


KEYS = ["variant", "layer", "head", "statistic"]


def table_value(df, variant, layer, head, statistic):
    return float(df.set_index(KEYS)["value"][variant, layer, head, statistic])


@pytest.mark.parametrize("n_valid", [9, 6])
def test_tidy_table_agrees_with_the_public_functions(n_valid):
    N, u, eps, eps_rel = 9, 0.3, 0.05, 0.5
    valid, mask = padded_mask(N, n_valid)
    ws = variant_weights(2, 3, N, seed=5, mask=mask, dtype=torch.float64)
    special = torch.tensor([True] + [False] * (N - 2) + [True])
    df = stats.tidy_table(ws, valid=valid, special=special, u=u, eps=eps, eps_relative=eps_rel)
    keys = valid.expand(2, 3, N)
    values = df.set_index(KEYS)["value"]
    for v, w in ws.items():
        m = stats.column_mass(w, mask)
        ds = stats.doubly_stochastic_deviation(w, mask)
        expected = {
            "column_mass_min": torch.where(keys, m, torch.inf).amin(-1),
            "column_mass_max": torch.where(keys, m, -torch.inf).amax(-1),
            "column_mass_min_over_bound": torch.where(keys, m, torch.inf).amin(-1) * n_valid,
            "explained_away": stats.explained_away_fraction(w, eps, mask),
            "explained_away_relative": stats.explained_away_fraction(w, eps_rel, mask, relative=True),
            "below_dnas_bound": stats.explained_away_fraction(w, 0.9999 / n_valid, mask),
            "below_hnas_bound": stats.explained_away_fraction(w, 0.9999 * u / n_valid, mask),
            "gini": stats.gini(m, valid),
            "row_entropy": stats.row_entropy(w, mask),
            "attention_distance": stats.mean_attention_distance(w, mask),
            "special_mass": stats.special_token_mass(w, special, mask),
            "ds_column_dev_max": ds.column_max,
            "ds_column_dev_mean": ds.column_mean,
            "ds_row_dev_max": ds.row_max,
            "js_to_unas": stats.js_distance(w, ws["unas"], mask),
        }
        for name, t in expected.items():
            for layer in range(2):
                for head in range(3):
                    got = values[v, layer, head, name]
                    assert got == pytest.approx(t[layer, head].item(), abs=1e-9), (v, name, layer, head)
    assert table_value(df, "dnas", 0, 0, "below_dnas_bound") == 0.0
    assert table_value(df, "hnas", 1, 2, "below_hnas_bound") == 0.0
    assert table_value(df, "dnas", 0, 0, "column_mass_min_over_bound") >= 1 - 1e-9


def test_tidy_table_blocked_path_matches_single_block(monkeypatch):
    ws = variant_weights(2, 3, 16, seed=6)
    whole = stats.tidy_table(ws)
    monkeypatch.setattr(stats.engine, "CHUNK_BYTES", 16 * 4 * 3)  # blocks of 3 rows: exercises row blocking
    blocked = stats.tidy_table(ws)
    pd.testing.assert_frame_equal(whole, blocked, check_exact=False, atol=1e-6)


def test_tidy_table_no_valid_token_and_float32_identity():
    ws = variant_weights(1, 2, 4)
    df = stats.tidy_table(ws, valid=torch.zeros(4, dtype=torch.bool))
    assert (df["value"] == 0).all() and len(df) > 0
    same = stats.tidy_table({"unas": ws["unas"], "copy": ws["unas"].clone()})
    assert (same[same.statistic == "js_to_unas"]["value"] == 0).all()  # identical rows: exactly 0


def test_tidy_table_bad_arguments():
    ws = variant_weights(1, 2, 4)
    with pytest.raises(ValueError, match="one shape"):
        stats.tidy_table({"a": ws["unas"], "b": ws["dnas"][..., :3]})
    with pytest.raises(ValueError, match="valid"):
        stats.tidy_table(ws, valid=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="u must"):
        stats.tidy_table(ws, u=2.0)
    with pytest.raises(ValueError, match="non-empty dict"):
        stats.tidy_table({})


def test_aggregate_windows_mean_std_and_weights():
    ws1, ws2 = variant_weights(1, 2, 5, seed=1), variant_weights(1, 2, 5, seed=2)
    t1, t2 = stats.tidy_table(ws1, window=0), stats.tidy_table(ws2, window=1)
    agg = stats.aggregate_windows(t for t in (t1, t2))  # a generator
    assert list(agg.columns) == ["variant", "layer", "head", "statistic", "value", "std", "n_windows"]
    assert len(agg) == len(t1) and (agg["n_windows"] == 2).all()
    merged = t1.merge(t2, on=["variant", "layer", "head", "statistic"])
    merged = merged.merge(agg, on=["variant", "layer", "head", "statistic"])
    assert (merged["value"] - (merged["value_x"] + merged["value_y"]) / 2).abs().max() < 1e-12
    assert (merged["std"] - (merged["value_x"] - merged["value_y"]).abs() / 2).abs().max() < 1e-9
    weighted = stats.aggregate_windows([t1, t2], weights=[3, 1])
    merged = t1.merge(t2, on=["variant", "layer", "head", "statistic"]).merge(
        weighted, on=["variant", "layer", "head", "statistic"]
    )
    assert (merged["value"] - (3 * merged["value_x"] + merged["value_y"]) / 4).abs().max() < 1e-12
    both = stats.aggregate_windows([pd.concat([t1, t2])])  # one table holding two windows
    assert (both["n_windows"] == 2).all()
    pd.testing.assert_frame_equal(both, agg)
    one = stats.aggregate_windows([t1])
    assert (one["std"] == 0).all() and (one["value"].to_numpy() == t1["value"].to_numpy()).all()
    special = torch.zeros(5, dtype=torch.bool)
    special[0] = True
    mixed = stats.aggregate_windows([stats.tidy_table(ws1, special=special), t2])  # special_mass once
    counts = mixed.groupby("statistic")["n_windows"].first()
    assert counts["special_mass"] == 1 and counts["gini"] == 2
    with pytest.raises(ValueError, match="empty"):
        stats.aggregate_windows([])


@pytest.mark.parametrize("shape", [(4,), (1, 4), (2, 1, 1, 4), (3, 1), (2, 1, 3, 1)])
def test_broadcast_masks_count_every_row_and_key(shape):
    """A mask that broadcasts over rows (key-only (N,), key padding (B, 1, 1, N)) or keys (M, 1) gives
    the statistics of the same mask expanded to the weights' shape (before: IndexError for (N,), and
    row means divided by 1 instead of M_valid)."""
    w = softmax_weights(2, 2, 3, 4, seed=7, dtype=torch.float64)
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(1)) < 0.6
    full = mask.expand(w.shape)
    fns = (stats.row_entropy, stats.mean_attention_distance, stats.column_mass, stats.relative_column_mass)
    for fn in fns:
        torch.testing.assert_close(fn(w, mask), fn(w, full))
    ea = stats.explained_away_fraction
    torch.testing.assert_close(ea(w, 0.5, mask), ea(w, 0.5, full))
    a, b = stats.doubly_stochastic_deviation(w, mask), stats.doubly_stochastic_deviation(w, full)
    torch.testing.assert_close((a.column_max, a.column_mean, a.row_max),
                               (b.column_max, b.column_mean, b.row_max))
    rows = full.any(-1)  # literal mean over valid rows of the per-row entropies
    h = -(torch.where(full, w, 0.0) * w.log()).sum(-1)
    want = torch.where(rows, h, 0.0).sum(-1) / rows.sum(-1).clamp_min(1)
    torch.testing.assert_close(stats.row_entropy(w, mask), want)


def test_column_statistics_count_keys_and_a_nan_mass_makes_only_its_head_nan():
    third = torch.tensor(1.0) / 3  # float32 1/3: a column exactly at the DNAS floor is not below it
    col = torch.stack([torch.stack([third, torch.tensor(0.5), 2.5 - third]),
                       torch.tensor([0.2, float("nan"), 2.8])])[None]  # (1, 2, 3): m = 3 rows, n = 3 keys
    out = stats.engine.column_statistics(col, 3, 3, 0.6, 0.4, torch.full((1, 2), 0.5))
    shares = {"explained_away": 2 / 3, "explained_away_relative": 1 / 3, "below_dnas_bound": 0.0,
              "below_hnas_bound": 0.0}
    for name, want in shares.items():
        assert out[name].dtype == torch.float32 and out[name][0, 0].item() == pytest.approx(want), name
        assert out[name][0, 1].isnan(), name  # the NaN mass of head 1
    assert out["column_mass_min"][0, 0] == third and out["column_mass_max"][0, 0] == 2.5 - third
    assert out["ds_column_dev_max"][0, 0] == pytest.approx(1.5 - third.item())
    assert all(t[0, 1].isnan() for t in out.values())  # min, max, Gini and deviations too


def test_row_sums_of_variants_with_different_key_masks_are_refused_by_name():
    ws = variant_weights(1, 2, 5, seed=3)
    spec = torch.tensor([True, False, False, False, True])
    sums = {"unas": stats.RowSums.from_maps(ws["unas"], special=spec),
            "dnas": stats.RowSums.from_maps(ws["dnas"])}
    with pytest.raises(ValueError, match=r"same key masks .*'unas': 1, 'dnas': 0"):
        stats.statistics_from_row_sums(sums, special_index=0)
