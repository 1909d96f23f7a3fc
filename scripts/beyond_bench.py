"""Numbers for docs/RESULTS.md and docs/BENCHMARKS.md (measures beyond weights), on the embedded MiniLM.

    python scripts/beyond_bench.py results  # KJV paragraphs: contributions, sinks, DNAS swaps, faithfulness
    python scripts/beyond_bench.py bench    # 512 tokens: contribution overhead, 72 interventions, peak RSS
    python scripts/beyond_bench.py interventions  # 512 tokens: the 72 DNAS swaps alone, vs a plain forward

Each part prints Markdown-ready lines. Timings are medians of ``--repeat`` runs measured side by side
in one process; peak memory is the process' maximum resident set (ru_maxrss) after each part.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from attnlab import VARIANTS, contributions, data, flow, hf  # noqa: E402
from attnlab.hf.beyond import faithfulness, interventions  # noqa: E402
from attnlab.hf.capture import values  # noqa: E402


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _md(df) -> str:
    """A DataFrame as a Markdown table (index as the first column)."""
    head = [str(df.index.name or ""), *map(str, df.columns)]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * len(head)) + " |"]
    for i, row in zip(df.index, df.values, strict=True):
        lines.append("| " + " | ".join([str(i), *(f"{x:.3f}" for x in row)]) + " |")
    return "\n".join(lines)


def _interleaved(fns, repeat: int) -> list[float]:
    """Median seconds of each function, timed round by round (one call of each per round)."""
    times = [[] for _ in fns]
    for _ in range(repeat):
        for t_list, fn in zip(times, fns, strict=True):
            t = time.perf_counter()
            fn()
            t_list.append(time.perf_counter() - t)
    return [statistics.median(t) for t in times]


def _median(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def results(chars: int) -> None:
    m = hf.load_model(None)
    text = data.load_corpus("kjv", max_chars=chars)
    r = hf.analyze(text, m, variants=VARIANTS, contributions=True)  # every registered variant
    print(
        f"text: first {chars} characters of the KJV corpus, {r.n_windows} windows of "
        f"{r.windowing.window} tokens"
    )
    print(
        "\n| variant | keys explained away by weight | of those, not by contribution | by contribution only |"
    )
    print("| --- | ---: | ---: | ---: |")
    for v in VARIANTS:
        by_w = by_w_not_c = by_c_only = total = 0
        for w in r.windows:
            wt, norms = w.weights[v], w.values[v].norms
            L, H, M, N = wt.shape
            m_rel = wt.sum(-2) * (N / M)
            c = contributions.contribution_mass(wt, norms)
            c_rel = contributions.relative_contribution(c, M) * (N / M)
            aw, ac = m_rel < 0.1, c_rel < 0.1
            by_w += int(aw.sum())
            by_w_not_c += int((aw & ~ac).sum())
            by_c_only += int((ac & ~aw).sum())
            total += aw.numel()
        print(
            f"| {v} | {by_w} ({by_w / total:.2%}) | {by_w_not_c} ({by_w_not_c / max(by_w, 1):.0%}) "
            f"| {by_c_only} |"
        )
    import pandas as pd

    sink = pd.concat([w.sinks() for w in r.windows])
    for stat in ("sink_mass_first", "sink_mass_special", "explained_away_relative_no_sinks"):
        piv = sink[sink.statistic == stat].groupby(["variant", "layer"]).value.mean().unstack()
        piv = piv.reindex([v for v in VARIANTS if v in piv.index])
        print(f"\n{stat} (mean over heads, rows, windows), rows = variant, columns = layer")
        print(_md(piv))
    t = r.table()
    ea = t[t.statistic == "explained_away_relative"].groupby("variant").value.mean()
    print("\nexplained_away_relative with sinks:", ea.round(4).to_dict())
    w0 = r.windows[0]
    ids = torch.tensor([w0.window.input_ids])
    res = interventions.head_interventions(m, ids, "dnas")
    pooled = res.measures["pooled_cosine"]
    top = torch.topk(pooled.reshape(-1), 8)
    print(f"\nDNAS swap, window 0 ({ids.shape[1]} tokens): top heads by pooled cosine distance")
    for val, idx in zip(top.values.tolist(), top.indices.tolist(), strict=True):
        L_, H_ = divmod(idx, pooled.shape[1])
        print(
            f"  layer {L_} head {H_}: pooled {val:.4f}, "
            f"hidden {float(res.measures['hidden_cosine'][L_, H_]):.4f}"
        )
    print(f"  per layer, mean pooled: {[round(x, 4) for x in pooled.mean(1).tolist()]}")
    print(
        f"  median head: {float(pooled.median()):.5f}; max/median {float(pooled.max() / pooled.median()):.1f}"
    )
    lines = [line for line in text.split("\n") if line.strip()]
    short = " ".join(lines[1:3])  # Genesis 1:2-3 (docs/RESULTS.md)
    fa = faithfulness.faithfulness(m, short)
    print(f"\nfaithfulness on Genesis 1:2-3 ({fa.table.n_tokens.iloc[0]} tokens):")
    print(_md(fa.table.pivot(index="variant", columns="measure", values="tau")))
    print("notes:", fa.notes)


def bench(repeat: int, interventions_too: bool = True) -> None:
    m = hf.load_model(None)
    text = data.load_corpus("kjv", max_chars=6000)
    ids = m.tokenizer(text, truncation=True, max_length=512, return_tensors="pt")["input_ids"]
    assert ids.shape[1] == 512
    net, L = m.model, m.info.n_layers
    paths = values.value_paths(net)
    print(f"threads: {torch.get_num_threads()}, load average: {os.getloadavg()}")
    print(f"RSS after loading: {_rss_mb():.0f} MB")

    def plain():
        with torch.no_grad():
            net(input_ids=ids)

    def capture():
        with torch.no_grad(), hf.capture_qk(net, stop_after=L):
            net(input_ids=ids)

    def capture_values():
        with torch.no_grad(), hf.capture_qk(net, stop_after=L), values.record_values(net, paths) as fw:
            net(input_ids=ids)
        values.summarize(fw[0], paths)

    with torch.no_grad(), values.record_values(net, paths) as recorded:
        net(input_ids=ids)

    def norms_only():
        values.summarize(recorded[0], paths)

    plain()
    t_plain, t_cap, t_val, t_norms = _interleaved((plain, capture, capture_values, norms_only), repeat)
    print(
        f"value norms alone (values.summarize): {t_norms * 1e3:.0f} ms = "
        f"{t_norms / t_plain:.3f}x a plain forward"
    )
    print(
        f"plain forward {t_plain * 1e3:.0f} ms; q/k capture forward {t_cap * 1e3:.0f} ms; "
        f"with values + norms + Gram {t_val * 1e3:.0f} ms"
    )
    print(f"contribution overhead: {(t_val - t_cap) / t_plain:.3f}x a plain forward")
    r = hf.analyze(text, m, variants=VARIANTS, window=512, contributions=True)
    w = r.windows[0]
    t_tab = _median(
        lambda: contributions.contribution_table(w.weights, {v: s.norms for v, s in w.values.items()}), repeat
    )
    t_layer = _median(lambda: w.layer_contribution_norms("dnas", 0), repeat)
    print(
        f"contribution statistics, {len(VARIANTS)} variants: {t_tab * 1e3:.0f} ms ({t_tab / t_plain:.2f}x); "
        f"layer-level norm, one layer (512 x 512, blocks of {contributions.BLOCK_ROWS} rows): "
        f"{t_layer * 1e3:.0f} ms"
    )
    print(f"RSS after contributions: {_rss_mb():.0f} MB")
    if not interventions_too:
        return
    t_iv = _median(lambda: interventions.head_interventions(m, ids, "dnas"), max(1, repeat // 2))
    print(
        f"interventions, all {L * m.info.n_heads} heads to DNAS at 512 tokens: {t_iv:.1f} s "
        f"({t_iv / t_plain:.0f}x a plain forward); RSS peak {_rss_mb():.0f} MB"
    )
    weights = hf.analyze(text[:600], m, variants=("unas",)).weights["unas"]
    n = weights.shape[-1]
    t_flow = _median(lambda: flow.attention_flow(weights, [0]), 1)
    print(
        f"flow, one output of {n} tokens x {L} layers: {t_flow:.2f} s "
        f"({flow.flow_work(L, n, 1) / t_flow:.2g} edge visits / s)"
    )


def bench_interventions(repeat: int) -> None:
    """All L x H heads of MiniLM swapped to DNAS at 512 tokens, against a plain forward (interleaved);
    peak RSS of this process (fresh: the model and the interventions only)."""
    m = hf.load_model(None)
    text = data.load_corpus("kjv", max_chars=6000)
    ids = m.tokenizer(text, truncation=True, max_length=512, return_tensors="pt")["input_ids"]
    assert ids.shape[1] == 512
    L, H = m.info.n_layers, m.info.n_heads
    print(f"threads: {torch.get_num_threads()}, load average: {os.getloadavg()}")
    print(f"RSS after loading: {_rss_mb():.0f} MB")

    def plain():
        with torch.no_grad():
            m.model(input_ids=ids)

    plain()
    t_plain, t_iv = _interleaved((plain, lambda: interventions.head_interventions(m, ids, "dnas")), repeat)
    print(
        f"plain forward {t_plain * 1e3:.0f} ms; interventions, all {L * H} heads to DNAS at 512 tokens: "
        f"{t_iv:.1f} s = {t_iv / t_plain:.1f}x a plain forward (medians of {repeat}); "
        f"peak RSS {_rss_mb():.0f} MB; load average after: {os.getloadavg()}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=("results", "bench", "interventions"))
    p.add_argument("--chars", type=int, default=4000, help="characters of the KJV corpus for results")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--no-interventions", action="store_true", help="bench: skip the interventions and flow")
    a = p.parse_args()
    if a.part == "results":
        results(a.chars)
    elif a.part == "interventions":
        bench_interventions(a.repeat)
    else:
        bench(a.repeat, not a.no_interventions)


if __name__ == "__main__":
    main()
