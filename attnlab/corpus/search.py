"""Corpus search (exBERT's "find tokens like this one"): the nearest tokens of a run's token index
(attnlab/corpus/index.py) to a query, by cosine similarity, with their documents and contexts.

    from attnlab.corpus.search import search
    search("runs/kjv", (0, 17))                     # like token 17 of document 0, by hidden state
    search("runs/kjv", vector, by="mass", k=10)     # a received-mass profile (L*H,) or (L, H)

``by="embedding"``: the cosine of the stored last hidden states (float16, or their random
projection). ``by="mass"``: the cosine of the centred log profiles, z = log(m + EPS) - mean over
(layer, head), i.e. the Pearson correlation of the log column masses: raw masses are all positive,
so every raw cosine is near 1, and a profile scaled by a constant (another window length) keeps its z.

The index's matrix is read once per run directory and kind (its Parquet column only), held as one
float32 array (T, K) with unit rows, and kept while its shard files are unchanged; a search is then
one matrix-vector product over T tokens and a partial sort.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attnlab.corpus.index import FOLDER, project

__all__ = ["search", "load_index", "mass_profile", "BY", "EPS"]

BY = ("embedding", "mass")
EPS = 1e-3  # added to a column mass before its log (sparsemax gives exact zeros)
_CACHE: dict[tuple[str, str], IndexMatrix] = {}
_CACHE_MAX = 2  # (run, kind) matrices kept: 100k tokens x 384 dims is 150 MB of float32
_LOCK = threading.Lock()


@dataclass
class IndexMatrix:
    """One kind of vector of a run's token index, every shard in order."""

    vectors: np.ndarray  # (T, K) float32, unit rows (0 where a vector is 0)
    doc_index: np.ndarray  # (T,) int32
    token_index: np.ndarray  # (T,) int32, the token's index among its document's text tokens
    table: object  # pyarrow Table: doc_id, window, position, token, text, space_before (T rows)
    meta: dict  # the index's settings and shapes (each shard's "attnlab_index" metadata)
    stamp: tuple  # the shard files' (name, size, mtime) when read


def mass_profile(masses: np.ndarray) -> np.ndarray:
    """(..., L*H) column masses -> (..., L*H) float32 unit vectors of the centred log profile."""
    z = np.log(np.asarray(masses, dtype=np.float32) + EPS)
    return _unit(z - z.mean(-1, keepdims=True))


def _unit(x) -> np.ndarray:
    """(..., K) -> float32 rows of norm 1 (zero rows stay 0); torch's vectorized float16 -> float32
    conversion and norm (numpy's take ~1 s on a 100k x 384 index)."""
    import torch

    t = torch.as_tensor(np.asarray(x)).float()
    norm = torch.linalg.vector_norm(t, dim=-1, keepdim=True)
    return t.div_(torch.where(norm > 0, norm, torch.ones_like(norm))).numpy()


def _shards(run_dir: Path) -> list[Path]:
    folder = run_dir / FOLDER
    shards = sorted(folder.glob("shard-*.parquet")) if folder.is_dir() else []
    if not shards:
        what = "is not a directory" if not run_dir.is_dir() else f"has no token index ({FOLDER}/)"
        raise ValueError(f"run_dir {str(run_dir)!r} {what}; write one with `attnlab corpus SOURCE --out "
                         f"{run_dir} --index` (Python: analyze_corpus(..., index=True)), or the Corpus "
                         "page's \"Token index for search\"")
    return shards


