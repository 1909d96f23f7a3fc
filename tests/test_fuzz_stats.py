"""Property-based fuzz suite over attnlab.stats (see tests/test_fuzz.py for the rules): every statistic
on random weights (shapes incl. 0 and 1, four dtypes, views, masks of every broadcastable shape incl.
key-only (N,), numpy scalars, NaN) against a float64 reference written from its definition in
docs/STATISTICS.md, or a ValueError naming the argument."""

from __future__ import annotations

import math
import random

import numpy as np
import pandas as pd
import pytest
import torch
from fuzzkit import (
    DTYPES,
    F64,
    VIEWS,
    assert_close_or_nan,
    assert_value_error,
    broadcastable_shapes,
    fuzz_settings,
    non_broadcastable_shapes,
    one_thread,  # noqa: F401 - autouse fixture
    random_mask,
    ref64,
    view_of,
)
from hypothesis import given
from hypothesis import strategies as st

from attnlab import stats

# ----------------------------------------------------------------------------------------------
# float64 references from the definitions
# ----------------------------------------------------------------------------------------------


def _full(mask, shape):
    return torch.ones(shape, dtype=torch.bool) if mask is None else mask.expand(shape)


def _mean_over(x, valid):  # mean of x (..., K) over valid entries; 0 when none
    n = valid.sum(-1).to(F64)
    s = torch.where(valid, x, torch.zeros_like(x)).sum(-1)
    return torch.where(n > 0, s / n.clamp_min(1), torch.zeros_like(s))


def ref_stats(w64, mask, eps, special=None):
    valid = _full(mask, w64.shape)
    w = torch.where(valid, w64, torch.zeros_like(w64))
    rows, keys = valid.any(-1), valid.any(-2)
    m = w.sum(-2)
    Mv, Nv = rows.sum(-1).to(F64), keys.sum(-1).to(F64)
    ratio = torch.where(Mv > 0, Nv / Mv.clamp_min(1), torch.zeros_like(Mv))
    rel = m * ratio[..., None]
    below = torch.where(m.isnan(), m, (m < eps).to(F64))
    below_rel = torch.where(rel.isnan(), rel, (rel < eps).to(F64))
    xlogx = torch.where(w > 0, w * w.log(), torch.where(w.isnan(), w, torch.zeros_like(w)))
    M, N = w.shape[-2:]
    dist = (torch.arange(M, dtype=F64)[:, None] - torch.arange(N, dtype=F64)[None, :]).abs()
    out = {
        "column_mass": m,
        "relative_column_mass": rel,
        "explained_away": _mean_over(below, keys),
        "explained_away_relative": _mean_over(below_rel, keys),
        "row_entropy": _mean_over(-xlogx.sum(-1), rows),
        "distance": _mean_over((w * dist).sum(-1), rows),
    }
    target = torch.where(Nv > 0, Mv / Nv.clamp_min(1), torch.zeros_like(Nv))
    col_dev = (m - target[..., None]).abs()
    out["ds_column_max"] = (
        torch.where(keys, col_dev, torch.zeros_like(col_dev)).amax(-1)
        if N
        else torch.zeros(m.shape[:-1], dtype=F64)
    )
    out["ds_column_mean"] = _mean_over(col_dev, keys)
    if special is not None:
        out["special"] = _mean_over((w * special.to(F64)).sum(-1), rows)
    return out


def ref_gini(x, valid):
    out = torch.zeros(x.shape[:-1], dtype=F64)
    if x.shape[-1] == 0 or out.numel() == 0:
        return out
    flat_x, flat_v = x.reshape(-1, x.shape[-1]), valid.expand(x.shape).reshape(-1, x.shape[-1])
    res = []
    for xs, vs in zip(flat_x, flat_v, strict=True):
        v = xs[vs]
        n, tot = len(v), v.sum()
        if n == 0 or not (tot > 0 or tot.isnan()):
            res.append(0.0)
            continue
        res.append(float((v[:, None] - v[None, :]).abs().sum() / (2 * n * tot)))
    return torch.tensor(res, dtype=F64).reshape(out.shape) if res else out


def ref_js(p, q):  # per-row JS distance (base 2)
    mix = (p + q) / 2

    def h(x):
        return -torch.where(x > 0, x * x.log2(), torch.where(x.isnan(), x, torch.zeros_like(x))).sum(-1)

    return (h(mix) - (h(p) + h(q)) / 2).clamp(0, 1).sqrt()


# ----------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------


class Rng(random.Random):
    def int(self, a, b):
        return self.randint(a, b)

    def pick(self, options):
        return self.choice(list(options))


