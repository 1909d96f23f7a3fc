"""MiniLM's 512-token analysis part by part (docs/BENCHMARKS.md, "Twenty-first session"): the analysis
kernel's time per layer inside the capture forward against SDPA's per layer in the plain forward
(wrappers around ``fused_forward.run_kernel`` and torch's ``scaled_dot_product_attention``), and the
medians of the plain forward, ``hf.analyze`` and ``table()``. Nothing is asserted.

    python3 scripts/profile_window_parts.py [ROUNDS]        # e.g. 20
"""

import collections
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from attnlab.hf.analysis.benchmark import _window
from attnlab.hf.analysis.pipeline import analyze
from attnlab.hf.compute import fused_forward
from attnlab.hf.load.loading import load_model


def timed_calls(spent: dict, key: str, fn):
    """``fn`` with each call's seconds appended to ``spent[key]``."""
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        spent[key].append(time.perf_counter() - t0)
        return out
    return wrapper


def main(rounds: int = 20) -> None:
    loaded = load_model(None)
    text, ids = _window(loaded, 512)
    L = loaded.info.n_layers
    spent = collections.defaultdict(list)
    fused_forward.run_kernel = timed_calls(spent, "kernel", fused_forward.run_kernel)
    F.scaled_dot_product_attention = timed_calls(spent, "sdpa", F.scaled_dot_product_attention)

    def forward():
        with torch.no_grad():
            loaded.model(input_ids=ids)

    whole = collections.defaultdict(list)
    for _ in range(rounds + 3):  # three warm-up rounds
        for key, fn in (("forward", forward), ("analyze", lambda: analyze(text, loaded, window=512))):
            t0 = time.perf_counter()
            result = fn()
            whole[key].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        result.table()
        whole["table"].append(time.perf_counter() - t0)
    for key in ("kernel", "sdpa"):
        per_layer = [statistics.median(spent[key][-rounds * L:][layer::L]) * 1e3 for layer in range(L)]
        print(f"{key} ms per layer: {' '.join(f'{t:.2f}' for t in per_layer)}  (sum {sum(per_layer):.1f})")
    for key, times in whole.items():
        print(f"{key}: {statistics.median(times[3:]) * 1e3:.1f} ms")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
