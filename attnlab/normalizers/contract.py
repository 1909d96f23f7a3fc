"""What a registered variant's normalizer must return, checked where attnlab first uses it.

A normalizer registered with :func:`~attnlab.normalizers.specs.register_variant` is someone else's
code: before its weights reach the statistics, the figures or a model, :func:`check_output` holds them
to the spec (docs/DESIGN.md §2, §4):

- a floating ``torch.Tensor`` of the logits' shape, on their device (checked on every call: metadata
  only, no pass over the data);
- values (checked on the first call with finite scores, then never again for that spec in this
  process): weights >= 0, 0 at masked entries (score -inf), finite, and each row with a valid key
  summing to 1 (``rows_sum_to_one``) or to at most 1 (``rows_sum_to_one=False``: softmax1's null key).

The built-in variants are tested (tests/test_normalizers.py) and skip the check. A spec registered
again (``replace=True``) is a new spec and is checked again. Errors are ValueErrors naming the
variant, what was expected and what was seen.
"""

from __future__ import annotations

import threading

import torch

from attnlab.normalizers.specs import VariantSpec

__all__ = ["check_output", "row_sum_tolerance"]

# spec name -> the spec whose values passed (a replaced spec is a new object: checked again)
_verified: dict[str, VariantSpec] = {}
_lock = threading.Lock()


def row_sum_tolerance(dtype: torch.dtype, n_keys: int) -> float:
    """|sum_j pi_ij - 1| allowed for a row of ``n_keys`` keys: rounding of a float sum, generously."""
    eps = torch.finfo(dtype).eps
    return max(1e-3 if dtype != torch.float64 else 1e-9, 8.0 * n_keys * eps)


def _fail(spec: VariantSpec, expected: str, seen: str) -> None:
    raise ValueError(f"variant {spec.name!r}: its normalizer must return {expected}, got {seen}")


def check_shape(spec: VariantSpec, logits: torch.Tensor, weights) -> None:
    """Type, dtype, shape and device of a normalizer's output (no pass over the data)."""
    if not isinstance(weights, torch.Tensor):
        _fail(spec, f"a torch.Tensor of weights of shape {tuple(logits.shape)}", type(weights).__name__)
    if weights.shape != logits.shape:
        _fail(spec, f"weights of the logits' shape {tuple(logits.shape)}", f"shape {tuple(weights.shape)}")
    if not weights.is_floating_point():
        _fail(spec, f"floating-point weights (the logits are {logits.dtype})", f"dtype {weights.dtype}")
    if weights.device != logits.device:
        _fail(spec, f"weights on the logits' device {logits.device}", f"device {weights.device}")


@torch.no_grad()
def check_values(spec: VariantSpec, logits: torch.Tensor, weights: torch.Tensor) -> bool:
    """The spec's guarantees on the values; True when they could all be checked (finite logits)."""
    w = weights.detach()
    valid = logits.detach() != float("-inf")  # masked entries are -inf (NaN and +inf are not masks)
    finite_in = not bool((torch.isnan(logits) | torch.isposinf(logits)).any())
    negative = w < 0
    if bool(negative.any()):
        _fail(spec, "weights >= 0", f"{int(negative.sum())} negative weight(s), the smallest "
              f"{float(w[negative].min()):.4g}")
    masked = ~valid & (w != 0)  # NaN != 0 holds too: a NaN at a masked entry is caught here
    if bool(masked.any()):
        _fail(spec, "weight 0 at masked entries (score -inf)",
              f"{int(masked.sum())} masked entr(y/ies) with weight != 0, e.g. {float(w[masked][0]):.4g}")
    if not finite_in:
        return False  # NaN / +inf scores: NaN weights are the rule there, the rest waits for finite ones
    bad = ~torch.isfinite(w)
    if bool(bad.any()):
        _fail(spec, "finite weights for finite scores",
              f"{int(bad.sum())} of {w.numel()} weight(s) NaN or infinite")
    rows = w.to(torch.float64).sum(-1)  # (..., M)
    has_key = valid.any(-1)
    tol = row_sum_tolerance(w.dtype, w.shape[-1])
    if spec.rows_sum_to_one:
        off = has_key & ((rows - 1.0).abs() > tol)
        expected = "rows summing to 1 (its spec's rows_sum_to_one)"
    else:
        off = has_key & (rows > 1.0 + tol)
        expected = "rows summing to at most 1 (its spec's rows_sum_to_one=False)"
    if bool(off.any()):
        sums = rows[off]
        _fail(spec, expected, f"{int(off.sum())} row(s) summing to {float(sums.min()):.6g}"
              + (f" ... {float(sums.max()):.6g}" if sums.numel() > 1 else ""))
    return True


def check_output(spec: VariantSpec, logits: torch.Tensor, weights) -> None:
    """Hold a registered variant's output to its spec (module docstring): the shape on every call,
    the values on the first call with finite scores. Built-in variants are not checked."""
    if spec.builtin:
        return
    check_shape(spec, logits, weights)
    if _verified.get(spec.name) is spec or weights.numel() == 0 or torch.compiler.is_compiling():
        return
    if weights.device.type == "meta":
        return
    if check_values(spec, logits, weights):
        with _lock:
            _verified[spec.name] = spec
