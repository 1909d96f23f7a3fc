"""attnlab's CPU kernels (``attnlab/csrc/*.cpp``), compiled for this machine on first use, as one library.

``attnlab/csrc/attnlab_cpu.cpp``: four operators, ``torch.ops.attnlab.*`` (float32 and float64, CPU,
forward only), used by ``attnlab.attend`` and the log-sum-exp functions (:func:`cpu_ops`):

    col_lse(a, b, row_bias, scale)      c_j = log sum_i exp(scale a_i . b_j + row_bias_i)   (BH, N)
    mix_attend(q, k, v, key_bias, dnas_bias, u, scale)
        (1 - u) softmax_j(s_ij + key_bias_j) v + u softmax_j(s_ij + key_bias_j + dnas_bias_j) v
    sinkhorn_round(q, k, c, key_bias, row_bias, scale)
        the next column potential of Sinkhorn after a row step with potentials c    (BH, N)
    sinkhorn_attend(q, k, v, key_bias, row_bias, iters, scale)
        Sinkhorn attention with each head's scores held once by its thread     (BH, M, Dv)

They are what makes DNAS, HNAS and Sinkhorn cost a small multiple of one SDPA call on CPU: the column
log-sum-exp is one matrix product per score panel plus a reduction (no value product), HNAS's two
row passes share one score panel and one exponential per score, and Sinkhorn computes each head's
scores once and iterates on them (or, over a memory bound, makes a round -- row step, then column
step -- one panel pass instead of two) (docs/BENCHMARKS.md).

``attnlab/csrc/held_cpu.cpp``: ``held_attend(q, k, v, key_bias, row_bias, u, iters, scale, budget_bytes)``,
DNAS / HNAS / Sinkhorn with each head's scores computed once and held (one score product, one
exponential per score, one value product per head; attnlab/normalizers/kernel_paths.py,
HELD_HEAD_BYTES), the first path of ``attend`` for these variants. ``attnlab/csrc/kernel_common.h``
holds the helpers both files share.

``attnlab/csrc/train_cpu.cpp``: ``train_dn_forward(q, k, v, mask, u, scale, out, p_d, p_u, e)`` and
``train_dn_backward(g, q, k, v, p_d, p_u, e, u, scale, grad_q, grad_k, grad_v, grad_u)``, the forward
and the backward of the training-size DNAS / HNAS autograd function (attnlab/normalizers/fused.py,
``_SmallDoublyNormalized``), one task per head with its panels in cache: scores, column log-sum-exp,
row softmaxes, mix and value product; then the softmax backwards with the column term and the
gradient products (:func:`attnlab.normalizers.kernel_paths.train_forward`).

``attnlab/csrc/causal_cpu.cpp``: ``causal_dnas(q, k, v, key_bias, row_bias, scale, floor)`` and
``causal_hnas(..., u, scale, floor)``, causal DNAS and causal HNAS in one pass over the score tiles
(query blocks outer, each column's running prefix maximum and sum carried down the rows; HNAS adds the
causal softmax's online row maxima and a second value product; docs/VARIANTS.md "Causal DNAS").

``attnlab/csrc/analysis_cpu.cpp``: ``torch.ops.attnlab_hf.heads``, the heads of ``attnlab.hf``'s fused
analysis on torch's threads (every variant's weights and every row sum the statistics need, in a few
sweeps over each head's rows; a head whose scores span more than 60 nats in log space,
``analysis_wide.h``; the attention output for the capture forward; :func:`analysis_ops`, used by
``attnlab/hf/compute/fused_sums.py`` and ``attnlab/hf/compute/fused_forward.py``); and
``torch.ops.attnlab_hf.causal_heads`` (``analysis_causal.h``, AVX-512 builds), the row sums of unas,
causal dnas and hnas of one causal layer (grouped-query heads, sliding window, softcap) for the
streamed analysis of masked windows (``attnlab/hf/compute/streamed.py``).

Building needs a C++ compiler (``g++``; scripts/install.sh installs it) and ninja (the ``ninja`` PyPI
package, in requirements.txt); the build takes about 20 s once and is cached per source, flags and
torch version and CPU under ``$ATTNLAB_CACHE`` (default ``~/.cache/attnlab``). Concurrent first uses (pytest
-n, several app sessions, Ray workers) wait for one build under an OS file lock (:func:`_build_lock`),
which a process killed while building does not leave behind. If the build fails, or with
``ATTNLAB_KERNELS=0``, ``cpu_ops()`` returns None and attnlab uses PyTorch's own kernels instead
(correct, slower); the reason is warned once and kept in ``build_error()``.

``python -m attnlab.kernels`` builds the kernels now and prints where they are.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import sys
import threading
import warnings
from pathlib import Path

import torch

__all__ = ["cpu_ops", "analysis_ops", "build_error", "available"]

SOURCES = [Path(__file__).parent / "csrc" / name
           for name in ("attnlab_cpu.cpp", "held_cpu.cpp", "panel_cpu.cpp", "hnas_cpu.cpp",
                        "sinkhorn_panels_cpu.cpp", "causal_cpu.cpp", "train_cpu.cpp", "analysis_cpu.cpp")]
# -march=native: the kernels run where they are built. No -ffast-math: masked scores are -inf, so
# only the flags that let sums and products be reordered and vectorized. -fopenmp: at::parallel_for
# is OpenMP inside the extension too (without it the kernels run on one thread).
CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
          "-fno-signed-zeros", "-fopenmp"]
LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_state: dict = {"tried": False, "ops": None, "error": None}


def _cpu_fingerprint() -> str:
    """The CPU's model and instruction-set flags: a build for one CPU (-march=native) is not reused
    on another that shares the cache (a network home directory, a copied image)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keys = ("model name", "flags")
        return "|".join(next((ln for ln in lines if ln.startswith(key)), "") for key in keys)
    except OSError:
        return platform.machine() + platform.processor()


