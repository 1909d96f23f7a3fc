"""Variants and their parameters for a corpus run, read from attnlab's variant registry.

The one place the corpus package learns which variants exist and what parameters they take: the
registry's specs when attnlab has them (``attnlab.variant_specs()``), else ``attnlab.VARIANTS`` with
the two parameters it had before (u: HNAS hybrid weight, iters: Sinkhorn iterations).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["ParamFlag", "param_flags", "resolve"]


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
    """Every parameter of every registered variant (merged by name)."""
    import attnlab

    specs = getattr(attnlab, "variant_specs", None)
    if specs is None:
        from attnlab.hf.interface import DEFAULT_ITERS, DEFAULT_U

        return [ParamFlag("u", float, DEFAULT_U, "HNAS hybrid weight u in [0, 1]", ("hnas",)),
                ParamFlag("iters", int, DEFAULT_ITERS, "Sinkhorn iterations (>= 1)", ("sinkhorn",))]
    flags: dict[str, ParamFlag] = {}
    for spec in specs():
        for p in spec.params:
            old = flags.get(p.name)
            used = (old.variants if old else ()) + (spec.name,)
            flags[p.name] = ParamFlag(p.name, p.kind, p.default, p.help, used)
    return list(flags.values())


def resolve(variants: Sequence[str] | str | None, params: Mapping[str, object] | None,
            mode: str = "recompute") -> tuple[tuple[str, ...], dict]:
    """-> (variants, parameters with defaults filled); ValueError naming a bad argument."""
    from attnlab.hf.weights import check_arguments

    known = {f.name: f for f in param_flags()}
    params = dict(params or {})
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ValueError(f"params: {unknown} are not parameters of any variant; known: {sorted(known)}")
    if variants is None or (isinstance(variants, str) and variants in ("", "all")):
        variants = all_variants()
    full = {name: params.get(name, f.default) for name, f in known.items()}
    import attnlab

    if hasattr(attnlab, "check_params"):
        chosen = check_arguments(variants, mode, **{k: v for k, v in full.items() if k in ("u", "iters")}) \
            if _legacy_check() else _check_names(variants, mode)
        for v in chosen:
            wanted = {k: full[k] for k in known if v in known[k].variants}
            full.update(attnlab.check_params(v, wanted))
        return chosen, full
    return check_arguments(variants, mode, full["u"], full["iters"]), full


def _legacy_check() -> bool:
    import inspect

    from attnlab.hf.weights import check_arguments

    return {"u", "iters"} <= set(inspect.signature(check_arguments).parameters)


def _check_names(variants, mode):
    from attnlab.hf.weights import check_arguments

    return check_arguments(variants, mode)
