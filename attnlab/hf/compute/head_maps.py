"""One variant's (L, H, N, N) weights of a streamed window, computed one (layer, head) at a time when
read: ``maps[l, h]`` is that head's (N, N) map, computed by the streamed analysis' own tiles
(attnlab/hf/compute/streamed.py) and not kept; ``maps[l]`` is a layer's (H, N, N).

Anything else a tensor offers (``maps.sum(-2)``, ``torch.stack``, ``np.asarray``, ``maps[..., 0]``)
materializes the whole (L, H, N, N) first, up to :data:`MATERIALIZE_LIMIT` bytes; beyond, a ValueError
says how much it would take and to read one layer or head at a time instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

__all__ = ["HeadMaps", "MATERIALIZE_LIMIT", "size_text"]

# Largest whole (L, H, N, N) a HeadMaps materializes (bytes; env ATTNLAB_MATERIALIZE_LIMIT_MB).
MATERIALIZE_LIMIT = int(os.environ.get("ATTNLAB_MATERIALIZE_LIMIT_MB", "2048")) << 20


def size_text(b: int) -> str:
    """Bytes as "1.5 GiB" or "300 MiB"."""
    return f"{b / 2**30:.1f} GiB" if b >= 2**30 else f"{b / 2**20:.0f} MiB"


class HeadMaps:
    """Lazy (L, H, N, N) float32 weights of one variant; ``head(l, h) -> (N, N)`` computes one map."""

    streamed_window = True  # one window's maps already (no batch dimension to select); immutable

    def __init__(self, variant: str, shape: tuple[int, int, int, int],
                 head: Callable[[int, int], torch.Tensor],
                 device: torch.device | str = "cpu", sinks: Callable | None = None, window=None):
        self._sinks = sinks  # (keys, special) -> {variant: sink statistics' parts} of the whole window
        self.window = window  # the streamed window behind it (attnlab.hf.compute.streamed.StreamedWindow)
        self.variant = variant
        self.shape = torch.Size(shape)
        self._head = head
        self.device = torch.device(device)
        self.dtype = torch.float32
        self._whole: torch.Tensor | None = None

    # -- what reads one head or one layer ----------------------------------------------------------
    def head(self, layer: int, head: int) -> torch.Tensor:
        """(N, N) weights of one head, on the CPU (computed now, not kept)."""
        L, H = self.shape[0], self.shape[1]
        layer, head = self._index(layer, L, "layer"), self._index(head, H, "head")
        if self._whole is not None:
            return self._whole[layer, head]
        return self._head(layer, head).to("cpu")

    def layer(self, layer: int) -> torch.Tensor:
        """(H, N, N) weights of one layer (H heads computed now)."""
        layer = self._index(layer, self.shape[0], "layer")
        return torch.stack([self.head(layer, h) for h in range(self.shape[1])])

    @staticmethod
    def _index(i, n: int, name: str) -> int:
        if isinstance(i, torch.Tensor) and i.numel() == 1 and not i.is_floating_point():
            i = int(i)
        if isinstance(i, bool) or not hasattr(i, "__index__"):
            raise ValueError(f"{name} must be an integer in [-{n}, {n - 1}], got {i!r}")
        i = int(i.__index__())
        if not -n <= i < n:
            raise ValueError(f"{name} must be an integer in [-{n}, {n - 1}], got {i}")
        return i % n

    def __getitem__(self, index):
        idx = index if isinstance(index, tuple) else (index,)
        for name, i in zip(("layer", "head"), idx[:2], strict=False):
            floating = isinstance(i, torch.Tensor) and i.is_floating_point()
            if isinstance(i, (float, complex, str)) or floating:
                n = self.shape[0 if name == "layer" else 1]
                raise ValueError(f"{name} must be an integer in [-{n}, {n - 1}] (or a slice), got {i!r}")
        ints = [hasattr(i, "__index__") and not isinstance(i, bool) for i in idx[:2]]
        if len(idx) >= 2 and all(ints):
            out = self.head(idx[0], idx[1])
            return out[idx[2:]] if len(idx) > 2 else out
        if len(idx) >= 1 and ints[0] and (len(idx) == 1 or isinstance(idx[1], slice)):
            out = self.layer(idx[0])
            return out[idx[1:]] if len(idx) > 1 else out
        return self.materialize()[index]

    def __len__(self) -> int:
        return self.shape[0]

    def __iter__(self):
        """One layer's (H, N, N) at a time."""
        return (self.layer(layer) for layer in range(self.shape[0]))

    def dim(self) -> int:
        return 4

    ndim = property(dim)

    def size(self, d: int | None = None):
        return self.shape if d is None else self.shape[d]

    def numel(self) -> int:
        return self.shape.numel()

    def sink_parts(self, keys: torch.Tensor, special: torch.Tensor | None) -> dict:
        """The parts of :func:`attnlab.sinks.statistics_from_parts` for this variant, streamed (no
        weights held); without a streamed window behind it, from the materialized weights."""
        if self._sinks is not None:
            return self._sinks(keys, special)[self.variant]
        from attnlab import sinks

        w = self.materialize()
        first = torch.zeros_like(keys)
        first[0] = True
        col, kept = sinks.sink_excluded_column_mass(w, keys)
        return {"first": sinks.sink_mass(w, first),
                "special": sinks.sink_mass(w, special) if special is not None else w.new_zeros(w.shape[:2]),
                "sink": sinks.sink_mass(w, keys), "excluded": col, "kept": kept,
                "importance_first": w[..., 0].sum(-1) / max(w.shape[-2], 1)}

    # -- everything else: the whole tensor -----------------------------------------------------------
    def materialize(self) -> torch.Tensor:
        """(L, H, N, N) on the CPU, computed once and kept (ValueError beyond MATERIALIZE_LIMIT)."""
        if self._whole is None:
            need = 4 * self.shape.numel()
            if need > MATERIALIZE_LIMIT:
                L, H, N = self.shape[0], self.shape[1], self.shape[2]
                raise ValueError(
                    f"{self.variant}'s weights of this window are (L, H, N, N) = ({L}, {H}, {N}, {N}): "
                    f"{size_text(need)} in float32, over the {size_text(MATERIALIZE_LIMIT)} limit "
                    "(ATTNLAB_MATERIALIZE_LIMIT_MB). Read one head (weights[variant][layer, head], (N, N)) "
                    "or one layer (weights[variant][layer]) at a time; the statistics (table()) never "
                    "need the weights")
            self._whole = torch.stack([self.layer(layer) for layer in range(self.shape[0])])
        return self._whole

    def __array__(self, dtype=None, copy=None):
        a = self.materialize().numpy()
        return a if dtype is None else a.astype(dtype)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def real(x):
            if isinstance(x, HeadMaps):
                return x.materialize()
            if isinstance(x, (list, tuple)):
                return type(x)(real(y) for y in x)
            return x

        return func(*real(args), **{k: real(v) for k, v in (kwargs or {}).items()})

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_head", "_whole", "_sinks", "shape", "variant", "device",
                                             "dtype", "streamed_window", "window"):
            raise AttributeError(name)
        return getattr(self.materialize(), name)

    def __repr__(self) -> str:
        L, H, N, _ = self.shape
        return f"HeadMaps({self.variant!r}, (L, H, N, N) = ({L}, {H}, {N}, {N}), computed per head on access)"

    # arithmetic and comparisons as a tensor's
    def _op(name):  # noqa: N805
        def op(self, *args):
            return getattr(self.materialize(), name)(*args)

        op.__name__ = name
        return op

    for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
                  "__rtruediv__", "__matmul__", "__rmatmul__", "__neg__", "__abs__", "__eq__", "__ne__",
                  "__lt__", "__le__", "__gt__", "__ge__"):
        locals()[_name] = _op(_name)
    del _name, _op
    __hash__ = object.__hash__
