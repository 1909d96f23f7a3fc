"""Which Triton kernels run a tensor, and loading them (compiled for CUDA, or interpreted on CPU).

Triton decides at decoration time (``@triton.jit``) whether a kernel is compiled or interpreted, from
``TRITON_INTERPRET``. attnlab therefore loads its kernel modules by path, once per mode, under
mode-specific module names, with the variable set for the load only: a process can hold both (CUDA
tests and interpreter tests in one pytest worker), and setting the variable later, or importing
``triton`` before it, changes nothing that is already loaded.

    mode(q)      "cuda" (q on CUDA, TRITON_INTERPRET unset) | "interpret" (q on CPU, TRITON_INTERPRET=1
                 now) | None (the kernels do not apply)
    kernels(m)   namespace with the kernel modules ``fwd``, ``bwd`` for mode m, or None (no triton)
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import torch

KERNEL_FILES = {"fwd": "kernels_fwd.py", "bwd": "kernels_bwd.py"}
_HERE = Path(__file__).resolve().parent
_LOADED: dict[str, SimpleNamespace | None] = {}
_LOCK = threading.Lock()


def triton_installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def interpreting() -> bool:
    """TRITON_INTERPRET is set to a true value now (read at every call)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def mode(q: torch.Tensor) -> str | None:
    if not triton_installed():
        return None
    if q.device.type == "cuda" and not interpreting():
        return "cuda"
    if q.device.type == "cpu" and interpreting():
        return "interpret"
    return None


def _load_file(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # inspect.getsource (used by triton.jit) looks modules up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def kernels(mode_: str) -> SimpleNamespace | None:
    """The kernel modules for ``mode_`` ("cuda" or "interpret"), loaded on first use; None when triton
    does not import or does not honour the mode (e.g. ``triton.knobs`` overridden in-process)."""
    with _LOCK:
        if mode_ in _LOADED:
            return _LOADED[mode_]
        saved = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1" if mode_ == "interpret" else "0"
        try:
            import triton  # noqa: F401, PLC0415
            from triton.runtime.interpreter import InterpretedFunction  # noqa: PLC0415

            mods = {key: _load_file(f"attnlab.gpu._{mode_}_{key}", _HERE / fname)
                    for key, fname in KERNEL_FILES.items()}
            interpreted = isinstance(mods["fwd"].row_kernel, InterpretedFunction)
            ns = SimpleNamespace(**mods) if interpreted == (mode_ == "interpret") else None
        except ImportError:
            ns = None
        finally:
            if saved is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = saved
        _LOADED[mode_] = ns
        return ns
