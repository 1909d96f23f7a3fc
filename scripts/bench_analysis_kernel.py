"""attnlab.hf's analysis kernel (``attnlab_hf.heads``, attnlab/csrc/analysis_cpu.cpp) head by head, on
the embedded MiniLM's q and k of the analysis benchmark's 512 tokens: milliseconds per head on one
thread (``attnlab_hf.heads`` called with one map at a time), medians of interleaved rounds, and all
72 maps in one call on torch's threads ("window"), for all statistics ("full"), without the Jensen-Shannon and
HNAS terms ("bare": scores, factors, Sinkhorn(3), the entropy and distance products) and with only
DNAS's Jensen-Shannon sum ("jd"); heads that span more than 60 nats take the kernel's log-space path
and are counted apart. Run it in two trees (PYTHONPATH) to compare kernels side by side.

    python scripts/bench_analysis_kernel.py 9      # rounds
"""

import statistics
import sys
import time

import torch

from attnlab import kernels
from attnlab.hf.analysis.benchmark import _BENCH_TEXT
from attnlab.hf.capture.interface import capture_qk
from attnlab.hf.capture.windows import special_affixes, tokenize_text
from attnlab.hf.load.loading import load_model


def heads(n_tokens: int = 512):
    """(q (N, D), k (N, D), scale) of every layer and head, and the (2, N) special-key masks."""
    loaded = load_model(None)
    prefix, suffix = special_affixes(loaded.tokenizer)
    text = _BENCH_TEXT * (n_tokens // 60 + 2)
    body = tokenize_text(loaded.tokenizer, text).ids[: n_tokens - len(prefix) - len(suffix)].tolist()
    ids = [*prefix, *body, *suffix]
    with torch.no_grad(), capture_qk(loaded.model, stop_after=loaded.info.n_layers) as captured:
        loaded.model(input_ids=torch.tensor([ids]), use_cache=False)
    out = [(c.query[0, h].float().contiguous(), c.key[0, h].float().contiguous(), c.scaling)
           for c in captured for h in range(c.query.shape[1])]
    special = torch.zeros(2, len(ids))
    special[:, 0] = special[:, -1] = 1.0
    return out, special


def main(rounds: int) -> None:
    ops = kernels.analysis_ops()
    if ops is None:
        sys.exit(f"attnlab's CPU kernels are not available: {kernels.build_error()}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    maps, spec_t = heads()
    N, S = spec_t.shape[1], spec_t.shape[0]
    M = len(maps)
    z = torch.zeros
    outputs = [z(M, 3, N), torch.ones(M, 3, N), z(M, 3, N), z(M, N, 3 + 2 * S), z(M, N, 2 + S), z(M, N, 10)]
    yes, no = True, False
    cases = {"full": (yes,) * 5, "bare": (no, no, no, no, yes), "jd": (yes, no, no, no, yes)}
    one = torch.zeros(1, dtype=torch.int64)

    def call(q, k, scale, check, order, flags, out):
        return ops.heads(q, k, scale, spec_t, 3, check, torch.full((len(order),), 0.5, dtype=torch.float64),
                         order, None, None, None, None, *out, *flags)

    def head(m, flags):  # map m alone, into the first map's outputs
        q, k, s = maps[m]
        return call(q[None], k[None], torch.tensor([s], dtype=torch.float64), torch.ones(1, dtype=torch.bool),
                    one, flags, [t[:1] for t in outputs])

    linear = [bool(head(m, cases["full"])[0]) for m in range(M)]
    q_all, k_all = torch.stack([q for q, _, _ in maps]), torch.stack([k for _, k, _ in maps])
    scales = torch.tensor([s for _, _, s in maps], dtype=torch.float64)
    order = torch.tensor(sorted(range(M), key=lambda m: linear[m]), dtype=torch.int64)  # wide ones first
    times = {(name, kind): [] for name in cases for kind in ("linear", "wide")}
    window = []
    for _ in range(rounds):
        for name, flags in cases.items():
            spent = {"linear": 0.0, "wide": 0.0}
            for m, lin in enumerate(linear):
                t0 = time.perf_counter()
                head(m, flags)
                spent["linear" if lin else "wide"] += time.perf_counter() - t0
            for kind, t in spent.items():
                times[(name, kind)].append(t)
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        call(q_all, k_all, scales, torch.ones(M, dtype=torch.bool), order, cases["full"], outputs)
        window.append(time.perf_counter() - t0)
        torch.set_num_threads(1)
    n_wide = linear.count(False)
    print(f"{len(maps)} heads ({n_wide} wide), N = {N}, 1 thread, medians of {rounds} rounds:")
    for name in cases:
        lin = statistics.median(times[(name, "linear")]) * 1e3 / max(1, len(maps) - n_wide)
        wide = statistics.median(times[(name, "wide")]) * 1e3 / max(1, n_wide)
        extra = f", wide heads {wide:.3f} ms/head" if n_wide else ""
        print(f"  {name:5s} linear heads {lin:.3f} ms/head{extra}")
    spent = statistics.median(window) * 1e3
    print(f"  window: all {M} maps, full, in one call on {threads} threads: {spent:.1f} ms")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 9)
