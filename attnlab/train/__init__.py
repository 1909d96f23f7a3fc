"""``attnlab train``: small transformers with any attention variant, crash-safe checkpoints, resume, DDP.

    attnlab train --recipe enc-hnas --out runs/enc-hnas          # or --config my.json
    attnlab train --recipe enc-hnas --out runs/enc-hnas --steps 2000 --resume
    torchrun --nproc_per_node 2 -m attnlab.train --recipe enc-unas --out runs/ddp   # DDP
    attnlab train speed                                          # tokens/s of unas, dnas, hnas
    attnlab train multiview --seeds 5                            # the synthetic multi-view task
    attnlab train results                                        # figures + numbers of docs/RESULTS.md
    attnlab train list                                           # shipped recipes
    attnlab train --recipe retrofit-hnas --model DIR --out runs/r  # HNAS u on a pretrained model
    attnlab train --recipe mlm-head --out runs/minilm-mlm         # MiniLM's masked-LM head (RUN/model)
    attnlab train --recipe causal-lm --out runs/gpt2-kjv          # a GPT-2 from scratch (RUN/model)

Python::

    from attnlab.train import RunConfig, load_recipe, train
    result = train(load_recipe("enc-hnas"), "runs/x")
"""

from __future__ import annotations

import argparse
import json
import sys

from attnlab.train.checkpoint import CheckpointError
from attnlab.train.config import (
    DataConfig,
    RunConfig,
    TrainConfig,
    list_recipes,
    load_recipe,
    recipe_file_kind,
    recipe_path,
)
from attnlab.train.metrics import MetricsLog, column_mass_summary, parse_metrics, read_metrics
from attnlab.train.trainer import TrainResult, learning_rate, train

__all__ = [
    "DataConfig",
    "TrainConfig",
    "RunConfig",
    "TrainResult",
    "CheckpointError",
    "MetricsLog",
    "list_recipes",
    "load_recipe",
    "train",
    "learning_rate",
    "column_mass_summary",
    "parse_metrics",
    "read_metrics",
    "add_arguments",
    "run",
]

ACTIONS = ("fit", "speed", "multiview", "results", "scale-results", "list")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="?", default="fit", choices=ACTIONS,
                        help="fit (default): train a model; speed: training tokens/s of unas, dnas, hnas; "
                             "multiview: the synthetic multi-view task; results: docs/RESULTS.md numbers and "
                             "figures; scale-results: its section (e), the HNAS-at-scale runs; list: shipped "
                             "recipes")
    src = parser.add_mutually_exclusive_group()
    names = ", ".join(list_recipes() + list_recipes(pretrained=True))
    src.add_argument("--recipe", help=f"a shipped recipe name ({names})")
    src.add_argument("--config", help="a run configuration JSON file (same format as a recipe)")
    parser.add_argument("--out", help="run directory (checkpoints, metrics.jsonl)")
    parser.add_argument("--steps", type=int, help="override train.steps")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out from its last checkpoint")
    parser.add_argument("--stop-after", type=int,
                        help="stop (with a checkpoint) after this step; resume later")
    parser.add_argument("--corpus",
                        help="override data.corpus: 'kjv', 'shakespeare', 'kjv+shakespeare' or a .txt file")
    parser.add_argument("--seed", type=int, help="override train.seed")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda when available)")
    parser.add_argument("--threads", type=int, help="override train.threads (torch CPU threads)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--lr", type=float, help="override train.lr (peak learning rate)")
    # pretrained-model recipes (retrofit-hnas, mlm-head; docs/RETROFIT.md)
    parser.add_argument("--model", help="retrofit-hnas / mlm-head: the pretrained model directory "
                        "(base.model; default: the embedded MiniLM)")
    parser.add_argument("--train-rest", action="store_true",
                        help="retrofit-hnas: also train the model's own weights (base.train_rest)")
    # speed / multiview / results
    parser.add_argument("--variants", nargs="+", default=None, help="speed/multiview: variants to compare")
    parser.add_argument("--seeds", type=int, default=None, help="multiview/results: number of seeds")
    parser.add_argument("--rounds", type=int, default=3, help="speed: timing rounds (median reported)")
    parser.add_argument("--checkpoints", default="checkpoints", help="results: shipped checkpoints directory")
    parser.add_argument("--figures", default="docs/figures", help="results: figure output directory")
    parser.add_argument("--multiview-json", help="results: reuse the multi-view numbers of this JSON "
                        "(output of `multiview --json` or `results --json`) instead of re-running the task")
    parser.add_argument("--runs", default="runs/hnas-scale",
                        help="scale-results: where unfinished scale runs are (shipped ones: --checkpoints)")
    parser.add_argument("--windows", type=int, default=512,
                        help="scale-results: held-out windows for the losses")
    parser.add_argument("--include-unfinished", action="store_true",
                        help="scale-results: also read unfinished runs (past step 0) at their latest "
                             "checkpoints, for an interim reading (default: finished runs only)")
    parser.add_argument("--json", dest="json_out",
                        help="speed/multiview/results: also write the numbers here")


