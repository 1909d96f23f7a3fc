"""``attnlab analyze FILE.txt``: every attention variant on a real model, written to a directory.

Outputs (all in ``--out``, which appears only when everything is written; see docs/ANALYSIS.md):

    manifest.json      model, variants, settings, windowing, text sha256, versions, files, notes
    statistics.csv     one row per window/variant/layer/head/statistic (attnlab.stats.tidy_table)
    summary.csv/.json  the same aggregated over windows (mean, std, n_windows)
    tokens.json        per window: tokens, word ids, special/punctuation flags, character spans
    weights.npz        (single-window texts, or --weights all: weights/window_0000.npz ...)
                       one (L, H, N, N) float32 array per variant, plus tokens (GAM checkpoints:
                       also "<variant>.phi", "<variant>.theta", "<variant>.brain_<b>" ...)
    figures/           HTML always (+ plotly.min.js); PNG/SVG/PDF when Chromium is available (else a note)

An encoder-decoder (T5, BART, mBART, Pegasus, Marian) reads FILE.txt as its source and ``--target``
(a text, or a file holding it) as what its decoder reads: the folder holds each kind of attention
(encoder, decoder, cross) instead (attnlab/analyze_seq2seq.py).

Bad input (missing, empty, binary, non-UTF-8 or oversized file; a directory that is not a model) ends
with a one-line message on stderr and exit status 2; nothing is left behind.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

from attnlab.analyze_outputs import manifest, write_all, write_folder, write_json
from attnlab.cli_errors import EXIT_BAD_INPUT, EXIT_INTERNAL, error, run_worded  # noqa: F401
from attnlab.cli_variants import add_variant_arguments, parse_variants, variant_params
from attnlab.normalizers import check_param

DEFAULT_MAX_MB = 20.0
STATIC_FORMATS = ("png", "svg", "pdf")


class InputError(ValueError):
    """Bad command-line input; reported as one line, exit status 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Analyse a UTF-8 text file with every attention variant on a real model."
    add = parser.add_argument
    add("file", metavar="FILE.txt", help="UTF-8 text file to analyse")
    add(
        "--model",
        metavar="DIR",
        default=None,
        help="local model directory written by save_pretrained, or a native attnlab checkpoint (a run or "
        "step directory of `attnlab train`, e.g. checkpoints/enc-hnas) (default: the embedded MiniLM-L6)",
    )
    add("--target", metavar="TEXT|FILE", default=None,
        help="an encoder-decoder's target: the text its decoder reads (or a UTF-8 file holding it); "
        "default: the decoder start token alone. Refused for other models")
    add_variant_arguments(parser)  # --variants and --u, --iters, --tol, ... from the registry
    add(
        "--mode",
        choices=("recompute", "swap"),
        default="recompute",
        help="recompute: variants from the model's own q and k; swap: the variant replaces the model's "
        "attention (default: recompute)",
    )
    add("--u-from", metavar="CHECKPOINT", default=None,
        help="u per layer and head from a trained attnlab HNAS checkpoint (its mean if the shapes differ; "
        "not with --u)")
    add(
        "--window",
        type=int,
        default=None,
        help="tokens per window incl. special tokens (default: a causal model's whole context up to its "
        "maximum positions; otherwise the model's max length, at most 512)",
    )
    add(
        "--overlap",
        type=int,
        default=None,
        help="text tokens shared by consecutive windows (default: a quarter of a window)",
    )
    add("--out", metavar="DIR", default=None, help="output directory (default: FILE-attnlab)")
    add("--overwrite", action="store_true", help="replace --out if it exists")
    add(
        "--weights",
        choices=("auto", "all", "none"),
        default="auto",
        help="weights NPZ: auto = only for single-window texts; all = one file per window",
    )
    add(
        "--formats",
        default=",".join(STATIC_FORMATS),
        help="static figure formats besides HTML: png,svg,pdf or 'none' (default: all three; need Chromium)",
    )
    add("--no-figures", action="store_true", help="write no figures")
    add(
        "--max-mb",
        type=float,
        default=DEFAULT_MAX_MB,
        help=f"refuse files larger than this many megabytes (default: {DEFAULT_MAX_MB:g})",
    )
    add("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    add("--device", default="auto",
        help="where the model runs: auto (a GPU when there is one, else the CPU), cpu, cuda, cuda:N "
        "(default: auto)")
    add("--quiet", action="store_true", help="no progress bar or notes on stderr")
    from attnlab import beyond_cli  # --contributions, --sinks, --flow, --interventions, --faithfulness

    beyond_cli.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    return run_worded("analyze", lambda: _run(args), "interrupted; no output written")


def _error(message: str) -> None:
    error("analyze", message)


def _note(args, message: str) -> None:
    if not args.quiet:
        print(f"attnlab analyze: note: {message}", file=sys.stderr)


# ----------------------------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------------------------


