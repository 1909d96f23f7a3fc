"""The training kernels (attnlab/csrc/train_cpu.cpp: kernels.train_dn_forward / train_dn_backward)
under the training-size DNAS / HNAS autograd function (attnlab/normalizers/fused.py,
_SmallDoublyNormalized): outputs and gradients (q, k, v, u) against the float64 PyTorch path of the
same function, masks, a fully masked row and column, u per head and as a number, the NaN rule."""

from __future__ import annotations

import math

import pytest
import torch

import attnlab
from attnlab import kernels
from attnlab import normalizers as nz

F64 = torch.float64
ops = kernels.cpu_ops()
needs_kernels = pytest.mark.skipif(ops is None, reason=f"CPU kernels not built: {kernels.build_error()}")


def _problem(seed, dtype, B=2, H=3, M=9, N=11, D=5):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (2 * torch.randn(B, H, L, D, generator=gen, dtype=dtype) for L in (M, N, N))
    masks = {"none": None}
    masks["keys"] = torch.rand(B, 1, 1, N, generator=gen) > 0.3  # key padding
    masks["keys"][..., 0] = True
    valid_q, valid_k = torch.ones(B, M, dtype=torch.bool), torch.ones(B, N, dtype=torch.bool)
    valid_q[0, -2:], valid_k[0, -3:] = False, False
    masks["padding"] = valid_q[:, None, :, None] & valid_k[:, None, None, :]  # as TransformerLM builds it
    masks["queries"] = valid_q[:, None, :, None]  # (B, 1, M, 1)
    arbitrary = torch.rand(B, H, M, N, generator=gen) > 0.4
    arbitrary[..., 2, :] = False  # a query with no valid key
    arbitrary[..., :, 4] = False  # a key no query sees
    masks["arbitrary"] = arbitrary
    return q, k, v, masks, gen


