"""A causal model's long analysis part by part (docs/BENCHMARKS.md, "Twenty-second session"): the
causal kernel's seconds per layer inside the capture forward (``causal_kernel.kernel_layer``) against
SDPA's per layer in the plain forward, and the plain forward, ``hf.analyze`` and ``table()`` of each
round. The model and text are the causal benchmark's (``attnlab.hf.analysis.causal_benchmark``).
Nothing is asserted.

    python3 scripts/profile_causal_parts.py [SHAPE] [N] [ROUNDS] [WARMUP]   # e.g. llama 8192 2 1
"""

import collections
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from attnlab import hf
from attnlab.hf.analysis.causal_benchmark import _text_of, build_model
from attnlab.hf.compute import causal_kernel

sys.path.insert(0, os.path.dirname(__file__))
from profile_window_parts import timed_calls  # noqa: E402


def main(shape: str = "llama", n: int = 8192, rounds: int = 2, warmup: int = 1) -> None:
    directory = os.path.join(tempfile.gettempdir(), f"attnlab-bench-{shape}-{n}")
    build_model(shape, n, directory)
    loaded = hf.load_model(directory)
    text, ids = _text_of(loaded, n)
    spent = collections.defaultdict(list)
    causal_kernel.kernel_layer = timed_calls(spent, "kernel", causal_kernel.kernel_layer)
    F.scaled_dot_product_attention = timed_calls(spent, "sdpa", F.scaled_dot_product_attention)
    whole = collections.defaultdict(list)
    for r in range(warmup + rounds):
        for key in spent:
            spent[key].clear()
        t0 = time.perf_counter()
        with torch.no_grad():
            loaded.model(input_ids=ids, use_cache=False)
        t1 = time.perf_counter()
        result = hf.analyze(text, loaded)
        t2 = time.perf_counter()
        result.windows[0].table()
        t3 = time.perf_counter()
        del result
        if r < warmup:
            continue
        parts = {"forward": t1 - t0, "analyze": t2 - t1, "table": t3 - t2,
                 "sdpa": sum(spent["sdpa"]), "kernel": sum(spent["kernel"])}
        for key, value in parts.items():
            whole[key].append(value)
        other = parts["analyze"] - parts["forward"] - (parts["kernel"] - parts["sdpa"])
        print(f"round {r - warmup}: " + ", ".join(f"{k} {v:.2f} s" for k, v in parts.items())
              + f"; the rest of analyze {other:+.2f} s; kernel/sdpa {parts['kernel'] / parts['sdpa']:.2f}; "
              f"kernel calls {len(spent['kernel'])}, sdpa calls {len(spent['sdpa'])}", flush=True)
    print("medians: " + ", ".join(f"{k} {statistics.median(v):.2f} s" for k, v in whole.items()))


if __name__ == "__main__":
    args = sys.argv[1:]
    main(*(args[:1]), *(int(a) for a in args[1:4]))
