"""Argument checks shared by every entry point (attend, attention_weights, modules, models, hf, stats,
CLI, app): one function per kind of argument. Each error is a ValueError that names the argument, what
was expected and what was seen (docs/DESIGN.md §4).

Numbers: Python and numpy scalars (``np.float32(0.5)``, ``np.int64(3)``) and 0-d tensors are ordinary
inputs; bool is not a number here. NaN is refused wherever a number is asked for.
"""

from __future__ import annotations

import math
import numbers

import torch

__all__ = ["check_float_tensor", "check_mask", "check_scale", "check_number", "check_head_shape",
           "plain_number", "scalar"]


def scalar(value):
    """A Python int/float for a Python, numpy or 0-d tensor number; the value itself otherwise."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point() \
            and value.dtype != torch.bool:
        return int(value)
    if isinstance(value, bool) or isinstance(value, torch.Tensor):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def plain_number(value):
    """:func:`scalar`, and a floating 0-d tensor's float too: for an argument that is one number, never
    a per-head tensor (``scalar`` keeps floating tensors, which may carry u's gradient)."""
    value = scalar(value)
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point() \
            and value.device.type != "meta":
        return float(value)
    return value


def check_float_tensor(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    return t


def check_mask(mask, shape: torch.Size, name: str = "mask") -> torch.Tensor | None:
    """A boolean mask broadcastable to ``shape`` (True = may attend), left-padded to its rank."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        seen = f"dtype {mask.dtype}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"{name} must be a boolean tensor (True = may attend), got {seen}")
    if mask.dim() > len(shape):
        raise ValueError(f"{name} of shape {tuple(mask.shape)} has more dims than the scores' shape "
                         f"{tuple(shape)}")
    try:
        ok = torch.broadcast_shapes(mask.shape, shape) == shape
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"{name} of shape {tuple(mask.shape)} does not broadcast to the scores' shape "
                         f"{tuple(shape)}")
    while mask.dim() < len(shape):
        mask = mask.unsqueeze(0)
    return mask


def check_scale(scale, default: float) -> float:
    """The score scale: a finite number > 0 (default: ``default``, i.e. 1/sqrt(D))."""
    if scale is None:
        return default
    value = plain_number(scale)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r} ({type(scale).__name__})")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"scale must be a finite number > 0, got {value!r}")
    return float(value)


def _range_text(kind: type, low, high) -> str:
    what = "an integer" if kind is int else "a number"
    if low is not None and high is not None:
        return f"{what} in [{low:g}, {high:g}]"
    if low is not None:
        return f"{what} >= {low:g}"
    if high is not None:
        return f"{what} <= {high:g}"
    return what


def check_number(name: str, value, *, kind: type = float, low=None, high=None, per_head: bool = False):
    """A parameter value: a Python/numpy number (int for ``kind=int``) in [low, high], or, when
    ``per_head``, a floating tensor of such values (shape checked by the caller, check_head_shape).

    Returns a Python float/int or the tensor. One host sync for a tensor (its min and max).
    """
    expected = _range_text(kind, low, high)
    v = scalar(value)
    if isinstance(v, torch.Tensor) and v.dim() == 0 and not per_head and v.device.type != "meta" \
            and v.dtype != torch.bool:
        v = v.item()  # a 0-d tensor where a number is asked for: its number
    if isinstance(v, torch.Tensor):
        if not per_head:
            raise ValueError(f"{name} must be {expected}, got a tensor of shape {tuple(v.shape)}")
        if not v.is_floating_point():
            raise ValueError(f"{name} must be {expected} or a floating tensor of them, got dtype {v.dtype}")
        if v.device.type == "meta":
            raise ValueError(f"{name} must be a tensor with data (not on the meta device)")
        if v.numel() and not torch.compiler.is_compiling():
            lo, hi = float(v.detach().min()), float(v.detach().max())
            if math.isnan(lo) or math.isnan(hi):  # min/max propagate NaN
                raise ValueError(f"{name} must be {expected}, got a tensor containing NaN")
            if (low is not None and lo < low) or (high is not None and hi > high):
                raise ValueError(f"{name} must be {expected}, got values in [{lo:g}, {hi:g}]")
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name} must be {expected}, got {value!r} ({type(value).__name__})")
    if kind is int:
        if isinstance(v, float):
            if not v.is_integer():
                raise ValueError(f"{name} must be {expected}, got {value!r}")
            v = int(v)
    else:
        v = float(v)
        if math.isnan(v):
            raise ValueError(f"{name} must be {expected}, got NaN")
    if (low is not None and v < low) or (high is not None and v > high):
        raise ValueError(f"{name} must be {expected}, got {v!r}")
    return v


def check_head_shape(name: str, value, shape: tuple[int, ...], what: str):
    """A per-head tensor must broadcast to ``shape`` (e.g. (B, H, 1, 1) or (L, H)) without being
    broadcast itself against other dimensions; a Python number passes unchanged."""
    if not isinstance(value, torch.Tensor):
        return value
    ok = value.dim() <= len(shape)
    if ok:
        try:
            ok = torch.broadcast_shapes(value.shape, shape) == torch.Size(shape)
        except RuntimeError:
            ok = False
    if not ok:
        raise ValueError(f"{name} must be a number or a tensor broadcastable to {what} {tuple(shape)}, "
                         f"got shape {tuple(value.shape)}")
    return value
