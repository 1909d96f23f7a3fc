"""Command-line options derived from the variant registry, shared by every subcommand that runs
variants (``attnlab analyze``, ``attnlab corpus``, ...): ``--variants`` and one ``--<param>`` flag per
declared parameter (``--u``, ``--iters``, ``--tol``, and those of registered plugins).
"""

from __future__ import annotations

import argparse

from attnlab.normalizers import DEFAULT_VARIANTS, VARIANTS, variant_specs

__all__ = ["add_variant_arguments", "variant_params", "parse_variants"]


def add_variant_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--variants`` and a flag per variant parameter (default None: the spec's default)."""
    names = ", ".join(VARIANTS)
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated variants among {names} (default: "
                             f"{','.join(DEFAULT_VARIANTS)})")
    seen: set[str] = set()
    for spec in variant_specs():
        for p in spec.params:
            if p.name in seen:
                continue
            seen.add(p.name)
            bounds = "" if p.low is None and p.high is None else (
                f"; range [{'-inf' if p.low is None else f'{p.low:g}'}, "
                f"{'inf' if p.high is None else f'{p.high:g}'}]")
            parser.add_argument(f"--{p.name.replace('_', '-')}", dest=p.name, type=p.kind, default=None,
                                help=f"{spec.display}: {p.help} (default: {p.default:g}{bounds})")


def variant_params(args: argparse.Namespace) -> dict:
    """The parameters given on the command line (flags left out are not given: the specs' defaults
    and causal rules apply in the library)."""
    seen = {p.name for s in variant_specs() for p in s.params}
    return {name: getattr(args, name) for name in seen if getattr(args, name, None) is not None}


def parse_variants(value: str) -> tuple[str, ...]:
    """'unas,dnas' -> ('unas', 'dnas'); ValueError naming --variants for anything else."""
    items = tuple(dict.fromkeys(v.strip().lower() for v in value.split(",") if v.strip()))
    bad = [v for v in items if v not in VARIANTS]
    if not items or bad:
        raise ValueError(f"--variants must be a comma-separated subset of {','.join(VARIANTS)}, "
                         f"got {value!r}")
    return items