@st.composite
def weight_cases(draw, views=VIEWS, dtypes=DTYPES, min_len=0):
    r = Rng(draw(st.integers(0, 2**63 - 1)))
    B, H = r.int(1, 2), r.int(1, 3)
    M, N = r.int(min_len, 5), r.int(min_len, 5)
    gen = torch.Generator().manual_seed(r.int(0, 2**31 - 1))
    logits = torch.randn(B, H, M, N, generator=gen, dtype=F64) * r.pick([1.0, 3.0, 10.0])
    w = torch.softmax(logits, -1) if N else logits
    dtype = r.pick(dtypes)
    w = view_of(w.to(dtype), r.pick(views))
    shape = r.pick([None, *broadcastable_shapes(B, H, M, N)])
    mask = None if shape is None else random_mask(gen, shape)
    eps = r.pick([0.05, 0.5, 1.0, np.float32(0.2), np.float64(0.3), 0, 2])
    special = torch.rand(N, generator=gen) < 0.3
    return dict(w=w, mask=mask, eps=eps, special=special, gen=gen, B=B, H=H, M=M, N=N, dtype=dtype)


def _tol(p):
    return 1e-9 if p["dtype"] == F64 else 2e-5 * max(1, p["M"], p["N"])


def _check_all(p, label=""):
    w, mask, eps = p["w"], p["mask"], p["eps"]
    ref = ref_stats(ref64(w), mask, float(eps), p["special"])
    tol = _tol(p)
    got = {
        "column_mass": stats.column_mass(w, mask),
        "relative_column_mass": stats.relative_column_mass(w, mask),
        "explained_away": stats.explained_away_fraction(w, eps, mask),
        "explained_away_relative": stats.explained_away_fraction(w, eps, mask, relative=True),
        "row_entropy": stats.row_entropy(w, mask),
        "distance": stats.mean_attention_distance(w, mask),
        "special": stats.special_token_mass(w, p["special"], mask),
    }
    ds = stats.doubly_stochastic_deviation(w, mask)
    got["ds_column_max"], got["ds_column_mean"] = ds.column_max, ds.column_mean
    for name, g in got.items():
        r = ref[name]
        if name.startswith("explained"):  # a share: a mass within rounding of eps may flip
            assert g.shape == r.shape and not bool((g.isnan() != r.isnan()).any()), f"{label} {name}"
            continue
        assert_close_or_nan(g, r.expand(g.shape) if r.dim() < g.dim() else r, tol * 10, f"{label} {name}")
    m = ref["column_mass"]
    keys = _full(mask, ref64(w).shape).any(-2).expand(m.shape)
    assert_close_or_nan(
        stats.gini(stats.column_mass(w, mask), keys), ref_gini(m, keys), tol * 10, f"{label} gini"
    )


@pytest.mark.slow  # ~1 s: .ci/run runs it, the inner loop does not
def test_map_statistics_match_references(reliability):
    @fuzz_settings(80)
    @given(weight_cases(views=("contiguous",), dtypes=(torch.float32, torch.float64)))
    def run(p):
        _check_all(p, "contiguous")

    run()
    reliability(
        "fuzz: attnlab.stats per-map statistics",
        "80 random (B, H, M, N) weights incl. M or N = 0, masks "
        "of 12 broadcastable shapes incl. key-only (N,) (IndexError before) and query-only (M, 1), eps as "
        "python / numpy scalars",
        "column mass, relative mass, explained-away shares, entropy, distance, "
        "special mass, doubly-stochastic deviation, Gini equal to float64 references from their definitions",
    )


@pytest.mark.slow  # ~1 s: .ci/run runs it, the inner loop does not
def test_map_statistics_on_views_and_half_precision(reliability):
    @fuzz_settings(60)
    @given(weight_cases())
    def run(p):
        _check_all(p, f"{p['dtype']}")

    run()
    reliability(
        "fuzz: attnlab.stats on views",
        "60 random cases: sliced, transposed, expanded, x[..., ::2] weights; float16 / bfloat16",
        "equal to the float64 contiguous references",
    )


@pytest.mark.slow  # ~1 s: .ci/run runs it, the inner loop does not
def test_statistics_propagate_nan(reliability):
    @fuzz_settings(50)
    @given(weight_cases(dtypes=(torch.float32, torch.float64), min_len=1), st.data())
    def run(p, data):
        w = p["w"].contiguous().clone()
        idx = tuple(data.draw(st.integers(0, d - 1)) for d in w.shape)
        w[idx] = float("nan")
        p["w"] = w
        _check_all(p, "NaN")

    run()
    reliability(
        "fuzz: NaN weights in attnlab.stats",
        "one NaN weight at a random (masked or valid) position",
        "NaN in exactly the statistics it enters (a masked NaN is ignored); never a finite wrong value",
    )


