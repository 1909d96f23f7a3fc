"""``fused_attend``: decide whether the Triton kernels apply to an attention call, and run them.

The kernels apply when triton imports; q is on CUDA (or on the CPU with TRITON_INTERPRET=1, the
interpreter that the tests use); q, k, v share one dtype of float32 / bfloat16 / float16; D and Dv are
powers of two in [16, 128]; no dim is empty; the mask depends on the query alone, the key alone, or is
their product (key and query padding; checked on the device, one comparison of the mask); u is one
weight per (batch, head); and the variant has a kernel path below (FAST_PATHS) that handles every
parameter its spec declares (HANDLED), parameters not given taking the spec's defaults.

Gradients: DNAS and HNAS (not causal) have Triton backward kernels; Sinkhorn with iters > 1 and
causal DNAS/HNAS under autograd return None (the caller's PyTorch path computes them). Everything
else returns None, never an error: the caller then takes its reference path, which also owns
argument validation.
"""

from __future__ import annotations

import math

import torch

from attnlab.gpu import loader
from attnlab.gpu.ops import DoublyNormalized, Launch, column_lse, row_pass, sinkhorn_potentials

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HEAD_DIMS = (16, 32, 64, 128)  # D and Dv (tl.dot needs >= 16 and a power of two)
# (block_m, block_n, num_warps) on CUDA per head dim: untuned first choices (tuning awaits a GPU run)
CUDA_BLOCKS = {16: (64, 64, 4), 32: (64, 64, 4), 64: (64, 64, 4), 128: (64, 32, 4)}
# Under the interpreter: small blocks, so that small test shapes already span several blocks
INTERPRET_BLOCKS = (32, 32, 1)


def available(q: torch.Tensor) -> bool:
    """True when the Triton kernels can run on tensors like ``q`` (device and triton; the other
    conditions of ``fused_attend`` are checked per call)."""
    m = loader.mode(q)
    return m is not None and loader.kernels(m) is not None


def _factor_mask(mask, B, H, M, N):
    """(query_valid (B, H, M) | None, key_valid (B, H, N) | None), or False when the mask depends on
    both i and j other than as a product of a query mask and a key mask."""
    if mask is None:
        return None, None
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    if mask.shape[-1] == 1:
        return mask[..., 0].expand(B, H, M), None
    if mask.shape[-2] == 1:
        return None, mask[..., 0, :].expand(B, H, N)
    rows, cols = mask.any(-1), mask.any(-2)  # (b, h, M), (b, h, N)
    if not bool(torch.equal(mask, rows[..., :, None] & cols[..., None, :])):
        return False
    return rows.expand(B, H, M), cols.expand(B, H, N)


def _bias(valid: torch.Tensor | None) -> torch.Tensor | None:
    """bool (B, H, L) -> float32 (B*H, L) contiguous: 0 where valid, -inf where not."""
    if valid is None:
        return None
    B, H, L = valid.shape
    out = torch.zeros(B, H, L, dtype=torch.float32, device=valid.device)
    return out.masked_fill_(~valid, float("-inf")).reshape(B * H, L)


def _u4(u, B, H, device) -> torch.Tensor | None:
    """u as a float32-or-its-own-dtype 4-D tensor broadcastable to (B, H, 1, 1), or None when it varies
    within a head (or is not a float / floating tensor)."""
    if not isinstance(u, torch.Tensor):
        if isinstance(u, bool) or not isinstance(u, (int, float)):
            return None
        return torch.full((1, 1, 1, 1), float(u), dtype=torch.float32, device=device)
    if not u.is_floating_point() or u.dim() > 4:
        return None
    u4 = u.reshape((1,) * (4 - u.dim()) + tuple(u.shape))
    if u4.shape[-2:] != (1, 1) or any(s not in (1, t) for s, t in zip(u4.shape[:2], (B, H), strict=True)):
        return None
    return u4.to(device)


def _launch(q, ns, mode_, scale, rb, kb) -> Launch:
    B, H, _, D = q.shape
    if mode_ == "interpret":
        bm, bn, warps = INTERPRET_BLOCKS
    else:
        bm, bn, warps = CUDA_BLOCKS[D]
    tf32 = q.dtype == torch.float32 and mode_ == "cuda" and torch.backends.cuda.matmul.allow_tf32
    return Launch(ns=ns, interpret=mode_ == "interpret", B=B, H=H, scale=scale, rb=rb, kb=kb,
                  prec="tf32" if tf32 else "ieee", f32=mode_ == "interpret" and q.dtype == torch.bfloat16,
                  block_m=bm, block_n=bn, num_warps=warps)


def _needs_grad(*ts) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in ts)


def _variant_params(variant: str, causal: bool, given: dict) -> dict | None:
    """The variant's parameters with its spec's defaults and causal rule (not value-checked: the
    caller's reference path owns that), or None when the variant is unknown, the causal rule refuses,
    or the spec declares a parameter that its kernel path does not handle."""
    from attnlab.normalizers import variant_spec  # noqa: PLC0415 (attnlab.normalizers may import us)

    try:
        spec = variant_spec(variant)
    except ValueError:
        return None
    params = {k: v for k, v in given.items() if v is not None and spec.param(k) is not None}
    named = frozenset(params)
    for p in spec.params:
        params.setdefault(p.name, p.default)
    if set(params) - HANDLED.get(variant, set()):
        return None
    if causal and spec.causal_rule is not None:
        try:
            params = spec.causal_rule(params, named)
        except ValueError:
            return None
    return params


