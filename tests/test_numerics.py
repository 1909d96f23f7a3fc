"""The normalizers' numerics rules (docs/DESIGN.md §4): views equal contiguous copies on every path,
NaN propagates as torch.softmax, scale is checked, Sinkhorn does not drift, stops at a tolerance and
stops on Ctrl-C between rounds."""

from __future__ import annotations

import math
import signal
import threading

import pytest
import torch

import attnlab
from attnlab import normalizers as nz

F64 = torch.float64
PATHS = ["kernel", "no-kernel"]


def _qkv(seed, B=2, H=3, M=9, N=11, D=8, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, L, D, generator=gen, dtype=dtype) for L in (M, N, N))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("variant", attnlab.VARIANTS)
@pytest.mark.parametrize("mask_kind", ["none", "keys", "pairs"])
def test_views_equal_contiguous_copies(monkeypatch, path, variant, mask_kind):
    if path == "no-kernel":
        monkeypatch.setattr(nz.kernel_paths, "cpu_ops", lambda: None)
    q, k, v = (torch.randn(2, 3, 9, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    k = torch.randn(2, 3, 11, 16, generator=torch.Generator().manual_seed(5))
    v = torch.randn(3, 2, 11, 4, generator=torch.Generator().manual_seed(6)).transpose(0, 1)  # a view
    qs, ks = q[..., ::2], k[..., ::2]  # last-dimension stride 2
    mask = {"none": None, "keys": torch.rand(2, 1, 1, 11, generator=torch.Generator().manual_seed(7)) > 0.3,
            "pairs": torch.rand(2, 3, 9, 11, generator=torch.Generator().manual_seed(8)) > 0.3}[mask_kind]
    kw = dict(mask=mask, iters=3, u=0.7)
    with torch.no_grad():
        got = attnlab.attend(qs, ks, v, variant, **kw)
        ref = attnlab.attend(qs.contiguous(), ks.contiguous(), v.contiguous(), variant, **kw)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)
    if variant in ("unas", "dnas"):
        c = attnlab.column_logsumexp(qs, ks, mask)
        torch.testing.assert_close(c, attnlab.column_logsumexp(qs.contiguous(), ks.contiguous(), mask))


@pytest.mark.parametrize("variant", attnlab.VARIANTS)
def test_nan_propagates_like_softmax(variant):
    """A NaN score makes its row NaN; for column-normalizing variants also every row sharing its
    column (through c_j); a row without the NaN stays finite only when nothing couples it."""
    s = torch.randn(1, 1, 4, 5, dtype=F64)
    s[0, 0, 1, 2] = float("nan")
    w = attnlab.attention_weights(s, variant)
    assert torch.isnan(w[0, 0, 1]).all()  # its own row, as torch.softmax
    if attnlab.variant_spec(variant).column_floor is None:  # row-wise (no column step): other rows untouched
        clean = attnlab.attention_weights(s[..., [0, 2, 3], :], variant)
        torch.testing.assert_close(w[0, 0, [0, 2, 3]], clean[0, 0])
    else:
        assert torch.isnan(w).all()  # c_2 is NaN, and it enters every row
    # through attend: NaN in q (a valid query) gives the same pattern as the weights
    q, k, v = _qkv(1, B=1, H=1, M=4, N=5)
    q[0, 0, 1, 0] = float("nan")
    out = attnlab.attend(q, k, v, variant)
    assert torch.isnan(out[0, 0, 1]).all()
    ref = attnlab.attention_weights(q @ k.transpose(-1, -2) / math.sqrt(8), variant) @ v
    torch.testing.assert_close(out, ref, equal_nan=True, atol=1e-5, rtol=1e-5)
    # a NaN in a padded (masked) query is masked away, as in the materialized path
    mask = torch.ones(1, 1, 4, 1, dtype=torch.bool)
    mask[0, 0, 1] = False
    out = attnlab.attend(q, k, v, variant, mask=mask)
    assert not torch.isnan(out).any() and (out[0, 0, 1] == 0).all()


def test_scale_is_checked_and_numpy_scalars_work():
    q, k, v = _qkv(2)
    for bad in (0.0, -1.0, float("inf"), float("nan"), "2", True):
        with pytest.raises(ValueError, match="scale must be a finite number > 0"):
            attnlab.attend(q, k, v, "dnas", scale=bad)
    import numpy as np

    torch.testing.assert_close(attnlab.attend(q, k, v, "hnas", u=np.float32(0.25), scale=np.float64(0.3)),
                               attnlab.attend(q, k, v, "hnas", u=0.25, scale=0.3))
    torch.testing.assert_close(attnlab.attend(q, k, v, "sinkhorn", iters=np.int64(2)),
                               attnlab.attend(q, k, v, "sinkhorn", iters=2))


def test_u_shape_must_be_per_head():
    q, k, v = _qkv(3)
    for shape in ((1, 1, 9, 1), (2, 3, 1, 8), (5,), (1, 1, 1, 1, 1)):
        with pytest.raises(ValueError, match=r"u must be a number or a tensor broadcastable to \(B, H, 1, 1"):
            attnlab.attend(q, k, v, "hnas", u=torch.full(shape, 0.5))
    torch.testing.assert_close(attnlab.attend(q, k, v, "hnas", u=torch.full((3, 1, 1), 0.5)),
                               attnlab.attend(q, k, v, "hnas", u=0.5))


def test_column_logsumexp_checks_its_arguments():
    q, k, _ = _qkv(4)
    with pytest.raises(ValueError, match="mask must be a boolean tensor"):
        attnlab.column_logsumexp(q, k, torch.ones(9, 11))
    with pytest.raises(ValueError, match="q must be 4-D"):
        attnlab.column_logsumexp(q[0], k)
    with pytest.raises(ValueError, match="query_bias must broadcast to"):
        attnlab.column_logsumexp(q, k, query_bias=torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match="scores must have at least 2 dims"):
        attnlab.attention_weights(torch.zeros(3), "unas")
    for M, N in ((0, 4), (4, 0), (0, 0)):
        w = attnlab.attention_weights(torch.zeros(2, M, N), "dnas")
        assert w.shape == (2, M, N)


@pytest.mark.slow  # 1-4 s: .ci/run runs it, the inner loop does not
@pytest.mark.parametrize("path", PATHS)
def test_float32_sinkhorn_does_not_drift_with_many_rounds(monkeypatch, path):
    """M != N: the potentials used to move by ln(M/N) per round (1e-4 off float64 at 3,000 rounds)."""
    if path == "no-kernel":
        monkeypatch.setattr(nz.kernel_paths, "cpu_ops", lambda: None)
    q, k, v = _qkv(5, B=1, H=2, M=24, N=6, D=8, dtype=F64)
    with torch.no_grad():
        ref = attnlab.attend(q, k, v, "sinkhorn", iters=3000)
        got = attnlab.attend(q.float(), k.float(), v.float(), "sinkhorn", iters=3000)
        s = (q @ k.transpose(-1, -2) / math.sqrt(8)).float()
        w = attnlab.attention_weights(s, "sinkhorn", iters=3000)
    assert (got.double() - ref).abs().max() < 2e-6
    torch.testing.assert_close(w.sum(-2), torch.full((1, 2, 6), 4.0), atol=1e-5, rtol=0)  # columns -> M/N


@pytest.mark.slow  # 1-4 s: .ci/run runs it, the inner loop does not
@pytest.mark.parametrize("path", PATHS)
def test_sinkhorn_tolerance_stops_early_with_marginals_within_tol(monkeypatch, path):
    if path == "no-kernel":
        monkeypatch.setattr(nz.kernel_paths, "cpu_ops", lambda: None)
    q, k, v = _qkv(6, B=1, H=2, M=12, N=12, dtype=F64)
    s = q @ k.transpose(-1, -2) / math.sqrt(8)
    w = attnlab.attention_weights(s, "sinkhorn", iters=5000, tol=1e-6)
    assert (w.sum(-2) - 1).abs().max() < 1e-6 * 1.5
    c = attnlab.normalizers.sinkhorn_potentials(q, k, iters=5000, tol=1e-6)
    w2 = torch.softmax(s - c[..., None, :], dim=-1)
    assert (w2.sum(-2) - 1).abs().max() < 1e-6 * 1.5
    with torch.no_grad():
        out = attnlab.attend(q, k, v, "sinkhorn", iters=5000, tol=1e-6)
    torch.testing.assert_close(out, w @ v, atol=1e-6, rtol=1e-6)


@pytest.mark.slow  # signals and a 0.5 s timer: .ci/run runs it
def test_long_sinkhorn_stops_on_ctrl_c():
    """Rounds beyond the whole-head kernel's SINKHORN_KERNEL_ROUNDS run one by one: SIGINT stops them."""
    q, k, v = _qkv(7, B=1, H=4, M=256, N=256, D=16)
    # Ctrl-C as in a terminal, whatever the test runner set for SIGINT in this process
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.5, lambda: signal.raise_signal(signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt), torch.no_grad():
            attnlab.attend(q, k, v, "sinkhorn", iters=10_000)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("variant", ["dnas", "hnas", "sinkhorn"])
def test_fused_float32_error_is_bounded_by_the_scores_rounding(variant):
    """The fused path computes the scores twice (c_j's pass and the row pass, different summation
    orders): float32 rounding of s (about 2^-23 |s|) is its error bound, at every scale
    (docs/DESIGN.md §4): |fused - float64| <= 1e-6 * max|s_ij| * max|v| + 1e-6."""
    q, k, v = _qkv(9, B=1, H=2, M=64, N=64, D=16)
    for scale in (1.0, 10.0, 100.0, 1e3, 1e4):
        s64 = (q.double() @ k.double().transpose(-1, -2)) * scale
        ref = attnlab.attention_weights(s64, variant) @ v.double()
        with torch.no_grad():
            got = attnlab.attend(q, k, v, variant, scale=scale).double()
        bound = 1e-6 * float(s64.abs().max()) * float(v.abs().max()) + 1e-6
        assert float((got - ref).abs().max()) <= bound, (variant, scale)


def test_all_finite_routes_every_non_finite_input_to_the_exact_path():
    """all_finite (the fast paths' gate: a sum per tensor) says False for NaN, +inf or -inf anywhere,
    True for finite tensors (also empty ones, views and half precision whose float16 sum would
    overflow) and skips None; a float32 sum that overflows from finite entries also says False, which
    only sends the call to the exact path."""
    from attnlab.normalizers.lse import all_finite

    x = torch.randn(3, 4, 50, 8)
    assert all_finite(x, None, x[..., ::2], x.transpose(-1, -2))
    assert all_finite(torch.empty(0, 3))
    for bad in (math.nan, math.inf, -math.inf):
        for where in ((0, 0, 0, 0), (2, 3, 49, 7), (1, 2, 17, 3)):
            y = x.clone()
            y[where] = bad
            assert not all_finite(y) and not all_finite(x, y) and not all_finite(y.transpose(-1, -2))
    half = torch.full((4000,), 60000.0, dtype=torch.float16)  # finite; its float16 sum is inf
    assert all_finite(half) and all_finite(half.bfloat16())
    half[123] = math.nan
    assert not all_finite(half)
    assert not all_finite(torch.full((10,), 3e38))  # finite entries, overflowing sum: the exact path
    import warnings  # noqa: PLC0415

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a tensor under autograd: no graph, no "requires_grad" warning
        assert all_finite(x.clone().requires_grad_())
