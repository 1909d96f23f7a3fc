"""Property-based fuzz suite over attnlab's public functions (attend, attention_weights, the log-sum-exp
passes, sinkhorn_potentials, relative_positions, attnlab.scores, the modules' forward).

Every case draws an ordinary research input (shapes including 0 and 1, four dtypes, views with
non-unit strides, masks of every broadcastable shape, numpy scalars, NaN/inf, large scales) and
asserts one of two outcomes: the float64 contiguous reference's result within ``fuzzkit.tolerance``
(NaN exactly where the reference has NaN: "NaN propagates to every weight it influences"), or a
ValueError whose message names the argument. Never another exception type, never NaN from finite
inputs; every case is small, so none can hang. Seeded (derandomized hypothesis). The statistics
are fuzzed in tests/test_fuzz_stats.py, hf and the CLI in tests/test_fuzz_entry.py.
"""

from __future__ import annotations

import math
import random

import numpy as np
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
    ref_column_lse,
    ref_weights,
    tensor,
    tolerance,
)
from hypothesis import given
from hypothesis import strategies as st

import attnlab
from attnlab import scores as sc

PAPER = ("unas", "dnas", "hnas", "sinkhorn")  # the variants with a literal reference here
ARGS = ("scores", "q", "k", "v", "mask", "u", "iters", "scale", "variant", "causal", "query_bias")


class Rng(random.Random):
    """Uniform choices from one seed (see :func:`problems`)."""

    def int(self, a, b):
        return self.randint(a, b)

    def pick(self, options):
        return self.choice(list(options))

    def bool(self):
        return self.random() < 0.5

    def float(self):
        return self.random()


def _variant(r):
    return r.pick([v for v in PAPER if v in attnlab.VARIANTS])


@st.composite
def problems(
    draw,
    max_len=5,
    views=("contiguous",),
    dtypes=(torch.float32, torch.float64),
    scales=(1.0, 4.0, 30.0),
    min_len=1,
    numpy=False,
    masks="all",
):
    """(B, H, M, N), a mask of a broadcastable shape (or None), variant, causal, u, iters, generator.

    Hypothesis draws one seed; every choice is made from it by ``random.Random``, so that each example
    is an independent uniform draw (hypothesis' own draws of many small choices stay near the previous
    example, which covers combinations such as a strided q with an (i, j) mask too rarely).
    """
    r = Rng(draw(st.integers(0, 2**63 - 1)))
    B, H = r.int(1, 2), r.int(1, 3)
    M, N = r.int(min_len, max_len), r.int(min_len, max_len)
    gen = torch.Generator().manual_seed(r.int(0, 2**31 - 1))
    variant = _variant(r)
    causal = r.bool()
    iters = 1 if causal else r.int(1, 4)
    shapes = broadcastable_shapes(B, H, M, N)
    if masks == "4d":
        shapes = [sh for sh in shapes if len(sh) == 4]
    mask_shape = r.pick([None, *shapes])
    mask = None if mask_shape is None else random_mask(gen, mask_shape)
    u_kinds = ["none", "python", "tensor_h", "tensor_bh", "zero", "one"] + (["np32", "np64"] if numpy else [])
    u_kind = r.pick(u_kinds)
    u_val = r.float()
    u = {
        "none": None,
        "python": u_val,
        "np32": np.float32(u_val),
        "np64": np.float64(u_val),
        "tensor_h": torch.rand(1, H, 1, 1, generator=gen, dtype=F64),
        "tensor_bh": torch.rand(B, H, 1, 1, generator=gen, dtype=F64),
        "zero": 0,
        "one": 1,
    }[u_kind]
    default = attnlab.check_params("sinkhorn", {}, causal=causal)["iters"]  # the spec's (causal: 1)
    iters_arg = r.pick([iters, None if iters == default else iters] + ([np.int64(iters)] if numpy else []))
    return dict(
        B=B,
        H=H,
        M=M,
        N=N,
        gen=gen,
        variant=variant,
        causal=causal,
        iters=iters,
        iters_arg=iters_arg,
        mask=mask,
        u=u,
        view=r.pick(views),
        dtype=r.pick(dtypes),
        scale=r.pick(scales),
        numpy=numpy,
        rng=r,
    )


