"""``attnlab swap-eval --model DIR --corpus SRC --variants dnas,sinkhorn,softmax1 --layers each --out DIR``:
the LM loss of a pretrained model with each variant swapped into each layer (local or Ray).

Writes DIR/rows/*.parquet, DIR/loss_delta.{parquet,csv} (per variant and layer: loss delta vs the
unswapped model, 95 % bootstrap CI over documents), DIR/loss_by_position.{parquet,csv}, DIR/figures/
and DIR/manifest.json (docs/SWAP_EVAL.md). Run the same command again to resume a killed run. Bad
input ends with a one-line message and exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from attnlab.cli_errors import run_worded


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from attnlab.corpus.variants import param_flags
    from attnlab.swap_eval.job import LAYER_MODES

    parser.description = __doc__.splitlines()[0]
    add = parser.add_argument
    add("--model", metavar="DIR", required=True, help="local save_pretrained directory with an LM head")
    add(
        "--corpus",
        metavar="SRC",
        required=True,
        help="kjv, a folder of .txt/.md files, or a .jsonl/.csv/.parquet file",
    )
    add("--out", metavar="DIR", required=True, help="run directory (rows, tables, figures, manifest)")
    add(
        "--variants",
        default="dnas,sinkhorn,softmax1",
        help="comma-separated variants, or all (default: dnas,sinkhorn,softmax1)",
    )
    add(
        "--layers",
        choices=LAYER_MODES,
        default="each",
        help="each: one swap per layer; all: every layer at once; each,all: both (default: each)",
    )
    for flag in param_flags():  # one flag per variant parameter of the registry
        add(
            f"--{flag.name.replace('_', '-')}",
            dest=f"param_{flag.name}",
            type=flag.kind,
            default=None,
            help=f"{flag.help} ({', '.join(flag.variants)}; default: {flag.default})",
        )
    add(
        "--window",
        type=int,
        default=None,
        help="tokens per window incl. special tokens (default: the model's max length, at most 512)",
    )
    add(
        "--mask-rate",
        type=float,
        default=0.15,
        help="masked-LM models: share of tokens masked (default 0.15)",
    )
    add("--max-docs", type=int, default=None, help="score only the first N documents")
    add("--text-column", default="text", help="text column of .jsonl/.csv/.parquet (default: text)")
    add("--id-column", default=None, help="document id column (default: the row or line number)")
    add(
        "--engine",
        choices=("local", "ray"),
        default=None,
        help="local, or ray (default: ray when --ray-address is given, else local)",
    )
    add("--ray-address", default=None, help="join this Ray cluster (host:port or ray://host:port)")
    add("--workers", type=int, default=None, help="Ray actors (default: 1 local, else 2)")
    add("--shard-docs", type=int, default=8, help="documents per shard (the unit of resume)")
    add("--bootstrap", type=int, default=1000, help="bootstrap resamples for the 95%% CIs (default 1000)")
    add("--seed", type=int, default=0, help="mask and bootstrap seed (default 0)")
    add("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    add("--device", default="cpu", help="local engine: cpu, cuda, cuda:N or auto (default: cpu)")
    add("--overwrite", action="store_true", help="replace a run in DIR made with other settings")
    add("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    return run_worded(
        "swap-eval",
        lambda: _run(args),
        "interrupted; completed shards are kept, run the same command to resume",
    )


def _run(args) -> int:
    import torch

    from attnlab.swap_eval import swap_eval

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    engine = args.engine or ("ray" if args.ray_address else "local")
    workers = args.workers if args.workers is not None else (2 if engine == "ray" else 1)
    params = {
        k[len("param_") :]: v for k, v in vars(args).items() if k.startswith("param_") and v is not None
    }
    variants = "all" if args.variants == "all" else [v.strip() for v in args.variants.split(",") if v.strip()]
    same = ("window", "mask_rate", "max_docs", "text_column", "id_column", "ray_address", "shard_docs",
            "bootstrap", "seed", "overwrite", "device")  # swap_eval's keyword = the flag's dest
    result = swap_eval(args.corpus, args.model, variants, args.layers, out=args.out, params=params,
                       engine=engine, workers=workers, progress=not args.quiet,
                       **{k: getattr(args, k) for k in same})
    m = result.manifest
    print(
        f"attnlab swap-eval: {m['n_documents']} documents, {m['n_tokens']} tokens, "
        f"{len(m['skipped'])} skipped -> {result.out}",
        file=sys.stderr,
    )
    return 0
