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
from attnlab.schema import check_analysis_manifest, check_manifest, read_json

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
    ``reproduce`` holds one ``attnlab analyze`` command per distinct source (run on the same text,
    saved as text.txt; its sha256 is in ``input``; sources that are one analysis share its output
    directory) and the Python call that rebuilds the figure from their output directories:
    ``attnlab.figures.reproduce_figure(file_name, [dir, ...])``, where ``file_name`` is
    the name the manifest is saved under (the Export menu's download name).
    """
    import attnlab

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    # one command per distinct source: panels of one analysis (Compare's variants of one model) share
    # its output directory, so the command is not repeated once per panel
    distinct = list(dict.fromkeys(json.dumps(s, sort_keys=True) for s in sources))
    names = [f"attnlab-out-{k}" for k in range(len(distinct))] if len(distinct) > 1 else ["attnlab-out"]
    dirs = [names[distinct.index(json.dumps(s, sort_keys=True))] for s in sources]
    commands = [
        shlex.join(analyze_command(json.loads(s), out_dir=d)) for s, d in zip(distinct, names, strict=True)
    ]
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
    info = check_analysis_manifest(read_json(out_dir / "manifest.json"), out_dir / "manifest.json")
    single = out_dir / "weights.npz"
    path = single if single.is_file() and window == 0 else out_dir / "weights" / f"window_{window:04d}.npz"
    if not path.is_file():
        raise FileNotFoundError(
            f"{out_dir} has no weights for window {window} (run attnlab analyze with --weights all)"
        )
    try:
        with np.load(path, allow_pickle=False) as npz:
            tokens = [str(t) for t in npz["tokens"]]
            weights = {k: npz[k] for k in npz.files if k not in ("tokens", "special")}
    except (KeyError, ValueError, OSError, EOFError) as e:  # no tokens, a pickle, not an npz
        raise ValueError(f"{path} is not the weights of an attnlab analyze window ({e.__class__.__name__}); "
                         "expected an .npz with 'tokens' and one (L, H, N, N) array per variant") from None
    bad = [k for k, w in weights.items() if w.ndim != 4 or w.shape[-2:] != (len(tokens), len(tokens))]
    if bad:
        raise ValueError(f"{path}: {bad[0]} has shape {weights[bad[0]].shape}, expected (L, H, N, N) with "
                         f"N = {len(tokens)} tokens")
    return weights, tokens, info


def _check_params_fit(params: Mapping, weights: Sequence[Mapping[str, np.ndarray]], source) -> None:
    """The manifest's variant(s), layer, head and focus exist in the loaded weights (ValueError naming
    the manifest's field, what the weights hold and what it says)."""
    one = params.get("variant")
    chosen = [one] if isinstance(one, str) else list(params.get("variants") or [])
    for v in chosen:
        if not any(v in w for w in weights):
            held = sorted({k for w in weights for k in w})
            raise ValueError(f"{source}: figure.params names variant {v!r}, expected one of {held} (the "
                             "variants in the output directories)")
    first = next(iter(weights[0].values()), None)
    if first is None:
        raise ValueError(f"{source}: the output directories hold no weights")
    L, H, N, _ = first.shape
    for name, n in (("layer", L), ("head", H), ("focus", N)):
        value = params.get(name)
        if value is not None and not 0 <= value < n:
            raise ValueError(f"{source}: figure.params.{name} must be in [0, {n - 1}] for these weights "
                             f"({L} layers, {H} heads, {N} tokens), got {value}")


def reproduce_figure(manifest_or_path, out_dirs: Sequence[str | Path]) -> FigureBundle:
    """Rebuild an exported figure from its manifest and the ``attnlab analyze`` output directories
    (one per source, in the manifest's order). Checks that the analysed text has the same sha256."""
    m, source = manifest_or_path, "the manifest"
    if not isinstance(m, Mapping):
        source = Path(m)
        m = read_json(source)
    check_manifest(dict(m), source, KINDS)  # types, ranges (head >= 0 ...), required fields, depth
    fig_spec, sources = m["figure"], m["sources"]
    if isinstance(out_dirs, str | Path) or len(out_dirs) != len(sources):
        got = "a single path" if isinstance(out_dirs, str | Path) else f"{len(out_dirs)} output directories"
        raise ValueError(f"out_dirs must list one output directory per source of {source} "
                         f"({len(sources)}), got {got}")
    loaded = [_load_window(Path(d), fig_spec["window"]) for d in out_dirs]
    for d, (_, _, info) in zip(out_dirs, loaded, strict=True):
        if info["input"]["sha256"] != m["input"]["sha256"]:
            raise ValueError(f"the text analysed in {d} differs from the one {source} exported (sha256 "
                             f"{info['input']['sha256'][:12]} != {m['input']['sha256'][:12]})")
    tokens = loaded[0][1]
    u = sources[0]["settings"].get("u")
    weights = [w for w, _, _ in loaded]
    _check_params_fit(fig_spec["params"], weights, source)
    multi = fig_spec["kind"] in MULTI_KINDS or len(weights) > 1
    try:
        return build(
            fig_spec["kind"],
            weights if multi else weights[0],
            tokens,
            fig_spec["params"],
            u=u if isinstance(u, float) else None,
            labels=fig_spec.get("labels") or None,
        )
    except (IndexError, KeyError, TypeError, ValueError) as e:  # a parameter the kind needs is missing
        raise ValueError(f"{source}: figure.params do not describe a {fig_spec['kind']} figure of these "
                         f"weights ({e.__class__.__name__}: {str(e)[:120]})") from None