def _build_dir() -> Path:
    headers = sorted(SOURCES[0].parent.glob("*.h"))
    # the sources' folder too: ninja's build file names the sources by path, so two checkouts of the
    # same sources sharing one folder would rebuild each other's kernels on every switch
    key = [*(src.read_bytes() for src in [*SOURCES, *headers]), " ".join(CFLAGS + LDFLAGS).encode(),
           torch.__version__.encode(), _cpu_fingerprint().encode(), str(SOURCES[0].parent.resolve()).encode()]
    digest = hashlib.sha256(b"\0".join(key))
    root = Path(os.environ.get("ATTNLAB_CACHE") or Path.home() / ".cache" / "attnlab")
    return root / "kernels" / f"cpu-{digest.hexdigest()[:16]}"


def _ninja_on_path() -> None:
    """torch's builder runs ``ninja`` from PATH; the PyPI package's binary may sit outside it."""
    try:
        import ninja  # noqa: PLC0415

        bin_dir = getattr(ninja, "BIN_DIR", None)
    except ImportError:
        return
    if bin_dir and bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def _build():
    from torch.utils.cpp_extension import load  # noqa: PLC0415

    _ninja_on_path()
    directory = _build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with _build_lock(directory):  # copies of the flags: load appends torch's libraries to extra_ldflags
        load(name=f"attnlab_cpu_{directory.name.split('-')[1]}", sources=[str(src) for src in SOURCES],
             extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), build_directory=str(directory),
             is_python_module=False, verbose=False)
    return torch.ops.attnlab


@contextlib.contextmanager
def _build_lock(directory: Path):
    """One process at a time builds or loads the kernels of ``directory``, under an OS file lock that
    goes with its holder. torch's own lock there (a file named ``lock`` that ``load`` creates and
    removes) stays behind when a process is killed while holding it (a Ray worker or an app server
    SIGKILLed while it loads the kernels), and every later ``load`` of that directory would wait for it
    forever; under this lock such a file can only be stale, so it is removed. Without ``fcntl`` (not
    POSIX) torch's lock alone serializes the builds."""
    try:
        import fcntl  # noqa: PLC0415
    except ImportError:
        yield
        return
    with open(directory / "attnlab.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (directory / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cpu_ops():
    """``torch.ops.attnlab`` with the CPU kernels, building them on first call; None when they are
    switched off (``ATTNLAB_KERNELS=0``) or cannot be built here (see :func:`build_error`)."""
    if _state["tried"]:
        return _state["ops"]
    with _lock:
        if not _state["tried"]:
            if os.environ.get("ATTNLAB_KERNELS", "1") == "0":
                _state["error"] = "switched off by ATTNLAB_KERNELS=0"
            else:
                try:
                    _state["ops"] = _build()
                except Exception as exc:  # no compiler, no ninja, a failed build: fall back, say why
                    _state["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
                    warnings.warn(
                        f"attnlab: CPU kernels unavailable ({_state['error']}); using PyTorch's kernels "
                        "(same results, DNAS/HNAS/Sinkhorn slower). Needs g++ and ninja.",
                        RuntimeWarning, stacklevel=2,
                    )
            _state["tried"] = True
    return _state["ops"]


def analysis_ops():
    """``torch.ops.attnlab_hf`` (attnlab.hf's analysis kernel) from the same build; None when the
    kernels are switched off or cannot be built here."""
    return None if cpu_ops() is None else torch.ops.attnlab_hf


def available() -> bool:
    return cpu_ops() is not None


def build_error() -> str | None:
    """Why the kernels are not in use (None when they are, or were not asked for yet)."""
    return _state["error"]


if __name__ == "__main__":
    ops = cpu_ops()
    if ops is None:
        print(f"attnlab CPU kernels: not available ({build_error()})", file=sys.stderr)
        sys.exit(1)
    print(f"attnlab CPU kernels: built in {_build_dir()}")
