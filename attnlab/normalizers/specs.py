"""The registry of variants: each is declared once, as a :class:`VariantSpec`, and everything else
(argument checks in every entry point, ``attnlab.VARIANTS``, the transformers registration, hf
analysis, the statistics' bounds, the CLI's choices and flags, the app's picker and widgets, the
benchmark's cases, the docs table) is derived from the specs.

Adding a variant = one normalizer function + one :func:`register_variant` call (built-ins:
``attnlab/normalizers/builtin.py``). A separate package ships variants through the entry-point group
``attnlab.variants``: each entry point names a callable that registers its variants (or a
:class:`VariantSpec`); they load the first time the registry is read.
"""

from __future__ import annotations

import re
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from attnlab.normalizers.checks import check_number

__all__ = ["Param", "VariantSpec", "register_variant", "variant_spec", "variant_specs", "check_variant",
           "check_param", "check_params", "parameter_names", "unregister_variant", "VARIANTS",
           "DEFAULT_VARIANTS", "ENTRY_POINT_GROUP"]

ENTRY_POINT_GROUP = "attnlab.variants"


@dataclass(frozen=True)
class Param:
    """One parameter of a variant, e.g. HNAS's ``u`` or Sinkhorn's ``iters``."""

    name: str  # keyword in attend/attention_weights/hf.analyze, --flag in the CLI, widget in the app
    kind: type  # float or int
    default: float | int  # used when the caller gives none
    low: float | None = None  # inclusive lower bound (None: unbounded)
    high: float | None = None  # inclusive upper bound (None: unbounded)
    help: str = ""  # one line, shown by the CLI and the app
    per_head: bool = False  # may be a tensor per head (B, H, 1, 1) / per layer and head (L, H)

    def check(self, value):
        return check_number(self.name, value, kind=self.kind, low=self.low, high=self.high,
                            per_head=self.per_head)


# (params, given parameter names) -> params for causal use, or ValueError
CausalRule = Callable[[dict, frozenset], dict]


@dataclass(frozen=True)
class VariantSpec:
    """Everything attnlab knows about one variant."""

    name: str  # registry key: lowercase identifier
    normalizer: Callable  # pure (logits with -inf where masked, NormalizerContext) -> weights
    label: str = ""  # display name ("DNAS"); default: name.upper()
    summary: str = ""  # one line for the CLI, the app and the docs table
    reference: str = ""  # where it comes from (paper, equation)
    params: tuple[Param, ...] = ()
    # each valid column's mass >= column_floor(params) / N_valid (dnas: 1, hnas: u); None: no floor
    column_floor: Callable[[Mapping[str, Any]], Any] | None = None
    rows_sum_to_one: bool = True  # False: rows sum to <= 1 (e.g. softmax1's null key)
    causal_rule: CausalRule | None = None  # None: a causal mask is just a mask for this variant
    fused: Callable | None = None  # (q, k, v, mask, scale, ctx) -> out or None; None: materialized
    # attnlab.hf's fused analysis computes it (a bool, or a predicate of the params); else materialized
    hf_kernel: bool | Callable[[Mapping[str, Any]], bool] = False
    default: bool = False  # analysed by default (hf.analyze, the CLI, the app)
    builtin: bool = field(default=False, repr=False)

    @property
    def display(self) -> str:
        return self.label or self.name.upper()

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)


_REGISTRY: dict[str, VariantSpec] = {}
_lock = threading.RLock()
_entry_points = {"loaded": False, "errors": []}
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def register_variant(name: str, normalizer: Callable | None = None, *, replace: bool = False,
                     spec: VariantSpec | None = None, **fields) -> VariantSpec:
    """Register a variant: ``register_variant("mine", fn, params=(Param(...),), summary="...")``.

    ``normalizer(logits, ctx) -> weights`` takes (..., M, N) logits with -inf where masked and a
    :class:`~attnlab.normalizers.functions.NormalizerContext` (``ctx.causal``, ``ctx.<param>``), and
    returns weights of the same shape. After registration ``attend``, ``attention_weights``,
    ``hf.analyze(variants=[name])``, the statistics, the figures, the CLI and the app accept it.
    A registered name is refused unless ``replace=True`` (built-ins are never replaced).
    """
    if spec is None:
        if not callable(normalizer):
            raise ValueError(f"normalizer must be a callable (logits, ctx) -> weights, got {normalizer!r}")
        spec = VariantSpec(name=name, normalizer=normalizer, **fields)
    if not isinstance(spec.name, str) or not _NAME.match(spec.name):
        raise ValueError(f"name must be a lowercase identifier (e.g. 'my_variant'), got {spec.name!r}")
    for p in spec.params:
        if p.kind not in (int, float):
            raise ValueError(f"params: {p.name!r} must have kind int or float, got {p.kind!r}")
        p.check(p.default)
    with _lock:
        old = _REGISTRY.get(spec.name)
        if old is not None and (old.builtin or not replace):
            raise ValueError(f"name {spec.name!r} is already registered"
                             + ("" if old.builtin else "; pass replace=True to replace it"))
        _REGISTRY[spec.name] = spec
        VARIANTS._add(spec)
        DEFAULT_VARIANTS._add(spec)
    return spec


