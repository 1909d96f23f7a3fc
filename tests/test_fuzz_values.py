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


# ----------------------------------------------------------------------------------------------
# 4. --u-from a checkpoint that learned no u; --u next to --u-from
# ----------------------------------------------------------------------------------------------


def _checkpoint(path, variant):
    from attnlab import models

    torch.manual_seed(0)
    config = models.ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=4, variant=variant)
    lm = models.TransformerLM(config)
    models.save(lm, path)
    return lm


def _analyze(argv, capsys) -> tuple[int, str]:
    from attnlab.cli import main

    rc = main(["analyze", *map(str, argv)])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("variant", ["unas", "dnas"])
def test_u_from_a_checkpoint_without_hnas_layers_is_refused(tmp_path, capsys, tiny_model_dir, variant,
                                                            reliability):
    from attnlab import hf

    _checkpoint(tmp_path / "ckpt", variant)
    with pytest.raises(ValueError, match=rf"ckpt must have learned HNAS weights u.*got layer variants "
                                         rf"\['{variant}', '{variant}'\]"):
        hf.hnas_u_from_checkpoint(tmp_path / "ckpt")
    src = tmp_path / "text.txt"
    src.write_text("Attention that does not explain away.")
    out = tmp_path / "out"
    rc, err = _analyze([src, "--model", tiny_model_dir("bert"), "--variants", "hnas", "--no-figures",
                        "--u-from", tmp_path / "ckpt", "--out", out], capsys)
    assert rc == 2 and "must have learned HNAS weights u" in err and "Traceback" not in err, err
    assert not out.exists()
    if variant == "unas":
        reliability("--u-from a checkpoint without u", "attnlab analyze --u-from <a UNAS checkpoint>",
                    f"exit {rc}: {err.strip()}")


def test_u_from_a_mixed_checkpoint_uses_its_hnas_layers(tmp_path):
    from attnlab import hf

    lm = _checkpoint(tmp_path / "ckpt", ["unas", "hnas"])
    u = hf.hnas_u_from_checkpoint(tmp_path / "ckpt")
    torch.testing.assert_close(u, lm.hybrid_weights())
    assert u[0].eq(0).all() and u[1].gt(0).all()


@pytest.mark.parametrize("u", ["0.3", "0", "1", "0.5"])
def test_u_next_to_u_from_is_refused(tmp_path, capsys, u, reliability):
    src = tmp_path / "text.txt"
    src.write_text("Attention that does not explain away.")
    out = tmp_path / "out"
    rc, err = _analyze([src, "--variants", "hnas", "--no-figures", "--u", u, "--u-from", tmp_path / "nowhere",
                        "--out", out], capsys)
    assert rc == 2 and "--u and --u-from are alternatives" in err and f"got --u {float(u):g}" in err, err
    assert not out.exists()
    if u == "0.3":
        reliability("--u next to --u-from", "attnlab analyze --u 0.3 --u-from CKPT",
                    f"exit {rc}: {err.strip()}")


# ----------------------------------------------------------------------------------------------
# 5. NaN in a model's weights: a note naming the first layer (table, CLI, app)
# ----------------------------------------------------------------------------------------------


def _tidy(first_nan: dict[str, int | None], L: int, H: int, windows: int = 1):
    """A tidy table whose variant v is NaN from layer first_nan[v] on (None: never)."""
    import pandas as pd

    rows = []
    for w in range(windows):
        for v, first in first_nan.items():
            for layer in range(L):
                for h in range(H):
                    for s in ("gini", "row_entropy"):
                        nan = first is not None and layer >= first and (w == windows - 1 or s == "gini")
                        rows.append((v, layer, h, s, math.nan if nan else 0.5, w))
    return pd.DataFrame(rows, columns=["variant", "layer", "head", "statistic", "value", "window"])


def test_nan_note_names_the_first_layer():
    from attnlab import stats

    @fuzz_settings(25)
    @given(st.integers(1, 6), st.integers(1, 3), st.lists(st.one_of(st.none(), st.integers(0, 5)), min_size=1,
                                                         max_size=4), st.integers(1, 3))
    def case(L, H, firsts, windows):
        first = {f"v{i}": None if f is None else min(f, L - 1) for i, f in enumerate(firsts)}
        table = _tidy(first, L, H, windows)
        note = stats.with_nan_note(table).attrs.get("notes", [])
        given_ = [f for f in first.values() if f is not None]
        if not given_:
            assert note == [] and stats.nan_note(table) is None
            return
        assert len(note) == 1 and note[0].startswith(f"NaN from layer {min(given_)} on")
        share = table.value.isna().mean()
        assert f"{share:.0%} of the statistics are NaN" in note[0]
        assert ("window 0" in note[0]) == (windows > 1)
        stats.with_nan_note(table)  # again: one note, not two
        assert len(table.attrs["notes"]) == 1

    case()