def load_index(run_dir: str | os.PathLike, by: str = "embedding") -> IndexMatrix:
    """The run's index as :class:`IndexMatrix` for ``by`` (cached while its shards are unchanged)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if by not in BY:
        raise ValueError(f"by must be one of {BY}, got {by!r}")
    run_dir = Path(run_dir)
    shards = _shards(run_dir)
    stamp = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in shards)
    key = (str(run_dir.resolve()), by)
    with _LOCK:
        hit = _CACHE.get(key)
    if hit is not None and hit.stamp == stamp:
        return hit
    columns = [by, "doc_index", "token_index", "doc_id", "window", "position", "token", "text",
               "space_before"]
    tables = [pq.read_table(p, columns=columns) for p in shards]
    meta = json.loads((tables[0].schema.metadata or {}).get(b"attnlab_index", b"{}"))
    values = [t.column(by).combine_chunks() for t in tables if t.num_rows]
    width = tables[0].schema.field(by).type.list_size
    flat = np.concatenate([v.values.to_numpy(zero_copy_only=False) for v in values] or [np.zeros(0)])
    matrix = flat.reshape(-1, width)  # (T, K) float16
    matrix = mass_profile(matrix) if by == "mass" else _unit(matrix)
    rest = pa.concat_tables([t.drop_columns([by]) for t in tables])
    doc_index = rest.column("doc_index").to_numpy().astype(np.int32)
    token_index = rest.column("token_index").to_numpy().astype(np.int32)
    entry = IndexMatrix(matrix, doc_index, token_index, rest.drop_columns(["doc_index", "token_index"]),
                        {**meta, "width": width}, stamp)
    with _LOCK:
        _CACHE[key] = entry
        while len(_CACHE) > _CACHE_MAX:
            _CACHE.pop(next(iter(_CACHE)))
    return entry


def _row_of(index: IndexMatrix, doc, token: int) -> int:
    """The row of (document, token index); doc is a doc_index (int) or a doc_id (str)."""
    if isinstance(doc, str):
        ids = index.table.column("doc_id").to_numpy(zero_copy_only=False)
        found = np.flatnonzero(ids == doc)
        if not len(found):
            raise ValueError(f"query names document {doc!r}, which the index does not hold")
        doc = int(index.doc_index[found[0]])
    if isinstance(doc, bool) or not isinstance(doc, (int, np.integer)) or isinstance(token, bool) \
            or not isinstance(token, (int, np.integer)):
        raise ValueError(f"query must be a vector or (document, token index) with integer indices "
                         f"(or a doc_id string), got ({doc!r}, {token!r})")
    rows = np.flatnonzero((index.doc_index == doc) & (index.token_index == token))
    if not len(rows):
        n = int((index.doc_index == doc).sum())
        raise ValueError(f"query ({doc}, {token}): document {doc} has {n} indexed tokens"
                         + (f" (token index 0..{n - 1})" if n else " (no such document in the index)"))
    return int(rows[0])


def _query_vector(index: IndexMatrix, query, by: str) -> tuple[np.ndarray, int | None]:
    """(unit query (K,), the query's own row or None)."""
    if isinstance(query, tuple):
        if len(query) != 2:
            raise ValueError(f"query must be a vector or (document, token index), got a tuple of "
                             f"{len(query)}")
        row = _row_of(index, *query)
        return index.vectors[row], row
    q = np.asarray(query, dtype=np.float64)
    K, meta = index.vectors.shape[1], index.meta
    if by == "mass" and q.ndim == 2:
        q = q.reshape(-1)  # (L, H) -> (L*H,) layer-major, as the index stores it
    if by == "embedding" and q.ndim == 1 and meta.get("dims") and q.shape[0] == meta.get("model_width"):
        q = project(q, meta["dims"], meta.get("seed", 0))  # a hidden state of the model's width
    if q.ndim != 1 or q.shape[0] != K or not np.isfinite(q).all():
        shape = "(L*H,) or (L, H)" if by == "mass" else f"({K},)"
        raise ValueError(f"query must be a finite vector of shape {shape} for by={by!r} on this index, "
                         f"got shape {tuple(q.shape)}" + ("" if np.isfinite(q).all() else " with NaN/inf"))
    q = mass_profile(q) if by == "mass" else _unit(q.astype(np.float32))
    return q.astype(np.float32), None


def search(run_dir: str | os.PathLike, query, by: str = "embedding", k: int = 20, context: int = 8,
           exclude_self: bool = False):
    """The ``k`` nearest indexed tokens to ``query`` by cosine similarity -> pandas DataFrame.

    Args:
        run_dir: a corpus run written with ``index=True`` (``attnlab corpus ... --index``).
        query: a vector — a last hidden state (K,) (or the model's width C when the index is
            projected) for ``by="embedding"``, a column-mass profile (L*H,) or (L, H) for ``by="mass"``
            — or a token of the index, ``(document, token index)`` with the document's doc_index
            (int) or doc_id (str).
        by: "embedding" or "mass"; k: results (>= 1); context: tokens shown either side.
        exclude_self: leave a (document, token) query's own row out of the results.

    Returns columns rank, similarity, doc_index, doc_id, token_index, window, position, token,
    left, text, right (``left + text + right`` is the context as the document reads it).
    """
    import pandas as pd

    for name, value, low in (("k", k, 1), ("context", context, 0)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    index = load_index(run_dir, by)
    q, own = _query_vector(index, query, by)
    sims = index.vectors @ q  # (T,) cosine similarities
    if exclude_self and own is not None:
        sims[own] = -np.inf
    T = len(sims)
    k = min(int(k), T)
    top = np.argpartition(-sims, k - 1)[:k] if k < T else np.arange(T)
    top = top[np.lexsort((top, -sims[top]))]  # by similarity, ties by index order
    table = index.table.take(top).to_pydict()
    contexts = [_context(index, int(r), context) for r in top]
    return pd.DataFrame({
        "rank": np.arange(1, len(top) + 1), "similarity": sims[top].astype(np.float64),
        "doc_index": index.doc_index[top], "doc_id": table["doc_id"], "token_index": index.token_index[top],
        "window": table["window"], "position": table["position"], "token": table["token"],
        "left": [c[0] for c in contexts], "text": table["text"], "right": [c[1] for c in contexts],
    })


def _context(index: IndexMatrix, row: int, width: int) -> tuple[str, str]:
    """(left, right): the document's characters of up to ``width`` tokens either side of ``row``
    (rows are in document and token order; whitespace between tokens as one space)."""
    T, doc = len(index.doc_index), index.doc_index[row]
    lo, hi = max(0, row - width), min(T, row + width + 1)
    same = np.flatnonzero(index.doc_index[lo:hi] == doc) + lo
    part = index.table.slice(int(same[0]), int(same[-1]) - int(same[0]) + 1).select(["text", "space_before"])
    texts, spaces = part.column("text").to_pylist(), part.column("space_before").to_pylist()
    pieces = [(" " if s else "") + t for t, s in zip(texts, spaces, strict=True)]
    at = row - int(same[0])
    left = "".join(pieces[:at]) + (" " if spaces[at] else "")
    return left.lstrip(), "".join(pieces[at + 1:])