def test_rollout_js_and_words_match_references(reliability):
    @fuzz_settings(60)
    @given(st.integers(0, 2**63 - 1))
    def run(seed):
        r = Rng(seed)
        L, H, N = r.int(1, 3), r.int(1, 3), r.int(0, 4)
        gen = torch.Generator().manual_seed(r.int(0, 2**31 - 1))
        dtype = r.pick((torch.float32, torch.float64))
        w64 = (
            torch.softmax(torch.randn(L, H, N, N, generator=gen, dtype=F64), -1)
            if N
            else torch.zeros(L, H, 0, 0, dtype=F64)
        )
        w = view_of(w64.to(dtype), r.pick(VIEWS[:2] + ("transposed", "sliced")))
        w64 = ref64(w)
        tol = 1e-9 if dtype == F64 else 1e-5 * max(1, N) * L
        # rollout: R = A_L ... A_1, A = rownorm(0.5 W + 0.5 I), heads averaged
        A = 0.5 * w64.mean(1) + 0.5 * torch.eye(N, dtype=F64)
        A = A / A.sum(-1, keepdim=True).clamp_min(1e-300)
        R = A[0]
        for a in A[1:]:
            R = a @ R
        assert_close_or_nan(stats.attention_rollout(w), R, tol, "rollout")
        p, q = (
            w,
            view_of(torch.softmax(torch.randn(L, H, N, N, generator=gen, dtype=F64), -1).to(dtype), "strided")
            if N
            else w,
        )
        assert_close_or_nan(
            stats.js_distance(p, q, reduce=False), ref_js(w64, ref64(q)), 1e-3 if dtype != F64 else 1e-6, "js"
        )
        hj = stats.head_js_matrix(w)
        ref_h = torch.zeros(L, H, H, dtype=F64)
        for a in range(H):
            for b in range(H):
                ref_h[:, a, b] = ref_js(w64[:, a], w64[:, b]).mean(-1) if N else 0.0
        assert_close_or_nan(hj, ref_h, 1e-3 if dtype != F64 else 1e-6, "head_js")
        ids = [None if i == 0 else r.int(0, 2) for i in range(N)]
        units = stats.word_units(ids)
        agg = stats.word_aggregate(w, ids)
        ref = torch.zeros(L, H, len(units), len(units), dtype=F64)
        for a, ua in enumerate(units):
            for b, ub in enumerate(units):
                ref[..., a, b] = w64[..., ua, :][..., :, ub].sum(-1).mean(-1)
        assert_close_or_nan(agg, ref, tol, "word_aggregate")
        assert len(stats.merge_tokens([f"t{i}" for i in range(N)], ids)) == len(units)

    run()
    reliability(
        "fuzz: rollout, JS, words",
        "60 random (L, H, N, N) incl. N = 0, views, float32 / float64",
        "attention_rollout, js_distance, head_js_matrix, word_aggregate equal to float64 loop references",
    )


@pytest.mark.slow  # ~1 s: .ci/run runs it, the inner loop does not
def test_tables_and_row_sums(reliability):
    @fuzz_settings(30)
    @given(st.integers(0, 2**63 - 1))
    def run(seed):
        r = Rng(seed)
        L, H, N = r.int(0, 2), r.int(0, 2), r.int(0, 4)
        gen = torch.Generator().manual_seed(r.int(0, 2**31 - 1))
        ws = {
            v: view_of(
                torch.softmax(torch.randn(L, H, N, N, generator=gen), -1) if N else torch.zeros(L, H, 0, 0),
                r.pick(VIEWS[:2] + ("transposed",)),
            )
            for v in ("unas", "dnas")
        }
        special = torch.rand(N, generator=gen) < 0.4
        valid = r.pick([None, torch.rand(N, generator=gen) < 0.7])
        u = r.pick([0.5, np.float32(0.25), torch.full((L, H), 0.3), 1])
        table = stats.tidy_table(
            ws, valid=valid, special=special, u=u, eps=np.float64(0.05), window=r.pick([None, 3])
        )
        assert list(table.columns[:5]) == ["variant", "layer", "head", "statistic", "value"]
        assert len(table) == (len(ws) * L * H * len(set(table["statistic"])) if L * H else 0)
        assert not table["value"].isna().any()
        if valid is None and L * H:
            sums = {
                v: stats.RowSums.from_maps(w, special=special, reference=None if v == "unas" else ws["unas"])
                for v, w in ws.items()
            }
            fast = stats.table_from_row_sums(
                sums,
                special_index=0,
                u=u,
                eps=np.float64(0.05),
                window=table.get("window", pd.Series([None])).iloc[0] if "window" in table else None,
            )
            pd.testing.assert_frame_equal(fast, table, check_exact=False, atol=1e-6)
        agg = stats.aggregate_windows([table, table])
        if len(table):
            assert np.allclose(agg["std"], 0.0)

    run()
    reliability(
        "fuzz: tidy_table / RowSums",
        "30 random {variant: (L, H, N, N)} incl. L, H or N = 0, views, valid "
        "and special masks, u as float / numpy / (L, H) tensor",
        "no NaN, one row per (variant, layer, head, "
        "statistic); table_from_row_sums(RowSums.from_maps(...)) equals tidy_table",
    )


