"""Corpus atlas: explaining-away statistics over many documents, on one machine or a Ray cluster.

    from attnlab.corpus import analyze_corpus
    result = analyze_corpus("kjv", out="runs/kjv", max_docs=100)
    result.summary()      # pandas: per variant, layer, head, statistic: mean, quantiles, 95 % CI
    result.rows           # the Parquet dataset of rows (a directory of shards)

With ``index=True`` (``attnlab corpus --index``) the run also writes a token index (``out/index/``,
attnlab/corpus/index.py) that :func:`attnlab.corpus.search.search` reads: the nearest tokens of the
corpus to a token, by last hidden state or by received-mass profile.

Modules: ``sources`` (documents), ``token_classes`` (attention received per key class), ``rows``
(one shard analysed), ``job`` (manifest, counting pass, resume, local engine), ``ray_engine``
(ray.data map_batches), ``summary`` (over documents), ``index`` (the token index written beside the
rows), ``search`` (nearest tokens in it), ``cli`` (``attnlab corpus``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CorpusResult", "analyze_corpus", "open_result"]

ENGINES = ("local", "ray")


@dataclass
class CorpusResult:
    """A finished (or opened) corpus run directory."""

    out: Path
    manifest: dict

    @property
    def rows(self) -> Path:
        """The Parquet dataset of rows: ``pyarrow.dataset.dataset(result.rows)``."""
        return self.out / "rows"

    def summary(self):
        """Per (variant, layer, head, statistic) over documents (``summary.parquet``)."""
        import pandas as pd

        return pd.read_parquet(self.out / "summary.parquet")

    def table(self, **filters):
        """The rows as a DataFrame, optionally filtered on equality, e.g. ``variant="dnas"``."""
        import pyarrow.compute as pc
        import pyarrow.dataset as ds

        expr = None
        for key, value in filters.items():
            e = pc.field(key) == value
            expr = e if expr is None else expr & e
        return ds.dataset(self.rows, format="parquet").to_table(filter=expr).to_pandas()


def open_result(out: str | os.PathLike) -> CorpusResult:
    """A finished run's directory -> CorpusResult; ValueError when it is not one."""
    from attnlab.corpus.job import MANIFEST, _read_json

    out = Path(out)
    manifest = _read_json(out / MANIFEST)
    if not manifest or not (out / "summary.parquet").is_file():
        raise ValueError(f"{str(out)!r} is not a finished corpus run (no {MANIFEST} and summary.parquet)")
    return CorpusResult(out, manifest)


def _check_int(name: str, value, low: int, allow_none: bool = False):
    if value is None and allow_none:
        return None
    from attnlab.normalizers.checks import scalar

    value = scalar(value)  # numpy and 0-d tensor integers as Python ints (the manifest is JSON)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}{' or None' if allow_none else ''}, "
                         f"got {value!r}")
    return value


def analyze_corpus(source, model=None, variants=None, mode: str = "recompute", *, out,
                   params: dict | None = None, window: int | None = None, overlap: int | None = None,
                   max_docs: int | None = None, text_column: str = "text", id_column: str | None = None,
                   engine: str = "local", ray_address: str | None = None, workers: int = 1,
                   shard_docs: int = 8, bootstrap: int = 1000, seed: int = 0, overwrite: bool = False,
                   device=None, progress: bool = False, index: bool = False, index_dims: int | None = None,
                   **variant_params) -> CorpusResult:
    """Analyse every document of ``source`` with every variant; rows and summary under ``out``.

    Args:
        source: "kjv" (the shipped King James Bible, one document per chapter), a folder of .txt/.md
            files, or a .jsonl / .csv / .parquet file with ``text_column`` (and ``id_column``).
        model: None (embedded MiniLM-L6) or a local model directory; variants: names (default all
            registered); params / **variant_params: variant parameters (u=..., iters=...).
        window, overlap: as ``hf.analyze``; max_docs: only the first documents.
        engine: "local" (this process) or "ray" (ray.data, ``workers`` actors; ``ray_address`` joins
            an existing cluster, else a local Ray is started). shard_docs: documents per shard.
        bootstrap, seed: resamples and seed of the confidence intervals.
        overwrite: replace a run in ``out`` made with other settings (otherwise refused).
        index: also write the token index (``out/index/``: per text token its document, position,
            last hidden state and received mass per layer and head; attnlab/corpus/index.py), which
            :func:`attnlab.corpus.search.search` reads; index_dims: project the hidden states to this
            many dimensions (a fixed random projection; None: the model's width, exact to float16).
    """
    from attnlab.corpus import job
    from attnlab.corpus.index import index_settings
    from attnlab.corpus.summary import summarize
    from attnlab.corpus.variants import resolve
    from attnlab.normalizers.checks import scalar

    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    workers = _check_int("workers", workers, 1)
    if engine == "local" and workers != 1:
        raise ValueError(f"workers={workers} needs engine='ray'; the local engine runs one process")
    if ray_address is not None and engine != "ray":
        raise ValueError("ray_address needs engine='ray'")
    shard_docs = _check_int("shard_docs", shard_docs, 1)
    max_docs = _check_int("max_docs", max_docs, 1, allow_none=True)
    bootstrap = _check_int("bootstrap", bootstrap, 1)
    seed = _check_int("seed", seed, 0)
    window, overlap = scalar(window), scalar(overlap)  # checked with the model (job.check_window, hf)
    if not isinstance(index, bool):
        raise ValueError(f"index must be True or False, got {index!r}")
    if index_dims is not None and not index:
        raise ValueError(f"index_dims={index_dims!r} needs index=True")
    from attnlab.hf import load_model

    info = load_model(model, device="cpu").info  # cached; causal models change variant defaults
    names, full = resolve(variants, {**(params or {}), **variant_params}, mode, info)
    settings = job.CorpusSettings(
        model=None if model is None else str(Path(model).resolve()), variants=names, params=full,
        mode=mode, window=window, overlap=overlap, max_docs=max_docs, shard_docs=shard_docs,
        bootstrap=bootstrap, seed=seed, index=index_settings(names, index_dims) if index else None,
    )
    cluster = None
    if engine == "ray":  # fail fast (unreachable address) before the counting pass
        from attnlab.corpus import ray_engine

        cluster = ray_engine.connect(ray_address, workers)
    t_prepare = time.perf_counter()
    run = job.prepare(source, out, settings, text_column=text_column, id_column=id_column,
                      overwrite=overwrite, device=device if engine == "local" else "cpu", progress=progress)
    t0 = time.perf_counter()
    if engine == "local":
        stats = job.run_local(run, progress=progress)
    else:
        stats = ray_engine.run_ray(run, cluster, workers, progress=progress)
    t_summary = time.perf_counter()
    summary = summarize(run.out / "rows", resamples=bootstrap, seed=seed)
    job.write_parquet(summary, run.out / "summary.parquet")
    summary.to_csv(run.out / "summary.csv", index=False)
    t1 = time.perf_counter()
    manifest = {**run.manifest, "engine": engine, "workers": workers,
                "last_run": {**stats, "prepare_s": t0 - t_prepare, "summary_s": t1 - t_summary,
                             "wall_s": t1 - t0, "finished": time.time()}}
    job.write_json(run.out / job.MANIFEST, manifest)
    job.Progress.final(run.out, engine)
    return CorpusResult(run.out, manifest)
