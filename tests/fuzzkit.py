"""Shared pieces of the property-based fuzz suite (tests/test_fuzz*.py): float64 references written
from the equations, tensors as views of every kind, masks of every broadcastable shape, and the one
assertion every case ends in (the reference's result within a stated tolerance, or a ValueError that
names the argument).

Tolerances (``tolerance``): |got - ref| <= base + rel * max|s| per dtype, where s are the scores:
float64 1e-9 + 1e-12 max|s|; float32 3e-5 + 3e-6 max|s| (normalization in float32); float16 3e-3 and
bfloat16 2e-2 (the result is rounded to half precision) + 3e-6 max|s|.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

F64 = torch.float64
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
VIEWS = ("contiguous", "strided", "transposed", "expanded", "sliced")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The fuzz cases are hundreds of tiny problems: on a loaded 2-core machine, waking a second
    torch thread for each costs more than the problem (seconds per case at load 13). One thread
    here; the multi-threaded paths are covered by the other test modules."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def fuzz_settings(n: int):
    """Seeded hypothesis settings with ``n`` examples, no per-example deadline (the time is bounded by
    the inputs' sizes) and no shrinking: a failure reports the first failing example as drawn, which
    keeps the cases the normalizers' owner is fixing (xfail) as cheap as the passing ones."""
    return settings(
        derandomize=True,
        deadline=None,
        max_examples=n,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        report_multiple_bugs=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def tolerance(dtype: torch.dtype, smax: float = 0.0) -> float:
    base = {torch.float64: 1e-9, torch.float32: 3e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    rel = 1e-12 if dtype == torch.float64 else 3e-6
    return base + rel * smax


# ----------------------------------------------------------------------------------------------
# Tensors as views
# ----------------------------------------------------------------------------------------------


def view_of(values: torch.Tensor, kind: str) -> torch.Tensor:
    """A tensor equal to ``values`` whose memory layout is of ``kind``: a contiguous copy, every other
    element of a wider buffer (last-dim stride 2), the transpose of a transposed buffer, an expanded
    size-1 dim (when ``values`` is constant along dim 0), or a slice of a larger batch."""
    shape = tuple(values.shape)
    if kind == "strided" and values.dim() >= 1:
        buf = torch.zeros(*shape[:-1], 2 * shape[-1], dtype=values.dtype)
        buf[..., ::2] = values
        return buf[..., ::2]
    if kind == "transposed" and values.dim() >= 2:
        return values.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kind == "sliced" and values.dim() >= 1:
        buf = torch.zeros(2 * shape[0] + 1, *shape[1:], dtype=values.dtype)
        buf[1::2] = values
        return buf[1::2]
    return values.contiguous()


def tensor(gen: torch.Generator, shape, dtype, kind: str, scale: float = 1.0) -> torch.Tensor:
    """Random normal values of ``shape`` in ``dtype`` laid out as ``kind`` (see :func:`view_of`).
    "expanded" repeats one slice along dim 0 with stride 0."""
    shape = tuple(shape)
    if kind == "expanded" and len(shape) >= 1:
        one = (torch.randn(1, *shape[1:], generator=gen, dtype=F64) * scale).to(dtype)
        return one.expand(shape)
    x = (torch.randn(*shape, generator=gen, dtype=F64) * scale).to(dtype)
    return view_of(x, kind)


def ref64(t: torch.Tensor) -> torch.Tensor:
    """The float64 contiguous copy a reference is computed on."""
    return t.detach().to(F64).contiguous()


# ----------------------------------------------------------------------------------------------
# Masks of every shape
# ----------------------------------------------------------------------------------------------


def broadcastable_shapes(B, H, M, N):
    """Shapes that broadcast to (B, H, M, N)."""
    return [
        (),
        (N,),
        (M, 1),
        (M, N),
        (1, N),
        (1, 1),
        (B, 1, 1, N),
        (B, 1, M, 1),
        (1, H, M, N),
        (H, 1, N),
        (B, H, M, N),
        (1, 1, 1, 1),
    ]


def non_broadcastable_shapes(B, H, M, N):
    """Shapes that do not broadcast to (B, H, M, N) (each differs from it in a dim of size != 1)."""
    out = [(N + 2,), (M + 2, N), (B + 2, 1, 1, N), (2, B, H, M, N), (H + 2, M, N), (M, N, 1)]
    return [s for s in out if not _broadcasts(s, (B, H, M, N))]


def _broadcasts(shape, target) -> bool:
    try:
        return tuple(torch.broadcast_shapes(shape, target)) == tuple(target)
    except RuntimeError:
        return False


def random_mask(gen: torch.Generator, shape, p: float = 0.7) -> torch.Tensor:
    return torch.rand(tuple(shape), generator=gen) < p


# ----------------------------------------------------------------------------------------------
# Float64 references of the normalizers (log space; NaN propagates as torch ops propagate it)
# ----------------------------------------------------------------------------------------------


def _minus(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """x - c, keeping masked entries (-inf) at -inf."""
    return torch.where(torch.isneginf(x), x, x - c)


def _row_norm(x):
    return _minus(x, torch.logsumexp(x, -1, keepdim=True))


def _col_norm(x, causal=False):
    c = torch.logcumsumexp(x, -2) if causal else torch.logsumexp(x, -2, keepdim=True)
    return _minus(x, c)


def logits_of(scores64, mask, causal):
    """Scores with -inf at masked entries (and above the diagonal when causal)."""
    M, N = scores64.shape[-2:]
    valid = torch.ones(scores64.shape, dtype=torch.bool) if mask is None else mask.expand(scores64.shape)
    if causal:
        valid = valid & torch.ones(M, N, dtype=torch.bool).tril()
    return scores64.masked_fill(~valid, float("-inf"))


def ref_weights(scores64, variant, mask=None, causal=False, u=0.5, iters=1):
    """Literal float64 weights of the four paper variants (Eqs. 1, 5, 10, 12) from float64 scores."""
    x = logits_of(scores64, mask, causal)
    if variant == "unas":  # Eq. 1
        return _row_norm(x).exp()
    if variant == "dnas":  # Eq. 5
        return _row_norm(_col_norm(x, causal)).exp()
    if variant == "hnas":  # Eq. 12
        w = torch.as_tensor(u, dtype=F64)
        return w * ref_weights(scores64, "dnas", mask, causal) + (1 - w) * ref_weights(
            scores64, "unas", mask, causal
        )
    if variant == "sinkhorn":  # Eq. 10
        for _ in range(iters):
            x = _row_norm(_col_norm(x, causal))
        return x.exp()
    raise KeyError(variant)


def ref_column_lse(s64, mask=None, bias=None):
    """c_j = logsumexp over valid i of (s_ij + b_i); 0 for a column without a valid query."""
    x = s64 if bias is None else s64 + bias[..., :, None]
    x = logits_of(x, mask, False)
    c = torch.logsumexp(x, -2)
    return torch.where(torch.isneginf(c), torch.zeros_like(c), c)


# ----------------------------------------------------------------------------------------------
# The one assertion
# ----------------------------------------------------------------------------------------------


def names_argument(exc: BaseException, names) -> bool:
    """Whether the message of ``exc`` names one of ``names`` (as a word: ``u`` is not in "must")."""
    msg = str(exc)
    return any(re.search(rf"(?<![A-Za-z_]){re.escape(n)}(?![A-Za-z_])", msg) for n in names)


def assert_value_error(fn, names, label=""):
    """fn() must raise ValueError whose message names one of ``names``; any other outcome fails."""
    try:
        fn()
    except ValueError as e:
        assert names_argument(e, names), f"{label}: ValueError does not name any of {names}: {e}"
        return str(e)
    except Exception as e:  # noqa: BLE001 - the point: never another exception type
        raise AssertionError(
            f"{label}: expected ValueError naming {names}, got {type(e).__name__}: {e}"
        ) from e
    raise AssertionError(f"{label}: expected ValueError naming {names}, got a result")


def assert_close_or_nan(
    got: torch.Tensor, ref: torch.Tensor, tol: float, label: str = "", masked: torch.Tensor | None = None
) -> None:
    """got equals ref within tol where ref is finite, and is NaN exactly where ref is NaN (a NaN-
    influenced entry at a masked position may also be 0). Shapes must agree."""
    assert tuple(got.shape) == tuple(ref.shape), f"{label}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    g = got.detach().to(F64)
    ref_nan = ref.isnan()
    got_nan = g.isnan()
    allowed_zero = ref_nan & (masked if masked is not None else torch.zeros_like(ref_nan)) & (g == 0)
    missing = ref_nan & ~got_nan & ~allowed_zero
    assert not bool(missing.any()), (
        f"{label}: finite value where NaN must propagate at {missing.nonzero()[:3].tolist()}"
    )
    extra = got_nan & ~ref_nan
    assert not bool(extra.any()), f"{label}: NaN from finite inputs at {extra.nonzero()[:3].tolist()}"
    fin = ~ref_nan
    if bool(fin.any()):
        err = (g[fin] - ref[fin]).abs().max().item()
        assert err <= tol, f"{label}: max |got - ref| = {err:.3g} > tolerance {tol:.3g}"


def numpy_or_python(draw, value: float, integer: bool = False):
    """The same number as a Python, numpy or 0-dim-array scalar."""
    kinds = ["python", "np64", "np32"] if not integer else ["python", "np64", "np32"]
    kind = draw(st.sampled_from(kinds))
    if integer:
        return {"python": int(value), "np64": np.int64(value), "np32": np.int32(value)}[kind]
    return {"python": float(value), "np64": np.float64(value), "np32": np.float32(value)}[kind]
