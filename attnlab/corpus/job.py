"""A corpus run: settings, the manifest, the counting pass, shards, resume, and the local engine.

Layout of a run directory ``out``::

    manifest.json        source (kind, path, sha256 fingerprint), model, variants, parameters,
                         windowing, shards, versions, documents and tokens, skipped documents and why
    token_counts.npy     corpus frequency of every token id (the counting pass; frequency bins)
    rows/shard-NNNNN.parquet   the rows of documents [N * shard_docs, (N + 1) * shard_docs)
    index/shard-NNNNN.parquet  with ``index``: one row per text token of the same documents
                               (attnlab/corpus/index.py; written before the rows' shard)
    summary.parquet, summary.csv   per (variant, layer, head, statistic) over documents (summary.py)
    progress.json        documents / tokens done, tokens/s, ETA (read by the app)

Resumable and lossless: a shard is written to a temporary file and renamed into place, so after a
kill at any moment every shard file on disk is complete; a rerun with the same settings skips the
shards that exist and analyses the rest, so every document is in exactly one shard. A rerun whose
source fingerprint or settings differ from the manifest is refused (``overwrite=True`` starts over).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from attnlab.corpus.index import FOLDER as INDEX
from attnlab.corpus.rows import analyse_shard, shard_path, write_outputs
from attnlab.corpus.sources import PART_CHARS, Source, open_source

__all__ = ["CorpusSettings", "CorpusRun", "prepare", "run_local", "FORMAT"]

FORMAT = "attnlab-corpus/1"
MANIFEST = "manifest.json"
COUNTS = "token_counts.npy"
PROGRESS = "progress.json"
OUR_FILES = (MANIFEST, COUNTS, PROGRESS, "summary.parquet", "summary.csv", "rows", INDEX)


@dataclass(frozen=True)
class CorpusSettings:
    """What decides the rows of a run (a change is refused on resume)."""

    model: str | None = None  # model directory; None = the embedded MiniLM-L6
    variants: tuple[str, ...] = ()  # () = every registered variant
    params: dict = field(default_factory=dict)  # variant parameters (u, iters, ...), defaults filled
    mode: str = "recompute"  # "recompute" | "swap" (hf.analyze's modes)
    window: int | None = None  # tokens per window incl. special tokens; None = hf.analyze's default
    overlap: int | None = None  # text tokens shared by consecutive windows; None = a quarter window
    max_docs: int | None = None  # analyse only the first max_docs documents
    shard_docs: int = 8  # documents per shard (the unit of resume and of Ray tasks)
    n_bins: int = 5  # corpus frequency bins
    part_chars: int = PART_CHARS  # a document is analysed in parts of this many characters
    bootstrap: int = 1000  # bootstrap resamples of documents (summary)
    seed: int = 0  # bootstrap seed
    index: dict | None = None  # the token index's settings (attnlab.corpus.index.index_settings); None: none

    def as_dict(self) -> dict:
        d = asdict(self)
        d["variants"] = list(self.variants)
        if d["index"] is None:  # runs from before the index resume unchanged
            del d["index"]
        return d


@dataclass
class CorpusRun:
    """A prepared run: settings checked, manifest written, documents counted."""

    out: Path
    source: Source
    settings: CorpusSettings
    manifest: dict
    loaded: object  # attnlab.hf.LoadedModel
    documents: list[dict]  # [{"index", "id", "tokens"}] in source order
    bins: np.ndarray  # (V,) frequency bin per token id

    @property
    def n_shards(self) -> int:
        return math.ceil(len(self.documents) / self.settings.shard_docs)

    def shard_documents(self, shard: int) -> list[dict]:
        s = self.settings.shard_docs
        return self.documents[shard * s : (shard + 1) * s]

    def pending(self) -> list[int]:
        """Shards without their rows (or, with an index, without their index shard)."""
        # a job whose settings have no token index (swap-eval's, attnlab/swap_eval) writes rows only
        indexed = getattr(self.settings, "index", None) is not None
        return [k for k in range(self.n_shards) if not shard_path(self.out, k).is_file()
                or (indexed and not shard_path(self.out, k, INDEX).is_file())]

    def row_settings(self) -> dict:
        s = self.settings
        return {"variants": list(s.variants), "mode": s.mode, "params": s.params, "window": s.window,
                "overlap": s.overlap, "n_bins": s.n_bins, "index": s.index}

    def texts(self, shards: list[int]):
        """(shard, [(doc_index, doc_id, parts)]) for ``shards`` (sorted), reading the source once."""
        wanted = {k: self.shard_documents(k) for k in sorted(shards)}
        by_id = {d["id"]: (k, d["index"]) for k, docs in wanted.items() for d in docs}
        current, batch = None, []
        found = 0
        for doc in self.source:
            if found == len(by_id):
                break
            if doc.id not in by_id:
                continue
            found += 1
            k, index = by_id[doc.id]
            if current is not None and k != current:
                yield current, batch
                batch = []
            current = k
            batch.append((index, doc.id, doc.parts(self.settings.part_chars)))
        if batch:
            yield current, batch


def _versions() -> dict:
    import importlib.metadata as md

    import attnlab

    out = {"attnlab": attnlab.__version__}
    for pkg in ("torch", "transformers", "pyarrow", "ray"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def _identity(source: Source, settings: CorpusSettings, info) -> dict:
    """What a resumed run must match."""
    return {"format": FORMAT, "source": {**source.describe(), "fingerprint": source.fingerprint()},
            "model": {"path": info.path, "name": info.name, "architecture": info.architecture},
            "settings": settings.as_dict()}


def _differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    diffs = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            diffs.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return diffs


def _clear(out: Path) -> None:
    for name in OUR_FILES:
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)


def prepare(source, out, settings: CorpusSettings, *, text_column="text", id_column=None,
            overwrite=False, device=None, progress=False) -> CorpusRun:
    """Check everything, write (or check) the manifest, run or reuse the counting pass."""
    from attnlab.hf import load_model

    src = source if isinstance(source, Source) else open_source(source, text_column, id_column)
    out = Path(out)
    loaded = load_model(settings.model, device=device or "cpu")
    check_window(loaded.info, settings.window)
    identity = _identity(src, settings, loaded.info)
    old = _read_json(out / MANIFEST)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out {str(out)!r} is a file; expected a directory for the run")
    if old:
        diffs = _differences({k: old.get(k) for k in identity}, identity)
        if diffs and not overwrite:
            raise ValueError(f"out {str(out)!r} holds a run with other settings ({'; '.join(diffs[:4])}); "
                             "use the same command to resume it, another --out, or --overwrite")
        if diffs:
            _clear(out)
            old = {}
    elif out.is_dir() and any(out.iterdir()):
        if not overwrite or any(p.name not in OUR_FILES for p in out.iterdir()):
            raise ValueError(f"out {str(out)!r} exists and is not an attnlab corpus run (no {MANIFEST}); "
                             "choose an empty or new directory")
        _clear(out)
    out.mkdir(parents=True, exist_ok=True)
    for stray in [p for d in ("rows", INDEX) if (out / d).is_dir() for p in (out / d).glob(".*.tmp")]:
        stray.unlink(missing_ok=True)  # a shard being written when the last run was killed
    manifest = old if old.get("documents") is not None and (out / COUNTS).is_file() else None
    if manifest is None:
        manifest = {**identity, "versions": _versions(), "created": time.time()}
        manifest.update(_count(src, loaded, settings, out, progress))
        write_json(out / MANIFEST, manifest)
    counts = np.load(out / COUNTS, allow_pickle=False)
    from attnlab.corpus.token_classes import frequency_bins

    return CorpusRun(out, src, settings, manifest, loaded, manifest["documents"],
                     frequency_bins(counts, settings.n_bins))


def check_window(info, window) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or not 0 < window <= info.max_length):
        raise ValueError(f"window must be an integer in [1, {info.max_length}] for {info.name}, "
                         f"got {window!r}")


def write_parquet(frame, path: Path) -> None:
    """A DataFrame as Parquet, atomically."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    frame.to_parquet(tmp, index=False)
    os.replace(tmp, path)


