"""``attnlab analyze FILE.txt --model DIR --target TEXT|FILE`` on an encoder-decoder (T5, BART, mBART,
Pegasus, Marian): the source is the file, the target the text the decoder reads (docs/ANALYSIS.md,
"Encoder-decoder models"). The output folder has the files of a one-text analysis, per kind:

    statistics.csv     one row per kind/variant/layer/head/statistic (kinds: encoder, decoder, cross)
    column_mass.csv    cross-attention column mass per source token: kind, variant, layer, head, key,
                       token, column_mass, relative_column_mass, floor (1/N DNAS, u/N HNAS)
    tokens.json        the source's and the target's tokens (the decoder start token first)
    weights.npz        "<kind>.<variant>" (L, H, M, N) float32 arrays, source_tokens, target_tokens
    figures/           per kind: grid_<kind>_<variant>, heatmap_<kind>_<variant>_layer0_head0,
                       column_mass_<kind>, explained_away_<kind> (HTML; PNG/SVG/PDF with Chromium)
    manifest.json      model, settings, the source file's and the target's sha256, files, notes
"""

from __future__ import annotations

import sys
from pathlib import Path

from attnlab.analyze_outputs import EXPLAINED_AWAY_STATISTIC, stamp, write_figures, write_folder, write_json

__all__ = ["read_target", "run_seq2seq", "figures_by_kind"]


def read_target(value: str | None, read_text, max_mb: float) -> str | None:
    """``--target``: the text of a file when it names one (read as the source is), else the text itself."""
    if value is None:
        return None
    try:
        is_file = Path(value).is_file()
    except OSError:  # a text too long (or odd) to be a file name
        is_file = False
    return read_text(value, max_mb)[0] if is_file else value


def figures_by_kind(result) -> tuple[dict, object]:
    """-> ({name: plotly figure}, the statistics table): for each kind the layer x head grid of every
    variant, the first variant's layer 0 head 0 map (target rows x source columns for cross), the
    column masses with their floors, the explained-away fractions."""
    import numpy as np

    from attnlab import figures

    out = {}
    first = result.variants[0]
    u = float(result.u) if "hnas" in result.variants and not hasattr(result.u, "numel") else None
    table = result.table()
    for kind in result.kinds:
        queries, keys = result.tokens(kind)
        weights = result.weights[kind]
        for v, w in weights.items():
            out[f"grid_{kind}_{v}"] = figures.attention_grid(
                w, keys, title=f"{v}, {kind} attention ({len(queries)} x {len(keys)}) by layer and head")
        out[f"heatmap_{kind}_{first}_layer0_head0"] = figures.attention_heatmap(
            weights[first][0, 0], keys, query_tokens=queries,
            title=f"{first}: {kind} attention, layer 0, head 0")
        masses = {v: m.reshape(-1).numpy() for v, m in result.column_masses(kind).items()}
        out[f"column_mass_{kind}"] = figures.column_mass_distribution(
            masses, len(keys), u=u, title=f"Column mass per key, {kind} attention (keys: "
            f"{'source' if kind != 'decoder' else 'target'} tokens)")
        fractions = {}
        ours = table[(table.kind == kind) & (table.statistic == EXPLAINED_AWAY_STATISTIC)]
        for v, w in weights.items():
            rows = ours[ours.variant == v]
            fractions[v] = np.zeros(tuple(w.shape[:2]))
            fractions[v][rows["layer"].to_numpy(), rows["head"].to_numpy()] = rows["value"].to_numpy()
        out[f"explained_away_{kind}"] = figures.explained_away_heatmap(
            fractions, title=f"Explained-away fraction (relative column mass < 0.1), {kind} attention")
    return out, table


def _tokens(window) -> dict:
    return {"tokens": window.tokens, "input_ids": window.input_ids, "word_ids": window.word_ids,
            "special": window.special.tolist(), "punctuation": window.punctuation.tolist(),
            "char_spans": [list(s) for s in window.char_spans]}


def _write(args, result, tmp: Path, formats) -> tuple[list[str], list[str]]:
    import numpy as np

    notes = list(result.notes)
    figs, table = figures_by_kind(result) if not args.no_figures else ({}, result.table())
    table.to_csv(tmp / "statistics.csv", index=False)
    result.column_mass_table("cross").to_csv(tmp / "column_mass.csv", index=False)
    write_json(tmp / "tokens.json", {"source": _tokens(result.source), "target": _tokens(result.target)})
    written = ["statistics.csv", "column_mass.csv", "tokens.json"]
    if args.weights != "none":
        arrays = {f"{k}.{v}": w.numpy() for k, maps in result.weights.items() for v, w in maps.items()}
        np.savez(tmp / "weights.npz", source_tokens=np.array(result.source.tokens),
                 target_tokens=np.array(result.target.tokens), **arrays)
        written.append("weights.npz")
    if figs:
        more, fig_notes = write_figures(tmp / "figures", result.view("cross"), None, None, formats, figs)
        written += more
        notes += fig_notes
    return written, notes


def _manifest(args, result, size: int, file_sha256: str, written: list[str], notes: list[str]) -> dict:
    u = result.u
    head, versions = stamp()
    return {
        **head,
        "input": {"file": Path(args.file).name, "bytes": size, "file_sha256": file_sha256,
                  "target": "start token only" if args.target is None else "given",
                  "sha256": result.text_sha256},  # of source and target as analysed
        "model": result.model.as_dict(),
        "settings": {"variants": list(result.variants), "mode": result.mode,
                     "u": u.tolist() if hasattr(u, "tolist") else u, "iters": result.iters,
                     "kinds": list(result.kinds), "weights": args.weights, "device": result.device},
        "tokens": {"source": len(result.source.tokens), "target": len(result.target.tokens)},
        "files": ["manifest.json", *written],
        "notes": notes,
        "versions": versions,
    }


def run_seq2seq(args, loaded, text: str, target: str | None, params: dict, variants, formats, out: Path,
                size: int, file_sha256: str, error) -> int:
    """The analysis of ``text`` (source) and ``target`` on the encoder-decoder ``loaded``, written to
    ``out`` (renamed into place when complete). ``error``: the CLI's InputError class."""
    from attnlab import beyond_cli, hf

    if beyond_cli.requested(args):
        raise error("--contributions, --sinks, --flow, --interventions and --faithfulness take one text; "
                    f"{loaded.info.name} is an encoder-decoder (source and target): expected none of them")
    result = hf.analyze(text, loaded, variants, args.mode, target=target, window=args.window,
                        overlap=args.overlap, **params)

    def fill(tmp: Path) -> tuple[list[str], list[str]]:
        written, notes = _write(args, result, tmp, formats)
        write_json(tmp / "manifest.json", _manifest(args, result, size, file_sha256, written, notes))
        return written, notes

    written, notes = write_folder(out, fill)
    if not args.quiet:
        for note in notes:
            print(f"attnlab analyze: note: {note}", file=sys.stderr)
        print(f"attnlab analyze: wrote {out} (encoder, decoder and cross attention, {len(written) + 1} "
              "files)", file=sys.stderr)
    return 0
