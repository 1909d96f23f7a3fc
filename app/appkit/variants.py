"""The variant registry as the sidebar sees it: every registered variant's parameters (one widget
each, from ``attnlab.variant_specs()``), and their values as the analysis takes them."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import attnlab

PIPELINE_FIELDS = ("u", "iters")  # parameters that are fields of appkit.analysis.Settings


def param_specs() -> Iterator[tuple[str, attnlab.Param]]:
    """(variant name, Param) for every parameter of every registered variant, in registry order.
    Parameters are one namespace (``u``, ``iters``, ``tol``, ... as in the CLI's flags): a name
    declared by two variants gets one widget, under the first."""
    seen = set()
    for spec in attnlab.variant_specs():
        for p in spec.params:
            if p.name not in seen:
                seen.add(p.name)
                yield spec.name, p


def variant_label(name: str) -> str:
    """The registry's display name ("DNAS", "Sinkhorn")."""
    return attnlab.variant_spec(name).display


def settings_fields(values: Mapping[str, object]) -> dict:
    """{param name: value} of the rendered widgets -> Settings' ``u``, ``iters`` and ``extra``
    (every other parameter, as sorted (name, value) pairs); parameters without a widget (their
    variant is not chosen) take the spec's default."""
    full = {p.name: values.get(p.name, p.default) for _, p in param_specs()}
    return {
        "u": float(full.get("u", 0.5)),
        "iters": int(full.get("iters", 3)),
        "extra": tuple(sorted((k, v) for k, v in full.items() if k not in PIPELINE_FIELDS)),
    }
