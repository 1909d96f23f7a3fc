"""attnlab's CPU kernels (attnlab/kernels.py, attnlab/csrc/attnlab_cpu.cpp) against plain torch, and
the fused attend paths that use them against the PyTorch-only paths (kernels switched off)."""

from __future__ import annotations

import math

import pytest
import torch

import attnlab
from attnlab import kernels
from attnlab import normalizers as nz

ops = kernels.cpu_ops()
needs_kernels = pytest.mark.skipif(ops is None, reason=f"CPU kernels not built: {kernels.build_error()}")


def _qkv(seed, B, H, M, N, D, Dv=None, dtype=torch.float32, spread=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = spread * torch.randn(B, H, M, D, generator=gen, dtype=dtype)
    k = torch.randn(B, H, N, D, generator=gen, dtype=dtype)
    v = torch.randn(B, H, N, Dv or D, generator=gen, dtype=dtype)
    return q, k, v


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(3, 1, 1), (2, 5, 8), (1, 70, 700), (1, 130, 513), (2, 600, 40)])
def test_col_lse_equals_torch(dtype, shape):
    """c_j = logsumexp_i (scale a_i . b_j + bias_i), every panel and chunk size (64 rows, 512 columns)."""
    BH, M, N = shape
    gen = torch.Generator().manual_seed(M * N)
    a = torch.randn(BH, M, 16, generator=gen, dtype=dtype)
    b = torch.randn(BH, N, 16, generator=gen, dtype=dtype)
    bias = 3 * torch.randn(BH, M, generator=gen, dtype=dtype)
    bias[:, ::3] = -math.inf  # masked rows
    s = a @ b.transpose(1, 2) * 0.25
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ops.col_lse(a, b, None, 0.25), torch.logsumexp(s, 1), **tol)
    torch.testing.assert_close(ops.col_lse(a, b, bias, 0.25), torch.logsumexp(s + bias[..., None], 1), **tol)


@needs_kernels
def test_col_lse_empty_columns_and_strides():
    a, b = torch.randn(2, 6, 4), torch.randn(2, 9, 4)
    bias = torch.full((2, 6), -math.inf)
    bias[0, 2] = 0.0
    c = ops.col_lse(a, b, bias, 1.0)
    assert torch.isneginf(c[1]).all()  # no valid row at all
    torch.testing.assert_close(c[0], (a[0, 2] @ b[0].T))
    wide = torch.randn(2, 9, 8)[..., ::2]  # last dim not contiguous: refused with a message
    with pytest.raises(RuntimeError, match="contiguous last dim"):
        ops.col_lse(a, wide, None, 1.0)
    rows = torch.randn(6, 2, 4).transpose(0, 1)  # (2, 6, 4) with a row stride of 8
    torch.testing.assert_close(ops.col_lse(rows, b, None, 1.0), torch.logsumexp(rows @ b.transpose(1, 2), 1))


def _mix_reference(q, k, v, key_bias, dnas_bias, u, scale):
    s = q @ k.transpose(-1, -2) * scale
    if key_bias is not None:
        s = s + key_bias[:, None, :]
    pu = torch.softmax(s, -1)
    pd = torch.softmax(s + dnas_bias[:, None, :], -1)
    w = (1 - u[:, None, None]) * pu + u[:, None, None] * pd
    return torch.nan_to_num(w) @ v


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1, 1, 1, 4), (3, 7, 9, 5), (2, 70, 2100, 12), (1, 200, 300, 64)])
def test_mix_attend_equals_torch(dtype, shape):
    """Every u (0, 1, between), key padding, rows with no key; panels of fewer rows for long N."""
    BH, M, N, Dv = shape
    gen = torch.Generator().manual_seed(M + N)
    q = torch.randn(BH, M, 8, generator=gen, dtype=dtype)
    k = torch.randn(BH, N, 8, generator=gen, dtype=dtype)
    v = torch.randn(BH, N, Dv, generator=gen, dtype=dtype)
    dnas_bias = -torch.logsumexp(q @ k.transpose(1, 2) * 0.3, 1)
    u = torch.linspace(0, 1, BH, dtype=dtype) if BH > 1 else torch.tensor([0.4], dtype=dtype)
    key_bias = torch.zeros(BH, N, dtype=dtype)
    key_bias[:, ::4] = -math.inf
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-12)
    for kb in (None, key_bias):
        got = ops.mix_attend(q, k, v, kb, dnas_bias, u, 0.3)
        torch.testing.assert_close(got, _mix_reference(q, k, v, kb, dnas_bias, u, 0.3), **tol)
    if N > 1:
        key_bias[0] = -math.inf  # a (batch, head) with every key masked: zero rows, no NaN
        got = ops.mix_attend(q, k, v, key_bias, dnas_bias, u, 0.3)
        assert torch.all(got[0] == 0) and torch.isfinite(got).all()


@needs_kernels
def test_mix_attend_underflow_row_is_recomputed():
    """A row whose DNAS mass sits > 87 nats below its UNAS maximum: sum_j x_j g_j underflows in
    float32, and the kernel redoes the row with its own DNAS maximum instead of dividing by 0."""
    q = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # (1, 2, 2)
    k = torch.tensor([[[60.0, 0.0], [0.0, 1.0], [-60.0, 0.0]]])  # (1, 3, 2)
    v = torch.eye(3)[None]
    dnas_bias = torch.tensor([[-200.0, 0.0, -5.0]])  # key 0 dominates UNAS, is nearly erased in DNAS
    u = torch.tensor([0.5])
    got = ops.mix_attend(q, k, v, None, dnas_bias, u, 1.0)
    ref = _mix_reference(q.double(), k.double(), v.double(), None, dnas_bias.double(), u.double(), 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), ref, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# attend / column_logsumexp: the kernel paths equal the PyTorch-only paths
