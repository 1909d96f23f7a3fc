"""The variant registry as the sidebar sees it: every registered variant's parameters, and the
bridge from their values to what today's analysis pipeline takes.

The widgets are built from ``attnlab.variant_specs()`` (one per ``Param``: kind, default, bounds,
help). Until the registry is on this branch, :func:`param_specs` describes today's two parameters
(HNAS ``u``, Sinkhorn ``iters``) in the registry's own terms; delete ``_BEFORE_REGISTRY`` on merge.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import attnlab


@dataclass(frozen=True)
class _Param:  # the fields of attnlab.Param that the sidebar reads
    name: str
    kind: type
    default: float | int
    low: float | int | None
    high: float | int | None
    help: str


_BEFORE_REGISTRY = {  # variant -> its parameters, as the registry will describe them
    "hnas": (_Param("u", float, 0.5, 0.0, 1.0, "u·DNAS + (1-u)·UNAS; column mass >= u/N"),),
    "sinkhorn": (_Param("iters", int, 3, 1, 20, "Sinkhorn normalisation iterations"),),
}


def param_specs() -> Iterator[tuple[str, object]]:
    """(variant name, Param) for every parameter of every registered variant, registry order."""
    if hasattr(attnlab, "variant_specs"):
        for spec in attnlab.variant_specs():
            for p in spec.params:
                yield spec.name, p
        return
    for name in attnlab.VARIANTS:
        for p in _BEFORE_REGISTRY.get(name, ()):
            yield name, p


def variant_label(name: str) -> str:
    """The registry's display label ("DNAS"), else the upper-cased name."""
    if hasattr(attnlab, "variant_spec"):
        return attnlab.variant_spec(name).label
    return {"sinkhorn": "Sinkhorn"}.get(name, name.upper())


def pipeline_fields(params: Mapping[str, Mapping[str, object]]) -> dict:
    """{variant: {param: value}} -> the ``u`` and ``iters`` the analysis pipeline takes today
    (``appkit.analysis.Settings``); a variant not chosen keeps its default."""
    defaults = {(v, p.name): p.default for v, p in param_specs()}
    return {
        "u": float(params.get("hnas", {}).get("u", defaults.get(("hnas", "u"), 0.5))),
        "iters": int(params.get("sinkhorn", {}).get("iters", defaults.get(("sinkhorn", "iters"), 3))),
    }
