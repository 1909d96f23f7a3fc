"""One shard of a corpus run: its documents analysed into rows (both engines call this).

A row is one (document, window, variant, layer, head, statistic) value. The statistics are those of
``WindowResult.table()`` (attnlab.stats.tidy_table, unchanged) followed by the key-class breakdown of
:mod:`attnlab.corpus.token_classes` and the sink rows of :mod:`attnlab.corpus.sink_rows`. Every
part of a document is windowed exactly as ``hf.stream_analysis`` windows a text; window numbers run
on across parts.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from attnlab.corpus.sink_rows import join_columns, recorded, sink_columns
from attnlab.corpus.sources import split_parts
from attnlab.corpus.token_classes import class_statistics_from_masses, key_classes

__all__ = ["SCHEMA", "analyse_documents", "analyse_shard", "write_shard", "write_outputs", "shard_path"]


def _schema():
    import pyarrow as pa

    return pa.schema([
        ("doc_index", pa.int32()),  # position of the document in the source (after skipping)
        ("doc_id", pa.string()),
        ("window", pa.int32()),  # window number within the document
        ("n_tokens", pa.int32()),  # tokens of the window, special tokens included
        ("variant", pa.string()),
        ("layer", pa.int16()),
        ("head", pa.int16()),
        ("statistic", pa.string()),
        ("value", pa.float64()),
    ])


SCHEMA = None  # pyarrow schema, built on first use (pyarrow imports lazily)


def schema():
    global SCHEMA
    if SCHEMA is None:
        SCHEMA = _schema()
    return SCHEMA


def _window_columns(result, masses, bins, n_bins) -> dict[str, np.ndarray]:
    """Columns variant, layer, head, statistic, value of one WindowResult (V*L*H*S rows); ``masses``
    its column masses {variant: (L, H, N)} (``result.column_masses()``, taken once per window)."""
    frame = result.table()  # variant, layer, head, statistic, value (+ window)
    w = result.window
    names, classes = key_classes(w.tokens, w.input_ids, w.special, w.punctuation, bins, n_bins)
    extra = class_statistics_from_masses(masses, len(w.tokens), names, classes)
    variants = list(result.weights)
    stat_names, first = extra[variants[0]]
    L, H, S = first.shape
    values = np.stack([extra[v][1].numpy() for v in variants])  # (V, L, H, S)
    V = len(variants)
    return {
        "variant": np.concatenate([frame["variant"].to_numpy(object),
                                   np.repeat(np.asarray(variants, dtype=object), L * H * S)]),
        "layer": np.concatenate([frame["layer"].to_numpy(np.int16),
                                 np.tile(np.repeat(np.arange(L, dtype=np.int16), H * S), V)]),
        "head": np.concatenate([frame["head"].to_numpy(np.int16),
                                np.tile(np.repeat(np.arange(H, dtype=np.int16), S), V * L)]),
        "statistic": np.concatenate([frame["statistic"].to_numpy(object),
                                     np.tile(np.asarray(stat_names, dtype=object), V * L * H)]),
        "value": np.concatenate([frame["value"].to_numpy(np.float64), values.reshape(-1)]),
    }


def analyse_documents(loaded, documents: Iterable[tuple[int, str, Iterable[str]]], settings: dict,
                      bins: np.ndarray | None, on_window=None):
    """-> (rows, window tokens): a pyarrow Table of :func:`schema` for ``documents`` = (doc_index,
    doc_id, parts), and the tokens of all its windows (special tokens and overlaps included).

    ``settings``: the run's settings (variants, mode, params, window, overlap, n_bins; ``index``, a
    dict or None, is left to :func:`analyse_shard`). ``on_window(n_tokens)`` is called after every
    window (progress). The columns of every window are numpy arrays, joined and turned into one
    Arrow table per call (per shard).
    """
    rows, _, window_tokens = analyse_shard(loaded, documents, {**settings, "index": None}, bins, on_window)
    return rows, window_tokens


def analyse_shard(loaded, documents: Iterable[tuple[int, str, Iterable[str]]], settings: dict,
                  bins: np.ndarray | None, on_window=None):
    """-> (rows, index or None, window tokens): :func:`analyse_documents`'s rows and, when
    ``settings["index"]`` is set, the token index of the same windows (attnlab/corpus/index.py),
    from the same analysis pass (the column masses are taken once per window for both)."""
    import pyarrow as pa

    from attnlab.corpus.index import IndexBlocks, owned_ranges
    from attnlab.hf import stream_analysis

    params = settings["params"]
    index = IndexBlocks(loaded, settings["index"]) if settings.get("index") else None
    blocks: dict[str, list[np.ndarray]] = {name: [] for name in schema().names}
    doc_ids: list[str] = []
    window_tokens = 0
    for doc_index, doc_id, parts in documents:
        window_base = token_base = 0
        doc_ids.append(doc_id)
        for part in parts:
            if not part.strip():
                continue
            stream = stream_analysis(part, loaded, settings["variants"], settings["mode"],
                                     window=settings["window"], overlap=settings["overlap"], **params)
            owned = owned_ranges(stream.windowing)
            for result, activations in recorded(stream, loaded):  # + its forwards' massive activations
                masses = result.column_masses()  # {variant: (L, H, N)}, once for rows and index
                cols = _window_columns(result, masses, bins, settings["n_bins"])
                cols = join_columns(cols, sink_columns(result, masses, activations, settings["mode"]))
                n = len(cols["value"])
                n_tokens = len(result.tokens)
                cols["doc_index"] = np.full(n, doc_index, np.int32)
                cols["doc_id"] = np.full(n, len(doc_ids) - 1, np.int32)  # index into doc_ids
                cols["window"] = np.full(n, window_base + result.index, np.int32)
                cols["n_tokens"] = np.full(n, n_tokens, np.int32)
                for name, values in cols.items():
                    blocks[name].append(values)
                if index is not None:  # its own forward (the last hidden states), after the sink rows
                    index.add_window(result, masses, owned[result.index], doc_index, doc_id,
                                     window_base + result.index, token_base, part)
                    if activations is not None:
                        activations.clear()  # that forward is not the analysis': not a sink row's
                window_tokens += n_tokens
                if on_window is not None:
                    on_window(n_tokens)
            window_base += len(stream)
            token_base += stream.windowing.n_tokens
    info = loaded.info
    index_table = None if index is None else index.table(info.n_layers, info.n_heads)
    if not blocks["value"]:
        return schema().empty_table(), index_table, window_tokens
    columns = {name: np.concatenate(values) for name, values in blocks.items()}
    columns["doc_id"] = np.asarray(doc_ids, dtype=object)[columns["doc_id"]]
    arrays = [pa.array(columns[f.name], f.type) for f in schema()]
    return pa.Table.from_arrays(arrays, schema=schema()), index_table, window_tokens


def document_parts(text: str, part_chars: int):
    return split_parts(text, part_chars)


def shard_path(out: str | os.PathLike, shard: int, folder: str = "rows") -> Path:
    return Path(out) / folder / f"shard-{shard:05d}.parquet"


def write_shard(out: str | os.PathLike, shard: int, table, folder: str = "rows") -> Path:
    """Write a shard atomically: a temporary file renamed into place (a kill leaves no partial shard)."""
    import pyarrow.parquet as pq

    path = shard_path(out, shard, folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    dictionary = [c for c in ("doc_id", "variant", "statistic", "token", "text") if c in table.column_names]
    pq.write_table(table, tmp, compression="zstd", use_dictionary=dictionary)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def write_outputs(out: str | os.PathLike, shard: int, rows, index=None) -> None:
    """A shard's index (when there is one) and then its rows, each atomically: the rows file marks the
    shard done, so a kill between the two leaves the shard pending, to be written again whole."""
    from attnlab.corpus.index import FOLDER

    if index is not None:
        write_shard(out, shard, index, FOLDER)
    write_shard(out, shard, rows)
