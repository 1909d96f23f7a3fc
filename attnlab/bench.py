"""Benchmarks: ``attnlab bench attention | analysis | training | corpus | corpus-search | swap-eval``
(also ``python -m attnlab.bench``).

corpus-search [--tokens 100000] [--real-docs N]: a search of a corpus run's token index (cold: the
first, reading the index; warm: the median after it) and the index's bytes per million tokens
(attnlab/corpus/search_benchmark.py).

swap-eval [--shape bert|gpt2] [--variants dnas]: a swap-eval over 100 documents of 512 tokens on a
MiniLM-sized model against its plain forward (attnlab/swap_eval/benchmark.py).

analysis --causal SHAPE: a causal model of the long-context shape (LLaMA GQA, LLaMA MHA, GPT-2) at
512-8,192 tokens, the analysis against the plain forward, and peak RSS growth
(attnlab/hf/analysis/causal_benchmark.py).

Every figure is a ratio to a baseline measured in the same run (machines are shared and noisy), and
each is the median of several repeats. Tests never assert speed; docs/BENCHMARKS.md records runs.

attention: each variant's ``attend`` time / torch SDPA's time, for S = 512..4096 (B=1, H=12, D=64,
float32, no grad; ``--heads``, ``--head-dim``, ``--dtype`` change them), and peak extra memory (max RSS
growth of a fresh process running one call, CPU). On CUDA with triton, also attnlab.gpu's Triton
kernels called directly (labels "... triton"), until they are attend's CUDA fast path.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import subprocess
import sys
import time

import torch


def _gpu_fast_paths() -> dict:
    from attnlab.gpu import FAST_PATHS  # noqa: PLC0415 (imports torch only, never triton)

    return FAST_PATHS


def attention_cases() -> list[tuple[str, str | None, dict]]:
    """(label, variant, attend keyword arguments) measured by the attention benchmark, from the
    registry: SDPA (the baseline), every variant with a fused attend path at its defaults (Sinkhorn at
    1, 2 and 3 rounds), and "dnas+weights", the materializing path (what a naive implementation
    holds), for the memory comparison. Variants without a fused path materialize (S x S per head) and
    are left out: their cost is that of "dnas+weights"."""
    from attnlab.normalizers import variant_specs  # noqa: PLC0415

    cases: list[tuple[str, str | None, dict]] = [("sdpa", None, {})]
    for spec in variant_specs():
        if spec.fused is None:
            continue
        if spec.param("iters") is not None:
            cases += [(f"{spec.name}({n})", spec.name, {"iters": n}) for n in (1, 2, 3)]
        else:
            cases.append((spec.name, spec.name, {}))
    return [*cases, ("dnas+weights", "dnas", {"return_weights": True})]


CASES = attention_cases()
# Masked cases, each against SDPA with the same mask (query padding: against unmasked SDPA, which has
# no cheaper form of it): 10 % of the keys padded, 10 % of the queries padded, causal.
MASK_CASES = [("sdpa keys", None, {"_mask": "keys"}), ("dnas keys", "dnas", {"_mask": "keys"}),
              ("dnas queries", "dnas", {"_mask": "queries"}),
              ("sdpa causal", None, {"_mask": "causal"}), ("dnas causal", "dnas", {"_mask": "causal"}),
              ("hnas causal", "hnas", {"_mask": "causal"})]
# The variants with a Triton kernel path (attnlab.gpu.FAST_PATHS) through attnlab.gpu.fused_attend,
# measured on CUDA when it applies, until the kernels are attend's CUDA fast path.
TRITON_CASES = [(f"{lab} triton", var, kw) for lab, var, kw in CASES
                if var in _gpu_fast_paths() and "return_weights" not in kw]
SIZES = (512, 1024, 2048, 4096)
B, H, D = 1, 12, 64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _inputs(seq: int, device: str = "cpu", heads: int = H, head_dim: int = D, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(B, heads, seq, head_dim, generator=gen).to(device=device, dtype=dtype)
            for _ in range(3)]


@functools.lru_cache(maxsize=8)
def _mask(kind: str, seq: int, device: str) -> torch.Tensor:
    """The benchmark's padding masks (seeded, made once per size, outside the timed calls): 10 % of the
    keys ("keys", (B, 1, 1, S)) or of the queries ("queries", (B, 1, S, 1)) padded."""
    gen = torch.Generator().manual_seed(1)
    keep = (torch.rand(seq, generator=gen) > 0.1).to(device)
    return keep.view(1, 1, 1, -1) if kind == "keys" else keep.view(1, 1, -1, 1)


def _baseline(label: str, labels) -> str:
    """The SDPA case a label's ratio is taken against: SDPA with the same mask where there is one."""
    kind = label.split(" ")[-1]
    return f"sdpa {kind}" if f"sdpa {kind}" in labels else "sdpa"