def _u_ref(u):
    if u is None:
        return 0.5
    return u.to(F64) if isinstance(u, torch.Tensor) else float(u)


def _check_weights(p, scores, got, label):
    s64 = ref64(scores)
    ref = ref_weights(s64, p["variant"], p["mask"], p["causal"], _u_ref(p["u"]), p["iters"])
    smax = float(s64.abs().nan_to_num(0, 0, 0).max()) if s64.numel() else 0.0
    assert got.dtype == scores.dtype, f"{label}: dtype {got.dtype} != {scores.dtype}"
    masked = None if p["mask"] is None else ~p["mask"].expand(ref.shape)
    assert_close_or_nan(got, ref, tolerance(scores.dtype, smax), label, masked)


# ----------------------------------------------------------------------------------------------
# attention_weights
# ----------------------------------------------------------------------------------------------


def _weights_case(p, scores):
    return attnlab.attention_weights(
        scores, p["variant"], mask=p["mask"], causal=p["causal"], u=p["u"], iters=p["iters_arg"]
    )


@pytest.mark.slow  # ~1 s: .ci/run runs it, the inner loop does not
def test_attention_weights_contiguous_float_inputs(reliability):
    @fuzz_settings(80)
    @given(problems())
    def run(p):
        scores = tensor(p["gen"], (p["B"], p["H"], p["M"], p["N"]), p["dtype"], "contiguous", p["scale"])
        _check_weights(p, scores, _weights_case(p, scores), "attention_weights")

    run()
    reliability(
        "fuzz: attention_weights",
        "80 random (B, H, M, N) (M, N 1-5), every variant, masks of 12 "
        "broadcastable shapes, causal, u float / per-head tensor, iters 1-4, float32 / float64",
        "equal to the float64 loop-free reference within 3e-5 + 3e-6 max|s| (float32), 1e-9 (float64)",
    )


# Input classes beyond contiguous float32 / float64 with Python scalars (one test each, so that a
# failure of one class does not hide the others): problems() keyword arguments, what is tried.
CLASSES = {
    "views": (
        dict(views=VIEWS[1:], min_len=3, max_len=6, min_dim=3),
        "sliced, transposed, expanded and x[..., ::2] tensors",
    ),
    "half": (dict(dtypes=(torch.float16, torch.bfloat16)), "float16 / bfloat16"),
    "numpy": (dict(numpy=True), "u, iters (and scale) as numpy scalars"),
    "empty": (dict(min_len=0, max_len=2), "M or N = 0"),
}
@pytest.mark.parametrize("case", list(CLASSES))
def test_attention_weights_input_classes(case, reliability):
    kw, what = CLASSES[case]

    @fuzz_settings(40)
    @given(problems(**{k: v for k, v in kw.items() if k != "min_dim"}))
    def run(p):
        scores = tensor(p["gen"], (p["B"], p["H"], p["M"], p["N"]), p["dtype"], p["view"], p["scale"])
        _check_weights(p, scores, _weights_case(p, scores), f"attention_weights {p['view']} {p['dtype']}")

    run()
    reliability(
        f"fuzz: attention_weights, {what}",
        "40 random cases, every variant, masks, causal, u, iters",
        "equal to the float64 contiguous reference within the stated tolerance",
    )


def test_attention_weights_nan_propagates(reliability):
    @fuzz_settings(80)
    @given(problems(max_len=4), st.data())
    def run(p, data):
        scores = tensor(
            p["gen"], (p["B"], p["H"], p["M"], p["N"]), p["dtype"], "contiguous", p["scale"]
        ).clone()
        idx = tuple(data.draw(st.integers(0, d - 1)) for d in scores.shape)
        scores[idx] = float("nan")
        _check_weights(p, scores, _weights_case(p, scores), "attention_weights NaN")

    run()
    reliability(
        "fuzz: NaN scores",
        "one NaN score in random (B, H, M, N) scores, every variant, masks, causal",
        "NaN in exactly the weights it influences (its row; for dnas / hnas / sinkhorn every row sharing "
        "its column through c_j), the rest equal to the reference; never a finite wrong value",
    )


