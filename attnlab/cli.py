"""The ``attnlab`` command: ``attnlab analyze | train | bench ...``.

Each subcommand lives in its own module, which provides ``add_arguments(parser)`` and
``run(args) -> int``; this file only dispatches (modules are imported when their command runs).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from attnlab.cli_errors import EXIT_BAD_INPUT, error, worded_warnings
from attnlab.schema import check_threads, max_threads

# Idle OpenMP threads that spin slow small torch ops down 10-60x on a shared 2-core machine; read when
# torch first loads, which happens below (subcommand modules import torch).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# subcommand -> (module, one-line help)
COMMANDS = {
    "analyze": ("attnlab.analyze_cli", "analyse a text with every attention variant on a model"),
    "train": ("attnlab.train", "train a small transformer with any attention variant"),
    "corpus": ("attnlab.corpus.cli", "explaining-away statistics over a corpus (local or Ray)"),
    "swap-eval": ("attnlab.swap_eval.cli", "LM loss with variants swapped in, per layer and position"),
    "bench": ("attnlab.bench", "benchmark attention variants against torch SDPA"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="attnlab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    name = argv[0] if argv and argv[0] in COMMANDS else None
    for cmd, (module, help_) in COMMANDS.items():
        p = sub.add_parser(cmd, help=help_)
        if cmd == name:  # import only the module of the command being run
            importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    threads = getattr(args, "threads", None)
    if isinstance(threads, int) and threads > max_threads():  # below 1: each command says so itself
        try:
            check_threads(threads)
        except ValueError as e:  # before any thread pool is sized from it
            error(args.command, e)
            return EXIT_BAD_INPUT
    with worded_warnings(args.command):
        return int(importlib.import_module(COMMANDS[args.command][0]).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