# ---------------------------------------------------------------------------------------------


def _spy(monkeypatch, name):
    """Wraps kernel_paths.<name>; the list records, per call, whether the kernel gave a result."""
    calls, real = [], getattr(nz.kernel_paths, name)

    def spy(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(nz.kernel_paths, name, spy)
    return calls


def _op_spy(monkeypatch):
    """kernel_paths' kernels behind a recorder: the list gets each kernel's name as it is called."""
    calls, real_ops = [], kernels.cpu_ops()

    class Spy:
        def __getattr__(self, name):
            op = getattr(real_ops, name)
            return lambda *a: calls.append(name) or op(*a)

    monkeypatch.setattr(nz.kernel_paths, "cpu_ops", lambda: Spy())
    return calls


def _masks(B, H, M, N, gen):
    return {
        "none": None,
        "keys": torch.rand(B, 1, 1, N, generator=gen) > 0.3,
        "queries": torch.rand(B, 1, M, 1, generator=gen) > 0.3,
        "arbitrary": torch.rand(B, H, M, N, generator=gen) > 0.3,  # not separable: PyTorch path
    }


@needs_kernels
@pytest.mark.parametrize("variant", ["dnas", "hnas", "sinkhorn", "sinkhorn-streamed"])
@pytest.mark.parametrize("mask_kind", ["none", "keys", "queries", "arbitrary"])
def test_attend_kernel_equals_pytorch_path(monkeypatch, variant, mask_kind):
    """sinkhorn: whole heads held (sinkhorn_attend); sinkhorn-streamed: over the memory bound, one
    sinkhorn_round pass per round."""
    if variant == "sinkhorn-streamed":
        monkeypatch.setattr(nz.kernel_paths, "SINKHORN_HEAD_BYTES", 0)
        variant = "sinkhorn"
    B, H, M, N = 2, 3, 150, 190
    q, k, v = _qkv(7, B, H, M, N, 16, 8)
    mask = _masks(B, H, M, N, torch.Generator().manual_seed(3))[mask_kind]
    u = torch.tensor([0.2, 0.5, 0.9]).view(3, 1, 1)
    kw = dict(mask=mask, u=u, iters=3)
    with torch.no_grad():
        fast = attnlab.attend(q, k, v, variant, **kw)
        monkeypatch.setattr(kernels, "cpu_ops", lambda: None)
        slow = attnlab.attend(q, k, v, variant, **kw)
        _, w = attnlab.attend(q, k, v, variant, **kw, return_weights=True)
    torch.testing.assert_close(fast, slow, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(fast, w @ v, atol=2e-5, rtol=2e-5)


@needs_kernels
def test_hnas_kernel_u_shapes_and_grad_fallback():
    q, k, v = _qkv(8, 2, 3, 140, 150, 8)
    ref = {}
    for u in (0.3, torch.tensor(0.3), torch.full((1, 3, 1, 1), 0.3), torch.full((2, 3, 1, 1), 0.3)):
        with torch.no_grad():
            ref[str(type(u)) + str(getattr(u, "shape", ""))] = attnlab.attend(q, k, v, "hnas", u=u)
    outs = list(ref.values())
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], atol=1e-6, rtol=1e-6)
    # a u that varies within a head is not a hybrid weight per (batch, head): refused, named
    u_rows = torch.full((1, 1, 140, 1), 0.3)
    with pytest.raises(ValueError, match=r"u must be a number or a tensor broadcastable to \(B, H, 1, 1\)"):
        attnlab.attend(q, k, v, "hnas", u=u_rows)
    # with gradients the differentiable path runs (the kernel has no backward); same forward value
    qg = q.clone().requires_grad_()
    out = attnlab.attend(qg, k, v, "hnas", u=0.3)
    out.sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()
    torch.testing.assert_close(out.detach(), outs[0], atol=2e-5, rtol=2e-5)


