"""``benchmark_causal``: the "Causal models at long context" figures of docs/BENCHMARKS.md.

A causal model of a given shape with random weights (seeded) is built from its config and saved once
(safetensors, MiniLM's WordPiece tokenizer with the model's positions), then for each N: the model's
plain SDPA forward on N tokens and ``hf.analyze(text, model).table()`` (default variants, every
statistic, one whole-context window) are timed in one run, interleaved, medians; the peak RSS growth
over the RSS after loading is measured in a fresh subprocess per N (so one N's peak does not hide
another's).

    python -m attnlab.bench analysis --causal llama --sizes 512,2048,8192
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

__all__ = ["SHAPES", "benchmark_causal", "build_model"]

# The shapes of the long-context issue: 12 layers, hidden 768, 12 heads, intermediate 2048 (LLaMA with
# 4 KV heads, the same with 12 = MHA) and a GPT-2 of the same size.
SHAPES = {
    "llama": ("LlamaConfig", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                  num_key_value_heads=4, intermediate_size=2048)),
    "llama-mha": ("LlamaConfig", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                      num_key_value_heads=12, intermediate_size=2048)),
    "gpt2": ("GPT2Config", dict(n_embd=768, n_layer=12, n_head=12, n_inner=2048, bos_token_id=0,
                                eos_token_id=0)),
}


def build_model(shape: str, positions: int, directory: str | os.PathLike) -> Path:
    """Save a random ``shape`` model with ``positions`` positions (seed 0) and a WordPiece tokenizer in
    ``directory`` (reused when it is already there)."""
    import transformers

    from attnlab.hf.load.loading import default_model_path

    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {shape!r}")
    directory = Path(directory)
    if (directory / "config.json").exists():
        return directory
    cls, fields = SHAPES[shape]
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True)
    tokenizer.model_max_length = positions
    key = "n_positions" if shape == "gpt2" else "max_position_embeddings"
    config = getattr(transformers, cls)(vocab_size=len(tokenizer), **fields, **{key: positions})
    torch.manual_seed(0)
    transformers.AutoModel.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _text_of(loaded, n: int) -> tuple[str, torch.Tensor]:
    """A text of exactly n tokens (special tokens included) for this tokenizer, and its ids (1, n)."""
    from attnlab.hf.analysis.benchmark import _BENCH_TEXT
    from attnlab.hf.capture.windows import special_affixes, tokenize_text

    prefix, suffix = special_affixes(loaded.tokenizer)
    tokenized = tokenize_text(loaded.tokenizer, _BENCH_TEXT * (n // 50 + 2))
    ids = [*prefix, *tokenized.ids[: n - len(prefix) - len(suffix)].tolist(), *suffix]
    return loaded.tokenizer.decode(ids, skip_special_tokens=True), torch.tensor([ids])


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_growth(directory: str, n: int) -> dict:
    """In this process: load the model, then analyse n tokens (analysis + table) while a thread samples
    the RSS every 5 ms; -> {"rss_after_load_mib", "peak_growth_mib", "memory_run_s" (that cold run)}."""
    from attnlab import hf

    loaded = hf.load_model(directory)
    text, _ = _text_of(loaded, n)
    base = _rss()
    peak, done = [base], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    hf.analyze(text, loaded).windows[0].table()
    elapsed = time.perf_counter() - t0
    done.set()
    thread.join()
    peak[0] = max(peak[0], _rss())
    return {"rss_after_load_mib": base / 2**20, "peak_growth_mib": (peak[0] - base) / 2**20,
            "memory_run_s": elapsed}


def benchmark_causal(shape: str = "llama", sizes=(512, 2048, 8192), repeats: int = 3, memory: bool = True,
                     directory: str | None = None, warmup: int = 0) -> dict:
    """{N: {forward_s, analyse_s, ratio_to_forward, forward_runs_s, analyse_runs_s, peak_growth_mib}} for
    the ``shape`` model (medians of ``repeats`` interleaved runs, and each run's seconds; at most 3 from
    N = 4096 on, where one analysis takes half a minute on 2 cores: single runs there varied by 15 % on a
    virtual machine, docs/BENCHMARKS.md). ``warmup`` untimed forward-and-analysis rounds go first at each
    N: on this project's VM the first two analyses at 8,192 tokens took 1.37-1.43x and the next
    1.19-1.20x (docs/BENCHMARKS.md, "Twenty-first session")."""
    from attnlab import hf

    if isinstance(warmup, bool) or not hasattr(warmup, "__index__") or int(warmup) < 0:
        raise ValueError(f"warmup must be a non-negative int (untimed rounds), got {warmup!r}")
    warmup = int(warmup)  # (a numpy integer: a Python int)
    sizes = tuple(int(n) for n in sizes)
    directory = directory or os.path.join(tempfile.gettempdir(), f"attnlab-bench-{shape}-{max(sizes)}")
    build_model(shape, max(sizes), directory)
    loaded = hf.load_model(directory)
    out = {"shape": shape, "config": SHAPES[shape][1], "torch_threads": torch.get_num_threads(),
           "variants": list(hf.analyze("warm up", loaded).variants), "sizes": {}}
    for n in sizes:
        text, ids = _text_of(loaded, n)
        reps = repeats if n < 4096 else min(repeats, 3)

        def forward(ids=ids):
            with torch.no_grad():
                loaded.model(input_ids=ids, use_cache=False)

        def analyse(text=text, n=n):
            result = hf.analyze(text, loaded)
            if result.n_windows != 1 or len(result.windows[0].tokens) != n:
                raise RuntimeError(f"expected one window of {n} tokens, got {result.n_windows}")
            result.windows[0].table()

        for _ in range(warmup):
            forward()
            analyse()
        t_fwd, t_an = [], []
        for _ in range(reps):
            for fn, times in ((forward, t_fwd), (analyse, t_an)):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        fwd, an = statistics.median(t_fwd), statistics.median(t_an)
        row = {"forward_s": fwd, "analyse_s": an, "ratio_to_forward": an / fwd, "repeats": reps,
               "warmup": warmup, "forward_runs_s": t_fwd, "analyse_runs_s": t_an}
        if memory:
            code = ("import json, sys; from attnlab.hf.analysis.causal_benchmark import peak_growth; "
                    f"print(json.dumps(peak_growth({str(directory)!r}, {n})))")
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
        out["sizes"][n] = row
        print(json.dumps({n: row}), file=sys.stderr, flush=True)
    return out
