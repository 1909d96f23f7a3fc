"""The summary of a corpus run: per (variant, layer, head, statistic), over documents.

Each document counts once: its value of a statistic is the mean over its windows (as
``AnalysisResult.summary`` averages windows). Over the D documents (sorted by their index in the
source, so the result does not depend on which engine or shard order wrote the rows):

    mean, std (population), q05 q25 q50 q75 q95      of the D document values
    ci_low, ci_high                                  95 % percentile bootstrap CI of the mean: B
                                                     resamples of D documents with replacement,
                                                     multinomial counts drawn from numpy's PCG64
                                                     seeded with ``seed`` (identical every run)

``head = -1`` rows describe the mean over a layer's heads (per document, then over documents):
the per-layer curves; a statistic of a whole layer (the ``massive_*`` rows of
attnlab/corpus/sink_rows.py) is written with head = -1 and summarized as it is. Memory: the shards
are read one at a time (the rows of a document are all in one shard, so its means over windows are
complete there); what is kept is the (documents x keys) matrix of per-document means of each variant,
8 bytes per document and key, never the rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from attnlab.normalizers.checks import scalar

__all__ = ["summarize", "QUANTILE_COLUMNS", "ALL_HEADS"]

QUANTILE_COLUMNS = {"q05": 0.05, "q25": 0.25, "q50": 0.5, "q75": 0.75, "q95": 0.95}
ALL_HEADS = -1  # ``head`` of the rows that average a layer's heads
_CHUNK = 2048  # statistics bootstrapped at once (bounds the (B, chunk) matrix)


def _per_document(frame):
    """{variant: wide DataFrame (index doc_index, columns (statistic, layer, head), float64)} and the
    windows per document (Series) of the rows of whole documents (one shard): per-document means over
    windows, and (head = ALL_HEADS) their means over a layer's heads; NaN where a document lacks a key."""
    import pandas as pd

    windows = frame.groupby("doc_index")["window"].nunique()
    out = {}
    for variant, part in frame.groupby("variant", sort=False):
        means = part.groupby(["doc_index", "statistic", "layer", "head"], sort=True)["value"].mean()
        wide = means.unstack(["statistic", "layer", "head"])  # (D, K)
        per_head = means[means.index.get_level_values("head") != ALL_HEADS]  # (a layer's rows are kept)
        per_layer = per_head.groupby(level=["doc_index", "statistic", "layer"]).mean()
        per_layer = per_layer.unstack(["statistic", "layer"])
        per_layer.columns = pd.MultiIndex.from_tuples([(s, lay, ALL_HEADS) for s, lay in per_layer.columns],
                                                      names=["statistic", "layer", "head"])
        out[variant] = pd.concat([wide, per_layer], axis=1)
    return out, windows


def _document_matrices(files, columns):
    """{variant: (doc_indices (D,), keys DataFrame (K: statistic, layer, head), X (D, K) float64,
    n_windows (D,))}, variants in order of appearance; one shard in memory at a time.

    Every document lies in one shard, so its means over windows are complete within that shard; only
    the (D, K) matrices of per-document means are kept (8 bytes per document and key).
    """
    import pandas as pd
    import pyarrow.parquet as pq

    parts: dict[str, list] = {}
    windows = []
    for f in files:
        per_variant, w = _per_document(pq.read_table(f, columns=columns).to_pandas())
        windows.append(w)
        for variant, wide in per_variant.items():
            parts.setdefault(variant, []).append(wide)
    windows = pd.concat(windows)
    out = {}
    for variant in list(parts):
        wide = pd.concat(parts.pop(variant), axis=0).sort_index(axis=0).sort_index(axis=1)
        keys = wide.columns.to_frame(index=False)[["statistic", "layer", "head"]]
        out[variant] = (wide.index.to_numpy(), keys, wide.to_numpy(np.float64),
                        windows.reindex(wide.index).to_numpy())
        del wide
    return out


def bootstrap_counts(n_docs: int, resamples: int, seed: int) -> np.ndarray:
    """(B, D) float64 multinomial resampling counts (each row sums to D), seeded."""
    rng = np.random.Generator(np.random.PCG64(seed))
    return rng.multinomial(n_docs, np.full(n_docs, 1.0 / n_docs), size=resamples).astype(np.float64)


def _describe(X: np.ndarray, counts: np.ndarray) -> dict[str, np.ndarray]:
    """Statistics over documents (rows of X, NaN = missing) of each column."""
    valid = ~np.isnan(X)
    n = valid.sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        complete = bool(valid.all())  # the usual case: np.quantile is vectorized, nanquantile is not
        mean = X.mean(0) if complete else np.nanmean(X, 0)
        out = {"mean": mean, "std": X.std(0) if complete else np.nanstd(X, 0)}
        qs = np.quantile(X, list(QUANTILE_COLUMNS.values()), axis=0) if complete else \
            np.nanquantile(X, list(QUANTILE_COLUMNS.values()), axis=0)
        out.update(zip(QUANTILE_COLUMNS, qs, strict=True))
        low, high = np.empty(X.shape[1]), np.empty(X.shape[1])
        X0, V = np.nan_to_num(X), valid.astype(np.float64)
        for c0 in range(0, X.shape[1], _CHUNK):
            c1 = min(c0 + _CHUNK, X.shape[1])
            boot = (counts @ X0[:, c0:c1]) / np.maximum(counts @ V[:, c0:c1], 1.0)  # (B, chunk)
            low[c0:c1], high[c0:c1] = np.quantile(boot, [0.025, 0.975], axis=0)
    out["ci_low"], out["ci_high"], out["n_documents"] = low, high, n
    return out


def summarize(rows_dir: str | Path, resamples: int = 1000, seed: int = 0):
    """Summary DataFrame of the Parquet rows under ``rows_dir`` (see the module docstring).

    Columns: variant, layer, head, statistic, mean, std, q05, q25, q50, q75, q95, ci_low, ci_high,
    n_documents, n_windows (windows over those documents).
    """
    import pandas as pd

    resamples = scalar(resamples)  # numpy and 0-d tensor numbers as Python ones
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise ValueError(f"resamples must be an integer >= 1, got {resamples!r}")
    files = sorted(Path(rows_dir).glob("shard-*.parquet"))
    if not files:
        raise ValueError(f"rows_dir {str(rows_dir)!r} holds no shard-*.parquet files; nothing to summarize")
    columns = ["doc_index", "window", "variant", "layer", "head", "statistic", "value"]
    frames = []
    counts_cache: dict[int, np.ndarray] = {}
    for variant, (docs, keys, X, windows) in _document_matrices(files, columns).items():
        D = len(docs)
        if D not in counts_cache:
            counts_cache[D] = bootstrap_counts(D, resamples, seed)
        stats = _describe(X, counts_cache[D])
        part = keys.assign(variant=variant, **stats)
        part["n_windows"] = (~np.isnan(X) * windows[:, None]).sum(0)
        frames.append(part)
    order = {v: i for i, v in enumerate(dict.fromkeys(p["variant"].iat[0] for p in frames))}
    out = pd.concat(frames, ignore_index=True)
    out["layer"] = out["layer"].astype(np.int64)
    out["head"] = out["head"].astype(np.int64)
    out["n_documents"] = out["n_documents"].astype(np.int64)
    out["n_windows"] = out["n_windows"].astype(np.int64)
    lead = ["variant", "layer", "head", "statistic"]
    return out[lead + [c for c in out.columns if c not in lead]].sort_values(
        ["variant", "statistic", "layer", "head"], key=lambda s: s.map(order) if s.name == "variant" else s,
        ignore_index=True,
    )
