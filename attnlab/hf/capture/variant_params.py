"""A variant's parameters as keyword arguments of :func:`attnlab.attend` / :func:`attnlab.hf.use_variant`,
validated by the registry (``attnlab.check_params``: defaults filled in, the causal rule applied)."""

from __future__ import annotations

from collections.abc import Mapping

import attnlab

__all__ = ["variant_kwargs"]


def variant_kwargs(variant: str, params: Mapping | None, *, causal: bool = False) -> dict:
    """Validated parameters of ``variant`` (ValueError naming a bad one or an unknown variant)."""
    if variant not in attnlab.VARIANTS:
        raise ValueError(f"variant must be one of {tuple(attnlab.VARIANTS)}, got {variant!r}")
    return dict(attnlab.check_params(variant, dict(params or {}), causal=causal))
