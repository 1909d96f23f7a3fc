"""``python -m attnlab.bench corpus``: the corpus engine's speed and memory (docs/BENCHMARKS.md).

In one run, on the same model and the same texts (``n_docs`` KJV chapters cut to one 512-token
window each), interleaved, medians of ``repeats``:

    analyze_tok_s   hf.analyze(text, window=512) + .table() per text, every variant
    local_tok_s     analyze_corpus(engine="local") over the same texts as documents (counting pass,
                    rows with the key-class breakdown, Parquet shards, bootstrap summary included)
    ray_tok_s       the same with engine="ray" (``workers`` actors on a local Ray), and
    ray_start_s     ray.init + the first actor's model load (the start-up cost)

and, each in a fresh process (``attnlab corpus kjv --max-docs N``), the peak RSS (MiB) of runs over
about ``memory_tokens`` text tokens: it must not grow with the corpus.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["benchmark_corpus"]


def _texts(loaded, n_docs: int, n_tokens: int = 512) -> list[str]:
    from attnlab.corpus.sources import open_source
    from attnlab.hf.windows import special_affixes, tokenize_text

    prefix, suffix = special_affixes(loaded.tokenizer)
    out = []
    for doc in open_source("kjv"):
        ids = tokenize_text(loaded.tokenizer, "".join(doc.parts())).ids
        keep = n_tokens - len(prefix) - len(suffix)
        if len(ids) >= keep:
            out.append(loaded.tokenizer.decode(ids[:keep].tolist()))
        if len(out) == n_docs:
            return out
    raise RuntimeError(f"the KJV has fewer than {n_docs} chapters of {n_tokens} tokens")


def _docs_for_tokens(loaded, tokens: int) -> int:
    from attnlab.corpus.sources import open_source
    from attnlab.hf.windows import tokenize_text

    total = 0
    for i, doc in enumerate(open_source("kjv"), 1):
        total += len(tokenize_text(loaded.tokenizer, "".join(doc.parts())).ids)
        if total >= tokens:
            return i
    return i


def _peak_rss_mib(args: list[str]) -> tuple[float, float]:
    """(peak RSS MiB, seconds) of ``attnlab corpus ARGS`` in a fresh process."""
    code = ("import resource, sys; from attnlab.cli import main; rc = main(sys.argv[1:]); "
            "print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(rc)")
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", code, "corpus", *args], capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(res.stderr[-2000:])
    peak_kib = int(next(ln.split()[1] for ln in res.stdout.splitlines() if ln.startswith("PEAK")))
    return peak_kib / 1024, time.perf_counter() - t0


def benchmark_corpus(n_docs: int = 8, repeats: int = 2, workers: int = 2, model=None,
                     memory_tokens=(100_000, 1_000_000), memory_model=None, memory_variants="unas",
                     memory_window: int = 128) -> dict:
    import ray

    import attnlab
    from attnlab.corpus import analyze_corpus, ray_engine
    from attnlab.hf import analyze, load_model

    loaded = load_model(model)
    texts = _texts(loaded, n_docs)
    variants = tuple(attnlab.VARIANTS)
    tmp = Path(tempfile.mkdtemp(prefix="attnlab-bench-corpus-"))
    (tmp / "docs").mkdir()
    for i, t in enumerate(texts):
        (tmp / "docs" / f"{i:03d}.txt").write_text(t)
    analyze(texts[0], loaded, variants, window=512).table()  # warm-up
    t_ray0 = time.perf_counter()
    cluster = ray_engine.connect(None, workers)
    times = {"analyze": [], "local": [], "ray": []}
    tokens = None
    for r in range(repeats):
        t0 = time.perf_counter()
        n = 0
        for t in texts:
            res = analyze(t, loaded, variants, window=512)
            res.table()
            n += sum(len(w.tokens) for w in res.windows)
        times["analyze"].append(time.perf_counter() - t0)
        tokens = n
        t0 = time.perf_counter()
        analyze_corpus(str(tmp / "docs"), model, variants, out=tmp / f"local{r}", window=512, shard_docs=2)
        times["local"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = analyze_corpus(str(tmp / "docs"), model, variants, out=tmp / f"ray{r}", window=512,
                             shard_docs=2, engine="ray", workers=workers)
        times["ray"].append(time.perf_counter() - t0)
        if r == 0:
            ray_first_s = time.perf_counter() - t_ray0  # includes ray.init and the actors' model load
            first_run = out.manifest["last_run"]
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "model": loaded.info.name, "variants": list(variants), "n_docs": n_docs, "tokens": tokens,
        "repeats": repeats, "workers": workers, "seconds": med, "all_seconds": times,
        "analyze_tok_s": tokens / med["analyze"], "local_tok_s": tokens / med["local"],
        "ray_tok_s": tokens / med["ray"], "local_over_analyze": med["analyze"] / med["local"],
        "ray_overhead": med["ray"] / med["local"] - 1.0, "ray_init_s": cluster.started_s,
        "ray_first_run_s": ray_first_s, "ray_first_run": first_run,
        "load_average": list(__import__("os").getloadavg()),
    }
    ray.shutdown()
    result["memory"] = {}
    mem_loaded = load_model(memory_model)
    for target in memory_tokens:
        docs = _docs_for_tokens(mem_loaded, target)
        args = ["kjv", "--out", str(tmp / f"mem{target}"), "--max-docs", str(docs), "--variants",
                memory_variants, "--window", str(memory_window), "--quiet", "--bootstrap", "200"]
        if memory_model:
            args += ["--model", str(memory_model)]
        peak, seconds = _peak_rss_mib(args)
        manifest = json.loads((tmp / f"mem{target}" / "manifest.json").read_text())
        result["memory"][target] = {"documents": docs, "tokens": manifest["n_tokens"], "peak_rss_mib": peak,
                                    "seconds": seconds}
        print(f"memory: {manifest['n_tokens']} tokens, peak RSS {peak:.0f} MiB, {seconds:.0f} s", flush=True)
    result["self_peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result