def read_text(path: str | os.PathLike, max_mb: float = DEFAULT_MAX_MB) -> tuple[str, int, str]:
    """-> (text, size in bytes, file sha256) of a UTF-8 text file, or InputError saying what is wrong."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"{p} does not exist")
    if not p.is_file():
        raise InputError(f"{p} is not a regular file")
    size = p.stat().st_size
    if size > max_mb * 1e6:
        raise InputError(f"{p} is {size / 1e6:.1f} MB, over the {max_mb:g} MB limit (raise it with --max-mb)")
    data = p.read_bytes()
    if b"\x00" in data:
        raise InputError(f"{p} looks like a binary file (it contains NUL bytes); expected UTF-8 text")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise InputError(
            f"{p} is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); re-encode it as UTF-8"
        ) from None
    if not text.strip():
        raise InputError(f"{p} is empty (or only whitespace); there is nothing to analyse")
    return text, size, hashlib.sha256(data).hexdigest()


def _parse_list(value: str, allowed: tuple[str, ...], what: str) -> tuple[str, ...]:
    items = tuple(dict.fromkeys(x.strip().lower() for x in value.split(",") if x.strip()))
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise InputError(f"--{what} must be a comma-separated subset of {','.join(allowed)}, got {value!r}")
    return items


def _output_dir(args) -> Path:
    out = Path(args.out) if args.out else Path(f"{Path(args.file).stem}-attnlab")
    if out.exists() and not args.overwrite:
        raise InputError(f"output directory {out} already exists (use --overwrite to replace it)")
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} exists and is not a directory")
    return out


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def _run(args) -> int:
    variants = parse_variants(args.variants)
    params = variant_params(args)
    formats = ()
    if args.formats.strip().lower() != "none":
        formats = _parse_list(args.formats, STATIC_FORMATS, "formats")
    for name, value in params.items():  # the library's check, worded with the flag
        try:
            check_param(name, value)
        except ValueError as e:
            raise InputError(f"--{e}") from None
    if args.u_from is not None and args.u is not None:
        raise InputError(f"--u and --u-from are alternatives: pass --u U (one u for every head) or --u-from "
                         f"CHECKPOINT (the u it learned per layer and head), got --u {args.u:g} and "
                         f"--u-from {args.u_from}")
    if args.threads is not None and args.threads < 1:
        raise InputError(f"--threads must be >= 1, got {args.threads}")
    if not 0.0 < args.max_mb < float("inf"):  # NaN fails too
        raise InputError(f"--max-mb must be a finite number > 0, got {args.max_mb:g}")
    from attnlab import beyond_cli

    beyond_cli.check(args, InputError)
    text, size, file_sha256 = read_text(args.file, args.max_mb)
    out = _output_dir(args)

    import torch

    from attnlab import hf  # heavy imports only once the input looks right

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        device = hf.resolve_device(args.device, "--device")
    except ValueError as e:
        raise InputError(str(e)) from None
    loaded = hf.load_model(args.model, device=device)
    u, u_note = _hnas_u(args, loaded.info)
    if u is not None:
        params["u"] = u
    if loaded.info.encoder_decoder or args.target is not None:  # source and target, three kinds
        from attnlab.analyze_seq2seq import read_target, run_seq2seq

        target = read_target(args.target, read_text, args.max_mb)
        return run_seq2seq(args, loaded, text, target, params, variants, formats, out, size, file_sha256,
                           InputError)
    stream = hf.stream_analysis(
        text, loaded, variants, args.mode, window=args.window, overlap=args.overlap,
        contributions=args.contributions, **params
    )
    if u_note:
        stream.notes.append(u_note)
    stream.notes += beyond_cli.preflight(args, stream, InputError) if beyond_cli.requested(args) else []
    def fill(tmp: Path) -> tuple[list[str], list[str]]:
        written, notes = write_all(args, stream, tmp, formats)
        write_json(tmp / "manifest.json", manifest(args, stream, size, file_sha256, written, notes))
        return written, notes

    written, notes = write_folder(out, fill)
    for note in notes:
        _note(args, note)
    if not args.quiet:
        n = stream.windowing.n_windows
        print(f"attnlab analyze: wrote {out} ({n} window(s), {len(written) + 1} files)", file=sys.stderr)
    return 0


def _hnas_u(args, info):
    """-> (u, note): --u, or the trained checkpoint's u per layer and head (its mean on a shape mismatch)."""
    if args.u_from is None:
        return args.u, None  # None: not given (the spec's default)
    from attnlab import hf

    u = hf.hnas_u_from_checkpoint(args.u_from)
    if tuple(u.shape) == (info.n_layers, info.n_heads):
        return u, f"u per layer and head from {args.u_from}"
    mean = float(u.mean())
    return mean, (
        f"u from {args.u_from} is {tuple(u.shape)} (layers, heads) but the model has "
        f"({info.n_layers}, {info.n_heads}): using its mean u = {mean:.4f}"
    )
