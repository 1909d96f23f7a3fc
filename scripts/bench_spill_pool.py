"""The spill's write time with and without the kept file (docs/BENCHMARKS.md, "Twenty-first session"):
``benchmark_causal(SHAPE, (N,), repeats=2)`` with ``spill.POOL_FILES`` set to POOL (0: a fresh file for
every analysis, 1: the default), ``Spill.put`` and the heap trims timed over the process's three
analyses (a warm-up and two timed; the first always writes a fresh file). Run POOL 0 and 1 in
alternating processes. Nothing is asserted.

    python3 scripts/bench_spill_pool.py POOL [SHAPE] [N]        # e.g. 1 llama 8192
"""

import collections
import json
import sys

from profile_window_parts import timed_calls  # (this folder is on sys.path when run)

from attnlab.hf.capture import spill


def main(pool: int, shape: str = "llama", n: int = 8192) -> None:
    spill.POOL_FILES = pool
    spent = collections.defaultdict(list)
    spill.Spill.put = timed_calls(spent, "put", spill.Spill.put)
    spill.release_heap = timed_calls(spent, "trim", spill.release_heap)
    from attnlab.hf.analysis.causal_benchmark import benchmark_causal

    res = benchmark_causal(shape, (n,), repeats=2, memory=False)
    print(f"POOL_FILES={pool}", json.dumps(res["sizes"]),
          f"put {sum(spent['put']):.3f} s, trims {sum(spent['trim']):.3f} s (three analyses)")


if __name__ == "__main__":
    main(int(sys.argv[1]), *sys.argv[2:3], *(int(a) for a in sys.argv[3:4]))