def test_weights_nan_note_probes_and_names_the_first_layer():
    from attnlab import stats

    @fuzz_settings(25)
    @given(st.integers(1, 5), st.integers(1, 3), st.integers(2, 7), st.integers(0, 4),
           st.sampled_from(["layer", "key", "query", "none"]), st.booleans())
    def case(L, H, N, first, where, numpy):
        first = min(first, L - 1)
        w = torch.softmax(torch.randn(L, H, N, N), -1)
        if where == "layer":  # NaN in the layer's q or k weights: its attention and every later one
            w[first:] = math.nan
        elif where == "key":  # one key's hidden state NaN: its column, then everything
            w[first, :, :, 0] = math.nan
            w[first + 1:] = math.nan
        elif where == "query" and first < L - 1:  # one query row NaN, everything one layer later
            w[first, 0, 0] = math.nan
            w[first + 1:] = math.nan
        weights = {"unas": w.numpy() if numpy else w, "dnas": w.clone()}
        note = stats.weights_nan_note(weights)
        if where == "none" or (where == "query" and first == L - 1):
            assert note is None
        else:
            assert note is not None and note.startswith(f"NaN from layer {first} on"), note

    case()


@pytest.fixture(scope="module")
def nan_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny BERT (2 layers) with NaN in layer 1's query projection."""
    import shutil

    from safetensors.torch import load_file, save_file

    directory = tmp_path_factory.mktemp("nan-bert") / "model"
    shutil.copytree(tiny_model_dir("bert"), directory)
    tensors = load_file(directory / "model.safetensors")
    key = next(k for k in tensors if "layer.1." in k and "query.weight" in k)
    tensors[key][0, 0] = math.nan
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def test_nan_model_weights_give_a_table_note_naming_the_layer(nan_model_dir, reliability):
    from attnlab import hf

    loaded = hf.load_model(nan_model_dir)
    result = hf.analyze("Attention that does not explain away, it keeps a share.", loaded)
    table = result.table()
    assert table.value.isna().any() and not table[table.layer == 0].value.isna().any()
    notes = table.attrs["notes"]
    assert len(notes) == 1 and notes[0].startswith("NaN from layer 1 on"), notes
    assert result.windows[0].table().attrs["notes"] == notes
    assert result.summary().attrs["notes"][0].startswith("NaN from layer 1 on")
    clean = hf.analyze("Attention that does not explain away.", hf.load_model(None)).table()
    assert not clean.attrs.get("notes")
    reliability("NaN in a model's weights", "hf.analyze(text, a model with NaN in layer 1's query weights)"
                ".table()", f"table.attrs['notes']: {notes[0]}")


def test_nan_model_weights_give_a_cli_note(nan_model_dir, tmp_path, capsys, reliability):
    import json

    src = tmp_path / "text.txt"
    src.write_text("Attention that does not explain away, it keeps a share.")
    out = tmp_path / "out"
    rc, err = _analyze([src, "--model", nan_model_dir, "--no-figures", "--out", out], capsys)
    assert rc == 0, err
    line = next((x for x in err.splitlines() if "note: NaN from layer 1 on" in x), None)
    assert line is not None, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert any(n.startswith("NaN from layer 1 on") for n in manifest["notes"]), manifest["notes"]
    reliability("NaN in a model's weights (CLI)", "attnlab analyze --model <NaN in layer 1's query weights>",
                f"exit 0 and on stderr: {line.strip()}")


