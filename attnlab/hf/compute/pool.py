"""The buffer pool of attnlab.hf's fused analysis: the memory of released (L, B, H, N, N) weight
tensors, kept (at most ``_POOL.max_bytes``) and reused for the next window's weights."""

from __future__ import annotations

import math
import threading

import numpy as np
import torch


class _Lease:
    """Memory of one weight tensor lent from ``_POOL``: numpy arrays made from it (and the tensors made
    from those) keep it alive; when the last one is gone it goes back to the pool."""

    def __init__(self, slab: np.ndarray):
        self.slab = slab
        self.__array_interface__ = slab.__array_interface__

    def __del__(self):
        try:
            _POOL.give_back(self.slab)
        except Exception:  # noqa: BLE001 -- interpreter shutdown: nothing to keep
            pass


class _WeightPool:
    """Recycles the memory of released (L, B, H, N, N) weight tensors for the next window.

    Writing ~300 MB of weights into fresh memory costs a page fault per 4 KiB (a third of a window's
    analysis); texts are analysed window after window and each window's weights are usually dropped
    before the next, so their memory is kept (at most ``max_bytes``) and reused. Tensors lent are
    ordinary CPU tensors (views of numpy arrays): the memory returns here only once no tensor uses it.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.free: list[np.ndarray] = []
        # re-entrant: a lease may come back (garbage collection) while this thread holds the lock
        self.lock = threading.RLock()

    def empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        n = math.prod(shape)
        if n * 4 > self.max_bytes:
            return torch.empty(shape)
        slab = None
        with self.lock:
            for i in range(len(self.free)):
                if self.free[i].size == n:
                    slab = self.free.pop(i)
                    break
        if slab is None or slab.size != n:
            slab = _aligned_empty(n)
        return torch.from_numpy(np.asarray(_Lease(slab))).view(shape)

    def give_back(self, slab: np.ndarray) -> None:
        if slab.nbytes > self.max_bytes:
            return
        with self.lock:
            kept = sum(s.nbytes for s in self.free)
            while self.free and kept + slab.nbytes > self.max_bytes:  # the oldest go first
                kept -= self.free.pop(0).nbytes
            self.free.append(slab)


def _aligned_empty(n: int, align: int = 64) -> np.ndarray:
    """float32 (n,) starting on an ``align``-byte boundary (a cache line: the kernel streams whole
    lines to memory), a view of a slightly larger array."""
    raw = np.empty(n + align // 4, dtype=np.float32)
    start = (-raw.ctypes.data % align) // 4
    return raw[start : start + n]


_POOL = _WeightPool(max_bytes=512 << 20)