def test_attention_weights_inf_scores(reliability):
    @fuzz_settings(40)
    @given(problems(max_len=4), st.data())
    def run(p, data):
        scores = tensor(
            p["gen"], (p["B"], p["H"], p["M"], p["N"]), p["dtype"], "contiguous", p["scale"]
        ).clone()
        idx = tuple(data.draw(st.integers(0, d - 1)) for d in scores.shape)
        scores[idx] = data.draw(st.sampled_from([math.inf, -math.inf]))
        try:
            got = _weights_case(p, scores)
        except ValueError as e:
            assert "scores" in str(e), e
            return
        _check_weights(p, scores, got, "attention_weights inf")

    run()
    reliability(
        "fuzz: +-inf scores",
        "one +inf or -inf score, every variant",
        "a ValueError naming scores, or "
        "NaN where the float64 reference is NaN (+inf) and the reference's value elsewhere (-inf = masked)",
    )


def test_attention_weights_bad_arguments_are_worded(reliability):
    @fuzz_settings(80)
    @given(problems(max_len=3, dtypes=(torch.float32,)), st.data())
    def run(p, data):
        B, H, M, N = p["B"], p["H"], p["M"], p["N"]
        scores = tensor(p["gen"], (B, H, M, N), torch.float32, "contiguous")
        kw = dict(mask=None, causal=False, u=None, iters=None)
        bad = data.draw(
            st.sampled_from(
                [
                    "mask_shape",
                    "mask_dtype",
                    "u_range",
                    "u_nan",
                    "u_type",
                    "u_shape",
                    "iters_zero",
                    "iters_float",
                    "iters_bool",
                    "iters_np_zero",
                    "causal_sinkhorn",
                    "variant",
                    "scores_int",
                    "scores_1d",
                    "scores_list",
                ]
            )
        )
        variant, names = p["variant"], None
        if bad == "mask_shape":
            kw["mask"] = random_mask(
                p["gen"], data.draw(st.sampled_from(non_broadcastable_shapes(B, H, M, N)))
            )
            names = ("mask",)
        elif bad == "mask_dtype":
            kw["mask"] = torch.ones(M, N, dtype=data.draw(st.sampled_from([torch.float32, torch.int64])))
            names = ("mask",)
        elif bad.startswith("u"):
            variant = "hnas"
            kw["u"] = {
                "u_range": data.draw(st.sampled_from([-0.1, 1.5, np.float32(2.0), -1])),
                "u_nan": data.draw(st.sampled_from([math.nan, np.float64("nan"), math.inf])),
                "u_type": data.draw(st.sampled_from(["0.5", [0.5], True])),
                "u_shape": torch.full((B, H, 1, N + 2), 0.5),
            }[bad]
            names = ("u",)
        elif bad.startswith("iters"):
            variant = "sinkhorn"
            kw["iters"] = {
                "iters_zero": data.draw(st.sampled_from([0, -3])),
                "iters_float": 2.5,
                "iters_bool": True,
                "iters_np_zero": np.int64(0),
            }[bad]
            names = ("iters",)
        elif bad == "causal_sinkhorn":
            variant, kw["causal"], kw["iters"] = "sinkhorn", True, data.draw(st.integers(2, 5))
            names = ("iters",)
        elif bad == "variant":
            variant, names = data.draw(st.sampled_from(["softmax", "DNAS", "", None])), ("variant",)
        elif bad == "scores_int":
            scores, names = torch.ones(B, H, M, N, dtype=torch.int64), ("scores",)
        elif bad == "scores_1d":
            scores, names = torch.ones(N), ("scores",)
        else:
            scores, names = [[0.0] * N] * M, ("scores",)
        assert_value_error(lambda: attnlab.attention_weights(scores, variant, **kw), names, bad)

    run()
    reliability(
        "fuzz: attention_weights bad arguments",
        "non-broadcastable / non-bool masks, u outside [0, 1], "
        "NaN, inf, str, u tensor not broadcastable to (B, H, 1, 1), iters 0 / 2.5 / True / np.int64(0), "
        "causal sinkhorn with iters > 1, unknown variant, int / 1-D / list scores",
        "ValueError naming the argument",
    )