@needs_kernels
@pytest.mark.parametrize("mask_kind", ["none", "keys", "queries"])
def test_column_logsumexp_kernel_gradcheck(mask_kind):
    """The kernel's forward under _QueryLogSumExp's written-out backward (float64)."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(1, 2, 9, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 7, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(1, 2, 9, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = _masks(1, 2, 9, 7, gen)[mask_kind]
    # the kernel path runs
    assert nz.kernel_paths.lse_kernel(q.detach(), k.detach(), None, mask, 0.5) is not None
    assert torch.autograd.gradcheck(lambda q, k, b: attnlab.column_logsumexp(q, k, mask, 0.5, b), (q, k, b))


def test_switched_off_and_failed_build(monkeypatch):
    """ATTNLAB_KERNELS=0 or a failed build: cpu_ops() is None, a reason is kept, attend still works."""
    monkeypatch.setattr(kernels, "_state", {"tried": False, "ops": None, "error": None})
    monkeypatch.setenv("ATTNLAB_KERNELS", "0")
    assert kernels.cpu_ops() is None and "ATTNLAB_KERNELS=0" in kernels.build_error()
    monkeypatch.setattr(kernels, "_state", {"tried": False, "ops": None, "error": None})
    monkeypatch.delenv("ATTNLAB_KERNELS")

    def broken():
        raise RuntimeError("Error building extension 'attnlab_cpu'\ng++: command not found")

    monkeypatch.setattr(kernels, "_build", broken)
    with pytest.warns(RuntimeWarning, match="g\\+\\+: command not found"):
        assert kernels.cpu_ops() is None
    assert kernels.available() is False
    q, k, v = _qkv(9, 1, 2, 20, 30, 4)
    _, w = attnlab.attend(q, k, v, "hnas", return_weights=True)
    torch.testing.assert_close(attnlab.attend(q, k, v, "hnas"), w @ v, atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1, 1, 3), (3, 9, 5), (2, 130, 2100), (1, 300, 64)])
def test_sinkhorn_round_equals_two_half_steps(dtype, shape):
    """c'_j = logsumexp_i (s_ij - r_i) with r_i = logsumexp_j (s_ij - c_j): the row step, then the
    column step (Eq. 10), with invalid keys and queries taking no part."""
    BH, M, N = shape
    gen = torch.Generator().manual_seed(M * N + 1)
    q = torch.randn(BH, M, 8, generator=gen, dtype=dtype)
    k = torch.randn(BH, N, 8, generator=gen, dtype=dtype)
    s = q @ k.transpose(1, 2) * 0.4
    key_bias = torch.zeros(BH, N, dtype=dtype)
    key_bias[:, 1::3] = -math.inf
    row_bias = torch.zeros(BH, M, dtype=dtype)
    row_bias[:, ::4] = -math.inf
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-12)
    for kb, rb in ((None, None), (key_bias, None), (None, row_bias), (key_bias, row_bias)):
        t = s + (0 if kb is None else kb[:, None, :]) + (0 if rb is None else rb[:, :, None])
        c = torch.logsumexp(t, 1).nan_to_num(neginf=0.0)  # the column step that comes first
        r = torch.logsumexp(t - c[:, None, :], 2)
        ref = torch.logsumexp(t - r[:, :, None].nan_to_num(neginf=math.inf), 1)
        got = ops.sinkhorn_round(q, k, c, kb, rb, 0.4)
        finite = torch.isfinite(ref)
        torch.testing.assert_close(got[finite], ref[finite], **tol)
        assert torch.isneginf(got[~finite]).all()


@pytest.mark.parametrize(("M", "N"), [(0, 5), (5, 0), (0, 0)])
def test_empty_queries_or_keys(M, N):
    """Nothing to attend to, or nobody asking: the right empty or zero output, no kernel error."""
    q, k, v = torch.randn(1, 2, M, 4), torch.randn(1, 2, N, 4), torch.randn(1, 2, N, 3)
    for variant in attnlab.VARIANTS:
        out = attnlab.attend(q, k, v, variant, iters=3)
        assert out.shape == (1, 2, M, 3) and torch.all(out == 0)


def test_empty_value_dim(capfd):
    """Dv = 0: the empty output, and no BLAS complaint on stderr (the kernels are skipped)."""
    q, k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 7, 4), torch.randn(1, 2, 7, 0)
    with torch.no_grad():
        for variant in attnlab.VARIANTS:
            assert attnlab.attend(q, k, v, variant, iters=3).shape == (1, 2, 5, 0)
    assert "MKL ERROR" not in capfd.readouterr().err


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("iters", [2, 3, 7])
def test_sinkhorn_attend_equals_explicit_loop(dtype, iters):
    """Whole-head Sinkhorn (Eq. 10) against the materialized PyTorch normalizer, with invalid keys,
    invalid queries (zero rows) and a (batch, head) whose keys are all masked (zero output)."""
    BH, M, N = 4, 37, 53
    gen = torch.Generator().manual_seed(iters)
    q = torch.randn(BH, M, 8, generator=gen, dtype=dtype)
    k = torch.randn(BH, N, 8, generator=gen, dtype=dtype)
    v = torch.randn(BH, N, 5, generator=gen, dtype=dtype)
    key_ok = torch.rand(BH, N, generator=gen) > 0.25
    key_ok[3] = False
    row_ok = torch.rand(BH, M, generator=gen) > 0.2
    key_bias = torch.zeros(BH, N, dtype=dtype).masked_fill(~key_ok, -math.inf)
    row_bias = torch.zeros(BH, M, dtype=dtype).masked_fill(~row_ok, -math.inf)
    got = ops.sinkhorn_attend(q, k, v, key_bias, row_bias, iters, 0.35)
    mask = (row_ok[:, :, None] & key_ok[:, None, :])[None]  # (1, BH, M, N)
    w = attnlab.attention_weights((q @ k.transpose(1, 2) * 0.35)[None], "sinkhorn", mask=mask, iters=iters)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=1e-11, rtol=1e-11)
    torch.testing.assert_close(got, (w @ v[None])[0], **tol)
    assert torch.all(got[3] == 0) and torch.all(got[~row_ok] == 0)


def _held_reference(q, k, v, key_ok, row_ok, variant, scale, **params):
    """The materialized float64 normalizer @ v on (BH, M, N) problems with separable masks."""
    mask = (row_ok[:, :, None] & key_ok[:, None, :])[None]  # (1, BH, M, N)
    s = (q.double() @ k.double().transpose(1, 2) * scale)[None]
    w = attnlab.attention_weights(s, variant, mask=mask, **params)
    return (w @ v.double()[None])[0]


def _masked_problem(seed, dtype, BH, M, N):
    """(q, k, v, key_ok, row_ok, key_bias, row_bias) of BH heads, D = 8, Dv = 6: about a quarter of
    the keys and a fifth of the queries invalid, the last head with every key masked; biases are
    0 / -inf."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(BH, M, 8, generator=gen, dtype=dtype)
    k = torch.randn(BH, N, 8, generator=gen, dtype=dtype)
    v = torch.randn(BH, N, 6, generator=gen, dtype=dtype)
    key_ok = torch.rand(BH, N, generator=gen) > 0.25
    key_ok[0, 0] = True
    key_ok[-1] = False
    row_ok = torch.rand(BH, M, generator=gen) > 0.2
    row_ok[0, 0] = True
    key_bias = torch.zeros(BH, N, dtype=dtype).masked_fill(~key_ok, -math.inf)
    row_bias = torch.zeros(BH, M, dtype=dtype).masked_fill(~row_ok, -math.inf)
    return q, k, v, key_ok, row_ok, key_bias, row_bias