def unregister_variant(name: str) -> None:
    """Remove a registered (non-built-in) variant, e.g. after trying one out in a notebook."""
    spec = variant_spec(name)
    if spec.builtin:
        raise ValueError(f"name {name!r} is a built-in variant and cannot be removed")
    with _lock:
        del _REGISTRY[name]
        for names in (VARIANTS, DEFAULT_VARIANTS):
            if list.__contains__(names, name):
                list.remove(names, name)


def _load_entry_points() -> None:
    """Variants of installed packages (group ``attnlab.variants``), once; a broken one is warned."""
    if _entry_points["loaded"]:
        return
    with _lock:
        if _entry_points["loaded"]:
            return
        _entry_points["loaded"] = True
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                obj = ep.load()
                if isinstance(obj, VariantSpec):
                    if obj.name not in _REGISTRY:
                        register_variant(obj.name, spec=obj)
                else:
                    obj()
            except Exception as exc:  # noqa: BLE001 - a third-party plugin must not break attnlab
                _entry_points["errors"].append((ep.name, repr(exc)))
                warnings.warn(f"attnlab: variant entry point {ep.name!r} failed to load: {exc!r}",
                              stacklevel=2)


def reload_entry_points() -> None:
    """Read the entry points again (after installing a plugin package into a running process)."""
    _entry_points["loaded"] = False
    _load_entry_points()


def variant_specs() -> tuple[VariantSpec, ...]:
    """Every registered variant, in registration order (built-ins first)."""
    _load_entry_points()
    return tuple(_REGISTRY.values())


def check_variant(variant, name: str = "variant") -> str:
    _load_entry_points()
    if not isinstance(variant, str) or variant not in _REGISTRY:
        raise ValueError(f"{name} must be one of {tuple(_REGISTRY)}, got {variant!r}")
    return variant


def variant_spec(name: str) -> VariantSpec:
    return _REGISTRY[check_variant(name)]


def parameter_names() -> tuple[str, ...]:
    """Every parameter name any registered variant declares (the CLI's flags, attend's keywords)."""
    names: dict[str, None] = {}
    for spec in variant_specs():
        names.update(dict.fromkeys(p.name for p in spec.params))
    return tuple(names)


def _declaration(name: str) -> Param | None:
    return next((p for s in variant_specs() for p in s.params if p.name == name), None)


def check_param(name: str, value):
    """One parameter checked against its declaration (whichever variant declares it)."""
    decl = _declaration(name)
    if decl is None:
        raise ValueError(f"{name} is not a parameter of any variant (known: {parameter_names()})")
    return decl.check(value)


def check_params(variant: str, params: Mapping[str, Any] | None = None, *, causal: bool = False) -> dict:
    """The validated parameters of ``variant``, defaults filled in, the causal rule applied.

    ``params`` may hold parameters of other variants (``attend(..., "dnas", u=0.3)``): they are
    checked against their own declaration and then ignored; None values count as not given. A name
    no registered variant declares is a ValueError.
    """
    spec = variant_spec(variant)
    given = {k: v for k, v in (params or {}).items() if v is not None}
    out: dict[str, Any] = {}
    for key, value in given.items():
        decl = spec.param(key)
        checked = decl.check(value) if decl is not None else check_param(key, value)
        if spec.param(key) is not None:
            out[key] = checked
    for p in spec.params:
        out.setdefault(p.name, p.default)
    if causal and spec.causal_rule is not None:
        out = spec.causal_rule(out, frozenset(k for k in given if spec.param(k) is not None))
    return out


class _Names(list):
    """The registered variant names, live and read-only: a variant registered later appears in it.

    A list underneath (so that pandas, numpy and Streamlit take it as they take a list), equal to the
    tuple of its names, hashable; installed plugins (entry points) are loaded on first read.
    """

    def __init__(self, only_default: bool = False):
        super().__init__()
        self._only_default = only_default

    def _add(self, spec: VariantSpec) -> None:
        if (spec.default or not self._only_default) and spec.name not in list(list.__iter__(self)):
            list.append(self, spec.name)

    def __iter__(self):
        _load_entry_points()
        return super().__iter__()

    def __len__(self) -> int:
        _load_entry_points()
        return super().__len__()

    def __getitem__(self, i):
        _load_entry_points()
        return super().__getitem__(i)

    def __contains__(self, name) -> bool:
        _load_entry_points()
        return super().__contains__(name)

    def __eq__(self, other) -> bool:
        return isinstance(other, (list, tuple)) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __add__(self, other):
        return tuple(self) + tuple(other)

    def __repr__(self) -> str:
        return repr(tuple(self))

    def _read_only(self, *args, **kwargs):
        raise TypeError("attnlab.VARIANTS is read-only: add a variant with attnlab.register_variant")

    append = extend = insert = remove = pop = clear = sort = reverse = _read_only
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _read_only


VARIANTS = _Names()  # every registered variant
DEFAULT_VARIANTS = _Names(only_default=True)  # analysed when the caller names none (the paper's four)