# ----------------------------------------------------------------------------------------------
# attend
# ----------------------------------------------------------------------------------------------


@st.composite
def qkv(draw, min_dim=1, **kw):
    p = draw(problems(**kw))
    views, r = kw.get("views", ("contiguous",)), p["rng"]
    D, Dv = r.int(min_dim, 6), r.int(1, 4)
    g, kind, dt = p["gen"], p["view"], p["dtype"]
    B, H, M, N = p["B"], p["H"], p["M"], p["N"]
    p["q"] = tensor(g, (B, H, M, D), dt, kind, math.sqrt(p["scale"]))
    p["k"] = tensor(g, (B, H, N, D), dt, r.pick(views), math.sqrt(p["scale"]))
    p["v"] = tensor(g, (B, H, N, Dv), dt, r.pick(views))
    numpy_scales = [np.float32(0.5), np.float64(0.25)] if p["numpy"] else []
    p["scale_arg"] = r.pick([None, 1.0 / math.sqrt(D), 0.5, 1, *numpy_scales])
    p["return_weights"] = r.bool()
    return p


def _check_attend(p, label):
    q, k, v = p["q"], p["k"], p["v"]
    res = attnlab.attend(
        q,
        k,
        v,
        p["variant"],
        mask=p["mask"],
        causal=p["causal"],
        u=p["u"],
        iters=p["iters_arg"],
        scale=p["scale_arg"],
        return_weights=p["return_weights"],
    )
    out, w = res if p["return_weights"] else (res, None)
    scale = 1.0 / math.sqrt(q.shape[-1]) if p["scale_arg"] is None else float(p["scale_arg"])
    s64 = scale * ref64(q) @ ref64(k).transpose(-1, -2)
    ref = ref_weights(s64, p["variant"], p["mask"], p["causal"], _u_ref(p["u"]), p["iters"])
    ref_out = ref @ ref64(v)
    smax = float(s64.abs().max()) if s64.numel() else 0.0
    vmax = float(ref64(v).abs().max()) if v.numel() else 0.0
    assert out.dtype == q.dtype, f"{label}: out dtype {out.dtype} != q dtype {q.dtype}"
    assert_close_or_nan(out, ref_out, tolerance(q.dtype, smax) * max(1.0, vmax) * 2, label + " out")
    if w is not None:
        assert_close_or_nan(w, ref, tolerance(q.dtype, smax), label + " weights")


def test_attend_contiguous_float_inputs(reliability):
    @fuzz_settings(80)
    @given(qkv())
    def run(p):
        _check_attend(p, "attend")

    run()
    reliability(
        "fuzz: attend",
        "80 random q, k, v (M, N 1-5, D 1-6), every variant, masks of 12 "
        "broadcastable shapes (separable and (i, j)-dependent), causal, return_weights, float32 / float64",
        "out and weights equal to the float64 reference (weights @ v) within the stated tolerance",
    )


@pytest.mark.parametrize("case", list(CLASSES))
def test_attend_input_classes(case, reliability):
    kw, what = CLASSES[case]

    @fuzz_settings(40)
    @given(qkv(**kw))
    def run(p):
        _check_attend(p, f"attend {p['view']} {p['dtype']}")

    run()
    reliability(
        f"fuzz: attend, {what}",
        "40 random q, k, v, every variant, masks, causal, return_weights",
        "equal to the float64 contiguous reference within the stated tolerance",
    )


def test_attend_bad_scale_is_worded(reliability):
    @fuzz_settings(30)
    @given(
        qkv(dtypes=(torch.float32,)),
        st.sampled_from(
            [math.inf, -math.inf, math.nan, 0.0, -1.0, np.float32("nan"), np.float64(-0.5), "1", 0]
        ),
    )
    def run(p, scale):
        assert_value_error(
            lambda: attnlab.attend(p["q"], p["k"], p["v"], p["variant"], scale=scale),
            ("scale",),
            f"scale={scale!r}",
        )

    run()
    reliability(
        "fuzz: attend scale",
        "scale = inf, -inf, NaN, 0, negative, numpy NaN, a str",
        "ValueError naming scale",
    )


