"""Property-based fuzz suite over silent wrong values (see tests/test_fuzz.py for the rules): what a
registered variant returns (shape, dtype, >= 0, finite, rows summing to 1), attention flow on empty,
NaN and negative weights and its work limit, contributions from negative norms or row counts, the
``--u`` / ``--u-from`` flags, NaN in a model's weights (the note in the table, the CLI and the app),
and ``special_mass`` (special tokens alone) beside ``punctuation_mass``.

Every case ends in one of two outcomes: the right value (NaN where a NaN enters, docs/DESIGN.md §4),
or a ValueError naming the argument (the variant, ``max_work``, ``norms``, ``n_rows``, the flag)
with what was expected and what was seen. Seeded (derandomized hypothesis), small, offline.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from fuzzkit import assert_value_error, fuzz_settings, one_thread  # noqa: F401 - autouse fixture
from hypothesis import given
from hypothesis import strategies as st

import attnlab
from attnlab import contributions, flow
from attnlab.normalizers import contract, specs

_names = itertools.count()


def _register(fn, **fields) -> str:
    name = f"fuzz_values_{next(_names)}"
    attnlab.register_variant(name, fn, summary="a fuzz case", **fields)
    return name


@pytest.fixture()
def registered():
    """register(fn, **fields) -> a fresh variant name, removed again after the test."""
    names = []

    def register(fn, **fields):
        names.append(_register(fn, **fields))
        return names[-1]

    yield register
    for name in names:
        specs.unregister_variant(name)


def _softmax(logits, ctx):
    """A correct normalizer: softmax, rows without a valid key all zero."""
    return torch.nan_to_num(torch.softmax(logits, -1), nan=0.0)


# ----------------------------------------------------------------------------------------------
# 1. Registered variants: their output is held to the spec at first use
# ----------------------------------------------------------------------------------------------

# defect -> (normalizer, what the message must say)
DEFECTS = {
    "shape_last": (lambda x, c: _softmax(x, c)[..., :-1], "shape"),
    "shape_extra_dim": (lambda x, c: _softmax(x, c)[None], "shape"),
    "shape_flat": (lambda x, c: _softmax(x, c).flatten(), "shape"),
    "integer": (lambda x, c: (_softmax(x, c) > 0.5).long(), "dtype"),
    "bool": (lambda x, c: _softmax(x, c) > 0.5, "dtype"),
    "negative": (lambda x, c: _softmax(x, c) - 1.5 * (x > 0), ">= 0"),
    "nan": (lambda x, c: _softmax(x, c) + torch.where(x > 0, math.nan, 0.0), "finite"),
    "inf": (lambda x, c: _softmax(x, c) + torch.where(x > 0, math.inf, 0.0), "finite"),
    "rows_double": (lambda x, c: 2 * _softmax(x, c), "rows summing to 1"),
    "rows_half": (lambda x, c: 0.5 * _softmax(x, c), "rows summing to 1"),
    "masked_weight": (lambda x, c: torch.softmax(torch.where(x > -math.inf, x, 0.0), -1),
                      ("masked", "rows summing to 1")),
    "not_a_tensor": (lambda x, c: _softmax(x, c).tolist(), "torch.Tensor"),
    "numpy": (lambda x, c: _softmax(x, c).numpy(), "torch.Tensor"),
}


@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_a_registered_variant_with_wrong_output_is_refused_at_first_use(registered, defect,
                                                                        reliability):
    fn, said = DEFECTS[defect]
    name = registered(fn)
    gen = torch.Generator().manual_seed(7)

    @fuzz_settings(8)
    @given(st.integers(1, 3), st.integers(2, 6), st.integers(2, 6),
           st.sampled_from(["none", "keys", "causal"]), st.sampled_from([torch.float32, torch.float64]))
    def case(H, M, N, how, dtype):
        scores = (torch.randn(1, H, M, N, generator=gen) * 3).to(dtype)
        scores[..., 0, 0] = 1.0  # some score > 0 (the NaN / inf defects put theirs there)
        mask = None
        if how == "keys":  # one masked key (the masked_weight defect gives it weight)
            mask = torch.ones(N, dtype=torch.bool)
            mask[-1] = False
        q = torch.randn(1, H, M, 4, generator=gen, dtype=dtype)
        k = torch.randn(1, H, N, 4, generator=gen, dtype=dtype)
        q[..., 0, :] = k[..., 0, :] = 3.0  # a score > 0 at (0, 0)
        causal = how == "causal"
        calls = {
            "weights": lambda: attnlab.attention_weights(scores, name, mask=mask, causal=causal),
            "attend": lambda: attnlab.attend(q, k, k, name, mask=mask, causal=causal, return_weights=True),
        }
        for call, fn_ in calls.items():
            if defect == "masked_weight" and how == "none":
                continue  # nothing masked: a plain softmax, correct
            msg = assert_value_error(fn_, [repr(name)], f"{defect} {call} {how}")
            assert any(x in msg for x in ((said,) if isinstance(said, str) else said)), msg
            assert "got" in msg and "must return" in msg, msg

    case()
    seen = assert_value_error(
        lambda: attnlab.attention_weights(torch.randn(1, 2, 3, 4) + 1.0, name,
                                          mask=torch.tensor([True, True, True, False])),
        [repr(name)], defect)
    reliability("registered variant returns wrong weights",
                f"register_variant with a normalizer: {defect}", seen)


def test_a_correct_variant_is_checked_once_and_again_when_replaced(registered, monkeypatch):
    calls = []
    real = contract.check_values
    monkeypatch.setattr(contract, "check_values", lambda *a: calls.append(a[0].name) or real(*a))
    name = registered(_softmax)
    scores = torch.randn(2, 3, 5, 5)
    for _ in range(3):
        w = attnlab.attention_weights(scores, name, causal=True)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 3, 5))
    assert calls == [name]  # values checked once; later calls: metadata only
    attnlab.register_variant(name, lambda x, c: 3 * _softmax(x, c), replace=True)
    with pytest.raises(ValueError, match=rf"variant '{name}'.*rows summing to 1.*got"):
        attnlab.attention_weights(scores, name)
    assert calls == [name, name]
    for built_in in attnlab.VARIANTS[:6]:  # built-ins are trusted
        attnlab.attention_weights(scores, built_in)
    assert calls == [name, name]


def test_shape_and_dtype_are_checked_on_every_call(registered):
    """A normalizer right for one shape and wrong for another is caught on the later call too."""
    name = registered(lambda x, c: _softmax(x, c) if x.shape[-1] < 5 else _softmax(x, c)[..., :4])
    attnlab.attention_weights(torch.randn(1, 1, 3, 4), name)
    with pytest.raises(ValueError, match=r"logits' shape \(1, 1, 3, 6\), got shape \(1, 1, 3, 4\)"):
        attnlab.attention_weights(torch.randn(1, 1, 3, 6), name)


def test_rows_may_sum_to_less_than_one_when_the_spec_says_so(registered):
    half = registered(lambda x, c: 0.5 * _softmax(x, c), rows_sum_to_one=False)
    w = attnlab.attention_weights(torch.randn(2, 4, 4), half)
    torch.testing.assert_close(w.sum(-1), torch.full((2, 4), 0.5))
    over = registered(lambda x, c: 1.5 * _softmax(x, c), rows_sum_to_one=False)
    with pytest.raises(ValueError, match="rows summing to at most 1.*got 8 row"):
        attnlab.attention_weights(torch.randn(2, 4, 4), over)


def test_nan_scores_give_nan_weights_and_the_check_waits_for_finite_ones(registered, monkeypatch):
    """NaN scores: NaN weights follow the rule (accepted); the values are checked on the first call
    with finite scores."""
    calls = []
    real = contract.check_values
    monkeypatch.setattr(contract, "check_values", lambda *a: calls.append(1) or real(*a))
    name = registered(lambda x, c: torch.softmax(x, -1))
    s = torch.randn(1, 1, 3, 3)
    s[0, 0, 1, 1] = math.nan
    assert attnlab.attention_weights(s, name)[0, 0, 1].isnan().all()
    attnlab.attention_weights(torch.randn(1, 1, 3, 3), name)
    attnlab.attention_weights(torch.randn(1, 1, 3, 3), name)
    assert len(calls) == 2  # the NaN call, then the finite one; none after


def test_plain_softmax_is_refused_on_a_row_without_valid_keys(registered):
    """torch.softmax of a fully masked row is NaN: 'no NaN on empty rows' (docs/DESIGN.md §4). With a
    mask the pipeline zeroes masked entries; -inf scores without a mask reach the normalizer as is."""
    name = registered(lambda x, c: torch.softmax(x, -1))
    s = torch.randn(1, 1, 3, 3)
    mask = torch.tensor([[True] * 3, [False] * 3, [True] * 3])
    assert attnlab.attention_weights(s, name, mask=mask)[0, 0, 1].eq(0).all()
    other = registered(lambda x, c: torch.softmax(x, -1))
    s[0, 0, 1] = -math.inf
    with pytest.raises(ValueError, match=f"variant '{other}'.*weight 0 at masked entries.*got"):
        attnlab.attention_weights(s, other)


def test_a_wrong_variant_is_refused_through_hf_analyze(registered, tiny_model_dir):
    from attnlab import hf

    name = registered(lambda x, c: _softmax(x, c) - 0.5 * (x > -math.inf))
    loaded = hf.load_model(tiny_model_dir("bert"))
    with pytest.raises(ValueError, match=f"variant '{name}': its normalizer must return weights >= 0, got"):
        hf.analyze("a b c d", loaded, variants=("unas", name)).table()


# ----------------------------------------------------------------------------------------------
# 2. Attention flow: empty, NaN, negative weights; the work limit
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(0, 2, 3, 3), (2, 0, 3, 3), (2, 2, 0, 0), (0, 3, 3), (2, 0, 0)])
def test_flow_on_empty_weights_is_a_worded_error(shape, reliability):
    seen = assert_value_error(lambda: flow.attention_flow(torch.zeros(shape)), ["weights"], str(shape))
    assert f"got shape {shape}" in seen
    reliability("attention flow on empty weights", f"attention_flow(torch.zeros{shape})", seen)


def test_flow_with_nan_weights_is_nan():
    @fuzz_settings(12)
    @given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 5), st.integers(0, 2), st.booleans(),
           st.sampled_from([math.nan, math.inf]), st.integers(0, 2**31))
    def case(L, H, N, how, residual, bad, seed):
        gen = torch.Generator().manual_seed(seed)
        w = torch.softmax(torch.randn(L, H, N, N, generator=gen, dtype=torch.float64), -1)
        if how == 0:
            w[:] = bad  # every weight
        elif how == 1:
            w[L - 1, 0, N - 1, 0] = bad  # one weight
        else:
            w[0, :, 0] = bad  # one row of every head
        out = flow.attention_flow(w, add_residual=residual)
        assert out.shape == (N, N) and out.isnan().all(), out

    case()


def test_all_nan_flow_is_nan_not_zero(reliability):
    out = flow.attention_flow(torch.full((2, 2, 4, 4), math.nan))
    assert out.isnan().all()
    reliability("attention flow on NaN weights", "attention_flow(all-NaN (2, 2, 4, 4) weights)",
                f"a (4, 4) flow, every value NaN (was a finite all-zero flow): {out[0].tolist()}")


def test_flow_on_negative_weights_is_refused():
    w = torch.softmax(torch.randn(2, 2, 4, 4), -1)
    w[1, 1, 2, 3] = -0.25
    seen = assert_value_error(lambda: flow.attention_flow(w), ["weights"], "negative")
    assert ">= 0" in seen and "-0.25" in seen


BAD_WORK = [math.nan, math.inf, -math.inf, -1.0, 0, 0.0, True, False, "1e9", None, np.float64("nan"),
            np.float32("inf"), np.int64(-5), torch.tensor(math.nan), torch.tensor([1e9, 2e9])]


@pytest.mark.parametrize("max_work", BAD_WORK, ids=repr)
def test_flow_refuses_a_max_work_that_is_not_a_finite_positive_number(max_work, reliability):
    w = torch.softmax(torch.randn(2, 2, 4, 4), -1)
    seen = assert_value_error(lambda: flow.attention_flow(w, max_work=max_work), ["max_work"],
                              repr(max_work))
    assert "finite number > 0" in seen and "got" in seen
    if isinstance(max_work, float) and math.isnan(max_work):
        reliability("flow work limit", "attention_flow(w, max_work=nan)", seen)


@pytest.mark.parametrize("max_work", [1e9, 10**9, np.float32(1e9), np.int64(10**9), torch.tensor(1e9)],
                         ids=repr)
def test_flow_accepts_every_kind_of_number_for_max_work(max_work):
    w = torch.softmax(torch.randn(2, 2, 4, 4, dtype=torch.float64), -1)
    torch.testing.assert_close(flow.attention_flow(w, max_work=max_work), flow.attention_flow(w))


def test_a_small_max_work_still_refuses_a_large_request():
    w = torch.softmax(torch.randn(2, 2, 6, 6), -1)
    with pytest.raises(ValueError, match="over the limit max_work"):
        flow.attention_flow(w, max_work=10.0)


# ----------------------------------------------------------------------------------------------
# 3. Contributions: negative norms or row counts
# ----------------------------------------------------------------------------------------------


def test_negative_norms_are_refused_everywhere(reliability):
    @fuzz_settings(12)
    @given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 6), st.floats(-1e3, -1e-6),
           st.integers(0, 2**31))
    def case(L, H, N, value, seed):
        gen = torch.Generator().manual_seed(seed)
        w = torch.softmax(torch.randn(L, H, N, N, generator=gen), -1)
        norms = torch.rand(L, H, N, generator=gen)
        norms.view(-1)[seed % norms.numel()] = value
        for label, fn in (
            ("contribution_mass", lambda: contributions.contribution_mass(w, norms)),
            ("contribution_statistics", lambda: contributions.contribution_statistics(w, norms)),
            ("contribution_table", lambda: contributions.contribution_table({"unas": w}, {"unas": norms})),
            ("explained_away_fraction_by", lambda: contributions.explained_away_fraction_by(w, norms=norms)),
        ):
            msg = assert_value_error(fn, ["norms"], label)
            assert ">= 0" in msg and "got a minimum of" in msg, msg

    case()
    seen = assert_value_error(lambda: contributions.contribution_statistics(
        torch.full((1, 1, 2, 2), 0.5), torch.tensor([[[1.0, -1e-6]]])), ["norms"])
    reliability("contributions from negative norms",
                "contribution_statistics(w, norms with one value -1e-06)", seen)


@pytest.mark.parametrize("n_rows", [-1, -7, 2.5, math.nan, math.inf, True, "3", None, np.float64(-1.0)],
                         ids=repr)
def test_relative_contribution_refuses_a_bad_row_count(n_rows, reliability):
    c = torch.rand(2, 5)
    seen = assert_value_error(lambda: contributions.relative_contribution(c, n_rows), ["n_rows"],
                              repr(n_rows))
    assert "integer >= 0" in seen
    if n_rows == -1:
        reliability("contributions with negative n_rows", "relative_contribution(c, n_rows=-1)", seen)


def test_relative_contribution_refuses_negative_contributions():
    c = torch.rand(2, 5)
    c[1, 2] = -0.5
    seen = assert_value_error(lambda: contributions.relative_contribution(c, 4), ["c"], "negative c")
    assert "got a minimum of -0.5" in seen


def test_contributions_are_never_negative_and_nan_propagates():
    @fuzz_settings(15)
    @given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 6), st.booleans(),
           st.integers(0, 2**31))
    def case(L, H, N, with_nan, seed):
        gen = torch.Generator().manual_seed(seed)
        w = torch.softmax(torch.randn(L, H, N, N, generator=gen), -1)
        norms = torch.rand(L, H, N, generator=gen) * 10
        if with_nan:
            norms[0, 0, seed % N] = math.nan
        c = contributions.contribution_mass(w, norms)
        assert not bool((c < 0).any())
        rel = contributions.relative_contribution(c, N)
        assert not bool((rel < 0).any())
        st_ = contributions.contribution_statistics(w, norms)
        for key, value in st_.items():
            if with_nan:  # the head with a NaN norm: every statistic NaN, never a finite share
                assert value[0, 0].isnan(), (key, value)
                assert not value.flatten()[1:].isnan().any(), (key, value)
            else:
                assert not value.isnan().any() and bool((value >= 0).all()), (key, value)

    case()