def _check_against_reference(call, reference, problem, dtype, views=True):
    """A kernel on (BH, M, N) problems against its float64 reference: with the problem's key and query
    masks (invalid rows and the fully masked last head give 0, and ``call``'s flag says every head is
    done), unmasked, and (``views``) on strided views of q, k, v with a contiguous last dimension,
    which must read the same values. ``call(q, k, v, key_bias, row_bias)`` -> (out, ok);
    ``reference(q, k, v, key_ok, row_ok)`` -> the float64 output."""
    q, k, v, key_ok, row_ok, key_bias, row_bias = problem
    BH, M, N = q.shape[0], q.shape[1], k.shape[1]
    tol = dict(atol=3e-5, rtol=3e-5) if dtype == torch.float32 else dict(atol=1e-11, rtol=1e-11)
    got, ok = call(q, k, v, key_bias, row_bias)
    torch.testing.assert_close(got.double(), reference(q, k, v, key_ok, row_ok), **tol)
    assert ok and torch.all(got[-1] == 0) and torch.all(got[~row_ok] == 0)
    everything = torch.ones(BH, N, dtype=torch.bool), torch.ones(BH, M, dtype=torch.bool)
    got, _ = call(q, k, v, None, None)
    torch.testing.assert_close(got.double(), reference(q, k, v, *everything), **tol)
    if views:
        qv, kv, vv = (torch.cat([t, t], -1)[..., : t.shape[-1]] for t in (q, k, v))
        torch.testing.assert_close(call(qv, kv, vv, None, None)[0], got, atol=0, rtol=0)


def _underflow_and_loose_heads(gen):
    """(q0, k0, q1, k1), (40, 2) each. Head 0: the keys along e_1 (tight bounds), query 0 scores
    50-150 with them, query 1 scores 0 with every key (its terms underflow against the shifts),
    query 2 = (30, 1). Head 1: query 0 = 100 e_1 leaves the bound of every key not along e_1 loose."""
    k0 = torch.cat([0.5 + torch.rand(40, 1, generator=gen), torch.zeros(40, 1)], -1)  # along e_1: tight
    q0 = torch.zeros(40, 2)
    q0[0, 0], q0[2] = 100.0, torch.tensor([30.0, 1.0])
    q1 = torch.randn(40, 2, generator=gen)
    q1[0] = torch.tensor([100.0, 0.0])
    return q0, k0, q1, torch.randn(40, 2, generator=gen)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
# sinkhorn with 5 rounds: .ci/run only (the inner loop's minute)
@pytest.mark.parametrize(("variant", "iters"), [("dnas", 1), ("hnas", 1), ("sinkhorn", 2),
                                               pytest.param("sinkhorn", 5, marks=pytest.mark.slow)])
@pytest.mark.parametrize(("BH", "M", "N", "budget"), [(5, 300, 700, 0), (3, 37, 53, 2**30), (2, 1, 9, 2**30)])
def test_held_attend_equals_float64_reference(dtype, variant, iters, BH, M, N, budget):
    """held_attend (each head's scores held: one score product, one exponential per score) against the
    float64 materialized variant, with invalid keys and queries, a (batch, head) with every key masked,
    several row blocks per head (N = 700: 93 rows) and groups of one head (budget 0) or all heads."""
    u = torch.linspace(0, 1, BH, dtype=dtype) if variant == "hnas" else None
    params = {"u": u.view(1, BH, 1, 1).double()} if u is not None else {}
    if variant == "sinkhorn":
        params["iters"] = iters
    _check_against_reference(
        lambda q, k, v, kb, rb: (ops.held_attend(q, k, v, kb, rb, u, iters, 0.35, budget), True),
        lambda q, k, v, key_ok, row_ok: _held_reference(q, k, v, key_ok, row_ok, variant, 0.35, **params),
        _masked_problem(M * N + iters, dtype, BH, M, N), dtype, views=False)


@needs_kernels
@pytest.mark.parametrize(("variant", "iters"), [("dnas", 1), ("hnas", 1), ("sinkhorn", 3)])
def test_held_attend_underflow_rows_are_recomputed(variant, iters):
    """Query 1 scores 0 with every key while query 0 scores 100: in float32 its DNAS (and UNAS, against
    the block maximum) terms exp(-100) underflow, and the kernel redoes that row from its scores."""
    gen = torch.Generator().manual_seed(5)
    k = torch.cat([torch.ones(1, 40, 1), torch.randn(1, 40, 1, generator=gen)], -1)  # (1, 40, 2)
    q = torch.tensor([[[100.0, 0.0], [0.0, 0.0], [30.0, 1.0]]])  # (1, 3, 2)
    v = torch.randn(1, 40, 3, generator=gen)
    u = torch.tensor([0.5]) if variant == "hnas" else None
    params = {"u": 0.5} if variant == "hnas" else ({"iters": iters} if variant == "sinkhorn" else {})
    got = ops.held_attend(q, k, v, None, None, u, iters, 1.0, 2**30)
    ref = _held_reference(q, k, v, torch.ones(1, 40, dtype=torch.bool), torch.ones(1, 3, dtype=torch.bool),
                          variant, 1.0, **params)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), ref, atol=2e-5, rtol=2e-5)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("BH", "M", "N", "panel"), [
    (5, 300, 700, 300 * 64 * 4),  # chunks of 64 keys (11 per head), tiles of 1024 rows: 1 per chunk
    (3, 37, 53, 2**30),  # one chunk per head, 3 heads: split in parts
    (2, 1, 9, 0),  # the smallest panel: 16-key chunks
    (1, 200, 1000, 200 * 16 * 4),  # one head split in parts of 16-key chunks
    (12, 64, 600, 64 * 100 * 4),  # heads whole to threads, a last chunk of 24 keys
])
def test_panel_dnas_equals_float64_reference(dtype, BH, M, N, panel):
    """panel_dnas (column panels: one score product, one exponential per score, the output accumulated
    over chunks) against the float64 materialized DNAS, with invalid keys and queries and a (batch,
    head) with every key masked, over the chunk widths and head splits the panel size gives."""
    _check_against_reference(
        lambda q, k, v, kb, rb: (ops.panel_dnas(q, k, v, kb, rb, 0.35, panel), True),
        lambda q, k, v, key_ok, row_ok: _held_reference(q, k, v, key_ok, row_ok, "dnas", 0.35),
        _masked_problem(M * N + 1, dtype, BH, M, N), dtype)