def test_attend_bad_shapes_are_worded(reliability):
    @fuzz_settings(40)
    @given(qkv(dtypes=(torch.float32,)), st.sampled_from(["q3d", "kD", "vN", "int", "list"]))
    def run(p, bad):
        q, k, v = p["q"], p["k"], p["v"]
        names = ("q", "k", "v")
        if bad == "q3d":
            q = q[0]
        elif bad == "kD":
            k = torch.zeros(*k.shape[:-1], k.shape[-1] + 1)
        elif bad == "vN":
            v = torch.zeros(v.shape[0], v.shape[1], v.shape[2] + 1, v.shape[3])
        elif bad == "int":
            q = q.to(torch.int64)
        else:
            v = v.tolist()
        assert_value_error(lambda: attnlab.attend(q, k, v, p["variant"]), names, bad)

    run()
    reliability(
        "fuzz: attend shapes",
        "3-D q, k of another D, v of another N, integer q, a list v",
        "ValueError naming q, k or v",
    )


def test_attend_large_scales_match_reference(reliability):
    @fuzz_settings(40)
    @given(qkv(dtypes=(torch.float32,)), st.sampled_from([1e2, 1e3]))
    def run(p, big):
        p["u"] = p["u"] if p["u"] is None or isinstance(p["u"], (torch.Tensor, float, int)) else float(p["u"])
        p["iters_arg"] = None if p["iters_arg"] is None else int(p["iters_arg"])
        p["scale_arg"] = big
        p["return_weights"] = False
        _check_attend(p, f"attend scale {big}")

    run()
    reliability(
        "fuzz: attend at large scales",
        "scale 1e2 and 1e3 (scores up to ~1e4), float32, every variant",
        "equal to the float64 reference within 3e-5 + 3e-6 max|s|",
    )


# ----------------------------------------------------------------------------------------------
# column_logsumexp, row_logsumexp, sinkhorn_potentials
# ----------------------------------------------------------------------------------------------


LSE_CLASSES = {
    "contiguous": (dict(masks="4d"), "4-D masks"),
    "masks": (dict(), "masks of every broadcastable shape"),
    **{k: v for k, v in CLASSES.items() if k != "half"},
}


@pytest.mark.parametrize(
    "case",
    list(LSE_CLASSES),
)
def test_column_and_row_logsumexp_match_reference(case, reliability):
    kw, what = LSE_CLASSES[case]

    @fuzz_settings(40)
    @given(qkv(**kw), st.booleans())
    def run(p, with_bias):
        q, k = p["q"], p["k"]
        scale = 1.0 / math.sqrt(q.shape[-1]) if p["scale_arg"] is None else float(p["scale_arg"])
        s64 = scale * ref64(q) @ ref64(k).transpose(-1, -2)
        smax = float(s64.abs().max()) if s64.numel() else 0.0
        bias = tensor(p["gen"], q.shape[:-1], q.dtype, "contiguous") if with_bias else None
        got = attnlab.column_logsumexp(q, k, p["mask"], p["scale_arg"], bias)
        ref = ref_column_lse(s64, p["mask"], None if bias is None else ref64(bias))
        assert_close_or_nan(got, ref, tolerance(q.dtype, smax) * 4, "column_logsumexp")
        mt = None if p["mask"] is None else p["mask"].expand(s64.shape).transpose(-1, -2)
        got_r = attnlab.normalizers.row_logsumexp(
            q, k, None if mt is None else mt.transpose(-1, -2), p["scale_arg"]
        )
        ref_r = ref_column_lse(s64.transpose(-1, -2), mt)
        assert_close_or_nan(got_r, ref_r, tolerance(q.dtype, smax) * 4, "row_logsumexp")

    run()
    reliability(
        f"fuzz: column_logsumexp / row_logsumexp, {what}",
        "40 random q, k (float32 / float64), masks, a query bias",
        "equal to logsumexp of the float64 scores over valid entries (0 for an empty column)",
    )


