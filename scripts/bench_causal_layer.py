"""One causal layer, side by side: torch's SDPA (is_causal) against attnlab's causal analysis kernel
(``causal_heads`` with the attention output, as inside the capture forward), on random q, k, v of a
12-head layer of head dim 64 (KV_HEADS key/value heads; the kernel once with k and v repeated to 12
heads, once reading each KV head once), interleaved rounds, medians. docs/BENCHMARKS.md, "Fourteenth
session". Nothing is asserted (speed is measured, not tested).

    python3 scripts/bench_causal_layer.py N [KV_HEADS] [ROUNDS]      # e.g. 8192 4 3
"""

import statistics
import sys
import time

import torch
import torch.nn.functional as F

from attnlab.hf.compute.causal_kernel import causal_kernel

H, D, S = 12, 64, 2  # query heads, head dim, key masks


def layer_inputs(n: int, heads: int = H, kv_heads: int = 4) -> tuple:
    """Seeded q (heads, n, D), k and v (kv_heads, n, D), and S key masks (the first and the last key)."""
    torch.manual_seed(0)
    q = torch.randn(heads, n, D)
    k, v = torch.randn(kv_heads, n, D), torch.randn(kv_heads, n, D)
    spec = torch.zeros(S, n)
    spec[0, 0] = spec[1, -1] = 1.0
    return q, k, v, spec


def analyse(kernel, q, keys, values, spec) -> None:
    """One call of the kernel as the capture forward makes it: every sum, the output, softmax1's."""
    heads, n = q.shape[:2]
    sums = [torch.zeros(3, heads, n) for _ in range(4)]  # cols, rowsum, entropy, distance
    special, js, s1 = torch.zeros(3, heads, n, S), torch.zeros(2, heads, n), torch.zeros(2, heads, n)
    kernel(q, keys, D**-0.5, 0.0, 0, torch.full((heads,), 0.5), spec, *sums, special, js, values,
           torch.empty(n, heads, D), s1)


def main(n: int, kv_heads: int = 4, rounds: int = 3) -> dict:
    kernel = causal_kernel()
    if kernel is None:
        raise SystemExit("attnlab's causal analysis kernel is not built here (needs AVX-512)")
    q, k, v, spec = layer_inputs(n, H, kv_heads)
    rep = H // kv_heads
    k_rep, v_rep = k.repeat_interleave(rep, 0).contiguous(), v.repeat_interleave(rep, 0).contiguous()

    def analysis(keys, values):
        analyse(kernel, q, keys, values, spec)

    def sdpa():
        F.scaled_dot_product_attention(q[None], k_rep[None], v_rep[None], is_causal=True)

    cases = {"sdpa": sdpa, "kernel": lambda: analysis(k_rep, v_rep), "kernel_gqa": lambda: analysis(k, v)}
    times: dict = {name: [] for name in cases}
    for _ in range(rounds):
        for name, run in cases.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(n, {name: round(t, 3) for name, t in med.items()},
          "ratio", round(med["kernel"] / med["sdpa"], 2), round(med["kernel_gqa"] / med["sdpa"], 2))
    return med


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:4]]
    main(*args) if args else main(2048)