def _run(q, k, v, variant, mask, u, weights_g):
    """attend's output and its gradients (q, k, v[, u]) for the loss sum(out * weights_g)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    leaves = [q, k, v]
    if isinstance(u, torch.Tensor):
        u = u.detach().clone().requires_grad_()
        leaves.append(u)
    out = attnlab.attend(q, k, v, variant, mask=mask, **({} if u is None else {"u": u}))
    grads = torch.autograd.grad((out * weights_g.to(out.dtype)).sum(), leaves)
    return out.detach(), [g.detach() for g in grads]


def _counting(monkeypatch):
    """Counts train_forward calls that took the kernel (returned panels)."""
    taken = []
    real = nz.kernel_paths.train_forward

    def counted(*args):
        res = real(*args)
        taken.append(res is not None)
        return res

    monkeypatch.setattr(nz.kernel_paths, "train_forward", counted)
    return taken


def _torch_path_float64(q, k, v, variant, mask, u, weights_g, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(nz.kernel_paths, "train_forward", lambda *args: None)
        u64 = u.to(F64) if isinstance(u, torch.Tensor) else u
        return _run(q.to(F64), k.to(F64), v.to(F64), variant, mask, u64, weights_g)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("mask_kind", ["none", "keys", "padding", "queries", "arbitrary"])
@pytest.mark.parametrize(("variant", "u_kind"), [("dnas", None), ("hnas", "per-head"), ("hnas", "heads-only"),
                                                 ("hnas", "float")])
def test_kernel_path_equals_float64_pytorch_path(monkeypatch, dtype, mask_kind, variant, u_kind):
    q, k, v, masks, gen = _problem(1, dtype)
    mask = masks[mask_kind]
    u = {None: None, "float": 0.35,
         "per-head": torch.rand(2, 3, 1, 1, generator=gen, dtype=dtype),  # (B, H, 1, 1)
         "heads-only": torch.tensor([0.0, 0.6, 1.0], dtype=dtype).view(3, 1, 1)}[u_kind]  # (H, 1, 1)
    weights_g = torch.randn(*q.shape[:3], v.shape[-1], generator=gen, dtype=F64)
    ref_out, ref_grads = _torch_path_float64(q, k, v, variant, mask, u, weights_g, monkeypatch)
    taken = _counting(monkeypatch)
    out, grads = _run(q, k, v, variant, mask, u, weights_g)
    assert taken == [True]
    assert out.dtype == dtype and len(grads) == len(ref_grads)
    tol = dict(atol=1e-12, rtol=1e-10) if dtype == F64 else dict(atol=3e-5, rtol=3e-5)
    torch.testing.assert_close(out.to(F64), ref_out, **tol)
    for name, got, ref in zip("qkvu"[:len(grads)], grads, ref_grads, strict=True):
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got.to(F64), ref, **tol, msg=lambda s, name=name: f"grad_{name}: {s}")
    if mask_kind == "arbitrary":  # the fully masked query row gives 0 and no gradient reaches it
        assert torch.all(out[..., 2, :] == 0) and torch.all(grads[0][..., 2, :] == 0)
        assert torch.all(grads[1][..., 4, :] == 0) and torch.all(grads[2][..., 4, :] == 0)


@needs_kernels
@pytest.mark.parametrize("variant", ["dnas", "hnas"])
def test_kernel_path_gradcheck(monkeypatch, variant):
    q, k, v, masks, _ = _problem(2, F64, B=1, H=2, M=5, N=6, D=3)
    mask = masks["arbitrary"]
    mask[..., 0, 0] = True
    taken = _counting(monkeypatch)
    u = torch.tensor([0.3, 0.8], dtype=F64).view(1, 2, 1, 1).requires_grad_()
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def f(q, k, v, u):
        return attnlab.attend(q, k, v, variant, mask=mask, u=u, scale=0.7)

    assert torch.autograd.gradcheck(f, (q, k, v, u))
    assert taken and all(taken)


@needs_kernels
def test_forward_op_panels():
    """train_dn_forward's outputs: out, p_d, p_u and e (e_i p_d_ij = the column softmax P_ij)."""
    gen = torch.Generator().manual_seed(3)
    B, H, M, N = 2, 2, 7, 6
    q, k, v = (torch.randn(B * H, L, 4, generator=gen, dtype=F64) for L in (M, N, N))
    mask = torch.rand(B, H, M, N, generator=gen) > 0.2
    mask[1, 0, 3, :] = False  # an empty row
    mask[0, 1, :, 5] = False  # an empty column
    u = torch.rand(B * H, generator=gen, dtype=F64)
    scale = 0.6
    logits = (scale * q @ k.transpose(-1, -2)).masked_fill(~mask.view(B * H, M, N), -math.inf)
    c = torch.logsumexp(logits, -2, keepdim=True)
    c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))
    col = torch.exp(logits - c)  # P
    p_d = torch.nan_to_num(col / col.sum(-1, keepdim=True))
    p_u = torch.nan_to_num(torch.softmax(logits, -1))
    mix = torch.lerp(p_u, p_d, u.view(-1, 1, 1))
    out, got_d, got_u, e = (torch.empty(B * H, M, 4, dtype=F64), torch.empty(B * H, M, N, dtype=F64),
                            torch.empty(B * H, M, N, dtype=F64), torch.empty(B * H, M, dtype=F64))
    assert ops.train_dn_forward(q, k, v, mask, u, scale, out, got_d, got_u, e)
    torch.testing.assert_close(got_d, p_d)
    torch.testing.assert_close(got_u, p_u)
    torch.testing.assert_close(out, mix @ v)
    torch.testing.assert_close(e[..., None] * got_d, col)
    assert torch.all(got_d[2, 3] == 0) and e[2, 3] == 0 and torch.all(got_d[1, :, 5] == 0)
    # DNAS alone (no u, no p_u), a key-only mask with stride 0 over heads and queries; float32
    keys = mask[:, :1, :1, :].expand(B, H, M, N)
    d32, o32, e32 = torch.empty(B * H, M, N), torch.empty(B * H, M, 4), torch.empty(B * H, M)
    assert ops.train_dn_forward(q.float(), k.float(), v.float(), keys, None, scale, o32, d32, None, e32)
    logits = (scale * q @ k.transpose(-1, -2)).masked_fill(~keys.reshape(B * H, M, N), -math.inf)
    c = torch.logsumexp(logits, -2, keepdim=True)
    ref = torch.softmax(logits - torch.where(torch.isfinite(c), c, torch.zeros_like(c)), -1)
    assert not keys.all() and torch.isfinite(ref).all()
    torch.testing.assert_close(d32.double(), ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(o32.double(), ref @ v, atol=1e-5, rtol=1e-5)
    # a NaN or +inf score: refused (the caller takes the PyTorch path)
    for bad in (math.nan, math.inf):
        qb = q.clone()
        qb[3, 0, :] = bad
        assert not ops.train_dn_forward(qb, k, v, None, u, scale, out, got_d, got_u, e)


@needs_kernels
@pytest.mark.parametrize("variant", ["dnas", "hnas"])
def test_overflowing_scores_take_the_pytorch_path(monkeypatch, variant):
    """q k^T overflowing to +inf (finite q, k): the kernel refuses, the result is the PyTorch path's
    (its NaN rule), not the kernel's."""
    q, k, v, _, _ = _problem(4, torch.float32)
    q[0, 1, 3] = 1e30
    k[0, 1, :, :] = 1e30
    taken = _counting(monkeypatch)
    weights_g = torch.ones(*q.shape[:3], v.shape[-1], dtype=F64)
    out, grads = _run(q, k, v, variant, None, 0.5, weights_g)
    assert taken == [False]
    with monkeypatch.context() as m:
        m.setattr(nz.kernel_paths, "train_forward", lambda *args: None)
        ref_out, ref_grads = _run(q, k, v, variant, None, 0.5, weights_g)
    torch.testing.assert_close(out, ref_out, equal_nan=True)
    assert torch.isnan(out[0, 1]).any() and not torch.isnan(out[1]).any()
    for got, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, ref, equal_nan=True)


