"""Property-based fuzz suite over the entry points (see tests/test_fuzz.py for the rules):
``hf.analyze`` / ``hf.batch_weights`` on a tiny random BERT, and the ``attnlab analyze`` command's
argument handling called in-process (``attnlab.cli.main``, no subprocess). Valid arguments give
weights whose valid rows sum to 1 (and numpy scalars the same weights as Python scalars); invalid
ones a ValueError naming the argument (the CLI: exit status 2 and a message naming the flag)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from fuzzkit import assert_value_error, fuzz_settings, one_thread  # noqa: F401 - autouse fixture
from hypothesis import given
from hypothesis import strategies as st

import attnlab


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from attnlab import hf

    return hf.load_model(tiny_model_dir("bert"))


def _rows_sum_to_one(w: torch.Tensor, valid: torch.Tensor, label: str):
    """Rows sum to 1 on valid tokens (to at most 1 where the variant's spec says rows may sum to
    less, e.g. softmax1), to 0 on padding."""
    # w (L, B, H, N, N); valid (B, N)
    sums = w.sum(-1)  # (L, B, H, N)
    want = valid[None, :, None, :].expand_as(sums).to(sums.dtype)
    if not attnlab.variant_spec(label).rows_sum_to_one:
        assert (sums <= want + 1e-6).all(), f"{label}: a row sums to more than 1"
        want = torch.where(want > 0, sums, want)
    err = (sums - want).abs().max().item() if sums.numel() else 0.0
    assert err < 1e-4, f"{label}: rows sum to 1 on valid tokens (0 on padding) up to {err:.2g}"


@pytest.mark.slow  # ~1 s: .ci/run runs it, the inner loop does not
def test_batch_weights_valid_arguments(tiny, reliability):
    from attnlab import hf

    vocab = tiny.tokenizer.vocab_size if hasattr(tiny.tokenizer, "vocab_size") else 100

    @fuzz_settings(15)
    @given(st.integers(0, 2**63 - 1))
    def run(seed):
        r = random.Random(seed)
        B, N = r.randint(1, 2), r.randint(1, 6)
        ids = torch.randint(5, vocab, (B, N), generator=torch.Generator().manual_seed(seed % 2**31))
        lengths = [r.randint(1, N) for _ in range(B)]
        mask = torch.tensor([[1] * n + [0] * (N - n) for n in lengths])
        u = r.choice([0.0, 0.3, 1.0])
        iters = r.choice([1, 2])
        variants = r.sample(list(attnlab.VARIANTS), r.randint(1, len(attnlab.VARIANTS)))
        w = hf.batch_weights(tiny, ids, mask, variants=variants, u=u, iters=iters)
        assert list(w) == variants
        for v, t in w.items():
            _rows_sum_to_one(t, mask.bool(), v)

    run()
    reliability(
        "fuzz: hf.batch_weights",
        "15 random padded batches (B 1-2, N 1-6) on a tiny BERT, any subset of "
        "variants, u 0 / 0.3 / 1, iters 1-2",
        "weights (L, B, H, N, N): valid rows sum to 1, padded rows 0",
    )


HF_CASES = [
    "u_range",
    "u_nan",
    "u_np",
    "iters_zero",
    "iters_np",
    "variants",
    "mode",
    "ids_1d",
    "ids_float",
    "mask_shape",
    "zero_tokens",
    "oov",
    "negative_id",
    "u_shape",
]


@pytest.mark.parametrize(
    "bad",
    HF_CASES,
)
def test_batch_weights_bad_arguments(tiny, bad, reliability):
    from attnlab import hf

    ids = torch.tensor([[101, 2000, 2001, 102]])
    kw, names = {}, None
    if bad == "u_range":
        kw, names = dict(u=1.5), ("u",)
    elif bad == "u_nan":
        kw, names = dict(u=math.nan), ("u",)
    elif bad == "u_np":  # a numpy scalar is an ordinary input: same weights as the Python float
        ref = hf.batch_weights(tiny, ids, u=0.25)
        got = hf.batch_weights(tiny, ids, u=np.float32(0.25))
        torch.testing.assert_close(got["hnas"], ref["hnas"])
        return
    elif bad == "iters_zero":
        kw, names = dict(iters=0), ("iters",)
    elif bad == "iters_np":
        torch.testing.assert_close(
            hf.batch_weights(tiny, ids, iters=np.int64(2))["sinkhorn"],
            hf.batch_weights(tiny, ids, iters=2)["sinkhorn"],
        )
        return
    elif bad == "variants":
        kw, names = dict(variants=["softmax"]), ("variants",)
    elif bad == "mode":
        kw, names = dict(mode="replace"), ("mode",)
    elif bad == "ids_1d":
        ids, names = ids[0], ("input_ids",)
    elif bad == "ids_float":
        ids, names = ids.float(), ("input_ids",)
    elif bad == "mask_shape":
        kw, names = dict(attention_mask=torch.ones(1, 3, dtype=torch.long)), ("attention_mask",)
    elif bad == "zero_tokens":
        ids, names = ids[:, :0], ("input_ids",)
    elif bad == "oov":
        ids, names = torch.tensor([[101, 10**7, 102]]), ("input_ids",)
    elif bad == "negative_id":
        ids, names = torch.tensor([[101, -5, 102]]), ("input_ids",)
    else:
        kw, names = dict(u=torch.full((5, 7), 0.5)), ("u",)
    msg = assert_value_error(lambda: hf.batch_weights(tiny, ids, **kw), names, bad)
    reliability("fuzz: hf.batch_weights bad arguments", f"{bad}", f"ValueError: {msg}")


@pytest.mark.parametrize("u", [torch.tensor(1.5), torch.tensor(float("nan")), torch.full((2, 4), -0.5)])
def test_analyze_recompute_refuses_bad_u_like_swap(tiny, u, reliability):
    from attnlab import hf

    msg = assert_value_error(
        lambda: hf.analyze("a short text.", tiny, variants=["hnas"], mode="recompute", u=u), ("u",), f"u={u}"
    )
    reliability("fuzz: hf.analyze recompute with a bad u tensor", f"u = {u.tolist()}", f"ValueError: {msg}")


def test_analyze_valid_arguments(tiny, reliability):
    from attnlab import hf

    @fuzz_settings(6)
    @given(
        st.sampled_from(["Hello world.", "A b c d e f g h i j.", "x", "Ünïcödé text, with punctuation!"]),
        st.sampled_from([None, 8, 16]),
        st.sampled_from(["recompute", "swap"]),
    )
    def run(text, window, mode):
        res = hf.analyze(
            text,
            tiny,
            variants=["unas", "dnas"],
            mode=mode,
            u=0.5,
            iters=1,
            window=window,
            overlap=0 if window else None,
        )
        assert res.n_windows >= 1
        for w in res.windows:
            for v, t in w.weights.items():
                n = t.shape[-1]
                assert t.shape[-2:] == (n, n)
                assert torch.allclose(t.sum(-1), torch.ones(()), atol=1e-4), v
            table = w.table()
            assert not table["value"].isna().any()

    run()
    reliability(
        "fuzz: hf.analyze",
        "short / one-character / non-ASCII texts, windows of 8 / 16 tokens, recompute and swap",
        "every window's rows sum to 1; its table has no NaN",
    )


# ----------------------------------------------------------------------------------------------
# The CLI's argument handling, in-process
# ----------------------------------------------------------------------------------------------

BAD_FLAGS = [
    (["--u", "1.5"], "--u"),
    (["--u", "nan"], "--u"),
    (["--u=-inf"], "--u"),
    (["--iters", "0"], "--iters"),
    (["--iters", "-2"], "--iters"),
    (["--threads", "0"], "--threads"),
    (["--variants", "softmax"], "--variants"),
    (["--variants", ","], "--variants"),
    (["--formats", "gif"], "--formats"),
    (["--device", "tpu"], "--device"),
    (["--max-mb", "nan"], "--max-mb"),
    (["--max-mb", "-1"], "--max-mb"),
    (["--max-mb", "0"], "--max-mb"),
]
PARSE_ERRORS = [
    ["--u", "abc"],
    ["--iters", "2.5"],
    ["--mode", "replace"],
    ["--weights", "some"],
    ["--window"],
]


@pytest.mark.parametrize("extra, flag", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_cli_refuses_bad_values_naming_the_flag(extra, flag, tmp_path, capsys, reliability):
    from attnlab import cli

    text = tmp_path / "t.txt"
    text.write_text("Some words to analyse.", encoding="utf-8")
    argv = ["analyze", str(text), "--out", str(tmp_path / "out"), "--no-figures", "--quiet", *extra]
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2, f"{extra}: exit {code}, stderr {err!r}"
    assert flag in err, f"{extra}: the message does not name {flag}: {err!r}"
    assert not (tmp_path / "out").exists()
    reliability(
        "fuzz: `attnlab analyze` bad values", " ".join(extra), f"exit 2, nothing written: {err.strip()}"
    )


@pytest.mark.parametrize("extra", PARSE_ERRORS, ids=[" ".join(a) for a in PARSE_ERRORS])
def test_cli_parse_errors_exit_2(extra, tmp_path, capsys):
    from attnlab import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["analyze", str(tmp_path / "t.txt"), *extra])
    assert e.value.code == 2
    assert extra[0] in capsys.readouterr().err
