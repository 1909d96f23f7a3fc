"""What a spill file's pages cost (attnlab/hf/capture/spill.py, docs/BENCHMARKS.md "Twenty-first
session"): the q and k of a 12-layer, 12-head, 4-KV-head model at 8,192 tokens (12 x (25 MB + 8 MB))
written ROUNDS times, each time into a fresh unlinked temporary file ("fresh") and over the pages of one
kept file ("kept"), with PAUSE seconds between rounds (the time an analysis and a forward take between
two spills). Prints seconds per round. Nothing is asserted.

    python3 scripts/bench_spill_pages.py [ROUNDS] [PAUSE]        # e.g. 4 5
"""

import sys
import tempfile
import time

import numpy as np

Q_BYTES, K_BYTES, LAYERS = 8192 * 768 * 4, 8192 * 256 * 4, 12


def write_layers(handle, q: np.ndarray, k: np.ndarray) -> float:
    """Seconds to write every layer's q and k at the start of ``handle``."""
    t0 = time.perf_counter()
    handle.seek(0)
    for _ in range(LAYERS):
        handle.write(memoryview(q))
        handle.write(memoryview(k))
        handle.flush()
    return time.perf_counter() - t0


def main(rounds: int = 4, pause: float = 5.0) -> None:
    q, k = np.ones(Q_BYTES // 4, dtype=np.float32), np.ones(K_BYTES // 4, dtype=np.float32)
    kept = tempfile.TemporaryFile()
    for r in range(rounds):
        with tempfile.TemporaryFile() as fresh:
            t_fresh = write_layers(fresh, q, k)
        time.sleep(pause)
        t_kept = write_layers(kept, q, k)
        print(f"round {r}: fresh file {t_fresh:.3f} s, kept file {t_kept:.3f} s", flush=True)
        time.sleep(pause)


if __name__ == "__main__":
    main(*(int(a) if i == 0 else float(a) for i, a in enumerate(sys.argv[1:3])))
