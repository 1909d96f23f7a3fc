"""``attnlab corpus SOURCE --out DIR``: explaining-away statistics over a corpus (local or Ray).

SOURCE is ``kjv`` (the shipped King James Bible, one document per chapter), a folder of .txt/.md
files, or a .jsonl / .csv / .parquet file. Writes DIR/rows/*.parquet, DIR/summary.parquet,
DIR/summary.csv and DIR/manifest.json (docs/ANALYSIS.md, "Corpus analysis"). Run the same command
again to resume a killed run. Bad input ends with a one-line message and exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from attnlab.cli_errors import EXIT_BAD_INPUT, EXIT_INTERNAL, error, run_worded  # noqa: F401


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from attnlab.corpus.variants import param_flags

    parser.description = __doc__.splitlines()[0]
    add = parser.add_argument
    add("source", metavar="SOURCE", help="kjv, a folder of .txt/.md files, or a .jsonl/.csv/.parquet file")
    add("--out", metavar="DIR", required=True, help="run directory (rows, summary, manifest)")
    add("--model", metavar="DIR", default=None, help="local save_pretrained directory (default: MiniLM-L6)")
    add("--variants", default="all", help="comma-separated variants (default: every registered one)")
    add("--mode", choices=("recompute", "swap"), default="recompute", help="as attnlab analyze")
    for flag in param_flags():  # one flag per variant parameter of the registry
        add(f"--{flag.name.replace('_', '-')}", dest=f"param_{flag.name}", type=flag.kind, default=None,
            help=f"{flag.help} ({', '.join(flag.variants)}; default: {flag.default})")
    add("--window", type=int, default=None, help="tokens per window incl. special tokens (default: as "
        "attnlab analyze: a causal model's whole context up to its maximum positions; otherwise the "
        "model's max length, at most 512)")
    add("--overlap", type=int, default=None, help="text tokens shared by consecutive windows")
    add("--max-docs", type=int, default=None, help="analyse only the first N documents")
    add("--text-column", default="text", help="text column of .jsonl/.csv/.parquet (default: text)")
    add("--id-column", default=None, help="document id column (default: the row or line number)")
    add("--engine", choices=("local", "ray"), default="local", help="local (default) or ray")
    add("--ray-address", default=None, help="join this Ray cluster (host:port or ray://host:port)")
    add("--workers", type=int, default=None, help="Ray actors (default: 1 local, else 2)")
    add("--shard-docs", type=int, default=8, help="documents per shard (the unit of resume)")
    add("--bootstrap", type=int, default=1000, help="bootstrap resamples for the 95%% CIs (default 1000)")
    add("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    add("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    add("--device", default="cpu", help="local engine: cpu, cuda, cuda:N or auto (default: cpu)")
    add("--index", action="store_true", help="also write the token index for corpus search (DIR/index: "
        "per token its last hidden state and received mass; ~0.84 GB per million MiniLM tokens)")
    add("--index-dims", type=int, default=None, help="project the index's hidden states to this many "
        "dimensions (a fixed random projection; default: the model's width)")
    add("--overwrite", action="store_true", help="replace a run in DIR made with other settings")
    add("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    return run_worded("corpus", lambda: _run(args),
                      "interrupted; completed shards are kept, run the same command to resume")


def _error(message: str) -> None:
    error("corpus", message)


def _run(args) -> int:
    import torch

    from attnlab.corpus import analyze_corpus

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    workers = args.workers if args.workers is not None else (2 if args.engine == "ray" else 1)
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    params = {k[len("param_"):]: v for k, v in vars(args).items() if k.startswith("param_") and v is not None}
    variants = None if args.variants == "all" else [v.strip() for v in args.variants.split(",") if v.strip()]
    result = analyze_corpus(
        args.source, args.model, variants, args.mode, out=args.out, params=params, window=args.window,
        overlap=args.overlap, max_docs=args.max_docs, text_column=args.text_column,
        id_column=args.id_column, engine=args.engine, ray_address=args.ray_address, workers=workers,
        shard_docs=args.shard_docs, bootstrap=args.bootstrap, seed=args.seed, overwrite=args.overwrite,
        device=args.device, progress=not args.quiet, index=args.index, index_dims=args.index_dims,
    )
    m = result.manifest
    print(f"attnlab corpus: {m['n_documents']} documents, {m['n_tokens']} tokens, "
          f"{len(m['skipped'])} skipped -> {result.out}", file=sys.stderr)
    return 0