def test_column_logsumexp_bad_arguments_are_worded(reliability):
    @fuzz_settings(40)
    @given(
        qkv(dtypes=(torch.float32,)), st.sampled_from(["mask_float", "q3d", "kD", "scale_nan", "bias_shape"])
    )
    def run(p, bad):
        q, k, mask, scale, bias, names = p["q"], p["k"], None, None, None, None
        if bad == "mask_float":
            mask, names = torch.ones(q.shape[-2], k.shape[-2]), ("mask",)
        elif bad == "q3d":
            q, names = q[0], ("q",)
        elif bad == "kD":
            k, names = torch.zeros(*k.shape[:-1], k.shape[-1] + 1), ("k", "q")
        elif bad == "scale_nan":
            scale, names = math.nan, ("scale",)
        else:
            bias, names = torch.zeros(q.shape[-2] + 1), ("query_bias",)
        assert_value_error(lambda: attnlab.column_logsumexp(q, k, mask, scale, bias), names, bad)

    run()
    reliability(
        "fuzz: column_logsumexp bad arguments",
        "float mask, 3-D q, k of another D, NaN scale, query_bias of a wrong shape",
        "ValueError naming the argument",
    )


@pytest.mark.parametrize(
    "case",
    list(LSE_CLASSES),
)
def test_sinkhorn_potentials_give_the_reference_weights(case, reliability):
    kw, what = LSE_CLASSES[case]

    @fuzz_settings(40)
    @given(qkv(**kw))
    def run(p):
        q, k = p["q"], p["k"]
        iters = p["iters"]
        scale = 1.0 / math.sqrt(q.shape[-1]) if p["scale_arg"] is None else float(p["scale_arg"])
        c = attnlab.normalizers.sinkhorn_potentials(q, k, p["mask"], p["scale_arg"], iters)
        s64 = scale * ref64(q) @ ref64(k).transpose(-1, -2)
        ref = ref_weights(s64, "sinkhorn", p["mask"], False, iters=iters)
        got = ref_weights(s64 - ref64(c)[..., None, :], "unas", p["mask"])  # pi = softmax_j(s_ij - c_j)
        smax = float(s64.abs().max()) if s64.numel() else 0.0
        assert_close_or_nan(got, ref, tolerance(q.dtype, smax) * 4, "sinkhorn_potentials")

    run()
    reliability(
        f"fuzz: sinkhorn_potentials, {what}",
        "40 random q, k, masks, iters 1-4 (float32 / float64)",
        "softmax_j(s_ij - c_j) equals the float64 Sinkhorn reference (c is compared through the weights "
        "it gives, so re-centring is allowed)",
    )


# ----------------------------------------------------------------------------------------------
# relative_positions and attnlab.scores
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow  # ~1 s: .ci/run runs it, the inner loop does not
def test_relative_positions_fuzz(reliability):
    ints = st.one_of(st.integers(-50, 50), st.integers(-(2**63), 2**63 - 1))

    @fuzz_settings(200)
    @given(st.lists(ints, max_size=6), st.sampled_from(["tensor", "list", "numpy", "int32", "batched"]))
    def run(values, kind):
        if kind == "int32":
            values = [v for v in values if -(2**31) <= v < 2**31]
        pos = {
            "tensor": lambda: torch.tensor(values, dtype=torch.int64),
            "list": lambda: values,
            "numpy": lambda: np.asarray(values, dtype=np.int64),
            "int32": lambda: torch.tensor(values, dtype=torch.int32),
            "batched": lambda: torch.tensor([values, values[::-1]], dtype=torch.int64),
        }[kind]()
        ok = len(set(values)) == len(values) and (not values or max(values) - min(values) + 1 <= 2**63 - 1)
        if not ok:
            assert_value_error(lambda: attnlab.relative_positions(pos), ("positions",), f"{values}")
            return
        got = attnlab.relative_positions(pos)
        ref = [[abs(a - b) + 1 for b in values] for a in values]
        assert got.dtype == torch.int64
        assert (got[0] if kind == "batched" else got).tolist() == (ref if values else [])

    run()
    for bad in (torch.tensor([0.5, 1.0]), torch.tensor(3), torch.tensor([True, False]), "0,1"):
        assert_value_error(lambda b=bad: attnlab.relative_positions(b), ("positions",), repr(bad))
    reliability(
        "fuzz: relative_positions",
        "200 random int lists incl. duplicates and int64 extremes, as tensors, "
        "lists, numpy, int32, batched; float / 0-dim / bool / str positions",
        "|pos_a - pos_b| + 1 exactly "
        "(int64), or ValueError naming positions (duplicates: Eq. 29; spans that overflow int64)",
    )


