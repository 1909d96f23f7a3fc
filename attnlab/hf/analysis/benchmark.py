"""``benchmark_analysis``: the "Real-model analysis" figures of docs/BENCHMARKS.md.

Warm analysis of 512 tokens of English with MiniLM (all four variants, every statistic) against the
model's own plain forward on the same tokens, measured in one run, interleaved, medians.
``variant_costs`` (``python -m attnlab.bench analysis --variant-costs``): what each variant adds to the
analysis of one window, against unas' own share (issue 32: softmax1 and sparsemax <= 1.5x unas').
"""

from __future__ import annotations

import statistics
import time

import torch

from attnlab.hf.analysis.pipeline import analyze
from attnlab.hf.capture.windows import special_affixes, tokenize_text
from attnlab.hf.load.loading import LoadedModel, load_model

__all__ = ["benchmark_analysis", "variant_costs"]

_BENCH_TEXT = (
    "Attention lets every word of a sentence look at every other word and decide how much each one "
    "matters. In the usual formulation the weights of a query are normalized over the keys, so a key "
    "that no query wants can be ignored entirely: it is explained away. Doubly normalized attention "
    "first normalizes over the queries and then over the keys, which guarantees that every key keeps "
    "a minimum share of the attention. A hybrid mixes both with a learned weight per head. "
)


def _timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def benchmark_analysis(n_tokens: int = 512, repeats: int = 5, model=None, threads: int | None = None) -> dict:
    """Warm analysis time of ``n_tokens`` tokens of English (one window, all four variants, every
    statistic of ``attnlab.stats.tidy_table``) and the model's plain forward time, in one run.

    Returns medians in seconds: ``analyse_s`` (tokenize, forward with capture, weights, statistics),
    ``weights_s`` (``analyze`` alone: it computes the statistics' row sums together with the weights),
    ``statistics_s`` (``table()`` from those sums), ``weights_on_access_s`` (reading every variant's
    weights afterwards: they are computed on first access, not by the analysis), ``forward_s`` (the
    model's own forward on the same tokens) and ``ratio_to_forward`` = analyse_s / forward_s.
    ``threads`` sets torch's CPU threads for the run (restored afterwards).
    """
    previous_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _benchmark(n_tokens, repeats, model)
    finally:
        torch.set_num_threads(previous_threads)


def _window(loaded: LoadedModel, n_tokens: int) -> tuple[str, torch.Tensor]:
    """(text, input_ids (1, n_tokens)): English of exactly one window of n_tokens tokens."""
    text = _BENCH_TEXT * (n_tokens // 60 + 2)
    prefix, suffix = special_affixes(loaded.tokenizer)
    tokenized = tokenize_text(loaded.tokenizer, text)
    ids = [*prefix, *tokenized.ids[: n_tokens - len(prefix) - len(suffix)].tolist(), *suffix]
    return loaded.tokenizer.decode(ids, skip_special_tokens=True), torch.tensor([ids])


def variant_costs(n_tokens: int = 512, repeats: int = 7, model=None,
                  extras=("dnas", "hnas", "sinkhorn", "softmax1", "sparsemax")) -> dict:
    """Median seconds of the model's plain forward and of ``analyze(variants) + table()`` for unas alone
    and for unas plus each of ``extras`` (one window, interleaved): unas' share = unas - forward,
    a variant's cost = (unas + variant) - unas, and its ratio to unas' share."""
    loaded = model if isinstance(model, LoadedModel) else load_model(model)
    text, input_ids = _window(loaded, n_tokens)
    sets = {"unas": ("unas",), **{v: ("unas", v) for v in extras}}

    def forward():
        with torch.no_grad():
            loaded.model(input_ids=input_ids)

    runs = {"forward": forward, **{name: (lambda vs=vs: analyze(text, loaded, vs, window=n_tokens).table())
                                    for name, vs in sets.items()}}
    for fn in runs.values():  # warm-up (kernels built, caches filled)
        fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):  # interleaved: a load change on a shared machine hits all alike
        for name, fn in runs.items():
            times[name] += _timed(fn, 1)
    med = {name: statistics.median(t) for name, t in times.items()}
    share = med["unas"] - med["forward"]
    return {"model": loaded.info.name, "n_tokens": int(input_ids.shape[1]), "repeats": repeats,
            "torch_threads": torch.get_num_threads(), "median_s": med, "unas_share_s": share,
            "cost_s": {v: med[v] - med["unas"] for v in extras},
            "cost_over_unas_share": {v: (med[v] - med["unas"]) / share for v in extras}, "target": 1.5}


def _benchmark(n_tokens: int, repeats: int, model) -> dict:
    loaded = model if isinstance(model, LoadedModel) else load_model(model)
    text, input_ids = _window(loaded, n_tokens)

    def forward():
        with torch.no_grad():
            loaded.model(input_ids=input_ids)

    def analyse():
        result = analyze(text, loaded, window=n_tokens)
        result.table()
        return result

    result = analyse()  # warm-up
    if result.n_windows != 1:
        raise RuntimeError(f"benchmark text spans {result.n_windows} windows; expected one")
    window = result.windows[0]
    forward()
    t_forward, t_analyse, t_weights, t_stats, t_access = [], [], [], [], []
    for _ in range(repeats):  # interleaved, so that load changes on a shared machine hit all alike
        t_forward += _timed(forward, 1)
        t_analyse += _timed(analyse, 1)
        t_weights += _timed(lambda: analyze(text, loaded, window=n_tokens), 1)
        t_stats += _timed(window.table, 1)
        fresh = analyze(text, loaded, window=n_tokens).windows[0].weights
        t_access += _timed(fresh.values, 1)  # every variant's weights, computed on first access
        del fresh
    fwd, total = statistics.median(t_forward), statistics.median(t_analyse)
    return {
        "model": loaded.info.name,
        "n_tokens": len(window.tokens),
        "n_windows": result.n_windows,
        "variants": list(result.variants),
        "repeats": repeats,
        "torch_threads": torch.get_num_threads(),
        "forward_s": fwd,
        "analyse_s": total,
        "weights_s": statistics.median(t_weights),
        "statistics_s": statistics.median(t_stats),
        "weights_on_access_s": statistics.median(t_access),
        "ratio_to_forward": total / fwd,
        "targets": {"analyse_s": 1.5, "ratio_to_forward": 1.2},
        "torch": torch.__version__,
    }
