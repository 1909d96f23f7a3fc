"""``python -m attnlab.corpus.clark``: Clark et al. 2019's per-layer attention to [CLS], [SEP] and
punctuation, re-measured on the embedded MiniLM-L6 over >= 1,000 segments of 128 tokens of the
shipped KJV corpus, for every registered variant, with 95 % bootstrap CIs over documents (chapters).

One command runs (or resumes) the corpus job, writes the figure (docs/figures/corpus_clark.png when
Chromium is available; .html with --html), its data (corpus_clark.csv) and prints the Markdown table
of docs/RESULTS.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

STATISTICS = ("received:special:[CLS]", "received:special:[SEP]", "received:punctuation")
MAX_DOCS = 116  # the first 116 chapters give 1,002 windows of 128 tokens (overlap 0) with MiniLM
SEGMENTS = 1000


def table_markdown(summary, statistics=STATISTICS) -> str:
    rows = summary[(summary["head"] == -1) & summary["statistic"].isin(statistics)]
    variants = list(dict.fromkeys(rows["variant"]))
    lines = []
    for stat in statistics:
        part = rows[rows["statistic"] == stat]
        lines += [f"**{stat.removeprefix('received:').removeprefix('special:')}** (mean over heads; "
                  "95 % CI over chapters)", "", "| layer | " + " | ".join(variants) + " |",
                  "|---" * (len(variants) + 1) + "|"]
        for layer in sorted(part["layer"].unique()):
            cells = []
            for v in variants:
                r = part[(part["variant"] == v) & (part["layer"] == layer)].iloc[0]
                cells.append(f"{r['mean']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]")
            lines.append(f"| {layer} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    from attnlab.corpus import analyze_corpus
    from attnlab.figures.app_views import figure_bytes
    from attnlab.figures.corpus import layer_curves

    p = argparse.ArgumentParser(prog="python -m attnlab.corpus.clark", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/corpus-clark", help="run directory (resumed if it exists)")
    p.add_argument("--figures", default="docs/figures", help="where the figure goes")
    p.add_argument("--max-docs", type=int, default=MAX_DOCS)
    p.add_argument("--engine", choices=("local", "ray"), default="local")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--html", action="store_true", help="also write the interactive HTML figure")
    args = p.parse_args(argv)
    result = analyze_corpus("kjv", out=args.out, window=128, overlap=0, max_docs=args.max_docs,
                            engine=args.engine, workers=args.workers, progress=True)
    summary = result.summary()
    windows = int(summary[summary["head"] == -1]["n_windows"].max())
    if windows < SEGMENTS:
        raise SystemExit(f"only {windows} segments; raise --max-docs")
    bundle = layer_curves(summary, STATISTICS,
                          title=f"MiniLM-L6 on {result.manifest['n_documents']} KJV chapters "
                                f"({windows} segments of 128 tokens): mean over heads, 95 % CI")
    out = Path(args.figures)
    out.mkdir(parents=True, exist_ok=True)
    bundle.table.to_csv(out / "corpus_clark.csv", index=False)  # the numbers the figure draws
    if args.html:  # ~5 MB with plotly.js inline
        (out / "corpus_clark.html").write_bytes(figure_bytes(bundle.figure, "html"))
    try:
        (out / "corpus_clark.png").write_bytes(figure_bytes(bundle.figure, "png"))
    except Exception as e:  # noqa: BLE001 -- no Chromium: HTML only
        print(f"note: no PNG ({e.__class__.__name__}: {e})", file=sys.stderr)
    print(f"{result.manifest['n_documents']} documents, {windows} segments, "
          f"{result.manifest['n_tokens']} text tokens\n")
    print(table_markdown(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
