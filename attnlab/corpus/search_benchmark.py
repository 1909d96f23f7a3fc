"""``python -m attnlab.bench corpus-search``: the time of a corpus search, and the index's size.

Search time, on a synthetic token index of ``tokens`` rows with MiniLM-L6's widths (hidden states of
384 values, 6 x 12 = 72 masses; float16 Gaussian vectors, since only the shapes matter for the time):
``cold_s`` = the first search (reading the shards' one column, the float32 matrix built) and
``warm_s`` = the median of ``repeats`` searches after it (one matrix-vector product and a partial
sort), by hidden state and by mass profile; the target is ``<= 1 s`` at 100,000 tokens.

Size: ``bytes_per_million_tokens`` of that synthetic index (random float16 hardly compresses: an
upper bound) and, with ``real_docs`` > 0, of a real index written by ``analyze_corpus(index=True)``
over the first ``real_docs`` KJV chapters on MiniLM-L6 (``--variants unas --window 128``).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

__all__ = ["benchmark_search", "synthetic_index"]

DOC_TOKENS = 800  # tokens per synthetic document (a KJV chapter has ~800 MiniLM tokens)
SHARD_DOCS = 8  # documents per shard (attnlab corpus's default)


def synthetic_index(run: Path, tokens: int, width: int = 384, n_heads_total: int = 72, seed: int = 0) -> None:
    """``run/index/shard-*.parquet`` of ``tokens`` rows with the index's schema (random vectors)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from attnlab.corpus.index import FOLDER, schema

    rng = np.random.default_rng(seed)
    sch = schema(width, n_heads_total, {"dims": None, "model_width": width, "variant": "unas"})
    (run / FOLDER).mkdir(parents=True, exist_ok=True)
    per_shard = DOC_TOKENS * SHARD_DOCS
    words = np.array([f"w{i}" for i in range(5000)], dtype=object)
    for shard, first in enumerate(range(0, tokens, per_shard)):
        n = min(per_shard, tokens - first)
        t = np.arange(first, first + n)
        token = words[rng.integers(0, len(words), n)]
        columns = {"doc_index": t // DOC_TOKENS, "doc_id": [f"doc{d}" for d in t // DOC_TOKENS],
                   "window": (t % DOC_TOKENS) // 100, "position": 1 + (t % DOC_TOKENS) % 100,
                   "token_index": t % DOC_TOKENS, "token": token, "text": token, "space_before": t % 7 != 0}
        arrays = [pa.array(columns[f.name], f.type) for f in sch if f.name in columns]
        for size, values in ((width, rng.standard_normal((n, width))),
                             (n_heads_total, rng.gamma(0.5, 2.0, (n, n_heads_total)))):
            flat = pa.array(values.astype(np.float16).reshape(-1), pa.float16())
            arrays.append(pa.FixedSizeListArray.from_arrays(flat, size))
        pq.write_table(pa.Table.from_arrays(arrays, schema=sch), run / FOLDER / f"shard-{shard:05d}.parquet",
                       compression="zstd", use_dictionary=["doc_id", "token", "text"])


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("shard-*.parquet"))


def _real_size(n_docs: int, tmp: Path) -> dict:
    from attnlab.corpus import analyze_corpus
    from attnlab.corpus.index import FOLDER

    result = analyze_corpus("kjv", out=tmp / "real", variants=["unas"], window=128, max_docs=n_docs,
                            bootstrap=10, index=True)
    n = result.manifest["n_tokens"]
    size = _bytes(tmp / "real" / FOLDER)
    return {"tokens": n, "index_bytes": size, "bytes_per_token": size / n,
            "bytes_per_million_tokens": size / n * 1e6,
            "rows_bytes_per_million_tokens": _bytes(tmp / "real" / "rows") / n * 1e6}


def benchmark_search(tokens: int = 100_000, repeats: int = 20, k: int = 20, real_docs: int = 0) -> dict:
    """-> {"tokens", "cold_s", "warm_s", "bytes_per_million_tokens", "real"}: see the module's docstring."""
    from attnlab.corpus import search as corpus_search
    from attnlab.corpus.index import FOLDER

    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < DOC_TOKENS:
        raise ValueError(f"tokens must be an integer >= {DOC_TOKENS}, got {tokens!r}")
    out: dict = {"tokens": tokens, "k": k, "repeats": repeats, "cold_s": {}, "warm_s": {}}
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "synthetic"
        synthetic_index(run, tokens)
        size = _bytes(run / FOLDER)
        out["synthetic_bytes_per_million_tokens"] = size / tokens * 1e6
        for by, width in (("embedding", 384), ("mass", 72)):
            corpus_search._CACHE.clear()
            t0 = time.perf_counter()
            corpus_search.search(run, rng.standard_normal(width) if by == "embedding" else
                                 rng.gamma(0.5, 2.0, width), by=by, k=k)
            out["cold_s"][by] = time.perf_counter() - t0
            times = []
            for _ in range(repeats):
                q = rng.standard_normal(width) if by == "embedding" else rng.gamma(0.5, 2.0, width)
                t0 = time.perf_counter()
                corpus_search.search(run, q, by=by, k=k)
                times.append(time.perf_counter() - t0)
            out["warm_s"][by] = statistics.median(times)
        times = []
        for i in range(repeats):  # a token of the index as the query
            t0 = time.perf_counter()
            corpus_search.search(run, (i % (tokens // DOC_TOKENS), 17), k=k)
            times.append(time.perf_counter() - t0)
        out["warm_s"]["token_query"] = statistics.median(times)
        out["matrix_mib"] = corpus_search.load_index(run).vectors.nbytes / 2**20
        if real_docs:
            out["real"] = _real_size(real_docs, Path(tmp))
    return out
