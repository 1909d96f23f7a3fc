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

Bad input (missing, empty, binary, non-UTF-8 or oversized file; a directory that is not a model) ends
with a one-line message on stderr and exit status 2; nothing is left behind.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

from attnlab.cli_errors import EXIT_BAD_INPUT, EXIT_INTERNAL, error, run_worded  # noqa: F401
from attnlab.cli_variants import add_variant_arguments, parse_variants, variant_params
from attnlab.normalizers import check_param

DEFAULT_MAX_MB = 20.0
STATIC_FORMATS = ("png", "svg", "pdf")
EXPLAINED_AWAY_STATISTIC = "explained_away_relative"  # m_j * N / M < eps_relative (comparable across N)


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
    add_variant_arguments(parser)  # --variants and --u, --iters, --tol, ... from the registry
    add(
        "--mode",
        choices=("recompute", "swap"),
        default="recompute",
        help="recompute: variants from the model's own q and k; swap: the variant replaces the model's "
        "attention (default: recompute)",
    )
    add("--u-from", metavar="CHECKPOINT", default=None,
        help="u per layer and head from a trained attnlab HNAS checkpoint (its mean if the shapes differ)")
    add(
        "--window",
        type=int,
        default=None,
        help="tokens per window incl. special tokens (default: the model's max length, at most 512)",
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
    stream = hf.stream_analysis(
        text, loaded, variants, args.mode, window=args.window, overlap=args.overlap,
        contributions=args.contributions, **params
    )
    if u_note:
        stream.notes.append(u_note)
    stream.notes += beyond_cli.preflight(args, stream, InputError) if beyond_cli.requested(args) else []
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        written, notes = _write_all(args, stream, tmp, formats)
        _write_json(tmp / "manifest.json", _manifest(args, stream, size, file_sha256, written, notes))
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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


def _publish(tmp: Path, out: Path) -> None:
    """Rename the finished temporary directory to ``out`` (replacing it when --overwrite)."""
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_all(args, stream, tmp: Path, formats) -> tuple[list[str], list[str]]:
    import numpy as np
    from tqdm.auto import tqdm

    from attnlab import beyond_cli, stats

    notes = list(stream.notes)
    written: list[str] = []
    n_windows = stream.windowing.n_windows
    save = {"auto": "single" if n_windows == 1 else "none", "all": "all", "none": "none"}[args.weights]
    if args.weights == "auto" and n_windows > 1:
        notes.append(
            f"the text spans {n_windows} windows: weights were not saved (statistics cover every window); "
            "use --weights all for one NPZ per window"
        )
    if save == "all":
        (tmp / "weights").mkdir()
    first: dict = {}
    csv_path = tmp / "statistics.csv"
    tokens = []

    def tables():
        bar = tqdm(stream, total=n_windows, unit="window", desc="analysing", disable=args.quiet)
        for i, result in enumerate(bar):
            table = result.table()
            table.to_csv(csv_path, mode="a", header=i == 0, index=False)
            w = result.window
            tokens.append(
                {
                    "window": w.index,
                    "start": w.start,
                    "stop": w.stop,
                    "tokens": w.tokens,
                    "word_ids": w.word_ids,
                    "special": w.special.tolist(),
                    "punctuation": w.punctuation.tolist(),
                    "char_spans": [list(s) for s in w.char_spans],
                }
            )
            if save != "none":
                name = "weights.npz" if save == "single" else f"weights/window_{w.index:04d}.npz"
                arrays = {v: t.numpy() for v, t in result.weights.items()}
                arrays.update({f"{v}.{name}": t.numpy() for v, maps in result.components.items()
                               for name, t in maps.items()})  # a GAM checkpoint's phi, theta, brains
                np.savez(tmp / name, tokens=np.array(w.tokens), special=w.special, **arrays)
                written.append(name)
            if i == 0:
                first["result"] = result
            written.extend(beyond_cli.per_window(args, result, tmp, i == 0))
            yield table

    summary = stats.aggregate_windows(tables())
    written[:0] = ["statistics.csv"]
    summary.to_csv(tmp / "summary.csv", index=False)
    _write_json(tmp / "summary.json", summary.to_dict(orient="records"))
    _write_json(tmp / "tokens.json", {"windowing": stream.windowing.as_dict(), "windows": tokens})
    written += ["summary.csv", "summary.json", "tokens.json"]
    more, more_notes, more_figures = beyond_cli.finish(args, stream, first["result"], tmp)
    written += more
    notes += more_notes
    if not args.no_figures:
        figs, fig_notes = _write_figures(
            tmp / "figures", first["result"], summary, stream, formats, more_figures
        )
        written += figs
        notes += fig_notes
    return written, notes


def _figures(result, summary, stream) -> dict:
    """name -> plotly figure: maps of the first window, explained-away fractions over all windows."""
    import numpy as np

    from attnlab import figures, stats

    L, H = stream.model.n_layers, stream.model.n_heads
    out, masses, fractions = {}, {}, {}
    for variant, w in result.weights.items():
        out[f"grid_{variant}"] = figures.attention_grid(
            w, result.tokens, title=f"{variant}: attention weights by layer and head (window 0)"
        )
        masses[variant] = stats.column_mass(w).reshape(-1).numpy()
        rows = summary[(summary["variant"] == variant) & (summary["statistic"] == EXPLAINED_AWAY_STATISTIC)]
        fractions[variant] = np.zeros((L, H))
        fractions[variant][rows["layer"].to_numpy(), rows["head"].to_numpy()] = rows["value"].to_numpy()
    out["explained_away"] = figures.explained_away_heatmap(
        fractions, title="Explained-away fraction (relative column mass < 0.1), mean over windows"
    )
    u = stream.u if "hnas" in result.weights and isinstance(stream.u, float) else None
    out["column_mass"] = figures.column_mass_distribution(
        masses, len(result.tokens), u=u, title="Column mass per key, every layer and head (window 0)"
    )
    first = next(iter(result.weights))
    out[f"heatmap_{first}_layer0_head0"] = figures.attention_heatmap(
        result.weights[first][0, 0], result.tokens, title=f"{first}: layer 0, head 0 (window 0)"
    )
    for name in ("phi", "theta"):  # a GAM checkpoint's content and relative-position maps
        maps = result.components.get(first, {})
        if name in maps:
            out[f"heatmap_{first}_{name}_layer0_head0"] = figures.attention_heatmap(
                maps[name][0, 0], result.tokens, title=f"{first}: GAM {name}, layer 0, head 0 (window 0)"
            )
    return out


def _write_figures(
    directory: Path, result, summary, stream, static, extra=None
) -> tuple[list[str], list[str]]:
    """HTML always (sharing one figures/plotly.min.js, so they open offline); ``static`` formats
    (png/svg/pdf) when Chromium is available, else a note."""
    from plotly.offline import get_plotlyjs

    from attnlab.figures.export import CHROMIUM_HINT, ExportError, chromium_available, export_figure

    notes = []
    if static and not chromium_available():
        notes.append(f"figures: HTML only, no {'/'.join(static).upper()} ({CHROMIUM_HINT})")
        static = ()
    directory.mkdir()
    (directory / "plotly.min.js").write_text(get_plotlyjs(), encoding="utf-8")
    written = ["figures/plotly.min.js"]
    failed = []
    for name, fig in {**_figures(result, summary, stream), **(extra or {})}.items():
        for fmt in ("html", *static):
            try:
                export_figure(fig, directory / f"{name}.{fmt}", include_plotlyjs="directory")
            except ExportError as e:
                failed.append(f"{name}.{fmt} ({e})")
                continue
            written.append(f"figures/{name}.{fmt}")
    if failed:
        notes.append("figures not written: " + "; ".join(failed))
    return written, notes


def _manifest(args, stream, size: int, file_sha256: str, written: list[str], notes: list[str]) -> dict:
    import torch
    import transformers

    import attnlab
    from attnlab import beyond_cli

    u = stream.u
    return {
        "attnlab_version": attnlab.__version__,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "input": {
            "file": Path(args.file).name,
            "bytes": size,
            "characters": len(stream.text),
            "sha256": stream.text_sha256,  # of the text as analysed (UTF-8, without a BOM)
            "file_sha256": file_sha256,
        },
        "model": stream.model.as_dict(),
        "settings": {
            "variants": list(stream.variants),
            "mode": stream.mode,
            "u": u.tolist() if hasattr(u, "tolist") else u,
            "iters": stream.iters,
            "iters_requested": args.iters,
            "params": {k: v.tolist() if hasattr(v, "tolist") else v for k, v in stream.params.items()},
            "weights": args.weights,
            "device": str(stream.device),
            "beyond": beyond_cli.manifest_settings(args),
        },
        "windowing": stream.windowing.as_dict(),
        "files": ["manifest.json", *written],
        "notes": notes,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
    }