@needs_kernels
def test_panel_dnas_underflow_rows_are_recomputed():
    """Query 1 scores 0 with every key while query 0 scores 100: its terms exp(s - c_j) ~ exp(-100)
    underflow in float32 and the kernel redoes that row from its scores."""
    gen = torch.Generator().manual_seed(5)
    k = torch.cat([torch.ones(1, 40, 1), torch.randn(1, 40, 1, generator=gen)], -1)  # (1, 40, 2)
    q = torch.tensor([[[100.0, 0.0], [0.0, 0.0], [30.0, 1.0]]])  # (1, 3, 2)
    v = torch.randn(1, 40, 3, generator=gen)
    got = ops.panel_dnas(q, k, v, None, None, 1.0, 0)
    ref = _held_reference(q, k, v, torch.ones(1, 40, dtype=torch.bool), torch.ones(1, 3, dtype=torch.bool),
                          "dnas", 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), ref, atol=2e-5, rtol=2e-5)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("panel", [0, 2**30])  # 16-key chunks, loose and tight ones; one chunk per head
def test_panel_dnas_loose_column_bounds_are_redone_exactly(dtype, panel):
    """panel_dnas shifts each column by a bound b_j >= max_i s_ij taken from the norms of q and k. Query
    0 = 100 e_1 makes that bound loose (> 10 nats above the column's log-sum-exp) for every key not
    along e_1, and those chunks are redone with their exact maxima; keys along e_1 keep tight bounds.
    Both kinds, mixed in chunks or not, with a key mask, give the float64 reference."""
    gen = torch.Generator().manual_seed(11)
    BH, M, N, D = 2, 50, 300, 8
    q = torch.randn(BH, M, D, generator=gen, dtype=torch.float64)
    q[:, 0] = 0
    q[:, 0, 0] = 100
    k = torch.randn(BH, N, D, generator=gen, dtype=torch.float64)
    along = torch.rand(N, generator=gen) < 0.5
    k[:, along] = 0
    k[:, along, 0] = 0.5 + torch.rand(int(along.sum()), generator=gen, dtype=torch.float64)
    v = torch.randn(BH, N, 5, generator=gen, dtype=torch.float64)
    key_ok = torch.rand(BH, N, generator=gen) > 0.1
    key_bias = torch.zeros(BH, N, dtype=dtype).masked_fill(~key_ok, float("-inf"))
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    tol = dict(atol=3e-5, rtol=3e-5) if dtype == torch.float32 else dict(atol=1e-11, rtol=1e-11)
    rows = torch.ones(BH, M, dtype=torch.bool)
    got = ops.panel_dnas(q, k, v, key_bias, None, 0.35, panel)
    torch.testing.assert_close(got.double(), _held_reference(q, k, v, key_ok, rows, "dnas", 0.35), **tol)
    got = ops.panel_dnas(q, k, v, None, None, 0.35, panel)
    keys = torch.ones(BH, N, dtype=torch.bool)
    torch.testing.assert_close(got.double(), _held_reference(q, k, v, keys, rows, "dnas", 0.35), **tol)


@needs_kernels
def test_panel_dnas_queries_with_a_large_common_part():
    """Queries 30 e_2 + noise (the shared direction real models' queries often have): the bound from the
    queries' mean stays tight, and the result is the float64 reference's, also with invalid queries
    (left out of the mean) that are far from the rest."""
    gen = torch.Generator().manual_seed(12)
    BH, M, N, D = 3, 120, 200, 16
    q = torch.randn(BH, M, D, generator=gen)
    q[..., 1] += 30
    q[:, :10] = -500  # invalid rows: masked below
    k, v = torch.randn(BH, N, D, generator=gen), torch.randn(BH, N, 7, generator=gen)
    row_ok = torch.ones(BH, M, dtype=torch.bool)
    row_ok[:, :10] = False
    row_bias = torch.zeros(BH, M).masked_fill(~row_ok, float("-inf"))
    got = ops.panel_dnas(q, k, v, None, row_bias, 0.25, 64 * 120 * 4)
    ref = _held_reference(q, k, v, torch.ones(BH, N, dtype=torch.bool), row_ok, "dnas", 0.25)
    torch.testing.assert_close(got.double(), ref, atol=3e-5, rtol=3e-5)
    assert torch.all(got[~row_ok] == 0)


