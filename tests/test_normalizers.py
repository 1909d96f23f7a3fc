"""Normalizers and attend(): literal float64 references, invariants, gradients, precision, errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnlab
from attnlab import normalizers as nz

VARIANTS = attnlab.VARIANTS
F64 = torch.float64


# ---------------------------------------------------------------------------------------------
# Literal references, written straight from the equations with explicit loops (float64)
# ---------------------------------------------------------------------------------------------


def ref_weights(s, valid, variant, u=0.5, iters=1, causal=False):
    """s, valid: (M, N) float64 / bool. Returns (M, N) weights, loops over i and j."""
    M, N = s.shape
    valid = valid.clone()
    if causal:
        for i in range(M):
            for j in range(N):
                if j > i:
                    valid[i, j] = False
    e = torch.where(valid, s.exp(), torch.zeros_like(s))

    def row_norm(x):
        out = torch.zeros_like(x)
        for i in range(M):
            tot = sum(x[i, j] for j in range(N))
            if tot > 0:
                for j in range(N):
                    out[i, j] = x[i, j] / tot
        return out

    def col_norm(x, prefix=False):
        out = torch.zeros_like(x)
        for i in range(M):
            for j in range(N):
                rows = range(i + 1) if prefix else range(M)
                tot = sum(x[r, j] for r in rows)
                if tot > 0:
                    out[i, j] = x[i, j] / tot
        return out

    if variant == "unas":  # Eq. (1)
        return row_norm(e)
    if variant == "dnas":  # Eq. (5): gamma = column-normalized, then row-normalized
        return row_norm(col_norm(e, prefix=causal))
    if variant == "hnas":  # Eq. (12)
        return u * ref_weights(s, valid, "dnas", causal=causal) + (1 - u) * ref_weights(
            s, valid, "unas", causal=causal
        )
    if variant == "sinkhorn":  # Eq. (10): explicit alternating loop
        x = e
        for _ in range(iters):
            x = row_norm(col_norm(x, prefix=causal))
        return x
    if variant == "softmax1":  # exp(s_ij) / (1 + sum_j exp(s_ij)): a null key with score 0
        out = torch.zeros_like(s)
        for i in range(M):
            tot = 1.0 + sum(e[i, j] for j in range(N))
            if valid[i].any():
                for j in range(N):
                    out[i, j] = e[i, j] / tot
        return out
    if variant == "sparsemax":  # Martins & Astudillo (2016), Algorithm 1, one row at a time
        out = torch.zeros_like(s)
        for i in range(M):
            z = sorted((float(s[i, j]) for j in range(N) if valid[i, j]), reverse=True)
            k, total = 0, 0.0
            for r, zr in enumerate(z, start=1):
                if 1 + r * zr > total + zr:
                    k, total = r, total + zr
                else:
                    break
            if k:
                tau = (total - 1) / k
                for j in range(N):
                    if valid[i, j]:
                        out[i, j] = max(float(s[i, j]) - tau, 0.0)
        return out
    raise AssertionError(variant)


def random_mask(gen, B, H, M, N, kind):
    if kind == "none":
        return None
    if kind == "key":
        return torch.rand(B, 1, 1, N, generator=gen) > 0.3
    if kind == "query":
        return torch.rand(B, 1, M, 1, generator=gen) > 0.3
    if kind == "padding":  # key padding & query padding, as a tokenizer batch would give
        kp = torch.rand(B, 1, 1, N, generator=gen) > 0.3
        qp = torch.rand(B, 1, M, 1, generator=gen) > 0.3
        return kp & qp
    return torch.rand(B, H, M, N, generator=gen) > 0.4  # arbitrary


MASK_KINDS = ["none", "key", "query", "padding", "arbitrary"]


def check_against_reference(seed, B, H, M, N, D, variant, kind, causal, iters, u):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, L, D, generator=gen, dtype=F64) for L in (M, N, N))
    mask = random_mask(gen, B, H, M, N, kind)
    scale = 1 / math.sqrt(D)
    scores = scale * q @ k.transpose(-1, -2)
    got = attnlab.attention_weights(scores, variant, mask=mask, causal=causal, u=u, iters=iters)
    full = torch.ones(B, H, M, N, dtype=torch.bool) if mask is None else mask.expand(B, H, M, N)
    expect = torch.stack([
        torch.stack([ref_weights(scores[b, h], full[b, h], variant, u, iters, causal) for h in range(H)])
        for b in range(B)
    ])
    torch.testing.assert_close(got, expect, atol=1e-10, rtol=1e-9)
    out_fused = attnlab.attend(q, k, v, variant, mask=mask, causal=causal, u=u, iters=iters)
    out_mat, w = attnlab.attend(q, k, v, variant, mask=mask, causal=causal, u=u, iters=iters,
                                return_weights=True)
    torch.testing.assert_close(w, expect, atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(out_fused, expect @ v, atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(out_mat, expect @ v, atol=1e-10, rtol=1e-9)
    assert not out_fused.isnan().any()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("causal", [False, True])
def test_matches_literal_reference(variant, kind, causal):
    iters = 1 if causal else 3
    check_against_reference(7, 2, 2, 5, 5, 4, variant, kind, causal, iters, 0.3)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    B=st.integers(1, 2),
    H=st.integers(1, 3),
    M=st.integers(1, 7),
    N=st.integers(1, 7),
    D=st.integers(1, 5),
    variant=st.sampled_from(VARIANTS),
    kind=st.sampled_from(MASK_KINDS),
    causal=st.booleans(),
    iters=st.integers(1, 4),
    u=st.floats(0.0, 1.0),
)
def test_matches_literal_reference_many_shapes(seed, B, H, M, N, D, variant, kind, causal, iters, u):
    if causal:
        iters = 1
    check_against_reference(seed, B, H, M, N, D, variant, kind, causal, iters, u)


def test_large_scores_stay_exact():
    """Scores in the hundreds: log-space normalization must not overflow."""
    gen = torch.Generator().manual_seed(3)
    s = 300 * torch.randn(1, 1, 6, 6, generator=gen, dtype=F64)
    for variant in VARIANTS:
        w = attnlab.attention_weights(s, variant, iters=2)
        assert torch.isfinite(w).all()
        if attnlab.variant_spec(variant).rows_sum_to_one:
            torch.testing.assert_close(w.sum(-1), torch.ones(1, 1, 6, dtype=F64))
        else:  # rows sum to at most 1 (softmax1's null key takes the rest)
            assert (w.sum(-1) <= 1 + 1e-12).all()


@pytest.mark.parametrize("spread", [0.3, 4.0, 40.0])
def test_sparsemax_sorts_only_the_candidates(spread):
    """sparsemax sorts only the keys within 1 of the row maximum (its support lies there): wide rows
    (few candidates), ties at the maximum and at max - 1, masked keys, an empty row and a NaN row all
    give the literal algorithm's weights, and its gradient the finite differences'."""
    gen = torch.Generator().manual_seed(int(spread * 10))
    M, N = 7, 33
    s = torch.randn(1, 1, M, N, generator=gen, dtype=F64) * spread
    s[..., 0, 3] = s[..., 0, 5] = s[..., 0, :].max() + 0.25  # a tie at the maximum
    s[..., 1, 7] = s[..., 1, :].max() - 1.0  # a key exactly at max - 1
    mask = torch.rand(1, 1, M, N, generator=gen) > 0.2
    mask[..., 2, :] = False  # an empty row
    got = attnlab.attention_weights(s, "sparsemax", mask=mask)
    expect = ref_weights(s[0, 0], mask[0, 0], "sparsemax")
    torch.testing.assert_close(got[0, 0], expect, atol=1e-12, rtol=1e-12)
    bad = s.clone()
    bad[..., 4, 9] = float("nan")
    nan_rows = attnlab.attention_weights(bad, "sparsemax", mask=mask)[0, 0].isnan().any(-1)  # (masked: 0)
    assert nan_rows.tolist() == [i == 4 and bool(mask[0, 0, 4, 9]) for i in range(M)]
    x = s.clone()
    x[..., 1, 7] -= 0.01  # off the kink (a key exactly at tau has no derivative)
    x.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: attnlab.attention_weights(t, "sparsemax", mask=mask), (x,))


def test_blocked_paths_match_materialized(monkeypatch):
    """Key-blocked column LSE (non-CPU fallback) and multi-block causal DNAS equal the reference."""
    monkeypatch.setattr(nz.lse, "KEY_BLOCK", 3)
    monkeypatch.setattr(nz.fused, "QUERY_BLOCK", 4)
    monkeypatch.setattr(nz.kernel_paths, "flash_lse_available", lambda q: False)
    for causal in (False, True):
        check_against_reference(11, 2, 2, 10, 10, 4, "dnas", "padding", causal, 1, 0.5)
        check_against_reference(12, 1, 2, 9, 11, 3, "hnas", "arbitrary", causal, 1, 0.7)
    check_against_reference(13, 2, 2, 7, 10, 3, "sinkhorn", "padding", False, 4, 0.5)


# ---------------------------------------------------------------------------------------------
# Invariants
# ---------------------------------------------------------------------------------------------


def _random_qkv(seed, B=2, H=3, M=12, N=12, D=8, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, L, D, generator=gen).to(dtype) for L in (M, N, N))


@pytest.mark.parametrize("variant", VARIANTS)
def test_rows_sum_to_one_and_empty_rows_are_zero(variant):
    q, k, v = _random_qkv(0)
    mask = torch.ones(2, 1, 12, 12, dtype=torch.bool)
    mask[0, :, 3] = False  # an empty query row
    mask[1, :, :, 5] = False  # an empty key column
    out, w = attnlab.attend(q, k, v, variant, mask=mask, return_weights=True, iters=2)
    rows = w.sum(-1)
    assert torch.allclose(rows[0, :, 3], torch.zeros(3))
    if attnlab.variant_spec(variant).rows_sum_to_one:
        assert torch.allclose(rows[0, :, :3], torch.ones_like(rows[0, :, :3]), atol=1e-5)
    else:
        assert ((rows[0, :, :3] > 0) & (rows[0, :, :3] < 1)).all()
    assert torch.allclose(out[0, :, 3], torch.zeros_like(out[0, :, 3]))
    assert torch.allclose(w[1, :, :, 5], torch.zeros_like(w[1, :, :, 5]))
    fused = attnlab.attend(q, k, v, variant, mask=mask, iters=2)
    assert not fused.isnan().any()
    torch.testing.assert_close(fused, out, atol=1e-5, rtol=1e-5)


def _valid_counts(mask, B, H, M, N):
    full = mask.expand(B, H, M, N)
    return full.any(-2).sum(-1, keepdim=True)  # (B, H, 1) valid keys


def test_dnas_column_mass_lower_bound():
    q, k, _ = _random_qkv(1, M=9, N=14)
    q, k = 4 * q, 4 * k  # peaked scores make explaining away strong for unas
    mask = torch.rand(2, 1, 1, 14, generator=torch.Generator().manual_seed(0)) > 0.3
    scores = q @ k.transpose(-1, -2) / math.sqrt(8)
    n_valid = _valid_counts(mask, 2, 3, 9, 14)
    col = attnlab.attention_weights(scores, "dnas", mask=mask).sum(-2)
    valid_cols = mask.expand(2, 3, 1, 14)[..., 0, :]
    assert (col[valid_cols] >= (1.0 / n_valid).expand_as(col)[valid_cols] - 1e-6).all()
    unas_col = attnlab.attention_weights(scores, "unas", mask=mask).sum(-2)
    assert (unas_col[valid_cols] < (1.0 / n_valid).expand_as(col)[valid_cols]).any()  # unas explains away


@pytest.mark.parametrize("u", [0.0, 0.25, 0.8, 1.0])
def test_hnas_column_mass_lower_bound(u):
    q, k, _ = _random_qkv(2, M=10, N=10)
    scores = 4 * q @ k.transpose(-1, -2)
    col = attnlab.attention_weights(scores, "hnas", u=u).sum(-2)
    assert (col >= u / 10 - 1e-6).all()


def test_hnas_endpoints_equal_unas_and_dnas():
    q, k, v = _random_qkv(3)
    for causal in (False, True):
        for u, other in ((0.0, "unas"), (1.0, "dnas")):
            a = attnlab.attend(q, k, v, "hnas", u=u, causal=causal)
            b = attnlab.attend(q, k, v, other, causal=causal)
            torch.testing.assert_close(a, b)


def test_hnas_per_head_u_tensor():
    q, k, v = _random_qkv(4)
    u = torch.tensor([0.0, 0.5, 1.0]).view(1, 3, 1, 1)
    out = attnlab.attend(q, k, v, "hnas", u=u)
    torch.testing.assert_close(out[:, 0], attnlab.attend(q, k, v, "unas")[:, 0])
    torch.testing.assert_close(out[:, 2], attnlab.attend(q, k, v, "dnas")[:, 2])


def test_sinkhorn_one_iteration_is_dnas():
    q, k, v = _random_qkv(5)
    s = q @ k.transpose(-1, -2)
    torch.testing.assert_close(attnlab.attention_weights(s, "sinkhorn", iters=1),
                               attnlab.attention_weights(s, "dnas"))
    # the default is the spec's (3 rounds), everywhere: attend, hf, the CLI, the app
    assert attnlab.variant_spec("sinkhorn").param("iters").default == 3
    torch.testing.assert_close(attnlab.attention_weights(s, "sinkhorn"),
                               attnlab.attention_weights(s, "sinkhorn", iters=3))


@pytest.mark.parametrize("M,N", [(12, 12), (8, 16), (16, 8)])
def test_sinkhorn_columns_approach_m_over_n(M, N):
    q, k, _ = _random_qkv(6, M=M, N=N, dtype=F64)
    s = q @ k.transpose(-1, -2)
    devs = []
    for iters in (1, 3, 10, 50):
        col = attnlab.attention_weights(s, "sinkhorn", iters=iters).sum(-2)
        devs.append((col - M / N).abs().max().item())
    assert devs[0] > devs[1] > devs[2] > devs[3]
    assert devs[-1] < 1e-3


@pytest.mark.parametrize("variant", VARIANTS)
def test_causal_rows_never_see_the_future(variant):
    """Changing a later query or key never changes an earlier causal row (DNAS: prefix columns)."""
    q, k, v = _random_qkv(7, M=10, N=10, dtype=F64)
    out, w = attnlab.attend(q, k, v, variant, causal=True, return_weights=True)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    q2[..., 6:, :] += torch.randn_like(q2[..., 6:, :])
    k2[..., 6:, :] += torch.randn_like(k2[..., 6:, :])
    v2[..., 6:, :] += 1.0
    out2, w2 = attnlab.attend(q2, k2, v2, variant, causal=True, return_weights=True)
    torch.testing.assert_close(w[..., :6, :], w2[..., :6, :])
    torch.testing.assert_close(out[..., :6, :], out2[..., :6, :])
    fused2 = attnlab.attend(q2, k2, v2, variant, causal=True)
    torch.testing.assert_close(fused2[..., :6, :], out[..., :6, :])
    assert torch.all(w.triu(1) == 0)


def test_whole_column_dnas_would_leak():
    """Why causal DNAS uses prefixes: whole-column normalization lets a later query change row 0."""
    q, k, _ = _random_qkv(8, M=6, N=6, dtype=F64)
    s = q @ k.transpose(-1, -2)
    tri = torch.ones(6, 6, dtype=torch.bool).tril()
    q2 = q.clone()
    q2[..., 5, :] += 3
    s2 = q2 @ k.transpose(-1, -2)
    leaky = attnlab.attention_weights(s, "dnas", mask=tri)[..., 0:5, :]
    leaky2 = attnlab.attention_weights(s2, "dnas", mask=tri)[..., 0:5, :]
    assert not torch.allclose(leaky, leaky2)
    w = attnlab.attention_weights(s, "dnas", causal=True)
    # documented diagonal bias: s_ii - c_i(i) = 0 is the largest logit of row i
    diag = torch.diagonal(w, dim1=-2, dim2=-1)
    assert torch.all(diag >= w.max(-1).values - 1e-12)


# ---------------------------------------------------------------------------------------------
# Gradients (float64 gradcheck), fused/blocked paths included
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("causal", [False, True])
# the materialized path (autograd through attention_weights) runs in .ci/run only: the inner loop
# keeps the fused paths (its minute, README)
@pytest.mark.parametrize("path", ["fused", "fused-large",
                                  pytest.param("materialized", marks=pytest.mark.slow)])
def test_gradcheck(variant, causal, path, monkeypatch):
    if path == "fused-large":  # the LSE pass + SDPA path that long sequences take under autograd
        monkeypatch.setattr(nz.fused, "SMALL_SCORES", 0)
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, L, 3, generator=gen, dtype=F64, requires_grad=True) for L in (5, 6, 6))
    mask = torch.rand(1, 1, 5, 6, generator=gen) > 0.25
    mask[..., 0] = True
    iters = 1 if causal else 2
    u = torch.full((1, 2, 1, 1), 0.3, dtype=F64, requires_grad=True)

    def f(q, k, v, u):
        res = attnlab.attend(q, k, v, variant, mask=mask, causal=causal, u=u, iters=iters,
                             return_weights=path == "materialized")
        return res[0] if path == "materialized" else res

    assert torch.autograd.gradcheck(f, (q, k, v, u))


@pytest.mark.slow  # ~1 s: .ci/run runs it, the inner loop does not
def test_gradcheck_blocked_column_lse(monkeypatch):
    monkeypatch.setattr(nz.lse, "KEY_BLOCK", 2)
    gen = torch.Generator().manual_seed(10)
    q, k = (torch.randn(1, 2, L, 3, generator=gen, dtype=F64, requires_grad=True) for L in (5, 7))
    mask = torch.rand(1, 2, 5, 7, generator=gen) > 0.3
    for flash in (True, False):
        monkeypatch.setattr(nz.kernel_paths, "flash_lse_available", lambda q, flash=flash: flash)
        assert torch.autograd.gradcheck(lambda q, k: attnlab.column_logsumexp(q, k, mask), (q, k))
        ref = torch.logsumexp((q @ k.transpose(-1, -2) / math.sqrt(3)).masked_fill(~mask, -math.inf), -2)
        got = attnlab.column_logsumexp(q, k, mask)
        finite = torch.isfinite(ref)
        torch.testing.assert_close(got[finite], ref[finite])
        assert torch.all(got[~finite] == 0)
        b = torch.randn(1, 2, 5, generator=gen, dtype=F64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda q, k, b: attnlab.column_logsumexp(q, k, mask, query_bias=b),
                                        (q, k, b))
        a = torch.randn(1, 2, 7, generator=gen, dtype=F64, requires_grad=True)
        r = nz.row_logsumexp(q, k, mask, key_bias=a)
        s = q @ k.transpose(-1, -2) / math.sqrt(3) + a[..., None, :]
        ref = torch.logsumexp(s.masked_fill(~mask, -math.inf), -1)
        finite = torch.isfinite(ref)
        torch.testing.assert_close(r[finite], ref[finite])
        assert torch.autograd.gradcheck(lambda q, k, a: nz.row_logsumexp(q, k, mask, key_bias=a), (q, k, a))


@pytest.mark.parametrize("variant", ["dnas", "hnas"])
def test_small_autograd_path_matches_large_path(variant, monkeypatch):
    """Training-size problems take one fused autograd function: same outputs and gradients."""
    q, k, v = (t.requires_grad_() for t in _random_qkv(15, M=9, N=9, dtype=F64))
    mask = torch.rand(2, 1, 9, 9, generator=torch.Generator().manual_seed(2)) > 0.3
    u = torch.tensor([0.2, 0.5, 0.9], dtype=F64).view(1, 3, 1, 1).requires_grad_()
    results = []
    for small in (1 << 20, 0):
        monkeypatch.setattr(nz.fused, "SMALL_SCORES", small)
        out = attnlab.attend(q, k, v, variant, mask=mask, u=u)
        grads = torch.autograd.grad((out * torch.arange(8.0, dtype=F64)).sum(), (q, k, v, u),
                                    allow_unused=True)
        results.append((out, grads))
    torch.testing.assert_close(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1], strict=True):
        if b is None:
            assert a is None or torch.all(a == 0)
        else:
            torch.testing.assert_close(a, b)


def test_gradients_finite_with_empty_rows_and_columns():
    q, k, v = (t.requires_grad_() for t in _random_qkv(11, M=6, N=6, dtype=F64))
    mask = torch.ones(2, 3, 6, 6, dtype=torch.bool)
    mask[..., 2, :] = False
    mask[..., :, 4] = False
    for variant in VARIANTS:
        for causal in (False, True):
            out = attnlab.attend(q, k, v, variant, mask=mask, causal=causal)
            (gq, gk, gv) = torch.autograd.grad(out.sum(), (q, k, v))
            assert all(torch.isfinite(g).all() for g in (gq, gk, gv))


# ---------------------------------------------------------------------------------------------
# Precision
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", VARIANTS)
def test_half_precision_close_to_float32(dtype, variant):
    q, k, v = _random_qkv(12, M=33, N=33, D=16)
    ref = attnlab.attend(q, k, v, variant, iters=3)
    for rw in (False, True):
        res = attnlab.attend(q.to(dtype), k.to(dtype), v.to(dtype), variant, iters=3, return_weights=rw)
        out = res[0] if rw else res
        assert out.dtype == dtype
        assert torch.isfinite(out).all()
        tol = 3e-2 if dtype == torch.bfloat16 else 5e-3
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


# ---------------------------------------------------------------------------------------------
# Bad input: ValueError naming the argument, the expectation and what was seen
# ---------------------------------------------------------------------------------------------


def test_bad_input_messages():
    q, k, v = _random_qkv(13)
    s = q @ k.transpose(-1, -2)
    cases = [
        (lambda: attnlab.attend(q, k, v, "softmax"), "variant"),
        (lambda: attnlab.attention_weights(s, "nope"), "variant"),
        (lambda: attnlab.attend(q, k[..., :5], v, "unas"), "k must be"),
        (lambda: attnlab.attend(q, k, v[:, :, :5], "unas"), "v must be"),
        (lambda: attnlab.attend(q[0], k, v, "unas"), "q must be 4-D"),
        (lambda: attnlab.attend(q, k, v, "unas", mask=torch.ones(5, 5, dtype=torch.bool)), "mask of shape"),
        (lambda: attnlab.attend(q, k, v, "unas", mask=torch.ones(12, 12)), "mask must be a boolean"),
        (lambda: attnlab.attend(q, k, v, "hnas", u=1.5), "u must"),
        (lambda: attnlab.attend(q, k, v, "hnas", u=torch.tensor([-0.1])),
         r"u must be a number in \[0, 1\], got values in \[-0.1"),
        (lambda: attnlab.attend(q, k, v, "sinkhorn", iters=0), "iters must be"),
        (lambda: attnlab.attend(q, k, v, "sinkhorn", iters=2, causal=True), "causal sinkhorn"),
        (lambda: attnlab.attention_weights(s, "sinkhorn", iters=3, causal=True), "causal sinkhorn"),
        (lambda: attnlab.attend(q.long(), k, v, "unas"), "q must be a floating-point"),
        (lambda: attnlab.attention_weights(s.int(), "unas"), "scores must be a floating-point"),
        (lambda: attnlab.relative_positions(torch.tensor([0.5, 1.0])), "positions must be an integer"),
    ]
    for fn, needle in cases:
        with pytest.raises(ValueError, match=needle):
            fn()


# ---------------------------------------------------------------------------------------------
# CUDA: same results as CPU (skipped without a GPU)
# ---------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_matches_cpu(variant, causal):
    q, k, v = _random_qkv(14, M=70, N=70, D=16)
    mask = torch.rand(2, 1, 1, 70, generator=torch.Generator().manual_seed(1)) > 0.2
    kw = dict(mask=mask, causal=causal, iters=1 if causal else 3)
    cpu = attnlab.attend(q, k, v, variant, **kw)
    dev = [t.cuda() for t in (q, k, v)]
    gpu = attnlab.attend(*dev, variant, **{**kw, "mask": mask.cuda()})
    torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-4, rtol=1e-4)
    gpu_w = attnlab.attend(*dev, variant, **{**kw, "mask": mask.cuda()}, return_weights=True)[1]
    cpu_w = attnlab.attend(q, k, v, variant, **kw, return_weights=True)[1]
    torch.testing.assert_close(gpu_w.cpu(), cpu_w, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("N", [40, 300])  # the small fused autograd function and the large path
def test_autocast_leaves_attention_in_float32(N):
    """Under torch.autocast (mixed-precision training) attend still computes in float32: the same
    result as without autocast, and HNAS's u (a float32 parameter) gets its gradient."""
    gen = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(2, 3, N, 8, generator=gen, requires_grad=True) for _ in range(3))
    u = torch.full((3, 1, 1), 0.4, requires_grad=True)
    for variant in VARIANTS:
        ref = attnlab.attend(q, k, v, variant, u=u, iters=2)
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            got = attnlab.attend(q, k, v, variant, u=u, iters=2)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, ref)
        got.sum().backward()
    assert u.grad is not None and torch.isfinite(u.grad).all() and float(u.grad.abs().sum()) > 0
