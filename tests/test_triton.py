"""attnlab.gpu's Triton kernels: under Triton's interpreter on CPU tensors, and on CUDA when there is one.

Interpreter tests (TRITON_INTERPRET=1 set by a fixture for each test only; attnlab.gpu.loader loads
an interpreted copy of the kernels whatever was imported before, so this works in any pytest worker):
every kernel path against float64 references built from ``attnlab.attention_weights`` on float64
scores, forward and gradients (q, k, v, u), every mask kind (none, key padding, query padding, both,
with empty rows and columns), causal prefix DNAS/HNAS, Sinkhorn 1..3, float16/bfloat16 inputs; the
interpreter is slow (~10 ms per tile step), so the default run checks one representative case per
path and the full grid is marked slow. Also what returns None ("does not apply") and why.

CUDA tests (``pytest -m cuda``, skipped without a GPU): the same paths at real sizes against
``attnlab.attend`` on the CPU in float32.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnlab
from attnlab import gpu
from attnlab.gpu import dispatch, loader

HAS_TRITON = loader.triton_installed()
HAS_CUDA = torch.cuda.is_available()
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")

TOL = 2e-5  # float32 kernels vs float64 reference, relative to the largest reference magnitude
HALF_TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2}  # half inputs vs float64 on the same rounded inputs
MASKS = ("none", "keys", "queries", "both")
# (variant, attend keyword arguments); "u_head" = a per-head tensor u (1, H, 1, 1), "u_bh" = (B, H, 1, 1)
CASES = [("dnas", {}), ("hnas", {"u": 0.3}), ("hnas", {"u": "u_head"}), ("hnas", {"u": "u_bh"}),
         ("sinkhorn", {"iters": 1}), ("sinkhorn", {"iters": 2}), ("sinkhorn", {"iters": 3})]
GRAD_CASES = CASES[:4]
B, H = 2, 2


@pytest.fixture
def interpret(monkeypatch):
    """Triton's interpreter for this test only (read by attnlab.gpu at every call)."""
    if not HAS_TRITON:
        pytest.skip("needs triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _inputs(M, N, D, seed=0, dtype=torch.float32, dv=None):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, M, D, generator=gen)
    k = torch.randn(B, H, N, D, generator=gen)
    v = torch.randn(B, H, N, dv or D, generator=gen)
    return [t.to(dtype) for t in (q, k, v)]


def _mask(kind, M, N, seed=1):
    """Key padding (B, 1, 1, N), query padding (B, 1, M, 1) or both (B, 1, M, N), each with one batch
    row fully valid and one with padding (so some rows / columns are empty); None for "none"."""
    if kind == "none":
        return None
    gen = torch.Generator().manual_seed(seed)
    keep_q = torch.rand(B, M, generator=gen) > 0.3
    keep_k = torch.rand(B, N, generator=gen) > 0.3
    keep_q[0], keep_k[0] = True, True
    keep_q[1, 0], keep_k[1, 0] = True, True  # at least one valid pair in batch 1
    if kind == "keys":
        return keep_k[:, None, None, :]
    if kind == "queries":
        return keep_q[:, None, :, None]
    return keep_q[:, None, :, None] & keep_k[:, None, None, :]


def _u(kw, dtype=torch.float32):
    u = kw.get("u")
    if u == "u_head":
        return torch.tensor([0.2, 0.9], dtype=dtype).view(1, H, 1, 1)
    if u == "u_bh":
        return torch.tensor([[0.0, 0.4], [1.0, 0.7]], dtype=dtype).view(B, H, 1, 1)
    return u


def _reference(q, k, v, variant, mask, causal, u, iters, scale=None):
    """float64: attnlab.attention_weights on float64 scores, then @ v (differentiable)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = scale * q @ k.transpose(-1, -2)
    w = attnlab.attention_weights(s, variant, mask=mask, causal=causal, u=u, iters=iters)
    return w @ v


def _close(got, want, what, tol=TOL):
    assert got is not None, f"{what}: the kernels did not apply"
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    err = float((got - want).abs().max())
    ref = max(float(want.abs().max()), 1e-6)
    assert err <= tol * ref, f"{what}: max |diff| {err:.3g} > {tol:g} x {ref:.3g}"


def check_forward(variant, kw, mask_kind, M, N, D, causal=False, dtype=torch.float32, scale=None):
    q, k, v = _inputs(M, N, D, dtype=dtype)
    mask = _mask(mask_kind, M, N)
    u, iters = _u(kw), kw.get("iters")
    out = gpu.fused_attend(q, k, v, variant, mask=mask, causal=causal, u=u, iters=iters, scale=scale)
    u64 = u.double() if isinstance(u, torch.Tensor) else u
    want = _reference(q.double(), k.double(), v.double(), variant, mask, causal, u64, iters, scale)
    assert out is not None and out.dtype == dtype
    _close(out, want, f"{variant} {kw} {mask_kind} {M}x{N} D={D} causal={causal} {dtype}",
           HALF_TOL.get(dtype, TOL))
    if mask is not None:  # rows without a valid key: exactly 0
        empty = ~(mask & torch.ones(M, N, dtype=torch.bool).tril() if causal else mask).any(-1)
        assert (out.float().masked_select(empty.expand(B, H, M)[..., None]) == 0).all()


def check_grads(variant, kw, mask_kind, M, N, D, dtype=torch.float32):
    q, k, v = _inputs(M, N, D, dtype=dtype)
    mask = _mask(mask_kind, M, N)
    u = _u(kw)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    u_t = u.clone().requires_grad_() if isinstance(u, torch.Tensor) else u
    out = gpu.fused_attend(*leaves, variant, mask=mask, u=u_t)
    assert out is not None and out.requires_grad
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    wrt = leaves + ([u_t] if isinstance(u_t, torch.Tensor) else [])
    grads = torch.autograd.grad(out, wrt, g)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    u64 = u.double().requires_grad_() if isinstance(u, torch.Tensor) else u
    want = _reference(*ref_leaves, variant, mask, False, u64, None)
    ref_wrt = ref_leaves + ([u64] if isinstance(u64, torch.Tensor) else [])
    ref_grads = torch.autograd.grad(want, ref_wrt, g.double())
    tol = 10 * HALF_TOL.get(dtype, TOL)
    for name, got, ref in zip("qkvu", grads, ref_grads, strict=False):
        like = u_t if name == "u" else {"q": q, "k": k, "v": v}[name]
        assert (got.shape, got.dtype) == (like.shape, like.dtype), f"grad {name}: shape or dtype"
        _close(got, ref, f"grad {name}: {variant} {kw} {mask_kind} {M}x{N} D={D} {dtype}", tol)


# ----------------------------------------------------------------------------------------------
# Interpreter: the default run (one representative case per path; the inner loop,
# `pytest -m "not slow"`, keeps the first of each list, the rest run in .ci/run)
# ----------------------------------------------------------------------------------------------


def _inner_loop_keeps(cases, keep=1):
    """``cases`` with all but the first ``keep`` marked slow (the interpreter costs ~1 s a case)."""
    return [*cases[:keep], *(pytest.param(*c, marks=pytest.mark.slow) for c in cases[keep:])]


@pytest.mark.parametrize("variant,kw", _inner_loop_keeps(CASES, 5), ids=lambda x: str(x))
def test_forward_every_variant(interpret, variant, kw):
    check_forward(variant, kw, "both", 33, 64, 16)


@pytest.mark.parametrize("mask_kind", _inner_loop_keeps([(m,) for m in MASKS[::-1]]))
def test_forward_every_mask_d64(interpret, mask_kind):
    check_forward("hnas", {"u": "u_bh"}, mask_kind, 64, 33, 64)


@pytest.mark.parametrize("variant,kw", _inner_loop_keeps([*GRAD_CASES[:2], *GRAD_CASES[3:]], 0), ids=str)
def test_gradients(interpret, variant, kw):
    check_grads(variant, kw, "both", 33, 40, 16)


@pytest.mark.parametrize("variant,kw", [("dnas", {}), ("hnas", {"u": "u_head"})], ids=lambda x: str(x))
def test_causal_prefix(interpret, variant, kw):
    check_forward(variant, kw, "keys", 64, 64, 16, causal=True)


@pytest.mark.slow
def test_causal_prefix_exact_where_cumsum_underflows(interpret):
    """A column whose later scores exceed the first rows' by > 46 nats inside one query tile: the fast
    cumsum prefix would lose the early rows; the kernel switches that tile to the exact scan."""
    q, k, v = _inputs(40, 40, 16)
    q[..., 20:30, :] = 8.0 * k[..., :1, :]  # rows 20..29 score ~ 8 |k_0|^2 / 4 on column 0 (and neighbours)
    out = gpu.fused_attend(q, k, v, "dnas", causal=True, scale=1.0)
    want = _reference(q.double(), k.double(), v.double(), "dnas", None, True, None, None, 1.0)
    _close(out, want, "causal dnas, large score range", 1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_inputs(interpret, dtype):
    check_forward("hnas", {"u": 0.6}, "keys", 33, 33, 16, dtype=dtype)


@pytest.mark.slow
def test_strided_inputs_and_expanded_u(interpret):
    """q, k, v as views of a (B, L, H, D) layout (no copy: the kernels take strides), u expanded."""
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in _inputs(33, 40, 16))
    assert not q.is_contiguous()
    u = torch.tensor(0.25).expand(1, H, 1, 1).requires_grad_()
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = gpu.fused_attend(*leaves, "hnas", u=u, mask=_mask("keys", 33, 40))
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    u64 = torch.tensor(0.25, dtype=torch.float64, requires_grad=True)
    want = _reference(*ref_leaves, "hnas", _mask("keys", 33, 40), False, u64, None)
    _close(out, want, "strided hnas")
    got = torch.autograd.grad(out.sum(), [*leaves, u])
    ref = torch.autograd.grad(want.sum(), [*ref_leaves, u64])
    for name, a, b in zip("qkvu", got, ref, strict=True):
        _close(a.sum() if name == "u" else a, b, f"strided grad {name}", 10 * TOL)


def test_sinkhorn_grad_and_causal_grad_do_not_apply(interpret):
    q, k, v = (t.requires_grad_() for t in _inputs(5, 5, 16))
    assert gpu.fused_attend(q, k, v, "sinkhorn", iters=2) is None
    assert gpu.fused_attend(q, k, v, "dnas", causal=True) is None
    assert gpu.fused_attend(q, k, v, "sinkhorn", iters=1) is not None  # = DNAS, has a backward


def test_does_not_apply(interpret):
    q, k, v = _inputs(5, 7, 16)
    mask = torch.rand(B, 1, 5, 7, generator=torch.Generator().manual_seed(0)) > 0.5  # not a product
    assert gpu.available(q)
    assert gpu.fused_attend(q, k, v, "dnas", mask=mask) is None
    assert gpu.fused_attend(q, k, v, "unas") is None  # SDPA is UNAS's fast path
    assert gpu.fused_attend(q, k, v, "no-such-variant") is None
    assert gpu.fused_attend(q.double(), k.double(), v.double(), "dnas") is None
    assert gpu.fused_attend(q, k.half(), v, "dnas") is None
    assert gpu.fused_attend(q[..., :8], k[..., :8], v, "dnas") is None  # D = 8
    assert gpu.fused_attend(q[..., :0, :], k, v, "dnas") is None  # M = 0
    assert gpu.fused_attend(q, k, v, "hnas", u=torch.rand(7)) is None  # u varies along keys
    assert gpu.fused_attend(q, k, v, "sinkhorn", iters=2, causal=True) is None
    assert gpu.fused_attend(q, k, v, "sinkhorn", tol=0.1) is None  # early stopping: not in the kernels


def test_parameter_defaults_come_from_the_specs(interpret):
    """Parameters not given take the spec's defaults (and its causal rule), as in attnlab.attend."""
    q, k, v = _inputs(5, 7, 16)
    for variant, causal in (("sinkhorn", False), ("sinkhorn", True), ("hnas", False)):
        out = gpu.fused_attend(q, k, v, variant, causal=causal)
        want = _reference(q.double(), k.double(), v.double(), variant, None, causal, None, None)
        _close(out, want, f"{variant} causal={causal} at its defaults")


def test_cpu_without_interpreter_or_triton(monkeypatch):
    """On the CPU, only the interpreter runs the kernels; without triton nothing does (no error)."""
    q, k, v = _inputs(5, 5, 16)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not gpu.available(q)
    assert gpu.fused_attend(q, k, v, "dnas") is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(loader, "triton_installed", lambda: False)
    assert not gpu.available(q)
    assert gpu.fused_attend(q, k, v, "dnas") is None


# ----------------------------------------------------------------------------------------------
# Interpreter: the full grid (slow)
# ----------------------------------------------------------------------------------------------

SHAPES = [(1, 5, 16), (5, 1, 16), (33, 64, 16), (64, 33, 64), (64, 64, 64)]


@pytest.mark.slow
@pytest.mark.parametrize("M,N,D", SHAPES)
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("variant,kw", CASES, ids=lambda x: str(x))
def test_forward_grid(interpret, variant, kw, mask_kind, M, N, D):
    check_forward(variant, kw, mask_kind, M, N, D)


@pytest.mark.slow
@pytest.mark.parametrize("M,N,D", [(1, 5, 16), (33, 64, 16), (64, 33, 64)])
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("variant,kw", GRAD_CASES, ids=lambda x: str(x))
def test_gradient_grid(interpret, variant, kw, mask_kind, M, N, D):
    check_grads(variant, kw, mask_kind, M, N, D)


@pytest.mark.slow
@pytest.mark.parametrize("M,N,D", [(1, 1, 16), (5, 33, 16), (64, 64, 64), (40, 20, 16)])
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("variant,kw", [("dnas", {}), ("hnas", {"u": 0.5}), ("sinkhorn", {"iters": 1})],
                         ids=lambda x: str(x))
def test_causal_grid(interpret, variant, kw, mask_kind, M, N, D):
    check_forward(variant, kw, mask_kind, M, N, D, causal=True)


@pytest.mark.slow
@pytest.mark.parametrize("blocks", [(16, 16, 1), (16, 32, 1), (32, 16, 1)])
def test_other_block_sizes(interpret, monkeypatch, blocks):
    """Several query and key blocks, unequal blocks (the causal carry is indexed by the query block)."""
    monkeypatch.setattr(dispatch, "INTERPRET_BLOCKS", blocks)
    check_forward("hnas", {"u": "u_head"}, "both", 40, 50, 16)
    check_forward("dnas", {}, "both", 50, 40, 16, causal=True)
    check_forward("sinkhorn", {"iters": 3}, "keys", 33, 47, 16)
    check_grads("hnas", {"u": "u_bh"}, "both", 40, 50, 16)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("variant,kw", [("dnas", {}), ("hnas", {"u": "u_head"}), ("sinkhorn", {"iters": 3})],
                         ids=lambda x: str(x))
def test_half_grid(interpret, dtype, variant, kw):
    check_forward(variant, kw, "both", 33, 64, 64, dtype=dtype)
    check_forward(variant, kw, "keys", 40, 40, 16, dtype=dtype, causal=variant != "sinkhorn")
    if variant != "sinkhorn":
        check_grads(variant, kw, "both", 33, 40, 16, dtype=dtype)


@pytest.mark.slow
def test_importing_attnlab_imports_no_triton():
    code = ("import sys, attnlab, attnlab.gpu, torch; q = torch.zeros(1, 1, 2, 16); "
            "assert attnlab.gpu.fused_attend(q, q, q, 'dnas') is None; "
            "assert 'triton' not in sys.modules, 'triton imported'")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(__import__("pathlib").Path(attnlab.__file__).resolve().parents[1])
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


# ----------------------------------------------------------------------------------------------
# Compiled for the GPU without one (slow): Triton's compiler and ptxas, target sm_90 (H100/H200)
# ----------------------------------------------------------------------------------------------

SHARED_LIMIT = 227 * 1024  # bytes of shared memory one block may use on sm_90
TL_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
DATA_POINTERS = {"Q", "K", "V", "G", "OUT", "DK", "DVv", "DQ"}  # in the input dtype; other pointers float32
COMPILE_CASES = [  # (module, kernel, constexpr flags)
    ("fwd", "col_lse_kernel", dict(HAS_RB=True, CAUSAL=True)),
    ("fwd", "row_kernel", dict(HAS_RB=True, HAS_KB=True, HYBRID=True, CAUSAL=True, SAVE=False)),
    ("fwd", "row_kernel", dict(HAS_RB=True, HAS_KB=True, HYBRID=True, CAUSAL=False, SAVE=True)),
    ("bwd", "bwd_kv_kernel", dict(HAS_RB=True, HAS_KB=True, HYBRID=True)),
    ("bwd", "bwd_q_kernel", dict(HAS_RB=True, HAS_KB=True, HYBRID=True)),
]


COMPILE_DTYPES = [(torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float16, 64), (torch.float32, 64)]
# Compiling needs Triton imported without the interpreter, and this test session interprets (no GPU:
# tests/conftest.py): the cases run in one fresh process, each reporting (spills, shared bytes).
COMPILE_SCRIPT = """
import json, sys, torch
from triton import compile as triton_compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from attnlab.gpu import dispatch, loader
TL = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}
DATA = {"Q", "K", "V", "G", "OUT", "DK", "DVv", "DQ"}
ns = loader.kernels("cuda")
out = {}
for key, module, name, flags, dtype, D in json.loads(sys.argv[1]):
    fn = getattr(getattr(ns, module), name)
    bm, bn, warps = dispatch.CUDA_BLOCKS[D]
    const = dict(flags, PREC="ieee", F32=False, BLOCK_M=bm, BLOCK_N=bn, D=D)
    if "DV" in fn.arg_names:
        const["DV"] = D
    pointers = fn.arg_names[: fn.arg_names.index("sqb")]
    sig = {a: "constexpr" if a in const else f"*{TL[dtype]}" if a in DATA
           else "*fp32" if a in pointers else "fp32" if a == "scale" else "i32" for a in fn.arg_names}
    try:
        k = triton_compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": warps})
        out[key] = {"spills": ".local" in k.asm["ptx"], "shared": k.metadata.shared}
    except Exception as e:  # reported per case
        out[key] = {"error": repr(e)[-2000:]}
print(json.dumps(out))
"""


def _compile_key(case, dtype, D) -> str:
    return "-".join([case[1], *(k for k in case[2] if case[2][k]), str(dtype), str(D)])


@pytest.fixture(scope="module")
def compiled():
    cases = [(_compile_key(c, dt, D), c[0], c[1], c[2], str(dt), D) for c in COMPILE_CASES
             for dt, D in COMPILE_DTYPES]
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    res = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT, json.dumps(cases)], capture_output=True,
                         text=True, env=env, timeout=1200)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("dtype,D", COMPILE_DTYPES, ids=str)