@needs_kernels
@pytest.mark.parametrize("mask_kind", ["none", "keys", "queries"])
def test_dnas_attend_takes_the_panel_kernel(monkeypatch, mask_kind):
    """attend's DNAS (and Sinkhorn(1)) without gradients goes through panel_dnas, and gives what the
    held-scores kernel and the PyTorch path give."""
    B, H, M, N = 2, 3, 150, 190
    q, k, v = _qkv(9, B, H, M, N, 16, 8)
    mask = _masks(B, H, M, N, torch.Generator().manual_seed(4))[mask_kind]
    calls, held_calls = _spy(monkeypatch, "panel_kernel"), _spy(monkeypatch, "held_kernel")
    with torch.no_grad():
        fast = attnlab.attend(q, k, v, "dnas", mask=mask)
        one = attnlab.attend(q, k, v, "sinkhorn", mask=mask, iters=1)
        assert len(calls) == 2
        monkeypatch.setattr(nz.kernel_paths, "PANEL_BYTES", 0)  # the panels' off switch
        held = attnlab.attend(q, k, v, "dnas", mask=mask)
        assert calls[2:] == [False] and held_calls == [True]  # the panels declined, held_attend ran
        monkeypatch.setattr(kernels, "cpu_ops", lambda: None)
        slow = attnlab.attend(q, k, v, "dnas", mask=mask)
    torch.testing.assert_close(fast, one, atol=0, rtol=0)
    torch.testing.assert_close(fast, held, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(fast, slow, atol=2e-5, rtol=2e-5)


def _causal_reference(q, k, v, key_ok, row_ok, scale, u=None):
    """The materialized float64 causal DNAS (prefix column normalizer) @ v on (BH, M, N) problems; with
    u (BH,), causal HNAS with those weights."""
    mask = (row_ok[:, :, None] & key_ok[:, None, :])[None]  # (1, BH, M, N)
    s = (q.double() @ k.double().transpose(1, 2) * scale)[None]
    if u is None:
        w = attnlab.attention_weights(s, "dnas", mask=mask, causal=True)
    else:
        w = attnlab.attention_weights(s, "hnas", mask=mask, causal=True, u=u.double()[None, :, None, None])
    return (w @ v.double()[None])[0]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("BH", "M", "N"), [
    (3, 300, 300),  # fewer heads than threads x 4: the keys split in parts of equal work
    (12, 140, 600),  # heads whole to threads; key chunks of 512 and a last one of 88
    (2, 300, 100),  # M > N: the last rows see every key
    (2, 50, 700),  # M < N: keys beyond the last query are never seen
    (1, 1, 1),
])
def test_causal_dnas_equals_float64_reference(dtype, BH, M, N):
    """causal_dnas (one pass, each column's prefix maximum and sum carried down the rows) against the
    float64 materialized causal DNAS, with invalid keys and queries and a head with every key masked,
    unmasked, and on strided views."""
    def call(q, k, v, kb, rb):
        out, redo = ops.causal_dnas(q, k, v, kb, rb, 0.35, nz.functions.LSE_FLOOR)
        return out, not redo.any()

    _check_against_reference(call, lambda *problem: _causal_reference(*problem, 0.35),
                             _masked_problem(M * N + 7, dtype, BH, M, N), dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("BH", "M", "N"), [
    (3, 300, 1100),  # parts of a head, each with its own softmax state, merged (three key chunks)
    (12, 140, 600),  # heads whole to threads; key chunks of 512 and a last one of 88
    (2, 300, 100),  # M > N
    (1, 1, 1),
])
def test_causal_hnas_equals_float64_reference(dtype, BH, M, N):
    """causal_hnas (causal DNAS's one pass with the causal softmax's online row maxima and a second
    value product) against the float64 materialized causal HNAS, with per-head weights that include u =
    0 and u = 1, invalid keys and queries, a head with every key masked, unmasked, and on strided
    views. The queries are scaled up so that rows' maxima rise across key chunks by tens of nats."""
    u = torch.linspace(0.0, 1.0, BH, dtype=dtype) if BH > 1 else torch.tensor([0.3], dtype=dtype)

    def call(q, k, v, kb, rb):
        out, redo = ops.causal_hnas(q, k, v, kb, rb, u, 0.35, nz.functions.LSE_FLOOR)
        return out, not redo.any()

    q, k, v, *rest = _masked_problem(M * N + 11, dtype, BH, M, N)
    ramp = torch.linspace(1.0, 4.0, N, dtype=dtype)[None, :, None]  # later keys score higher
    problem = (q * 2.0, k * ramp[:, : k.shape[1]], v, *rest)
    _check_against_reference(call, lambda *pr: _causal_reference(*pr, 0.35, u=u), problem, dtype)


@needs_kernels
def test_causal_dnas_underflowed_rows_are_redone_exactly():
    """Query 0 scores 100 with key 0, query 1 scores 0 with it and key 1 is masked: query 1's one weight,
    exp(0 - logaddexp(100, 0)), underflows in float32, the kernel flags the head, and attend gives the
    exact result (query 1 takes v_0) through the blocked path."""
    q = torch.tensor([[[100.0, 0.0], [0.0, 0.0], [1.0, 1.0]]])  # (1, 3, 2)
    k = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]])
    v = torch.randn(1, 3, 4, generator=torch.Generator().manual_seed(3))
    key_ok = torch.tensor([[True, False, True]])
    key_bias = torch.zeros(1, 3).masked_fill(~key_ok, float("-inf"))
    _, redo = ops.causal_dnas(q, k, v, key_bias, None, 1.0, nz.functions.LSE_FLOOR)
    assert redo.tolist() == [True]
    with torch.no_grad():
        got = attnlab.attend(q[None], k[None], v[None], "dnas", mask=key_ok[:, None, None, :], causal=True,
                             scale=1.0)[0]
    ref = _causal_reference(q, k, v, key_ok, torch.ones(1, 3, dtype=torch.bool), 1.0)
    torch.testing.assert_close(got.double(), ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got[0, 1], v[0, 0])