def test_scores_functions_fuzz(reliability):
    @fuzz_settings(80)
    @given(
        st.integers(0, 2**31 - 1),
        st.sampled_from(DTYPES),
        st.sampled_from(VIEWS),
        st.sampled_from([1, 2, 3, 1.5, 0.5, np.float64(2.0), np.int64(3)]),
        st.booleans(),
        st.integers(0, 4),
        st.integers(1, 4),
    )
    def run(seed, dtype, kind, n, rescale, T, M):
        g = torch.Generator().manual_seed(seed)
        y = tensor(g, (2, T, M), dtype, kind)
        y64 = ref64(y)
        nf = float(n)
        phi = y64.pow(int(nf)) if nf.is_integer() else y64.sign() * y64.abs().pow(nf)
        tol = tolerance(dtype) * 10
        got = sc.signed_power(y, n)
        assert_close_or_nan(
            got, phi, tol * max(1.0, float(phi.abs().max()) if phi.numel() else 1.0), "signed_power"
        )
        feats = sc.power_features(y, n, rescale)
        if rescale and nf != 1:
            rms = y64.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
            ref = rms * (
                (y64 / rms).pow(int(nf))
                if nf.is_integer()
                else (y64 / rms).sign() * (y64 / rms).abs().pow(nf)
            )
        else:
            ref = phi
        big = max(1.0, float(ref.abs().max()) if ref.numel() else 1.0)
        assert_close_or_nan(feats, ref, tol * big, "power_features")
        if nf.is_integer() and nf >= 1:
            poly = sc.polynomial_features(y, int(nf), rescale)
            assert len(poly) == int(nf)
        if T and M <= 3:
            B = torch.randn(M, M, generator=g, dtype=F64)
            eps = sc.gam_scores_reference(y64[0], B, lambda x: x * x)
            torch.testing.assert_close(eps, (y64[0] ** 2) @ B @ (y64[0] ** 2).T)

    run()
    for bad_n in (0, -1, math.nan, math.inf, "2"):
        assert_value_error(lambda b=bad_n: sc.signed_power(torch.ones(2), b), ("n",), repr(bad_n))
    assert_value_error(lambda: sc.polynomial_features(torch.ones(2, 2), 0), ("degree",), "degree 0")
    assert_value_error(lambda: sc.power_features(torch.ones(2, 2, dtype=torch.long), 2), ("y",), "int y")
    assert_value_error(
        lambda: sc.gam_scores_reference(torch.ones(2, 3), torch.ones(2, 2), abs), ("bilinear",), "B"
    )
    reliability(
        "fuzz: attnlab.scores",
        "signed_power / power_features (rescale on and off) / polynomial_features / "
        "gam_scores_reference on 4 dtypes and every view, n integer, fractional, numpy; n <= 0, NaN, inf, "
        "str; degree 0; integer y; a B of the wrong shape",
        "equal to the float64 formula (Eqs. 17-18, the "
        "opt-in rms guard), or ValueError naming n / degree / y / bilinear",
    )


# ----------------------------------------------------------------------------------------------
# Modules' forward
# ----------------------------------------------------------------------------------------------


def _module(r, gen_seed):
    from attnlab.modules import AttentionConfig, GAMAttention, GAMConfig, MultiHeadAttention

    variant = _variant(r)
    H = r.pick([1, 2])
    d = H * r.int(1, 3)
    torch.manual_seed(gen_seed)
    if r.bool():
        return (
            MultiHeadAttention(AttentionConfig(d_model=d, n_heads=H, variant=variant, iters=2)),
            d,
            H,
            False,
        )
    cfg = GAMConfig(
        d_model=d,
        n_heads=H,
        variant=variant,
        iters=2,
        f=r.pick(["power", "poly"]),
        power=r.pick([1.0, 2.0]),
        n_brains=r.int(1, 2),
        rank=r.pick([None, 2]),
        relative_position=r.bool(),
        max_len=8,
        rescale=r.bool(),
    )
    return GAMAttention(cfg), d, H, cfg.relative_position


