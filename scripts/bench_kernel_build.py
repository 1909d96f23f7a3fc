"""One built kernel library against torch's SDPA: attnlab's causal analysis kernel (``causal_heads`` with
the attention output, as inside the capture forward) from the kernel build in BUILD_DIR (a folder of
``~/.cache/attnlab/kernels`` or a copy built with other flags), on random q, k, v of H query heads over
H / 3 key/value heads (4 over 2 by default), head dim 64, two key masks; prints the minimum over
REPEATS calls, and SDPA's. Run builds in alternating processes (one library per process: the ops
share one name) to compare them: docs/BENCHMARKS.md, "Twentieth session". Nothing is asserted.

    T=1 taskset -c 1 python3 scripts/bench_kernel_build.py BUILD_DIR [N] [REPEATS] [SDPA_REPEATS]
    T=2 H=12 python3 scripts/bench_kernel_build.py BUILD_DIR 8192 2 2       # one 12-head layer, 2 threads
"""

import glob
import os
import sys
import time

import torch
from bench_causal_layer import analyse, layer_inputs  # (this folder is on sys.path when run)


def main(build: str, n: int = 4096, repeats: int = 5, sdpa_repeats: int = 3) -> None:
    torch.set_num_threads(int(os.environ.get("T", "1")))
    for lib in sorted(glob.glob(os.path.join(build, "*.so"))):
        torch.ops.load_library(lib)
    kernel = torch.ops.attnlab_hf.causal_heads
    H = int(os.environ.get("H", "4"))
    Hkv = H // 3 if "H" in os.environ else 2
    q, k, v, spec = layer_inputs(n, H, Hkv)

    def run():
        analyse(kernel, q, k, v, spec)

    def timed(fn, count):
        best = float("inf")
        for _ in range(count):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best

    R = H // Hkv
    kr, vr = k.repeat_interleave(R, 0)[None], v.repeat_interleave(R, 0)[None]
    t_kernel = timed(run, repeats)
    t_sdpa = timed(lambda: torch.nn.functional.scaled_dot_product_attention(q[None], kr, vr, is_causal=True),
                   sdpa_repeats)
    print(os.path.basename(os.path.normpath(build)), f"kernel min {t_kernel:.4f}", f"sdpa min {t_sdpa:.4f}",
          f"ratio {t_kernel / t_sdpa:.3f}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    main(sys.argv[1], *(int(a) for a in sys.argv[2:5]))
