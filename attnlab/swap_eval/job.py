"""A swap-eval run: settings, the swaps, the manifest, shards of documents scored, resume, local engine.

Layout of a run directory ``out`` (docs/SWAP_EVAL.md)::

    manifest.json          source (kind, path, sha256 fingerprint), model, settings, versions,
                           documents and tokens, skipped documents and why, the last run's timings
    token_counts.npy       corpus frequency of every token id (the corpus job's counting pass)
    rows/shard-NNNNN.parquet   per (document, swap, position): scored tokens and their summed loss
    loss_delta.parquet/.csv, loss_by_position.parquet/.csv, figures/   (summary.py, figures.py)
    progress.json          documents / tokens done, tokens/s, ETA

Resume and refusal are the corpus job's (:mod:`attnlab.corpus.job`): shards are written to a
temporary file and renamed into place, a rerun scores only the missing shards (so every document is
in exactly one shard, counted once), and a rerun whose source fingerprint or settings differ is
refused unless ``overwrite``. Its helpers (counting pass, JSON and Parquet writes, progress, the
shard reader :class:`attnlab.corpus.job.CorpusRun`) are reused here.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from attnlab.corpus.job import (  # the corpus job's helpers: the same files, written the same way
    COUNTS,
    MANIFEST,
    PROGRESS,
    CorpusRun,
    _count,
    _differences,
    _read_json,
    _versions,
    check_window,
    write_json,
    write_parquet,
)
from attnlab.corpus.job import _clear as corpus_clear
from attnlab.corpus.job import run_local as corpus_run_local
from attnlab.corpus.sources import PART_CHARS, Source, open_source

__all__ = [
    "FORMAT",
    "LAYER_MODES",
    "BASELINE",
    "ALL_LAYERS",
    "SwapEvalSettings",
    "SwapEvalRun",
    "prepare",
    "plan_swaps",
    "score_documents",
    "run_local",
    "write_json",
    "write_parquet",
]

FORMAT = "attnlab-swap-eval/1"
LAYER_MODES = ("each", "all", "each,all")  # one swap per layer | every layer at once | both
BASELINE = "model"  # ``variant`` of the unswapped model's rows
ALL_LAYERS = -1  # ``layer`` of the rows of the unswapped model and of all-layer swaps
OUR_FILES = (
    MANIFEST,
    COUNTS,
    PROGRESS,
    "rows",
    "figures",
    "loss_delta.parquet",
    "loss_delta.csv",
    "loss_by_position.parquet",
    "loss_by_position.csv",
)


@dataclass(frozen=True)
class SwapEvalSettings:
    """What decides the rows of a run (a change is refused on resume)."""

    model: str = ""  # model directory, loaded with its LM head (attnlab.hf.load_language_model)
    variants: tuple[str, ...] = ("dnas", "sinkhorn", "softmax1")  # swapped in, one at a time
    layers: str = "each"  # "each": one swap per layer, "all": every layer at once, "each,all": both
    params: dict = field(default_factory=dict)  # variant parameters (u, iters, ...), defaults filled
    window: int | None = None  # tokens per window incl. special tokens; None = max length, at most 512
    mask_rate: float = 0.15  # masked-LM models: share of a window's tokens masked (BERT's rule)
    max_docs: int | None = None  # score only the first max_docs documents
    shard_docs: int = 8  # documents per shard (the unit of resume and of Ray tasks)
    part_chars: int = PART_CHARS  # a document is read in parts of this many characters
    bootstrap: int = 1000  # bootstrap resamples of documents (loss_delta CIs)
    seed: int = 0  # masked-LM mask and bootstrap seed

    def as_dict(self) -> dict:
        d = asdict(self)
        d["variants"] = list(self.variants)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> SwapEvalSettings:
        return cls(**{**d, "variants": tuple(d["variants"])})


@dataclass
class SwapEvalRun(CorpusRun):
    """A prepared run (the corpus run's shards and document reader); ``loaded`` has its LM head,
    ``bins`` is unused (None)."""

    def swaps(self):
        return plan_swaps(self.loaded.info, self.settings)


def plan_swaps(info, settings: SwapEvalSettings) -> list[tuple[str, int, object]]:
    """[(variant label, layer label, lm_loss.Swap)]: the unswapped model first, then per variant its
    per-layer swaps (``each``) and its all-layer swap (``all``, layer label ALL_LAYERS)."""
    import attnlab
    from attnlab.hf.beyond.lm_loss import Swap, check_swap

    out = [(BASELINE, ALL_LAYERS, Swap())]
    for v in settings.variants:
        mine = {
            p.name: settings.params[p.name]
            for p in attnlab.variant_spec(v).params
            if p.name in settings.params
        }
        if "each" in settings.layers:
            out += [(v, layer, check_swap(info, v, [layer], None, mine)) for layer in range(info.n_layers)]
        if "all" in settings.layers:
            out.append((v, ALL_LAYERS, check_swap(info, v, None, None, mine)))
    return out


def _schema():
    import pyarrow as pa

    return pa.schema(
        [
            ("doc_index", pa.int32()),  # position of the document in the source (after skipping)
            ("doc_id", pa.string()),
            ("variant", pa.string()),  # BASELINE for the unswapped model
            ("layer", pa.int16()),  # the swapped layer; ALL_LAYERS: every layer (or none, for BASELINE)
            ("position", pa.int32()),  # position of the scored tokens in their windows
            ("n_tokens", pa.int32()),  # scored tokens of the document at that position (over its windows)
            ("loss_sum", pa.float64()),  # their summed loss, nats
        ]
    )


def score_documents(loaded, documents, swaps, settings: SwapEvalSettings):
    """-> (rows, scored tokens): a pyarrow Table of :func:`_schema` for ``documents`` = (doc_index,
    doc_id, parts), every window of every part scored under every swap (hf.beyond.lm_loss), losses
    summed per (document, swap, position). ``swaps``: :func:`plan_swaps`'s."""
    import pyarrow as pa

    from attnlab.hf.beyond.lm_loss import text_windows, window_losses
    from attnlab.hf.capture.windows import MAX_DEFAULT_WINDOW

    window = settings.window or min(loaded.info.max_length, MAX_DEFAULT_WINDOW)
    cols: dict[str, list] = {name: [] for name in _schema().names}
    scored = 0
    for doc_index, doc_id, parts in documents:
        sums = np.zeros((len(swaps), window))  # (K, P): summed loss per swap and position
        counts = np.zeros(window, dtype=np.int64)  # (P,): scored tokens per position (equal for every swap)
        w = 0
        for part in parts:
            for ids, special in text_windows(loaded.tokenizer, part, window):
                losses = window_losses(
                    loaded,
                    ids,
                    special,
                    [s for _, _, s in swaps],
                    seed=settings.seed,
                    text=doc_index,
                    window=w,
                    mask_rate=settings.mask_rate,
                )
                for k, scored_k in enumerate(losses):
                    sums[k] += np.bincount(scored_k.positions, scored_k.losses, minlength=window)
                counts += np.bincount(losses[0].positions, minlength=window)
                scored += len(losses[0].positions)
                w += 1
        at = np.flatnonzero(counts)  # positions with scored tokens
        for k, (variant, layer, _) in enumerate(swaps):
            for name, value in (
                ("doc_index", doc_index),
                ("doc_id", doc_id),
                ("variant", variant),
                ("layer", layer),
            ):
                cols[name].append(np.full(len(at), value, dtype=object if isinstance(value, str) else None))
            cols["position"].append(at)
            cols["n_tokens"].append(counts[at])
            cols["loss_sum"].append(sums[k, at])
    if not cols["position"]:
        return _schema().empty_table(), scored
    arrays = [pa.array(np.concatenate(cols[f.name]), f.type) for f in _schema()]
    return pa.Table.from_arrays(arrays, schema=_schema()), scored


def _identity(source: Source, settings: SwapEvalSettings, info) -> dict:
    """What a resumed run must match."""
    return {
        "format": FORMAT,
        "source": {**source.describe(), "fingerprint": source.fingerprint()},
        "model": {"path": info.path, "name": info.name, "architecture": info.architecture},
        "settings": settings.as_dict(),
    }


def _clear(out: Path) -> None:
    """Remove a run's files: the corpus job's (manifest, counts, progress, rows), tables, figures."""
    corpus_clear(out)
    shutil.rmtree(out / "figures", ignore_errors=True)
    for name in OUR_FILES:
        if name.endswith((".parquet", ".csv")):
            (out / name).unlink(missing_ok=True)


def prepare(
    source,
    out,
    settings: SwapEvalSettings,
    *,
    text_column="text",
    id_column=None,
    overwrite=False,
    device=None,
    progress=False,
) -> SwapEvalRun:
    """Check everything, write (or check) the manifest, run or reuse the counting pass."""
    from attnlab.hf import load_language_model

    src = source if isinstance(source, Source) else open_source(source, text_column, id_column)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out {str(out)!r} is a file; expected a directory for the run")
    loaded = load_language_model(settings.model, device=device or "cpu")
    check_window(loaded.info, settings.window)
    identity = _identity(src, settings, loaded.info)
    old = _read_json(out / MANIFEST)
    if old:
        diffs = _differences({k: old.get(k) for k in identity}, identity)
        if diffs and not overwrite:
            raise ValueError(
                f"out {str(out)!r} holds a run with other settings ({'; '.join(diffs[:4])}); "
                "use the same command to resume it, another --out, or --overwrite"
            )
        if diffs:
            _clear(out)
            old = {}
    elif out.is_dir() and any(out.iterdir()):
        if not overwrite or any(p.name not in OUR_FILES for p in out.iterdir()):
            raise ValueError(
                f"out {str(out)!r} exists and is not an attnlab swap-eval run (no {MANIFEST}); "
                "choose an empty or new directory"
            )
        _clear(out)
    out.mkdir(parents=True, exist_ok=True)
    for stray in (out / "rows").glob(".*.tmp") if (out / "rows").is_dir() else ():
        stray.unlink(missing_ok=True)  # a shard being written when the last run was killed
    manifest = old if old.get("documents") is not None else None
    if manifest is None:
        manifest = {**identity, "versions": _versions(), "created": time.time()}
        manifest.update(_count(src, loaded, settings, out, progress))
        write_json(out / MANIFEST, manifest)
    return SwapEvalRun(out, src, settings, manifest, loaded, manifest["documents"], None)


def run_local(run: SwapEvalRun, progress: bool = False) -> dict:
    """Score the pending shards one after the other in this process (the corpus job's loop);
    -> {"shards", "tokens", "s", "cpu_s"}."""
    swaps = run.swaps()
    return corpus_run_local(run, progress, lambda docs: score_documents(run.loaded, docs, swaps,
                                                                        run.settings))