def _config_from_args(args) -> RunConfig:
    if args.model is not None or args.train_rest:
        flag = "--model" if args.model is not None else "--train-rest"
        raise ValueError(f"{flag} is for the pretrained-model recipes ({', '.join(list_recipes(True))}), "
                         f"not for {args.recipe or args.config!r}")
    config = RunConfig.from_file(_config_file(args))
    return RunConfig.from_dict(_overridden(config.to_dict(), args))


def _overridden(d: dict, args) -> dict:
    """A run configuration's dict with the command line's overrides."""
    if args.steps is not None:
        d["train"]["steps"] = args.steps
    if args.seed is not None:
        d["train"]["seed"] = args.seed
    if args.threads is not None:
        d["train"]["threads"] = args.threads
    if args.corpus is not None:
        d["data"]["corpus"] = args.corpus
    if args.lr is not None:
        d["train"]["lr"] = args.lr
        d["train"]["min_lr"] = min(d["train"]["min_lr"], args.lr)
    return d


def _config_file(args):
    """The recipe or config file named by the arguments."""
    if args.recipe:
        return recipe_path(args.recipe)
    if args.config:
        return args.config
    raise ValueError("give --recipe NAME or --config FILE.json")


def _run_pretrained(args, path) -> int:
    """retrofit-hnas / mlm-head: attnlab.train.retrofit."""
    from attnlab.train.retrofit import train_hf
    from attnlab.train.retrofit_config import HFRunConfig

    d = _overridden(HFRunConfig.from_file(path).to_dict(), args)
    if args.model is not None:
        d["base"]["model"] = args.model
    if args.train_rest:
        d["base"]["train_rest"] = True
    result = train_hf(HFRunConfig.from_dict(d), args.out, resume=args.resume, device=args.device,
                      progress=not args.no_progress, stop_after=args.stop_after)
    print(json.dumps({"run_dir": str(result.run_dir), "step": result.step, "loss": result.final_loss,
                      "eval_loss": result.final_eval_loss, "u": result.hybrid_weights}))
    return 0


def _print_json(obj, path: str | None) -> None:
    text = json.dumps(obj, indent=2)
    print(text)
    if path:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text + "\n")


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "list":
            for name in list_recipes():
                print(f"{name:14s} {load_recipe(name).description}")
            from attnlab.train.retrofit_config import HFRunConfig

            for name in list_recipes(pretrained=True):
                print(f"{name:14s} {HFRunConfig.from_file(recipe_path(name)).description}")
            return 0
        if args.action == "speed":
            from attnlab.train.speed import format_table, training_speed

            if args.config:
                config = RunConfig.from_file(args.config)
            else:
                config = load_recipe(args.recipe or "enc-unas")
            res = training_speed(config, variants=args.variants or ("unas", "dnas", "hnas"),
                                 steps=args.steps or 10, rounds=args.rounds, device=args.device)
            print(format_table(res), file=sys.stderr)
            _print_json(res, args.json_out)
            return 0
        if args.action == "multiview":
            from attnlab.train.results import multiview_experiment

            res = multiview_experiment(variants=args.variants or ("unas", "dnas", "hnas"),
                                       seeds=args.seeds or 5, steps=args.steps or 600,
                                       progress=not args.no_progress)
            _print_json(res, args.json_out)
            return 0
        if args.action == "results":
            from attnlab.train.results import build_results

            res = build_results(args.checkpoints, args.figures, seeds=args.seeds or 5,
                                mv_steps=args.steps or 600, multiview_json=args.multiview_json)
            _print_json(res, args.json_out)
            return 0
        if args.action == "scale-results":
            from attnlab.train.scale_results import build_scale_results

            if args.windows < 1:
                raise ValueError(f"--windows must be a positive integer, got {args.windows}")
            res = build_scale_results(args.checkpoints, args.figures, args.runs, n_windows=args.windows,
                                      include_unfinished=args.include_unfinished)
            _print_json(res, args.json_out)
            return 0
        if not args.out:
            raise ValueError("--out DIR is required to train")
        path = _config_file(args)
        if recipe_file_kind(path) is not None:
            return _run_pretrained(args, path)
        result = train(_config_from_args(args), args.out, resume=args.resume, device=args.device,
                       progress=not args.no_progress, stop_after=args.stop_after)
        print(json.dumps({"run_dir": str(result.run_dir), "step": result.step, "loss": result.final_loss,
                          "eval_loss": result.final_eval_loss, "u": result.hybrid_weights}))
        return 0
    except (ValueError, OSError, CheckpointError) as e:
        print(f"attnlab train: error: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnlab.train", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