@needs_kernels
def test_kernel_not_taken_without_gradients_or_when_large(monkeypatch):
    """The kernels serve only the training-size autograd function (M N <= SMALL_SCORES, gradients)."""
    q, k, v, _, _ = _problem(5, torch.float32)
    taken = _counting(monkeypatch)
    with torch.no_grad():
        attnlab.attend(q, k, v, "hnas")
    monkeypatch.setattr(nz.fused, "SMALL_SCORES", 0)
    attnlab.attend(q.requires_grad_(), k, v, "dnas").sum().backward()
    assert taken == [] and q.grad is not None


def test_pytorch_path_without_kernels(monkeypatch):
    """No kernels (not built, ATTNLAB_KERNELS=0), other dtypes or devices: train_forward declines and
    the PyTorch code of the same function runs, with the float64 reference's gradients."""
    q, k, v, masks, gen = _problem(6, torch.float32)
    weights_g = torch.randn(*q.shape[:3], v.shape[-1], generator=gen, dtype=F64)
    u = torch.full((1, 3, 1, 1), 0.4)
    ref_out, ref_grads = _torch_path_float64(q, k, v, "hnas", masks["padding"], u, weights_g, monkeypatch)
    monkeypatch.setattr(nz.kernel_paths, "cpu_ops", lambda: None)
    assert nz.kernel_paths.train_forward(q, k, v, None, None, 0.5) is None
    assert nz.kernel_paths.train_forward(q.half(), k.half(), v.half(), None, None, 0.5) is None
    taken = _counting(monkeypatch)
    out, grads = _run(q, k, v, "hnas", masks["padding"], u, weights_g)
    assert taken == [False]
    torch.testing.assert_close(out.to(F64), ref_out, atol=3e-5, rtol=3e-5)
    for got, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got.to(F64), ref, atol=3e-5, rtol=3e-5)