@pytest.mark.parametrize(
    "bad",
    [
        "weights_list",
        "weights_int",
        "weights_1d",
        "mask_float",
        "mask_shape",
        "eps_neg",
        "eps_nan",
        "eps_str",
        "u_range",
        "u_tensor_range",
        "n_valid",
        "special_shape",
        "word_ids_len",
        "word_ids_type",
        "tokens_type",
        "rollout_empty",
        "rollout_square",
        "agg_weights",
        "agg_empty",
        "rowsums_shape",
        "pair_mask",
    ],
)
def test_statistics_bad_arguments_are_worded(bad, reliability):
    w = torch.softmax(torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(0)), -1)
    calls = {
        "weights_list": (lambda: stats.column_mass(w.tolist()), ("weights",)),
        "weights_int": (lambda: stats.row_entropy(w.long()), ("weights",)),
        "weights_1d": (lambda: stats.column_mass(w[0, 0, 0]), ("weights",)),
        "mask_float": (lambda: stats.column_mass(w, torch.ones(4)), ("mask",)),
        "mask_shape": (
            lambda: stats.row_entropy(
                w, torch.ones(non_broadcastable_shapes(2, 3, 4, 4)[0], dtype=torch.bool)
            ),
            ("mask",),
        ),
        "eps_neg": (lambda: stats.explained_away_fraction(w, -0.1), ("eps",)),
        "eps_nan": (lambda: stats.explained_away_fraction(w, np.float32("nan")), ("eps",)),
        "eps_str": (lambda: stats.explained_away_fraction(w, "0.1"), ("eps",)),
        "u_range": (lambda: stats.hnas_bound(np.float64(1.5), 4), ("u",)),
        "u_tensor_range": (lambda: stats.tidy_table({"unas": w}, u=torch.tensor([0.5, 2.0, 0.1])), ("u",)),
        "n_valid": (lambda: stats.dnas_bound(np.int64(-1)), ("n_valid",)),
        "special_shape": (lambda: stats.special_token_mass(w, torch.ones(5, dtype=torch.bool)), ("special",)),
        "word_ids_len": (lambda: stats.word_aggregate(w, [0, 1, 2]), ("weights", "word_ids")),
        "word_ids_type": (lambda: stats.word_units([0, "a"]), ("word_ids",)),
        "tokens_type": (lambda: stats.merge_tokens([1, 2], [0, 1]), ("tokens",)),
        "rollout_empty": (lambda: stats.attention_rollout(torch.zeros(0, 2, 3, 3)), ("weights",)),
        "rollout_square": (lambda: stats.attention_rollout(torch.zeros(2, 2, 3, 4)), ("weights",)),
        "agg_weights": (
            lambda: stats.aggregate_windows([stats.tidy_table({"unas": w})] * 2, weights=[1.0]),
            ("weights",),
        ),
        "agg_empty": (lambda: stats.aggregate_windows([]), ("tables",)),
        "rowsums_shape": (
            lambda: stats.RowSums(
                (2, 3, 4, 4),
                cols=torch.zeros(6, 5),
                rowsum=torch.zeros(6, 4),
                entropy=torch.zeros(6, 4),
                distance=torch.zeros(6, 4),
            ),
            ("RowSums.cols",),
        ),
        "pair_mask": (lambda: stats.pair_mask(torch.tensor(True)), ("valid_q",)),
    }
    fn, names = calls[bad]
    msg = assert_value_error(fn, names, bad)
    if bad == "mask_shape":
        reliability(
            "fuzz: attnlab.stats bad arguments",
            f"{len(calls)} kinds: lists, integer or 1-D weights, float "
            "or non-broadcastable masks, eps < 0 / NaN / str, u outside [0, 1], n_valid < 0, a special mask "
            "of another length, word ids of another length or type, empty or non-square rollout, fewer "
            "window weights than tables, RowSums of inconsistent shapes",
            f"ValueError naming the argument (e.g. {msg})",
        )


def test_numpy_scalars_equal_python_scalars():
    w = torch.softmax(torch.randn(2, 5, 5, generator=torch.Generator().manual_seed(1)), -1)
    for a, b in ((0.2, np.float32(0.2)), (0.3, np.float64(0.3)), (1, np.int64(1))):
        torch.testing.assert_close(
            stats.explained_away_fraction(w, a), stats.explained_away_fraction(w, float(b))
        )
        stats.explained_away_fraction(w, b)
    assert stats.dnas_bound(np.int64(4)) == 0.25 and stats.hnas_bound(np.float32(0.5), np.int32(4)) == 0.125
    assert math.isclose(stats.hnas_bound(torch.tensor(0.5), 4), 0.125)