def _call(variant, kwargs, q, k, v, triton: bool = False):
    import attnlab

    kwargs = dict(kwargs)
    kind = kwargs.pop("_mask", None)
    if kind == "causal":
        kwargs["causal"] = True
    elif kind is not None:
        kwargs["mask"] = _mask(kind, q.shape[-2], str(q.device))
    if variant is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=kwargs.get("mask"),
                                                                is_causal=kwargs.get("causal", False))
    if triton:
        from attnlab import gpu

        out = gpu.fused_attend(q, k, v, variant, **kwargs)
        if out is None:
            raise RuntimeError(f"attnlab.gpu.fused_attend does not apply to {variant} {kwargs}")
        return out
    return attnlab.attend(q, k, v, variant, **kwargs)


def _triton_applies(q) -> bool:
    from attnlab import gpu

    return q.device.type == "cuda" and gpu.available(q) and gpu.fused_attend(q, q, q, "dnas") is not None


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _interleaved_medians(fns: dict, repeats: int, device: str, cpu: dict | None = None) -> dict:
    """Median seconds per callable, measured in rounds that call each once (warm-up round first), so
    that load changes on a shared machine hit every case alike. With ``cpu`` (a dict), also the median
    CPU seconds of this process per call (all its threads; less sensitive to other processes' load)."""
    times = {name: [] for name in fns}
    cpu_times = {name: [] for name in fns}
    for round_ in range(repeats + 1):
        for name, fn in fns.items():
            _sync(device)
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            _sync(device)
            if round_:
                times[name].append(time.perf_counter() - t0)
                cpu_times[name].append(time.process_time() - c0)
    if cpu is not None:
        cpu.update({name: statistics.median(ts) for name, ts in cpu_times.items()})
    return {name: statistics.median(ts) for name, ts in times.items()}


