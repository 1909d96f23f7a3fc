"""A variant's parameters as keyword arguments of :func:`attnlab.attend`, validated.

The variant registry (``attnlab.check_params``) is the one place that knows each variant's
parameters; until it exists in this checkout the two parameters of the built-in variants (HNAS ``u``,
Sinkhorn ``iters``) are checked here with the same rules as :func:`attnlab.hf.use_variant`.
"""

from __future__ import annotations

from collections.abc import Mapping

import attnlab
from attnlab.hf.interface import DEFAULT_ITERS, DEFAULT_U

__all__ = ["variant_kwargs"]

_LEGACY = {"hnas": {"u": DEFAULT_U}, "sinkhorn": {"iters": DEFAULT_ITERS}}


def variant_kwargs(variant: str, params: Mapping | None, *, causal: bool = False) -> dict:
    """Validated parameters of ``variant`` with defaults filled in (ValueError naming a bad one).
    Causal Sinkhorn uses iters = 1 (DESIGN.md §2)."""
    params = dict(params or {})
    check = getattr(attnlab, "check_params", None)
    if check is not None:
        return dict(check(variant, params, causal=causal))
    if variant not in attnlab.VARIANTS:
        raise ValueError(f"variant must be one of {tuple(attnlab.VARIANTS)}, got {variant!r}")
    known = _LEGACY.get(variant, {})
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ValueError(f"params for {variant!r} may hold {sorted(known) or 'nothing'}, got {unknown}")
    out = {**known, **params}
    if "u" in out:
        u = out["u"]
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 <= float(u) <= 1.0:
            raise ValueError(f"params['u'] must be a float in [0, 1], got {u!r}")
        out["u"] = float(u)
    if "iters" in out:
        it = out["iters"]
        if isinstance(it, bool) or not isinstance(it, int) or it < 1:
            raise ValueError(f"params['iters'] must be an integer >= 1, got {it!r}")
        out["iters"] = 1 if causal else it
    return out
