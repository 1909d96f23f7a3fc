"""``table()`` of MiniLM's 512-token analysis alone (docs/BENCHMARKS.md, "Twenty-second session"):
the median of ROUNDS calls on one result, after five untimed ones. Run it with PYTHONPATH set to
two checkouts in turn to compare them. Nothing is asserted.

    python3 scripts/bench_table.py [ROUNDS]        # e.g. 100
"""

import statistics
import sys
import time

from attnlab.hf.analysis.benchmark import _window
from attnlab.hf.analysis.pipeline import analyze
from attnlab.hf.load.loading import load_model


def main(rounds: int = 100) -> None:
    loaded = load_model(None)
    text, _ = _window(loaded, 512)
    window = analyze(text, loaded, window=512).windows[0]
    for _ in range(5):
        window.table()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        window.table()
        times.append(time.perf_counter() - t0)
    low, _, high = (t * 1e3 for t in statistics.quantiles(times, n=4))
    median = statistics.median(times) * 1e3
    print(f"table(): median {median:.2f} ms of {rounds} (quartiles {low:.2f} / {high:.2f})")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