def _peak_extra_mib(label: str, seq: int) -> float:
    """Peak RSS growth (MiB) during one call, in a fresh process after its inputs and a warm-up exist.

    Linux: VmHWM (the peak RSS of this process image) is reset through /proc/self/clear_refs just
    before the call and read after it; a fresh process keeps allocator caches of other cases out.
    """
    variant, kwargs = next((v, kw) for lab, v, kw in CASES if lab == label)
    code = f"""
import torch
from attnlab.bench import _inputs, _call
def status(key):
    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith(key)) / 1024
with torch.no_grad():
    _call({variant!r}, {kwargs!r}, *_inputs(64))
    q, k, v = _inputs({seq})
    before = status('VmRSS:')
    with open('/proc/self/clear_refs', 'w') as fh:
        fh.write('5')
    out = _call({variant!r}, {kwargs!r}, q, k, v)
    print(status('VmHWM:') - before)
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(res.stdout.strip().splitlines()[-1])


def bench_attention(sizes=SIZES, device: str = "cpu", memory: bool = True, repeats: int = 5,
                    heads: int = H, head_dim: int = D, dtype: str = "float32") -> dict:
    """Times (s) and ratios to SDPA per size (masked cases to SDPA with the same mask: MASK_CASES), and
    peak extra memory (MiB) per size (CPU only)."""
    results = {"sizes": list(sizes), "device": device, "heads": heads, "head_dim": head_dim, "dtype": dtype,
               "time_s": {}, "ratio": {}, "cpu_ratio": {}, "peak_extra_mib": {}}
    with torch.no_grad():
        for seq in sizes:
            q, k, v = _inputs(seq, device, heads, head_dim, DTYPES[dtype])
            reps = repeats if seq <= 2048 else max(3, repeats // 2)
            cases = [(lab, var, kw, False) for lab, var, kw in (*CASES, *MASK_CASES)]
            if _triton_applies(q):
                cases += [(lab, var, kw, True) for lab, var, kw in TRITON_CASES]
            fns = {lab: (lambda v_=var, kw=kw, t=t, x=(q, k, v): _call(v_, kw, *x, triton=t))
                   for lab, var, kw, t in cases}
            cpu: dict = {}
            t = _interleaved_medians(fns, reps, device, cpu)
            results["time_s"][seq] = t
            results["ratio"][seq] = {lab: t[lab] / t[_baseline(lab, t)] for lab in t}
            results["cpu_ratio"][seq] = {lab: cpu[lab] / max(cpu[_baseline(lab, cpu)], 1e-9) for lab in cpu}
            print(f"S={seq}: " + "  ".join(f"{lab} {r:.2f}x" for lab, r in results["ratio"][seq].items()),
                  flush=True)
            print(f"S={seq} (CPU time): " + "  ".join(
                f"{lab} {r:.2f}x" for lab, r in results["cpu_ratio"][seq].items()), flush=True)
    if memory and device == "cpu" and (heads, head_dim, dtype) == (H, D, "float32"):
        for seq in sizes:
            results["peak_extra_mib"][seq] = {lab: _peak_extra_mib(lab, seq) for lab, _, _ in CASES}
            print(f"S={seq} peak extra MiB: " + "  ".join(
                f"{lab} {m:.0f}" for lab, m in results["peak_extra_mib"][seq].items()), flush=True)
    return results


def machine() -> str:
    threads = torch.get_num_threads()
    cap = torch.backends.cpu.get_cpu_capability()
    cpu = f"{platform.machine()} {platform.processor() or ''}".strip()
    return f"{cpu}, torch {torch.__version__} ({cap}, {threads} threads)"


def attention_markdown(res: dict) -> str:
    labels = list(res["ratio"][res["sizes"][0]])  # sdpa first, then every case measured
    lines = ["| S | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for seq in res["sizes"]:
        r = res["ratio"][seq]
        cells = [f"{res['time_s'][seq]['sdpa'] * 1e3:.1f} ms"] + [f"{r[lab]:.2f}x" for lab in labels[1:]]
        lines.append(f"| {seq} | " + " | ".join(cells) + " |")
    if res.get("cpu_ratio"):
        lines += ["", "The same calls' CPU time (all threads of the process) over SDPA's:", "",
                  "| S | " + " | ".join(labels[1:]) + " |", "|---" * len(labels) + "|"]
        for seq in res["sizes"]:
            r = res["cpu_ratio"][seq]
            lines.append(f"| {seq} | " + " | ".join(f"{r[lab]:.2f}x" for lab in labels[1:]) + " |")
    if res["peak_extra_mib"]:
        labels = list(res["peak_extra_mib"][res["sizes"][0]])
        lines += ["", "Peak extra memory (MiB, max-RSS growth of a fresh process during one call):", "",
                  "| S | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
        for seq in res["sizes"]:
            m = res["peak_extra_mib"][seq]
            lines.append(f"| {seq} | " + " | ".join(f"{m[lab]:.0f}" for lab in labels) + " |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=["attention", "analysis", "training", "corpus", "corpus-search",
                                         "swap-eval"], help="which benchmark")
    parser.add_argument("--tokens", type=int, default=100_000, help="corpus-search: tokens of the index")
    parser.add_argument("--real-docs", type=int, default=0,
                        help="corpus-search: also index this many KJV chapters (MiniLM) for the size")
    parser.add_argument("--shape", choices=["bert", "gpt2"], default="bert",
                        help="swap-eval: a MiniLM-sized masked (bert) or causal (gpt2) LM")
    parser.add_argument("--variants", default="dnas", help="swap-eval: comma-separated variants swapped in")
    parser.add_argument("--docs", type=int, default=100, help="swap-eval: documents of 512 tokens")
    parser.add_argument("--variant-costs", action="store_true",
                        help="analysis: each variant's cost on one MiniLM window against unas' share")
    parser.add_argument("--memory-tokens", default="100000,1000000", help="corpus: tokens of the RSS runs")
    parser.add_argument("--memory-model", default="tiny",
                        help="corpus: RSS runs model: tiny (2-layer BERT, default), minilm or a directory")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="sequence lengths (attention)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per case (median)")
    parser.add_argument("--warmup", type=int, default=0,
                        help="analysis --causal: untimed forward-and-analysis rounds before the timed ones")
    parser.add_argument("--heads", type=int, default=H, help="attention: heads (B=1)")
    parser.add_argument("--head-dim", type=int, default=D, help="attention: head dimension D")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="attention: input dtype")
    parser.add_argument("--json", help="also write the results as JSON to this file")
    parser.add_argument("--causal", choices=["llama", "llama-mha", "gpt2"],
                        help="analysis: a causal model of this shape at --sizes tokens "
                        "(default 512,2048,8192)")


def run(args: argparse.Namespace) -> int:
    args.sizes_given = args.sizes != ",".join(map(str, SIZES))
    print(f"machine: {machine()}  device: {args.device}", flush=True)
    if args.what == "attention":
        sizes = tuple(int(s) for s in args.sizes.split(","))
        res = bench_attention(sizes, args.device, memory=not args.no_memory, repeats=args.repeats,
                              heads=args.heads, head_dim=args.head_dim, dtype=args.dtype)
        print(f"B=1, H={args.heads}, D={args.head_dim}, {args.dtype}")
        print()
        print(attention_markdown(res))
    elif args.what == "analysis" and args.causal:
        from attnlab.hf.analysis.causal_benchmark import benchmark_causal

        sizes = tuple(int(s) for s in args.sizes.split(",")) if args.sizes_given else (512, 2048, 8192)
        res = benchmark_causal(args.causal, sizes, repeats=args.repeats, memory=not args.no_memory,
                               warmup=args.warmup)
    elif args.what == "analysis" and args.variant_costs:
        from attnlab.hf.analysis.benchmark import variant_costs

        res = variant_costs(repeats=args.repeats)
        print(json.dumps(res, indent=2))
    elif args.what == "analysis":
        from attnlab.hf import benchmark_analysis

        res = benchmark_analysis()
        print(json.dumps(res, indent=2))
    elif args.what == "corpus":
        from attnlab.corpus.benchmark import benchmark_corpus

        tokens = () if args.no_memory else tuple(int(t) for t in args.memory_tokens.split(",") if t)
        res = benchmark_corpus(repeats=max(1, min(args.repeats, 2)), memory_tokens=tokens,
                               memory_model=None if args.memory_model == "minilm" else args.memory_model)
        print(json.dumps(res, indent=2, default=str))
    elif args.what == "corpus-search":
        from attnlab.corpus.search_benchmark import benchmark_search

        res = benchmark_search(tokens=args.tokens, repeats=args.repeats, real_docs=args.real_docs)
        print(json.dumps(res, indent=2, default=str))
    elif args.what == "swap-eval":
        from attnlab.swap_eval.benchmark import benchmark_swap_eval

        res = benchmark_swap_eval(args.shape, n_docs=args.docs, repeats=max(1, min(args.repeats, 3)),
                                  variants=tuple(v.strip() for v in args.variants.split(",") if v.strip()))
        print(json.dumps(res, indent=2, default=str))
    else:
        from attnlab.train.config import load_recipe
        from attnlab.train.speed import training_speed

        res = training_speed(load_recipe("enc-unas"), device=args.device)
        print(json.dumps(res, indent=2))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2, default=str)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnlab.bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