@needs_kernels
@pytest.mark.parametrize("mask_kind", ["none", "keys", "queries"])
def test_causal_dnas_attend_takes_the_kernel(monkeypatch, mask_kind):
    """attend's causal DNAS (and causal Sinkhorn, iters = 1) without gradients goes through
    causal_dnas, and gives what the blocked PyTorch path gives; with gradients it takes that path.
    Causal HNAS (one weight per head) goes through causal_hnas and gives the PyTorch path's lerp of
    causal softmax and causal DNAS."""
    B, H, M, N = 2, 3, 150, 150
    q, k, v = _qkv(19, B, H, M, N, 16, 8)
    mask = _masks(B, H, M, N, torch.Generator().manual_seed(4))[mask_kind]
    calls = _spy(monkeypatch, "causal_kernel")
    with torch.no_grad():
        fast = attnlab.attend(q, k, v, "dnas", mask=mask, causal=True)
        sink = attnlab.attend(q, k, v, "sinkhorn", mask=mask, causal=True, iters=1)
        u = torch.tensor([0.2, 0.7, 1.0])[None, :, None, None]  # (1, H, 1, 1): one weight per head
        hnas = attnlab.attend(q, k, v, "hnas", mask=mask, causal=True, u=u)
    assert calls == [True, True, True]
    qg = q.clone().requires_grad_()
    graded = attnlab.attend(qg, k, v, "dnas", mask=mask, causal=True)
    graded.sum().backward()
    assert calls[3:] == [False] and torch.isfinite(qg.grad).all()
    monkeypatch.setattr(kernels, "cpu_ops", lambda: None)
    with torch.no_grad():
        slow = attnlab.attend(q, k, v, "dnas", mask=mask, causal=True)
        hnas_slow = attnlab.attend(q, k, v, "hnas", mask=mask, causal=True, u=u)
    torch.testing.assert_close(fast, sink, atol=0, rtol=0)
    torch.testing.assert_close(fast, slow, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(graded.detach(), slow, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(hnas, hnas_slow, atol=2e-5, rtol=2e-5)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("BH", "M", "N", "panel"), [
    (5, 300, 700, 300 * 64 * 4),  # 11 chunks of 64 keys per head
    (3, 37, 53, 2**30),  # one chunk per head
    (2, 1, 9, 0),  # the smallest panel: 16-key chunks
    # value products over groups of 1024 keys and a last one of 476 (.ci/run only: ~1.6 s)
    pytest.param(12, 140, 1500, 140 * 256 * 4, marks=pytest.mark.slow),
])
def test_panel_hnas_equals_float64_reference(dtype, BH, M, N, panel):
    """panel_hnas (HNAS, Eq. 12, from bound-shifted panels written once and read once) against the
    float64 materialized HNAS, for u from 0 (UNAS) to 1 (DNAS) across the heads, with invalid keys and
    queries and a head with every key masked, unmasked, and on strided views."""
    u = torch.linspace(0, 1, BH, dtype=dtype)

    def call(q, k, v, kb, rb):
        out, done = ops.panel_hnas(q, k, v, kb, rb, u, 0.35, panel)
        return out, done.all()

    _check_against_reference(
        call, lambda q, k, v, key_ok, row_ok: _held_reference(q, k, v, key_ok, row_ok, "hnas", 0.35,
                                                               u=u.view(1, BH, 1, 1).double()),
        _masked_problem(M * N + 3, dtype, BH, M, N), dtype)


@needs_kernels
def test_panel_hnas_rows_below_the_shift_and_loose_heads_are_exact(monkeypatch):
    """Head 0: query 1 scores 0 with every key while query 0 scores 50-150, so its UNAS and DNAS terms
    underflow against the shifts and the kernel redoes that row from its scores. Head 1: query 0 =
    100 e_1 leaves the bound of every key not along e_1 loose; panel_hnas says so (done False) and
    attend's HNAS gives that head through held_attend. Both equal the float64 reference."""
    gen = torch.Generator().manual_seed(5)
    q0, k0, q1, k1 = _underflow_and_loose_heads(gen)
    q, k = torch.stack([q0, q1]), torch.stack([k0, k1])  # (2, 40, 2)
    v = torch.randn(2, 40, 3, generator=gen)
    u = torch.tensor([0.5, 0.3])
    got, done = ops.panel_hnas(q, k, v, None, None, u, 1.0, 0)
    assert done.tolist() == [True, False]
    ones = torch.ones(2, 40, dtype=torch.bool)
    ref = _held_reference(q, k, v, ones, ones, "hnas", 1.0, u=u.view(1, 2, 1, 1).double())
    assert torch.isfinite(got[0]).all()
    torch.testing.assert_close(got[0].double(), ref[0], atol=2e-5, rtol=2e-5)
    calls = _op_spy(monkeypatch)
    with torch.no_grad():
        small = attnlab.attend(q[None], k[None], v[None], "hnas", u=u.view(1, 2, 1, 1), scale=1.0)[0]
        assert calls == ["held_attend"]  # heads under PANEL_HELD_MIN_SCORES: held_attend alone
        monkeypatch.setattr(nz.kernel_paths, "PANEL_HELD_MIN_SCORES", 0)
        out = attnlab.attend(q[None], k[None], v[None], "hnas", u=u.view(1, 2, 1, 1), scale=1.0)[0]
    assert calls[1:] == ["panel_hnas", "held_attend"]
    torch.testing.assert_close(small, out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("iters", [2, 3, pytest.param(5, marks=pytest.mark.slow)])  # 5: .ci/run only
@pytest.mark.parametrize(("BH", "M", "N", "panel"), [
    (5, 300, 700, 300 * 64 * 4),  # 11 chunks of 64 keys per head
    (3, 37, 53, 2**30),  # one chunk per head
    (2, 1, 9, 0),  # the smallest panel: 16-key chunks
])
def test_panel_sinkhorn_equals_float64_reference(dtype, iters, BH, M, N, panel):
    """panel_sinkhorn (Sinkhorn's rounds on bound-shifted panels written once, the row normalization
    after the value product) against the float64 materialized Sinkhorn, with invalid keys and queries
    and a head with every key masked, unmasked, and on strided views."""
    def call(q, k, v, kb, rb):
        out, done = ops.panel_sinkhorn(q, k, v, kb, rb, iters, 0.35, panel)
        return out, done.all()

    _check_against_reference(
        call, lambda q, k, v, key_ok, row_ok: _held_reference(q, k, v, key_ok, row_ok, "sinkhorn", 0.35,
                                                               iters=iters),
        _masked_problem(M * N + iters, dtype, BH, M, N), dtype)


@needs_kernels
def test_panel_sinkhorn_leaves_underflowing_and_loose_heads_to_held_attend(monkeypatch):
    """Head 0: query 1 scores 0 with every key while query 0 scores 50-150 (its row sum underflows);
    head 1: a loose column bound (query 0 = 100 e_1). panel_sinkhorn leaves both (done False), head 2
    (ordinary) it does; attend's Sinkhorn gives all three, through held_attend for the first two,
    equal to the float64 reference."""
    gen = torch.Generator().manual_seed(6)
    q0, k0, q1, k1 = _underflow_and_loose_heads(gen)
    q2, k2 = torch.randn(2, 40, 2, generator=gen)  # head 2: an ordinary one
    q, k = torch.stack([q0, q1, q2]), torch.stack([k0, k1, k2])
    v = torch.randn(3, 40, 3, generator=gen)
    _, done = ops.panel_sinkhorn(q, k, v, None, None, 3, 1.0, 0)
    assert done.tolist() == [False, False, True]
    calls = _op_spy(monkeypatch)
    monkeypatch.setattr(nz.kernel_paths, "PANEL_HELD_MIN_SCORES", 0)  # these 40 x 40 heads take the panels
    with torch.no_grad():
        out = attnlab.attend(q[None], k[None], v[None], "sinkhorn", iters=3, scale=1.0)[0]
    assert calls == ["panel_sinkhorn", "held_attend"]
    ones = torch.ones(3, 40, dtype=torch.bool)
    ref = _held_reference(q, k, v, ones, ones, "sinkhorn", 1.0, iters=3)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


@needs_kernels
@pytest.mark.slow  # a fresh interpreter
def test_a_stale_torch_build_lock_does_not_stop_a_new_process():
    """A process killed while it loaded the kernels leaves torch's lock file in the build directory;
    the next process removes it under attnlab's own file lock and loads the kernels instead of waiting
    for it forever. Its build directory is the same after the load as before (load appends to the
    flags it is given: attnlab passes copies)."""
    import fcntl
    import subprocess
    import sys

    directory = kernels._build_dir()
    with open(directory / "attnlab.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # no other process loads while the stale file is made
        (directory / "lock").touch()
        fcntl.flock(handle, fcntl.LOCK_UN)
    # this process' flags (scripts/kernel_builds.py sets others), so that it is the same build
    script = (f"from attnlab import kernels; kernels.CFLAGS = {kernels.CFLAGS!r}; "
              "before = kernels._build_dir(); "
              "assert kernels.cpu_ops() is not None, kernels.build_error(); "
              "print(before == kernels._build_dir(), before)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", str(directory)]
    assert not (directory / "lock").exists()


@pytest.mark.slow
def test_the_js_table_is_the_fit_of_its_script():
    """kChiTable in attnlab/csrc/analysis_vec.h (the AVX-512 analysis kernel's Jensen-Shannon terms)
    is what scripts/fit_js_table.py fits (up to the fit's last bits), and it reproduces chi to 5e-7
    (relative)."""
    import json
    import pathlib
    import re
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    header = (root / "attnlab" / "csrc" / "analysis_vec.h").read_text()
    body = header[header.index("kChiTable[6][32] = {"):]
    body = body[: body.index("};")]
    number = r"(-?[0-9.]+e[-+][0-9]+)f"
    rows = [[float(v) for v in re.findall(number, line)] for line in body.splitlines()[1:]]
    # the fit, and the header's table's error, in a fresh interpreter (nothing a worker's earlier tests
    # set reaches it)
    code = ("import json, sys, numpy as np, runpy; m = runpy.run_path('scripts/fit_js_table.py'); "
            "t = m['fit'](); h = np.array(json.loads(sys.stdin.read()), dtype=np.float32); "
            "print(json.dumps({'table': t.tolist(), 'degree': m['DEGREE'], "
            "'error': m['max_relative_error'](h)}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, input=json.dumps(rows), capture_output=True,
                         text=True, check=True)
    fit = json.loads(out.stdout.strip().splitlines()[-1])
    table = torch.tensor(fit["table"], dtype=torch.float32)
    assert len(rows) == table.shape[0] == fit["degree"] + 1
    # the header's coefficients are the script's fit up to the fit's own last bits, which move with the
    # numpy (LAPACK) release (seen: the highest-order ones, ~1e-9, 2e-6 apart relative after a fresh
    # install) -- and they reproduce chi as the fit does
    assert torch.allclose(torch.tensor(rows, dtype=torch.float32), table, rtol=1e-5, atol=1e-12)
    assert fit["error"] < 5e-7