@pytest.mark.slow  # an AppTest run (a few seconds)
def test_nan_model_weights_give_an_app_warning(nan_model_dir, monkeypatch):
    pytest.importorskip("streamlit.testing.v1")
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("ATTNLAB_DEBUG", "1")
    monkeypatch.setenv("ATTNLAB_UMAP", "off")
    monkeypatch.setenv("ATTNLAB_MODEL_ROOTS", str(Path(nan_model_dir).parent))
    app = str(Path(__file__).resolve().parents[1] / "app" / "streamlit_app.py")
    at = AppTest.from_file(app, default_timeout=120).run()
    at.selectbox(key="inspect_model").set_value("Local Hugging Face directory…").run()
    at.text_input(key="inspect_model_dir").set_value(str(nan_model_dir)).run()
    at.switch_page("app_pages/explaining_away.py").run()
    assert not at.exception, [e.message for e in at.exception]
    warnings_ = [w.value for w in at.warning]
    assert any(w.startswith("NaN from layer 1 on") for w in warnings_), warnings_


# ----------------------------------------------------------------------------------------------
# 6. special_mass: special tokens alone; punctuation_mass beside it
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["The cat sat on the mat, because it was tired.",
                                  "Wait -- what?! (Really...) Yes; no: maybe.", "no punctuation here"])
def test_special_mass_counts_special_tokens_alone(minilm, text, reliability):
    from attnlab import hf, stats

    w = hf.analyze(text, minilm).windows[0]
    assert w._sums is not None  # the analysis' row sums (the fast path) are what is checked
    table = w.table().set_index(["variant", "layer", "head", "statistic"])["value"]
    for v, weights in w.weights.items():
        special = stats.special_token_mass(weights, w.special)  # (L, H): docs/STATISTICS.md's definition
        punct = stats.special_token_mass(weights, w.punctuation)
        got_s = torch.tensor(table.xs((v, "special_mass"), level=["variant", "statistic"]).to_numpy())
        got_p = torch.tensor(table.xs((v, "punctuation_mass"), level=["variant", "statistic"]).to_numpy())
        torch.testing.assert_close(got_s, special.flatten().double(), atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(got_p, punct.flatten().double(), atol=2e-5, rtol=1e-4)
        assert bool((got_p >= 0).all())
    if text.startswith("The cat"):
        unas = table.xs("unas", level="variant")
        reliability("special_mass and punctuation", f"hf.analyze({text!r}).table()",
                    f"special_mass (unas, mean) {unas.xs('special_mass', level='statistic').mean():.3f} = "
                    "the "
                    f"special tokens alone, as docs/STATISTICS.md defines it; punctuation_mass "
                    f"{unas.xs('punctuation_mass', level='statistic').mean():.3f} a statistic of its own")


def test_special_mass_without_punctuation_and_the_old_keyword(minilm):
    from attnlab import hf

    w = hf.analyze("The cat sat on the mat, because it was tired.", minilm).windows[0]
    plain = w.table(punctuation=False)
    assert "punctuation_mass" not in set(plain.statistic) and "special_mass" in set(plain.statistic)
    with pytest.warns(DeprecationWarning, match="special_mass counts special tokens only"):
        old = w.table(include_punctuation=True)
    new = w.table()
    assert old.equals(new)
    recomputed = w.table(reference="dnas")  # not from the row sums: from the weights
    a = recomputed[recomputed.statistic.isin(["special_mass", "punctuation_mass"])].value.to_numpy()
    b = new[new.statistic.isin(["special_mass", "punctuation_mass"])].value.to_numpy()
    np.testing.assert_allclose(a, b, atol=2e-5)


def test_tidy_table_punctuation_fuzz():
    from attnlab import stats

    @fuzz_settings(20)
    @given(st.integers(1, 2), st.integers(1, 3), st.integers(1, 7), st.integers(0, 2**31))
    def case(L, H, N, seed):
        gen = torch.Generator().manual_seed(seed)
        w = {"unas": torch.softmax(torch.randn(L, H, N, N, generator=gen), -1)}
        special = torch.rand(N, generator=gen) < 0.3
        punct = (torch.rand(N, generator=gen) < 0.3) & ~special
        df = stats.tidy_table(w, special=special, punctuation=punct).set_index("statistic")["value"]
        torch.testing.assert_close(torch.tensor(df.loc[["special_mass"]].to_numpy()),
                                   stats.special_token_mass(w["unas"], special).flatten().double())
        torch.testing.assert_close(torch.tensor(df.loc[["punctuation_mass"]].to_numpy()),
                                   stats.special_token_mass(w["unas"], punct).flatten().double())
        assert_value_error(lambda: stats.tidy_table(w, punctuation=torch.ones(N + 1, dtype=torch.bool)),
                           ["punctuation"])

    case()
