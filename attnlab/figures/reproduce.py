"""Reproducing an exported figure: the JSON manifest, the ``attnlab analyze`` command line of each
source, and :func:`reproduce_figure`, which reads the CLI's output layout and rebuilds the figure
with the builder the page used (:func:`attnlab.figures.kinds.build`).

The manifest (``"format": "attnlab-figure/1"``) records the figure (kind, parameters, window), the
analysed text's sha256, and per source the model (``ModelInfo.as_dict()``) and its settings.
"""

from __future__ import annotations

import datetime
import json
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from attnlab.figures.bundle import FigureBundle
from attnlab.figures.kinds import KINDS, MULTI_KINDS, build

__all__ = ["MANIFEST_FORMAT", "analyze_command", "manifest", "reproduce_figure"]

MANIFEST_FORMAT = "attnlab-figure/1"


def analyze_command(source: Mapping, text_file: str = "text.txt", out_dir: str = "attnlab-out") -> list[str]:
    """The ``attnlab analyze`` command line that recomputes ``source``'s weights (see :func:`manifest`)."""
    s = source["settings"]
    cmd = ["attnlab", "analyze", text_file]
    if source["model"].get("path") and not source["model"].get("embedded"):
        cmd += ["--model", source["model"]["path"]]
    # u per layer and head (a list) is a native HNAS checkpoint's learned u: the command's default there
    u = [] if isinstance(s["u"], list) else ["--u", f"{s['u']:g}"]
    cmd += [
        "--variants",
        ",".join(s["variants"]),
        "--mode",
        s["mode"],
        *u,
        "--iters",
        str(s["iters"]),
        *[
            f
            for name, value in (s.get("params") or {}).items()
            for f in (f"--{name.replace('_', '-')}", f"{value:g}")
        ],
        "--window",
        str(s["window"]),
        "--weights",
        "all",
        "--no-figures",
        "--out",
        out_dir,
    ]
    return cmd


def manifest(
    kind: str,
    params: Mapping,
    sources: Sequence[Mapping],
    *,
    text_sha256: str,
    characters: int,
    window: int,
    labels: Sequence[str] | None = None,
    extra: Mapping | None = None,
    file_name: str = "manifest.json",
) -> dict:
    """The JSON manifest of an exported figure: what was analysed and how to rebuild the figure.

    Each source is ``{"model": ModelInfo.as_dict(), "settings": {variants, mode, u, iters, window}}``.
    ``reproduce`` holds one ``attnlab analyze`` command per source (run on the same text, saved as
    text.txt; its sha256 is in ``input``) and the Python call that rebuilds the figure from their
    output directories: ``attnlab.figures.reproduce_figure(file_name, [dir, ...])``, where
    ``file_name`` is the name the manifest is saved under (the Export menu's download name).
    """
    import attnlab

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    dirs = [f"attnlab-out-{k}" for k in range(len(sources))] if len(sources) > 1 else ["attnlab-out"]
    commands = []
    for src, d in zip(sources, dirs, strict=True):
        commands.append(shlex.join(analyze_command(src, out_dir=d)))
    return {
        "format": MANIFEST_FORMAT,
        "attnlab_version": getattr(attnlab, "__version__", "?"),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "figure": {"kind": kind, "params": dict(params), "window": window, "labels": list(labels or [])},
        "input": {"sha256": text_sha256, "characters": characters, "file": "text.txt"},
        "sources": [dict(s) for s in sources],
        "reproduce": {
            "commands": commands,
            "python": f"from attnlab.figures import reproduce_figure; "
            f"fig = reproduce_figure({file_name!r}, {dirs!r}).figure",
            "note": "run each command on the same text (text.txt, sha256 above)",
        },
        **({"extra": dict(extra)} if extra else {}),
    }


def _load_window(out_dir: Path, window: int) -> tuple[dict[str, np.ndarray], list[str], dict]:
    """Weights {variant: (L, H, N, N)} and tokens of one window from an ``attnlab analyze`` output."""
    info = json.loads((out_dir / "manifest.json").read_text(encoding="utf-8"))
    single = out_dir / "weights.npz"
    path = single if single.is_file() and window == 0 else out_dir / "weights" / f"window_{window:04d}.npz"
    if not path.is_file():
        raise FileNotFoundError(
            f"{out_dir} has no weights for window {window} (run attnlab analyze with --weights all)"
        )
    with np.load(path, allow_pickle=False) as npz:
        tokens = [str(t) for t in npz["tokens"]]
        weights = {k: npz[k] for k in npz.files if k not in ("tokens", "special")}
    return weights, tokens, info


def reproduce_figure(manifest_or_path, out_dirs: Sequence[str | Path]) -> FigureBundle:
    """Rebuild an exported figure from its manifest and the ``attnlab analyze`` output directories
    (one per source, in the manifest's order). Checks that the analysed text has the same sha256."""
    m = manifest_or_path
    if not isinstance(m, Mapping):
        m = json.loads(Path(m).read_text(encoding="utf-8"))
    if m.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"not an attnlab figure manifest (format {m.get('format')!r})")
    fig_spec, sources = m["figure"], m["sources"]
    if len(out_dirs) != len(sources):
        raise ValueError(f"the manifest has {len(sources)} source(s), got {len(out_dirs)} output directories")
    loaded = [_load_window(Path(d), fig_spec["window"]) for d in out_dirs]
    for _, _, info in loaded:
        if info["input"]["sha256"] != m["input"]["sha256"]:
            raise ValueError("the analysed text differs from the exported one (sha256 mismatch)")
    tokens = loaded[0][1]
    u = sources[0]["settings"].get("u")
    weights = [w for w, _, _ in loaded]
    multi = fig_spec["kind"] in MULTI_KINDS or len(weights) > 1
    return build(
        fig_spec["kind"],
        weights if multi else weights[0],
        tokens,
        fig_spec["params"],
        u=u if isinstance(u, float) else None,
        labels=fig_spec.get("labels") or None,
    )
