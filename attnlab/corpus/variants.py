"""Variants and their parameters for a corpus run, read from attnlab's variant registry.

The one place the corpus package learns which variants exist (``attnlab.VARIANTS``) and what
parameters they take (``attnlab.variant_specs()``): the CLI grows one flag per parameter, and a run's
parameters are checked by the registry (``attnlab.check_params``) with defaults filled in, so the
manifest records every value used.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["ParamFlag", "param_flags", "resolve", "all_variants"]


@dataclass(frozen=True)
class ParamFlag:
    """A variant parameter as a command-line flag."""

    name: str  # keyword of hf.analyze (u, iters, ...)
    kind: type  # float | int
    default: object
    help: str
    variants: tuple[str, ...]  # variants that take it


def all_variants() -> tuple[str, ...]:
    import attnlab

    return tuple(attnlab.VARIANTS)


def param_flags() -> list[ParamFlag]:
    """Every parameter of every registered variant (merged by name, registration order)."""
    import attnlab

    flags: dict[str, ParamFlag] = {}
    for spec in attnlab.variant_specs():
        for p in spec.params:
            old = flags.get(p.name)
            used = (old.variants if old else ()) + (spec.name,)
            flags[p.name] = ParamFlag(p.name, p.kind, p.default, p.help, used)
    return list(flags.values())


def resolve(variants: Sequence[str] | str | None, params: Mapping[str, object] | None,
            mode: str = "recompute", info=None) -> tuple[tuple[str, ...], dict]:
    """-> (variants, their parameters with defaults filled); ValueError naming a bad argument.

    ``variants`` None or "all": every registered variant. Parameters must be plain numbers (the
    manifest is JSON): a per-head tensor is refused.
    """
    import attnlab
    from attnlab.hf.compute.weights import check_arguments
    from attnlab.normalizers.checks import plain_number

    params = {name: plain_number(value) for name, value in (params or {}).items()}  # numpy: Python
    known = {f.name for f in param_flags()}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"params: {unknown} are not parameters of any variant; known: {sorted(known)}")
    for name, value in params.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"params: {name} must be a number for a corpus run (the manifest is JSON), "
                             f"got {type(value).__name__}")
    if variants is None or (isinstance(variants, str) and variants in ("", "all")):
        variants = all_variants()
    names, given = check_arguments(variants, mode, params, info)
    full: dict = {}
    for v in names:
        spec = attnlab.variant_spec(v)
        mine = {p.name: given[p.name] for p in spec.params if given.get(p.name) is not None}
        full.update(attnlab.check_params(v, mine, causal=bool(info is not None and info.causal)))
    return names, {k: (float(v) if isinstance(v, float) else v) for k, v in full.items()}