@pytest.mark.parametrize("case", COMPILE_CASES, ids=lambda c: "-".join([c[1], *(k for k in c[2] if c[2][k])]))
def test_kernels_compile_for_sm90(compiled, case, dtype, D):
    """What the interpreter cannot check: the kernels as CUDA compiles them with dispatch's block sizes
    (constexpr globals, dot shapes and dtypes), without local-memory spills, within shared memory."""
    got = compiled[_compile_key(case, dtype, D)]
    assert "error" not in got, got.get("error")
    assert not got["spills"], f"{case[1]}: registers spill to local memory"
    assert got["shared"] <= SHARED_LIMIT, f"{case[1]}: {got['shared']} bytes of shared memory"


# ----------------------------------------------------------------------------------------------
# CUDA (real sizes; skipped without a GPU)
# ----------------------------------------------------------------------------------------------

cuda_only = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs CUDA and triton")
CUDA_TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def _cuda_case(variant, kw, mask_kind, M, N, D, dtype, causal=False, grad=False):
    q, k, v = _inputs(M, N, D, dtype=dtype)
    mask = _mask(mask_kind, M, N)
    u = _u(kw)
    dev = [t.cuda().requires_grad_(grad) for t in (q, k, v)]
    u_dev = u.cuda().requires_grad_(grad) if isinstance(u, torch.Tensor) else u
    out = gpu.fused_attend(*dev, variant, mask=None if mask is None else mask.cuda(), causal=causal, u=u_dev,
                           iters=kw.get("iters"))
    cpu = [t.float().requires_grad_(grad) for t in (q, k, v)]
    u_cpu = u.float().requires_grad_(grad) if isinstance(u, torch.Tensor) else u
    want = attnlab.attend(*cpu, variant, mask=mask, causal=causal, u=u_cpu, iters=kw.get("iters"))
    what = f"cuda {variant} {kw} {mask_kind} {M}x{N} D={D} {dtype} causal={causal}"
    _close(out.cpu(), want, what, CUDA_TOL[dtype])
    if grad:
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
        wrt = dev + ([u_dev] if isinstance(u_dev, torch.Tensor) else [])
        ref_wrt = cpu + ([u_cpu] if isinstance(u_cpu, torch.Tensor) else [])
        got = torch.autograd.grad(out, wrt, g.to(dtype).cuda())
        ref = torch.autograd.grad(want, ref_wrt, g.to(dtype).float())
        for name, a, b in zip("qkvu", got, ref, strict=False):
            _close(a.cpu(), b, f"{what}: grad {name}", 10 * CUDA_TOL[dtype])


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("variant,kw", CASES, ids=lambda x: str(x))
def test_cuda_forward(ieee_float32_matmul, variant, kw, D, dtype):
    for mask_kind, (M, N) in (("none", (1000, 1000)), ("both", (777, 1500)), ("queries", (1024, 300))):
        _cuda_case(variant, kw, mask_kind, M, N, D, dtype)


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("variant,kw", GRAD_CASES, ids=lambda x: str(x))
def test_cuda_gradients(ieee_float32_matmul, variant, kw, D, dtype):
    _cuda_case(variant, kw, "both", 700, 900, D, dtype, grad=True)


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("variant,kw", [("dnas", {}), ("hnas", {"u": "u_head"})], ids=lambda x: str(x))
def test_cuda_causal(ieee_float32_matmul, variant, kw, dtype):
    for mask_kind in ("none", "keys"):
        _cuda_case(variant, kw, mask_kind, 1100, 1100, 64, dtype, causal=True)



@pytest.mark.slow
def test_attention_benchmark_options_on_cpu():
    """bench attention --heads/--head-dim/--dtype plumbing (no timing asserted; no Triton cases on CPU)."""
    from attnlab import bench

    res = bench.bench_attention(sizes=(16,), memory=False, repeats=1, heads=2, head_dim=16, dtype="bfloat16")
    assert set(res["ratio"][16]) == {label for label, _, _ in (*bench.CASES, *bench.MASK_CASES)}
    assert (res["heads"], res["head_dim"], res["dtype"]) == (2, 16, "bfloat16")
    assert "| 16 |" in bench.attention_markdown(res)