def fused_attend(q, k, v, variant, *, mask=None, scale=None, causal=False, u=None, iters=None, **params):
    """Attention output (B, H, M, Dv) in q.dtype through the Triton kernels, or None where they do not
    apply (see the module docstring). Same semantics as ``attnlab.attend(q, k, v, variant, ...)``:
    rows without a valid key give 0, columns without a valid query contribute nothing.

    q (B, H, M, D), k (B, H, N, D), v (B, H, N, Dv); mask bool broadcastable to (B, H, M, N) or None;
    u float or tensor broadcastable to (B, H, 1, 1) (HNAS); iters int >= 1 (Sinkhorn); other variant
    parameters by name (Sinkhorn's tol: only 0 has a kernel path). Parameters not given take the
    variant spec's defaults.
    """
    run = FAST_PATHS.get(variant) if isinstance(variant, str) else None
    if run is None or not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return None
    params = _variant_params(variant, bool(causal), {"u": u, "iters": iters, **params})
    if params is None:
        return None
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return None
    B, H, M, D = q.shape
    N, DV = v.shape[-2:]
    if k.shape != (B, H, N, D) or v.shape[:3] != (B, H, N) or min(B, H, M, N) == 0:
        return None
    if q.dtype not in DTYPES or not (q.dtype == k.dtype == v.dtype):
        return None
    if D not in HEAD_DIMS or DV not in HEAD_DIMS:
        return None
    if not (q.device == k.device == v.device):
        return None
    mode_ = loader.mode(q)
    ns = None if mode_ is None else loader.kernels(mode_)
    if ns is None:
        return None
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.device != q.device:
            return None
        try:
            if torch.broadcast_shapes(mask.shape, (B, H, M, N)) != (B, H, M, N):
                return None
        except RuntimeError:
            return None
    factored = _factor_mask(mask, B, H, M, N)
    if factored is False:
        return None
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    L = _launch(q, ns, mode_, scale, _bias(factored[0]), _bias(factored[1]))
    return run(L, q, k, v, causal=bool(causal), **params)


def _dnas(L, q, k, v, *, causal):
    """Eq. (5): one column LSE pass, one biased row pass; causal: prefix potentials c_j(i)."""
    if causal:
        if _needs_grad(q, k, v):
            return None  # no kernel backward for causal DNAS
        return row_pass(L, q, k, v, None, causal=True)[0]
    if _needs_grad(q, k, v):
        return DoublyNormalized.apply(q, k, v, None, L)
    c, _ = column_lse(L, q, k, L.rb)
    return row_pass(L, q, k, v, c)[0]


def _hnas(L, q, k, v, *, causal, u):
    """Eq. (12): u * pi_dnas V + (1 - u) * pi_unas V, both from one score tile per key block."""
    u4 = _u4(u, L.B, L.H, q.device)
    if u4 is None:
        return None
    if causal:
        if _needs_grad(q, k, v, u4):
            return None  # no kernel backward for causal HNAS
        u_bh = u4.detach().float().expand(L.B, L.H, 1, 1).reshape(-1).contiguous()
        return row_pass(L, q, k, v, None, u_bh, causal=True)[0]
    if _needs_grad(q, k, v, u4):
        return DoublyNormalized.apply(q, k, v, u4, L)
    u_bh = u4.float().expand(L.B, L.H, 1, 1).reshape(-1).contiguous()
    c, _ = column_lse(L, q, k, L.rb)
    return row_pass(L, q, k, v, c, u_bh)[0]


def _sinkhorn(L, q, k, v, *, causal, iters, tol=0.0):
    """Eq. (10) by potentials: iters - 1 (row, column) LSE rounds after the first column pass, then the
    row pass; iters=1 (and causal, which allows only 1) is DNAS. Forward only for iters > 1."""
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1 or (causal and iters > 1):
        return None
    if tol != 0:
        return None  # early stopping: the PyTorch path checks the column masses between rounds
    if causal or iters == 1:
        return _dnas(L, q, k, v, causal=causal)
    if _needs_grad(q, k, v):
        return None  # no kernel backward for Sinkhorn(iters > 1)
    return row_pass(L, q, k, v, sinkhorn_potentials(L, q, k, iters))[0]


# Variant name -> kernel path (the lead declares these as the CUDA fast paths of the variant specs).
# A variant not listed (unas: SDPA is its fast path; sparsemax, softmax1, ...) gets None.
FAST_PATHS = {"dnas": _dnas, "hnas": _hnas, "sinkhorn": _sinkhorn}
# The parameters each kernel path handles; a spec declaring another one makes the path not apply.
HANDLED = {"dnas": set(), "hnas": {"u"}, "sinkhorn": {"iters", "tol"}}
