"""Column-panel and held-scores kernels against the previous paths, in one run: ``attnlab.attend`` with
``kernel_paths.PANEL_BYTES`` and ``HELD_HEAD_BYTES`` at their values ("panel": panel_dnas, panel_hnas,
panel_sinkhorn), with the panels off ("held": held_attend) or with both off ("before": column LSE +
SDPA, mix_attend, the per-thread Sinkhorn kernel), interleaved rounds, medians of wall and CPU time,
ratios to SDPA (with the same key-padding mask for "+keymask"). B=1, H=12, D=64, float32, no grad.

    python scripts/bench_held.py 1024,2048,4096 5      # sizes, rounds
"""

import statistics
import sys
import time

import torch
import torch.nn.functional as F

import attnlab
from attnlab.normalizers import kernel_paths as kp

HELD, PANEL = kp.HELD_HEAD_BYTES, kp.PANEL_BYTES
VARIANTS = (("dnas", "dnas", {}), ("hnas", "hnas", {}), ("sinkhorn(3)", "sinkhorn", {"iters": 3}))


def timed(S: int, reps: int) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 12, S, 64) for _ in range(3))
    keys = torch.rand(1, 1, 1, S) > 0.1

    def case(variant, held, panel, **kw):
        def f():
            kp.HELD_HEAD_BYTES = HELD if held else 0
            kp.PANEL_BYTES = PANEL if panel else 0
            return attnlab.attend(q, k, v, variant, **kw)
        return f

    cases = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
             "sdpa+keymask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=keys)}
    for name, var, kw in (*VARIANTS, ("dnas+keymask", "dnas", {"mask": keys})):
        cases[name + " panel"] = case(var, True, True, **kw)
        cases[name + " held"] = case(var, True, False, **kw)
        cases[name + " before"] = case(var, False, False, **kw)
    wall = {n: [] for n in cases}
    cpu = {n: [] for n in cases}
    with torch.no_grad():
        for r in range(reps + 1):
            for n, f in cases.items():
                c0, t0 = time.process_time(), time.perf_counter()
                f()
                if r:
                    wall[n].append(time.perf_counter() - t0)
                    cpu[n].append(time.process_time() - c0)
    for label, d in (("wall", wall), ("cpu", cpu)):
        med = {n: statistics.median(x) for n, x in d.items()}
        ratios = [f"{n} {med[n] / med['sdpa+keymask' if 'keymask' in n else 'sdpa']:.2f}x"
                  for n in cases if not n.startswith("sdpa")]
        print(f"S={S} {label}: sdpa {med['sdpa'] * 1e3:.0f} ms; " + "  ".join(ratios), flush=True)
    kp.HELD_HEAD_BYTES, kp.PANEL_BYTES = HELD, PANEL


if __name__ == "__main__":
    for size in map(int, sys.argv[1].split(",")):
        timed(size, int(sys.argv[2]))
