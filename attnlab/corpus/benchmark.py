"""``python -m attnlab.bench corpus``: the corpus engine's speed and memory (docs/BENCHMARKS.md).

In one run, on the same model and the same texts (``n_docs`` KJV chapters cut to one 512-token
window each), interleaved, medians of ``repeats``:

    analyze         hf.analyze(text, window=512) + .table() per text, every variant
    local           analyze_corpus(engine="local") over the same texts as documents: the whole call
                    (counting pass, rows with the key-class breakdown, Parquet shards, bootstrap
                    summary), and its analysis alone (``analyse_s``)
    ray             the same with engine="ray" (``workers`` single-threaded actors on a local Ray,
                    started once before the repeats: ``ray_init_s``), split into start-up (the actors
                    importing attnlab and loading the model: ``startup_s``, paid once per run) and
                    the steady state (``steady_s``, from the first actor ready to the last shard)

Ratios: ``local_over_analyze`` = analyze seconds / local seconds (target >= 0.8); ``ray_overhead``
= ray / local - 1 for the whole call and ``ray_steady_overhead`` = ray steady / local analysis - 1
(target <= 0.15). CPU seconds (this process, and the actors' own) are recorded beside the wall
times: on a loaded machine they show the work done, independently of how the cores were shared.

Peak memory: each in a fresh process (``attnlab corpus kjv --max-docs N --variants unas --window
128``), the peak RSS (MiB) of runs over about ``memory_tokens`` text tokens: it must not grow with
the corpus. ``memory_model="tiny"`` (default) is a 2-layer x 4-head BERT built from a config with
MiniLM's tokenizer (so that 1 M tokens take minutes); None = MiniLM-L6; else a model directory.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["benchmark_corpus"]


def _texts(loaded, n_docs: int, n_tokens: int = 512) -> list[str]:
    from attnlab.corpus.sources import open_source
    from attnlab.hf.capture.windows import special_affixes, tokenize_text

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
    from attnlab.hf.capture.windows import tokenize_text

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


def build_tiny_bert(directory: Path, positions: int = 128, seed: int = 0) -> Path:
    """A random 2-layer x 4-head BERT (width 32) with MiniLM's tokenizer, saved to ``directory``."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from attnlab.hf import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True)
    tokenizer.model_max_length = positions
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=positions)
    BertModel(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _timed(fn):
    """(result, wall seconds, CPU seconds of this process) of fn()."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def benchmark_corpus(n_docs: int = 8, repeats: int = 2, workers: int = 2, model=None,
                     memory_tokens=(100_000, 1_000_000), memory_model="tiny", memory_variants="unas",
                     memory_window: int = 128, shard_docs: int = 2) -> dict:
    import os

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
    cluster = ray_engine.connect(None, workers)
    load = [os.getloadavg()[0]]
    keys = ("analyze", "analyze_cpu", "local", "local_cpu", "local_analyse", "ray", "ray_startup",
            "ray_steady", "ray_actor_cpu", "ray_driver_cpu")
    times: dict[str, list[float]] = {k: [] for k in keys}
    tokens = None
    corpus = dict(window=512, shard_docs=shard_docs)

    def analyze_all():
        n = 0
        for t in texts:
            res = analyze(t, loaded, variants, window=512)
            res.table()
            n += sum(len(w.tokens) for w in res.windows)
        return n

    for r in range(repeats):
        tokens, s, c = _timed(analyze_all)
        times["analyze"].append(s)
        times["analyze_cpu"].append(c)
        res, s, c = _timed(lambda r=r: analyze_corpus(str(tmp / "docs"), model, variants,
                                                      out=tmp / f"local{r}", **corpus))
        times["local"].append(s)
        times["local_cpu"].append(c)
        times["local_analyse"].append(res.manifest["last_run"]["s"])
        res, s, _ = _timed(lambda r=r: analyze_corpus(str(tmp / "docs"), model, variants,
                                                      out=tmp / f"ray{r}", engine="ray", workers=workers,
                                                      **corpus))
        last = res.manifest["last_run"]
        times["ray"].append(s)
        times["ray_startup"].append(last["startup_s"])
        times["ray_steady"].append(last["steady_s"])
        times["ray_actor_cpu"].append(last["cpu_s"])
        times["ray_driver_cpu"].append(last["driver_cpu_s"])
        load.append(os.getloadavg()[0])
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "model": loaded.info.name, "variants": list(variants), "n_docs": n_docs, "tokens": tokens,
        "repeats": repeats, "workers": workers, "shard_docs": shard_docs, "median_s": med,
        "all_s": times, "analyze_tok_s": tokens / med["analyze"], "local_tok_s": tokens / med["local"],
        "ray_tok_s": tokens / med["ray"], "ray_steady_tok_s": tokens / med["ray_steady"],
        "local_over_analyze": med["analyze"] / med["local"],
        "local_over_analyze_cpu": med["analyze_cpu"] / med["local_cpu"],
        "ray_overhead": med["ray"] / med["local"] - 1.0,
        "ray_steady_overhead": med["ray_steady"] / med["local_analyse"] - 1.0,
        "ray_init_s": cluster.started_s, "ray_startup_s": med["ray_startup"],
        "load_average_1min": load,
    }
    ray.shutdown()
    print(f"throughput: analyze {result['analyze_tok_s']:.1f} tok/s, local {result['local_tok_s']:.1f} "
          f"({result['local_over_analyze']:.2f}x), ray overhead {result['ray_overhead']:+.0%} "
          f"(steady state {result['ray_steady_overhead']:+.0%}, start-up {med['ray_startup']:.1f} s, "
          f"ray.init {cluster.started_s:.1f} s)", flush=True)
    result["memory"] = _memory(tmp, memory_tokens, memory_model, memory_variants, memory_window)
    return result


def _memory(tmp: Path, memory_tokens, memory_model, variants: str, window: int) -> dict:
    from attnlab.hf import load_model

    if memory_model == "tiny":
        memory_model = build_tiny_bert(tmp / "tiny-bert", positions=max(window, 8))
    mem_loaded = load_model(memory_model)
    out = {}
    for target in memory_tokens:
        docs = _docs_for_tokens(mem_loaded, target)
        args = ["kjv", "--out", str(tmp / f"mem{target}"), "--max-docs", str(docs), "--variants",
                variants, "--window", str(window), "--quiet", "--bootstrap", "200"]
        if memory_model:
            args += ["--model", str(memory_model)]
        peak, seconds = _peak_rss_mib(args)
        manifest = json.loads((tmp / f"mem{target}" / "manifest.json").read_text())
        out[target] = {"documents": docs, "tokens": manifest["n_tokens"], "peak_rss_mib": peak,
                       "seconds": seconds, "model": str(memory_model or "MiniLM-L6"), "window": window}
        print(f"memory: {manifest['n_tokens']} tokens, peak RSS {peak:.0f} MiB, {seconds:.0f} s", flush=True)
    return out