def _count(src: Source, loaded, settings: CorpusSettings, out: Path, progress: bool) -> dict:
    """The counting pass: token frequencies and the document list (tokens per document)."""
    from attnlab.hf.capture.windows import tokenize_text

    tokenizer = loaded.tokenizer
    counts = np.zeros(len(tokenizer), dtype=np.int64)
    documents, skipped = [], []
    bar = _bar(progress, None, "counting", "doc")
    try:
        for doc in src:
            n = 0
            for part in doc.parts(settings.part_chars):
                ids = tokenize_text(tokenizer, part).ids
                if len(ids):
                    counts += np.bincount(ids, minlength=len(counts))[: len(counts)]
                n += len(ids)
            if n == 0:
                skipped.append({"id": doc.id, "reason": "no tokens for this tokenizer"})
                continue
            documents.append({"index": len(documents), "id": doc.id, "tokens": n})
            bar.update(1)
            if settings.max_docs is not None and len(documents) >= settings.max_docs:
                break
    finally:
        bar.close()
    skipped = src.skipped + skipped
    if not documents:
        reasons = "; ".join(f"{s['id']}: {s['reason']}" for s in skipped[:3])
        raise ValueError(f"source {src.path!r} has no documents to analyse"
                         + (f" ({len(skipped)} skipped: {reasons})" if skipped else " (it is empty)"))
    tmp = out / f".{COUNTS}.{os.getpid()}.tmp.npy"
    np.save(tmp, counts, allow_pickle=False)
    os.replace(tmp, out / COUNTS)
    return {"documents": documents, "n_documents": len(documents),
            "n_tokens": int(sum(d["tokens"] for d in documents)), "skipped": skipped}


