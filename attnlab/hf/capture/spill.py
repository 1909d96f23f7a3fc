"""Captured q and k kept in a temporary file instead of memory, for long causal windows.

The streamed analysis (attnlab/hf/compute/streamed.py) keeps every layer's q and k after the capture
forward: the weights are computed from them per (layer, head) on access. At 8,192 tokens that is
L * N * (H + H_kv) * D * 4 bytes: 604 MB for 12 layers of 12 heads of 64 dimensions, more than the
rest of the analysis together. With a :class:`Spill`, each layer's q and k are written to an unlinked
temporary file as soon as the layer's hook has used them (they then leave memory with the layer's
attention), and every later reader maps them back from the file afresh:

- a mapping costs no memory until its pages are read, and its pages leave the process when the tensor
  that maps them is freed: a pass over the layers holds one layer's q and k at a time;
- the values are the very bytes that were captured (no rounding: the same results as in memory);
- the file lives in the page cache as long as the window's results do (the operating system writes it
  out under memory pressure instead of the process being killed), then in the pool below or closed;
- after each spilled layer the heap's free pages go back to the system (glibc's ``malloc_trim``):
  otherwise each layer's freed 25 MB buffers stay in the process, fragmented, ~50 MB more RSS a layer
  at 8,192 tokens (docs/BENCHMARKS.md, "Causal models at long context");
- one finished spill file of at most :data:`POOL_MAX_BYTES` (1 GiB; 8,192 tokens of 12 layers of 12 + 12
  heads of 64 dimensions take 604 MB) is kept (:data:`POOL_FILES`) and written over by the next spill,
  once the window's results and every tensor that maps the file are gone: writing a fresh file makes
  the system find and clear new pages, 0.3-1.3 s at 8,192 tokens on this project's machine against
  0.06-0.09 s for the same bytes over a kept file's pages (docs/BENCHMARKS.md, "Twenty-first
  session"); :func:`clear_pool` closes it (its pages are page cache, which the system may reclaim).

Windows whose q and k together are at most :data:`SPILL_BYTES` (``ATTNLAB_SPILL_BYTES``; 256 MiB,
e.g. 12 layers x 16 heads x 64 dims below ~5,400 tokens) stay in memory, as they always did.
``ATTNLAB_SPILL_DIR`` chooses the file's folder (default: the system's temporary folder).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass, replace

import torch

__all__ = ["POOL_FILES", "POOL_MAX_BYTES", "SPILL_BYTES", "Spill", "Stored", "clear_pool", "spill_bytes",
           "spill_for"]

SPILL_BYTES = 256 << 20  # q and k of one window above this go to a file (ATTNLAB_SPILL_BYTES)

_ALIGN = mmap.ALLOCATIONGRANULARITY  # a mapping's offset must be a multiple of it
POOL_FILES = 1  # finished spill files kept for the next spills to write over (module docstring)
POOL_MAX_BYTES = 1 << 30  # a longer file is closed, not kept (disk space no one sees: it is unlinked)


def spill_bytes() -> int:
    """The budget in bytes (``ATTNLAB_SPILL_BYTES`` when set: a non-negative integer)."""
    raw = os.environ.get("ATTNLAB_SPILL_BYTES")
    if raw is None:
        return SPILL_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"ATTNLAB_SPILL_BYTES must be a non-negative integer (bytes), got {raw!r}")
    return value


def spill_for(info, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Spill | None:
    """The :class:`Spill` of one capture forward, or None: a causal model's single unpadded text on the
    CPU (the streamed analysis' window) may spill; padded batches and bidirectional windows never do.
    ``info``: the model's :class:`~attnlab.hf.load.model_info.ModelInfo`; input_ids, attention_mask (B, N)."""
    one_text = input_ids.shape[0] == 1 and bool(attention_mask.bool().all())
    if not (info.causal and one_text and input_ids.device.type == "cpu"):
        return None
    return Spill(spill_bytes(), info.n_layers)


def spill_dir() -> str:
    """The spill file's folder: ``ATTNLAB_SPILL_DIR``, else the system's temporary folder."""
    return os.environ.get("ATTNLAB_SPILL_DIR") or tempfile.gettempdir()


def check_room(need: int, n_tokens: int) -> None:
    """A worded ValueError, before anything is written, when the spill folder has less free space
    than the window's q and k take (a disk filling up mid-forward, or a small tmpfs /tmp, otherwise)."""
    folder = spill_dir()
    free = shutil.disk_usage(folder).free
    if need > free:
        raise ValueError(
            f"a window of {n_tokens:,} tokens keeps its q and k in a file of {need / 2**30:.1f} GiB, and "
            f"{folder} has {free / 2**30:.1f} GiB free: set ATTNLAB_SPILL_DIR to a folder on a larger disk, "
            "or pass a smaller window")


class _File:
    """One open spill file and who still uses it: its :class:`Spill` (``spilling``) and the tensors that
    map it (``mappings``). It goes back to the pool when neither is left."""

    def __init__(self, handle, folder: str):
        self.handle, self.folder = handle, folder
        self.size = os.fstat(handle.fileno()).st_size  # bytes the file already has (pages to reuse)
        self.spilling, self.mappings = True, 0

    def spill_done(self) -> None:
        with _POOL_LOCK:
            self.spilling = False
            self._maybe_free()

    def mapped(self, mapping) -> None:
        with _POOL_LOCK:
            self.mappings += 1
        weakref.finalize(mapping, self.unmapped)

    def unmapped(self) -> None:
        with _POOL_LOCK:
            self.mappings -= 1
            self._maybe_free()

    def _maybe_free(self) -> None:  # (under _POOL_LOCK)
        if self.spilling or self.mappings or self.handle.closed:
            return
        if len(_POOL) < POOL_FILES and self.size <= POOL_MAX_BYTES:
            _POOL.append(self)
        else:
            self.handle.close()


_POOL: list[_File] = []  # finished files, none of them mapped: written over by the next spills
_POOL_LOCK = threading.RLock()  # (re-entrant: a finalizer may run inside a locked block)


def _take_file(folder: str) -> _File:
    """A kept file of ``folder`` when the pool has one (its pages are written over), else a new
    unlinked temporary file there."""
    with _POOL_LOCK:
        for i, kept in enumerate(_POOL):
            if kept.folder == folder:
                kept = _POOL.pop(i)
                kept.spilling = True
                return kept
    return _File(tempfile.TemporaryFile(dir=folder), folder)


def clear_pool() -> int:
    """Close the spill files kept for reuse (their pages and disk space go back to the system) -> how
    many were closed."""
    with _POOL_LOCK:
        files, _POOL[:] = list(_POOL), []
    for kept in files:
        kept.handle.close()
    return len(files)


@dataclass(frozen=True)
class Stored:
    """Where one tensor lies in the spill file."""

    offset: int  # bytes, a multiple of the mapping granularity
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * torch.empty((), dtype=self.dtype).element_size()


class Spill:
    """An append-only temporary file of tensors for one capture (module docstring).

    Args:
        budget: bytes of q and k the window may keep in memory; above it every layer is spilled.
        n_layers: layers the capture will record (the decision is taken at the first layer, from its
            q and k times ``n_layers``).
    """

    def __init__(self, budget: int, n_layers: int):
        self.budget, self.n_layers = int(budget), int(n_layers)
        self.active: bool | None = None  # decided at the first layer
        self._file: _File | None = None  # taken at the first put (a kept one when the pool has one)
        self._end = 0
        self._lock = threading.Lock()

    def _open(self) -> None:
        with self._lock:
            if self._file is None:
                self._file = _take_file(spill_dir())
                weakref.finalize(self, self._file.spill_done)  # (a bound method of the file, not of self)

    def layer(self, captured):
        """The :class:`~attnlab.hf.capture.run_state.CapturedLayer` to keep for ``captured``: itself,
        or (when spilling) the same record whose ``query`` and ``key_heads`` map the file, with
        ``reload`` giving fresh mappings of both."""
        q, k = captured.query, captured.key_heads
        if self.active is None:
            per_layer = q.numel() * q.element_size() + k.numel() * k.element_size()
            self.active = q.device.type == "cpu" and per_layer * self.n_layers > self.budget
            if self.active:
                self._open()
                check_room(per_layer * self.n_layers - self._file.size, q.shape[-2])
        if not self.active:
            return captured
        sq, sk = self.put(q), self.put(k)
        release_heap()
        return replace(captured, query=self.get(sq), key_heads=self.get(sk),
                       reload=lambda: (self.get(sq), self.get(sk)))

    def put(self, tensor: torch.Tensor) -> Stored:
        """Append ``tensor``'s bytes (C order) to the file -> where they lie."""
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._open()
        with self._lock:
            handle = self._file.handle
            stored = Stored(self._end, tuple(tensor.shape), tensor.dtype)
            handle.seek(self._end)
            handle.write(memoryview(data))
            self._end = -(-(self._end + data.nbytes) // _ALIGN) * _ALIGN
            if self._end > self._file.size:  # (a kept file keeps its length: its pages are reused)
                handle.truncate(self._end)
                self._file.size = self._end
            handle.flush()
        return stored

    def get(self, stored: Stored) -> torch.Tensor:
        """A tensor that maps ``stored``'s bytes (private, copy-on-write: writing to it never changes
        the file); no memory is read until its elements are."""
        if stored.nbytes == 0:
            return torch.empty(stored.shape, dtype=stored.dtype)
        with self._lock:
            mapped = mmap.mmap(self._file.handle.fileno(), stored.nbytes, access=mmap.ACCESS_COPY,
                               offset=stored.offset)
        self._file.mapped(mapped)  # the file is not written over while this mapping lives
        flat = torch.frombuffer(mapped, dtype=torch.uint8)  # keeps the mapping alive
        return flat.view(stored.dtype).view(stored.shape)


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc
    except (OSError, AttributeError):
        return None


def release_heap() -> bool:
    """Return the heap's free pages to the system (glibc ``malloc_trim(0)``); False where the C library
    has no such call (nothing happens)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
