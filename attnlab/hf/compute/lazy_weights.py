"""Attention weights computed on first access: the fused analysis (attnlab/hf/compute/fused_sums.py) takes the
statistics' row sums without writing any weights, and keeps only each layer's q and k; a variant's
(L, H, N, N) weights are computed from them, by the same call that would have written them
together with the sums (so with the same values), when something reads ``weights[variant]``, and
kept afterwards.

:class:`LazyWeights` is a ``dict`` (``isinstance(w, dict)``, ``dict(w)``, ``{**w}``, ``w.items()``,
pickling and safetensors all see tensors): only reading a value computes it; ``items()`` and
``values()`` compute every missing variant in one pass.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import torch

__all__ = ["LazyWeights", "batch_item", "fingerprint", "stored"]


class _Pending:
    """The stored value of a variant whose weights are not computed yet (never handed out)."""

    def __repr__(self) -> str:
        return "<not computed yet>"


_PENDING = _Pending()


class LazyWeights(dict):
    """variant -> weights tensor, each computed by ``compute(names) -> {name: tensor}`` on first read.

    Writing (``w[v] = t``, ``del w[v]``, ``update``, ``pop``, ...) behaves as on a dict; it and any
    in-place change of a computed tensor show in :meth:`fingerprint`, so statistics computed with
    the weights are known to be stale (attnlab/hf/analysis/results.py)."""

    def __init__(self, names: Iterable[str], compute: Callable[[tuple[str, ...]], dict]):
        super().__init__(dict.fromkeys(names, _PENDING))
        self._compute = compute
        self._lock = threading.RLock()  # two threads reading one variant compute it once
        self._born: dict[str, tuple[int, int]] = {}  # name -> (id, _version) when computed
        self._edits = 0

    # -- computing ---------------------------------------------------------------------------
    @property
    def computed(self) -> tuple[str, ...]:
        """The variants whose weights are in memory."""
        return tuple(n for n, t in dict.items(self) if t is not _PENDING)

    def _fill(self, names: Iterable[str]) -> None:
        with self._lock:
            missing = tuple(n for n in names if dict.__getitem__(self, n) is _PENDING)
            if not missing:
                return
            for name, t in self._compute(missing).items():
                dict.__setitem__(self, name, t)
                self._born[name] = (id(t), t._version)

    def mapped(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> LazyWeights:
        """A LazyWeights of ``fn(weights)`` per variant, computed on first read as well."""
        compute = self._compute
        return LazyWeights(dict.keys(self), lambda names: {n: fn(t) for n, t in compute(names).items()})

    def fingerprint(self) -> tuple:
        """Changes when a variant is set or removed, or a computed tensor is changed in place."""
        changed = tuple(n for n, (ident, version) in self._born.items()
                        if (t := dict.get(self, n)) is None or id(t) != ident or t._version != version)
        return ("lazy", id(self), self._edits, changed)

    # -- reading -----------------------------------------------------------------------------
    def __getitem__(self, name):
        value = dict.__getitem__(self, name)  # KeyError as a dict's
        if value is _PENDING:
            self._fill((name,))
            value = dict.__getitem__(self, name)
        return value

    def get(self, name, default=None):
        return self[name] if dict.__contains__(self, name) else default

    def __iter__(self):  # (also keeps C code such as dict(w) from copying the stored values)
        return iter(dict.keys(self))

    def values(self):
        self._fill(dict.keys(self))
        return dict.values(self)

    def items(self):
        self._fill(dict.keys(self))
        return dict.items(self)

    def copy(self) -> dict:
        """A plain dict of every variant's weights (computed now)."""
        return dict(self.items())

    def __reduce__(self):
        return (dict, (self.copy(),))

    def __eq__(self, other):
        return dict.__eq__(self.copy(), other)

    def __ne__(self, other):
        return not self == other

    __hash__ = None

    def __or__(self, other):
        out = self.copy()
        out.update(other)
        return out

    def __ror__(self, other):
        out = dict(other)
        out.update(self.copy())
        return out

    def __repr__(self) -> str:
        return "LazyWeights({" + ", ".join(f"{n!r}: {t!r}" for n, t in dict.items(self)) + "})"

    # -- writing -----------------------------------------------------------------------------
    def __setitem__(self, name, value):
        with self._lock:
            self._edits += 1
            self._born.pop(name, None)
            dict.__setitem__(self, name, value)

    def __delitem__(self, name):
        with self._lock:
            dict.__delitem__(self, name)
            self._edits += 1
            self._born.pop(name, None)

    def __ior__(self, other):
        self.update(other)
        return self

    def update(self, *args, **kwargs):
        for name, value in dict(*args, **kwargs).items():
            self[name] = value

    def setdefault(self, name, default=None):
        if dict.__contains__(self, name):
            return self[name]
        self[name] = default
        return default

    _MISSING = object()

    def pop(self, name, default=_MISSING):
        if not dict.__contains__(self, name):
            if default is LazyWeights._MISSING:
                raise KeyError(name)
            return default
        value = self[name]
        del self[name]
        return value

    def popitem(self):
        if not dict.__len__(self):
            raise KeyError("popitem(): dictionary is empty")
        name = next(reversed(dict.keys(self)))
        return name, self.pop(name)

    def clear(self):
        with self._lock:
            dict.clear(self)
            self._born.clear()
            self._edits += 1


def stored(weights: dict):
    """The values held now, computing nothing: a LazyWeights' variants not computed yet are placeholders
    (for type checks such as "is any of them a streamed HeadMaps?"; ``weights.values()`` would compute
    every variant)."""
    return dict.values(weights)


def batch_item(weights: dict, b: int) -> dict:
    """{variant: (L, B, H, N, N)} -> {variant: (L, H, N, N)} of batch item ``b``; lazy stays lazy."""
    if isinstance(weights, LazyWeights):
        return weights.mapped(lambda t: t[:, b])
    return {v: w if getattr(w, "streamed_window", False) else w[:, b] for v, w in weights.items()}


def fingerprint(weights: dict) -> tuple:
    """Which weight tensors (and versions) a set of statistics was computed with: a weight changed in
    place or replaced changes it (tests/test_hf.py). A LazyWeights' does not change when a variant
    is computed."""
    if isinstance(weights, LazyWeights):
        return weights.fingerprint()
    return tuple((name, id(w), 0 if getattr(w, "streamed_window", False) else w._version, tuple(w.shape),
                  w.dtype) for name, w in weights.items())
