"""The output folder of ``attnlab analyze``: statistics, summary, tokens, weights, figures and the
manifest, written into a temporary directory that is renamed into place only when complete
(docs/ANALYSIS.md lists the files)."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shutil
from pathlib import Path

__all__ = [
    "EXPLAINED_AWAY_STATISTIC", "publish", "write_folder", "write_json", "write_all", "figures_of",
    "write_figures", "manifest", "stamp",
]

EXPLAINED_AWAY_STATISTIC = "explained_away_relative"  # m_j * N / M < eps_relative (comparable across N)

def publish(tmp: Path, out: Path) -> None:
    """Rename the finished temporary directory to ``out`` (replacing it when --overwrite)."""
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)


def write_folder(out: Path, fill):
    """``fill(tmp)`` in a temporary directory beside ``out``, then the directory renamed to ``out``
    (:func:`publish`); on any failure, also Ctrl-C, it is removed. -> what ``fill`` returned."""
    import tempfile

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        value = fill(tmp)
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return value


def stamp() -> tuple[dict, dict]:
    """(the manifest's head: attnlab version and time of writing; its versions: python, torch,
    transformers)."""
    import torch
    import transformers

    import attnlab

    head = {"attnlab_version": attnlab.__version__,
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__}
    return head, versions


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_all(args, stream, tmp: Path, formats) -> tuple[list[str], list[str]]:
    import numpy as np
    from tqdm.auto import tqdm

    from attnlab import beyond_cli, stats
    from attnlab.stats.nan_notes import NOTE_PREFIX as NAN_NOTE

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
    skipped: list[int] = []  # windows whose weights were too large to write (said once)
    csv_path = tmp / "statistics.csv"
    tokens = []
    nan_notes: list[str] = []  # one per window whose table holds NaN (attnlab.stats.nan_notes)

    def tables():
        bar = tqdm(stream, total=n_windows, unit="window", desc="analysing", disable=args.quiet)
        for i, result in enumerate(bar):
            table = result.table()
            table.to_csv(csv_path, mode="a", header=i == 0, index=False)
            nan_notes.extend((f"window {result.index}: " if n_windows > 1 else "") + n
                             for n in table.attrs.get("notes", []) if n.startswith(NAN_NOTE))
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
            too_big = _weights_bytes(result) > MAX_WEIGHTS_BYTES
            if save != "none" and too_big and not skipped:
                skipped.append(w.index)
                size = _weights_bytes(result) / 2**30
                notes.append(f"window {w.index}: its weights are {size:.1f} GiB in float32, over the "
                             f"{MAX_WEIGHTS_BYTES / 2**30:.0f} GiB that --weights writes: not saved (the "
                             "statistics cover them; in Python read one head: "
                             "result.weights[variant][layer, head])")
            if save != "none" and not too_big:
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
    if nan_notes:  # NaN in the model's weights or outputs: said on stderr and in the manifest
        windows = f"; {len(nan_notes)} of {n_windows} windows hold NaN" if n_windows > 1 else ""
        notes.append(nan_notes[0] + windows)
    written[:0] = ["statistics.csv"]
    summary.to_csv(tmp / "summary.csv", index=False)
    write_json(tmp / "summary.json", summary.to_dict(orient="records"))
    write_json(tmp / "tokens.json", {"windowing": stream.windowing.as_dict(), "windows": tokens})
    written += ["summary.csv", "summary.json", "tokens.json"]
    more, more_notes, more_figures = beyond_cli.finish(args, stream, first["result"], tmp)
    written += more
    notes += more_notes
    if not args.no_figures:
        figs, fig_notes = write_figures(
            tmp / "figures", first["result"], summary, stream, formats, more_figures
        )
        written += figs
        notes += fig_notes
    return written, notes


# Largest weights --weights writes per window (all variants, float32) and the longest window whose
# attention maps are drawn (a map has N^2 cells; larger windows get the column-mass figures only).
MAX_WEIGHTS_BYTES = 2 << 30
MAX_MAP_TOKENS = 1024


def _weights_bytes(result) -> int:
    return sum(4 * math.prod(tuple(w.shape)) for w in result.weights.values())


def figures_of(result, summary, stream) -> dict:
    """name -> plotly figure: maps of the first window (up to MAX_MAP_TOKENS tokens), explained-away
    fractions over all windows, column masses of the first window."""
    import numpy as np

    from attnlab import figures

    L, H = stream.model.n_layers, stream.model.n_heads
    out, masses, fractions = {}, {}, {}
    maps = len(result.tokens) <= MAX_MAP_TOKENS
    for variant, mass in result.column_masses().items():  # streamed windows: no weights held
        if maps:
            out[f"grid_{variant}"] = figures.attention_grid(
                result.weights[variant], result.tokens,
                title=f"{variant}: attention weights by layer and head (window 0)")
        masses[variant] = mass.reshape(-1).numpy()
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
    if maps:
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


def write_figures(
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
    own = figures_of(result, summary, stream) if stream is not None else {}  # None: ``extra`` alone
    for name, fig in {**own, **(extra or {})}.items():
        for fmt in ("html", *static):
            try:
                export_figure(fig, directory / f"{name}.{fmt}", include_plotlyjs="directory")
            except ExportError as e:
                failed.append(f"{name}.{fmt} ({e})")
                continue
            written.append(f"figures/{name}.{fmt}")
    if failed:
        notes.append("figures not written: " + "; ".join(failed))
    if len(result.tokens) > MAX_MAP_TOKENS:
        notes.append(f"figures: window 0 has {len(result.tokens):,} tokens, over the {MAX_MAP_TOKENS:,} "
                     "whose attention maps are drawn: the maps (grid, heatmap) were left out, the "
                     "column-mass and explained-away figures cover every head")
    return written, notes


def manifest(args, stream, size: int, file_sha256: str, written: list[str], notes: list[str]) -> dict:
    from attnlab import beyond_cli

    u = stream.u
    head, versions = stamp()
    return {
        **head,
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
        "versions": versions,
    }