def _bar(enabled: bool, total, desc: str, unit: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, leave=False, unit_scale=True,
                dynamic_ncols=True)


class Progress:
    """Documents, tokens/s and ETA: a tqdm bar and ``progress.json`` (for the app)."""

    def __init__(self, run: CorpusRun, pending: list[int], enabled: bool, engine: str):
        self.run, self.engine = run, engine
        done = set(range(run.n_shards)) - set(pending)
        self.total_docs = len(run.documents)
        self.docs = sum(len(run.shard_documents(k)) for k in done)
        self.total_tokens = run.manifest["n_tokens"]
        self.tokens_before = sum(d["tokens"] for k in done for d in run.shard_documents(k))
        self.tokens = 0  # analysed in this process (window tokens, specials and overlaps included)
        self.start = time.perf_counter()
        self.bar = _bar(enabled, self.total_tokens, f"corpus ({engine})", "tok")
        self.bar.update(self.tokens_before)
        self._last = 0.0
        self.write("running")

    def shard_done(self, shard: int, window_tokens: int) -> None:
        docs = self.run.shard_documents(shard)
        text_tokens = sum(d["tokens"] for d in docs)
        self.docs += len(docs)
        self.tokens += window_tokens
        self.tokens_before += text_tokens
        self.bar.update(text_tokens)
        self.bar.set_postfix_str(f"docs {self.docs}/{self.total_docs}")
        self.write("running")

    def write(self, status: str) -> None:
        elapsed = time.perf_counter() - self.start
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        left = self.total_tokens - self.tokens_before
        write_json(self.run.out / "progress.json", {
            "status": status, "engine": self.engine, "documents_done": self.docs,
            "documents": self.total_docs, "tokens_done": self.tokens_before,
            "tokens": self.total_tokens, "tokens_per_s": rate, "elapsed_s": elapsed,
            "eta_s": left / rate if rate > 0 and status == "running" else None, "updated": time.time(),
        })

    @staticmethod
    def final(out: Path, engine: str) -> None:
        """Mark the run finished (summary written) in progress.json."""
        state = _read_json(out / PROGRESS)
        write_json(out / PROGRESS, {**state, "status": "finished", "engine": engine, "eta_s": None,
                                    "updated": time.time()})

    def close(self, status: str) -> None:
        self.bar.close()
        self.write(status)


def run_local(run: CorpusRun, progress: bool = False, score=None) -> dict:
    """Analyse the pending shards one after the other in this process; -> {"shards", "tokens", "s"}.
    ``score(docs) -> (table, tokens)`` computes one shard's rows (default: the corpus rows and, when
    the run has one, its token index; attnlab swap-eval passes its own)."""
    index = {}  # "last": the token index of the shard just scored (the default score, with an index)
    if score is None:
        def score(docs):
            rows, index["last"], n_tokens = analyse_shard(run.loaded, docs, run.row_settings(), run.bins)
            return rows, n_tokens
    pending = run.pending()
    bar = Progress(run, pending, progress, "local")
    tokens = 0
    t0, cpu0 = time.perf_counter(), time.process_time()
    try:
        for shard, docs in run.texts(pending):
            table, n_tokens = score(docs)
            write_outputs(run.out, shard, table, index.pop("last", None))
            tokens += n_tokens
            bar.shard_done(shard, n_tokens)
    except BaseException:
        bar.close("interrupted")
        raise
    bar.close("analysed")
    return {"shards": len(pending), "tokens": tokens, "s": time.perf_counter() - t0,
            "cpu_s": time.process_time() - cpu0}