@st.composite
def module_cases(draw):
    r = Rng(draw(st.integers(0, 2**63 - 1)))
    seed = r.int(0, 2**31 - 1)
    module, d, H, rel = _module(r, seed)
    B, T = r.int(1, 2), r.int(1, 4)
    g = torch.Generator().manual_seed(seed)
    mask_shape = r.pick([None, (T,), (B, 1, 1, T), (1, 1, T, T), (B, H, T, T), (T, 1)])
    mask = None if mask_shape is None else random_mask(g, mask_shape)
    causal = r.bool() and module.config.variant != "sinkhorn"
    return dict(
        module=module.eval(),
        d=d,
        B=B,
        T=T,
        gen=g,
        mask=mask,
        causal=causal,
        rel=rel,
        view=r.pick(VIEWS),
        dtype=r.pick((torch.float32, torch.float64)),
    )


def test_modules_forward_fuzz(reliability):
    @fuzz_settings(40)
    @given(module_cases())
    def run(p):
        m, dt = p["module"], p["dtype"]
        x = tensor(p["gen"], (p["B"], p["T"], p["d"]), dt, p["view"])
        with torch.no_grad():
            got, w = m.to(dt)(x, mask=p["mask"], causal=p["causal"], return_weights=True)
            ref, ref_w = m.to(F64)(ref64(x), mask=p["mask"], causal=p["causal"], return_weights=True)
        assert got.dtype == dt and got.shape == x.shape
        tol = tolerance(dt) * 20
        assert_close_or_nan(got, ref, tol, f"{type(m).__name__} out")
        assert_close_or_nan(w, ref_w, tol, f"{type(m).__name__} weights")

    run()
    reliability(
        "fuzz: modules' forward",
        "40 random MultiHeadAttention / GAMAttention (every variant, power / "
        "poly, brains, rank, relative positions, rescale on / off) on views of x, masks (T,), (B, 1, 1, T), "
        "(T, T), (B, H, T, T), (T, 1), causal",
        "equal to the same module in float64 on a contiguous x",
    )


def test_modules_bad_inputs_are_worded(reliability):
    @fuzz_settings(40)
    @given(
        module_cases(),
        st.sampled_from(
            [
                "x2d",
                "xwidth",
                "xint",
                "xlist",
                "mask_shape",
                "mask_float",
                "positions_shape",
                "positions_float",
                "causal_str",
            ]
        ),
    )
    def run(p, bad):
        m, B, T, d = p["module"].float(), p["B"], p["T"], p["d"]
        x = torch.zeros(B, T, d)
        kw, names = {}, ("x",)
        if bad == "x2d":
            x = torch.zeros(T, d)
        elif bad == "xwidth":
            x = torch.zeros(B, T, d + 1)
        elif bad == "xint":
            x = torch.zeros(B, T, d, dtype=torch.int64)
        elif bad == "xlist":
            x = [[0.0] * d]
        elif bad == "mask_shape":
            kw["mask"], names = torch.ones(T + 1, dtype=torch.bool), ("mask",)
        elif bad == "mask_float":
            kw["mask"], names = torch.ones(T), ("mask",)
        elif bad == "causal_str":
            kw["causal"], names = "yes", ("causal",)
        elif p["rel"]:
            kw["positions"] = (
                torch.zeros(T + 1, dtype=torch.long) if bad == "positions_shape" else torch.zeros(T)
            )
            names = ("positions",)
        else:
            return
        assert_value_error(lambda: m(x, **kw), names, bad)

    run()
    reliability(
        "fuzz: modules' bad inputs",
        "2-D x (GAMAttention said 'not enough values to unpack'), x of another "
        "width, integer x, a list, masks that do not broadcast or are float, positions of a wrong shape "
        "or dtype, causal='yes'",
        "ValueError naming x / mask / positions / causal",
    )
