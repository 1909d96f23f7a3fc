"""Build attnlab's CPU kernels with another -march and run the kernel tests against that build.

    python scripts/kernel_builds.py x86-64 [pytest args...]     # SSE2 only: ATen's DEFAULT vectors
    python scripts/kernel_builds.py x86-64-v3 [pytest args...]  # AVX2 + FMA
    python scripts/kernel_builds.py native [pytest args...]

attnlab.kernels.CFLAGS is patched in this process before anything builds (the build directory is keyed
by the flags, so each -march gets its own cached build), then pytest runs in-process; the default test
files are tests/test_kernels.py and tests/test_numerics.py. Run it without pytest-xdist's ``-n``: its
worker processes import attnlab afresh and would test the native build instead.
"""

import sys

import pytest

from attnlab import kernels

march = sys.argv[1] if len(sys.argv) > 1 else "x86-64"
kernels.CFLAGS = [f"-march={march}" if flag.startswith("-march=") else flag for flag in kernels.CFLAGS]
ops = kernels.cpu_ops()
if ops is None:
    sys.exit(f"build with -march={march} failed: {kernels.build_error()}")
print(f"kernels built with {' '.join(kernels.CFLAGS)} in {kernels._build_dir()}", flush=True)
sys.exit(pytest.main(sys.argv[2:] or ["-q", "tests/test_kernels.py", "tests/test_numerics.py"]))
