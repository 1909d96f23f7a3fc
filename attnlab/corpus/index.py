"""The token index of a corpus run (``attnlab corpus --index``): one row per text token, written
beside the rows, shard by shard, for "find tokens like this one" (:mod:`attnlab.corpus.search`).

Each text token of a document is indexed once, from one window: consecutive windows overlap, and
a token in an overlap belongs to the window whose edge it is farther from (the midpoint of the
overlap splits it), so it is seen with the most context. Special tokens ([CLS], [SEP], <s>) are not
indexed. ``index/shard-NNNNN.parquet`` holds the documents of ``rows/shard-NNNNN.parquet``:

    doc_index int32, doc_id string    the document (as in the rows)
    window int32, position int32      window number in the document, position in that window
                                      (special tokens counted, as Inspect counts them)
    token_index int32                 the token's index among the document's text tokens
    token string                      the tokenizer's piece ("##ing", "Ġthe")
    text string, space_before bool    the document's characters of the token, and whether
                                      characters (whitespace) separate it from the previous token:
                                      the contexts are rebuilt from these (no source is read)
    embedding list<float16>[K]        the model's last hidden state at the token (transformers'
                                      ``hidden_states[-1]``; a native checkpoint: the last block's
                                      output), K = the model's width, or ``dims`` after a fixed
                                      random projection (seed 0, Gaussian / sqrt(dims))
    mass list<float16>[L*H]           the column mass m_j = sum_i pi_ij the token receives in
                                      every layer and head (layer-major) under the index's
                                      variant (the run's first): the masses the statistics use

The settings (``CorpusSettings.index``) are part of the run's identity: a resumed run with other
index settings is refused. Size: about ``2 K + 2 L H + 10`` bytes per token (float16 barely
compresses); measured on MiniLM-L6 (K = 384, L H = 72) 843 bytes, 0.84 GB per million tokens
(docs/ANALYSIS.md).
"""

from __future__ import annotations

import numpy as np
import torch

from attnlab.normalizers.checks import scalar

__all__ = ["FOLDER", "index_settings", "schema", "token_embeddings", "project", "owned_ranges",
           "IndexBlocks"]

FOLDER = "index"  # beside rows/ in the run directory
EMBEDDING = "last_hidden_state"
SEED = 0  # the random projection's seed


def index_settings(variants, dims: int | None) -> dict:
    """What ``CorpusSettings.index`` records for an indexed run (JSON: it goes into the manifest)."""
    dims = scalar(dims)  # numpy and 0-d tensor integers as Python ints (the manifest is JSON)
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
        raise ValueError(f"index_dims must be an integer >= 1 or None, got {dims!r}")
    return {"embedding": EMBEDDING, "dims": dims, "seed": SEED, "variant": variants[0], "dtype": "float16"}


def schema(width: int, n_heads_total: int, meta: dict | None = None):
    """The pyarrow schema of an index shard (``width`` embedding values, L*H masses)."""
    import json

    import pyarrow as pa

    fields = [("doc_index", pa.int32()), ("doc_id", pa.string()), ("window", pa.int32()),
              ("position", pa.int32()), ("token_index", pa.int32()), ("token", pa.string()),
              ("text", pa.string()), ("space_before", pa.bool_()),
              ("embedding", pa.list_(pa.float16(), width)), ("mass", pa.list_(pa.float16(), n_heads_total))]
    return pa.schema(fields, metadata={"attnlab_index": json.dumps(meta or {})})


def token_embeddings(loaded, input_ids) -> np.ndarray:
    """(N, C) float32 on the CPU: the last hidden state of one window ``input_ids`` (N,) — transformers'
    ``hidden_states[-1]``, or for a native attnlab checkpoint the output of its last block (the
    Embeddings page's "token representations after" the last layer)."""
    from attnlab.hf.load.native import NativeModel

    ids = torch.as_tensor(np.asarray(input_ids, dtype=np.int64)).reshape(1, -1).to(loaded.device)  # (1, N)
    with loaded.lock, torch.no_grad():
        if not isinstance(loaded, NativeModel):
            out = loaded.model(input_ids=ids, output_hidden_states=True, use_cache=False)
            return out.hidden_states[-1][0].float().cpu().numpy()
        captured = {}

        def keep(module, args, out) -> None:  # the block returns (x, weights); x is left as it is
            captured["x"] = out[0]

        hook = loaded.model.blocks[-1].register_forward_hook(keep)
        try:
            loaded.model(ids)
        finally:
            hook.remove()
        return captured["x"][0].float().cpu().numpy()


def project(x: np.ndarray, dims: int | None, seed: int = SEED) -> np.ndarray:
    """(..., C) -> (..., dims) by a fixed Gaussian matrix / sqrt(dims) (Johnson-Lindenstrauss: cosines
    kept to about ±1/sqrt(dims)); ``dims`` None or >= C: ``x`` unchanged (float32)."""
    x = np.asarray(x, dtype=np.float32)
    C = x.shape[-1]
    if dims is None or dims >= C:
        return x
    matrix = np.random.default_rng(seed).standard_normal((C, dims)).astype(np.float32) / np.sqrt(dims)
    return x @ matrix  # (..., dims)


def owned_ranges(windowing) -> list[tuple[int, int]]:
    """[lo, hi) text tokens each window indexes: every token once, an overlap split at its midpoint."""
    starts = list(windowing.starts)
    stops = [min(s + windowing.content, windowing.n_tokens) for s in starts]
    cuts = [0] + [max(starts[k + 1], min(stops[k], (starts[k + 1] + stops[k]) // 2))
                  for k in range(len(starts) - 1)] + [windowing.n_tokens]
    return [(cuts[k], cuts[k + 1]) for k in range(len(starts))]


class IndexBlocks:
    """The index rows of one shard, gathered window by window (numpy), joined into one Arrow table."""

    def __init__(self, loaded, settings: dict):
        self.loaded, self.settings = loaded, settings
        self.blocks: list[dict] = []
        self.width = self.model_width = 0  # K (stored) and C (the model's hidden size), once seen

    def add_window(self, result, masses: dict, owned: tuple[int, int], doc_index: int, doc_id: str,
                   window: int, token_base: int, text: str) -> None:
        """Index window ``result`` (a WindowResult of ``text``)'s text tokens [lo, hi) of ``owned``;
        ``masses`` {variant: (L, H, N)} its column masses; ``token_base`` the document's text tokens
        in its earlier parts."""
        w = result.window
        lo, hi = max(owned[0], w.start), min(owned[1], w.stop)
        if hi <= lo:
            return
        first = int(np.argmin(w.special)) if len(w.special) else 0  # the prefix's special tokens
        pos = first + np.arange(lo - w.start, hi - w.start)  # (n,) positions in the window
        hidden = token_embeddings(self.loaded, w.input_ids)  # (N, C)
        emb = project(hidden[pos], self.settings["dims"])  # (n, K)
        m = masses[self.settings["variant"]]  # (L, H, N)
        mass = m.reshape(-1, m.shape[-1])[:, torch.as_tensor(pos)].T.float().numpy()  # (n, L*H)
        spans = [w.char_spans[p] for p in pos]  # (start, end) in ``text``; (-1, -1) unknown
        pieces = [text[a:b] if a >= 0 else w.tokens[p] for (a, b), p in zip(spans, pos, strict=True)]
        space = [a > 0 and text[a - 1].isspace() for a, _ in spans]
        self.width, self.model_width = emb.shape[1], hidden.shape[1]
        n = len(pos)
        self.blocks.append({
            "doc_index": np.full(n, doc_index, np.int32), "doc_id": [doc_id] * n,
            "window": np.full(n, window, np.int32), "position": pos.astype(np.int32),
            "token_index": np.arange(token_base + lo, token_base + hi, dtype=np.int32),
            "token": [w.tokens[p] for p in pos], "text": pieces, "space_before": np.asarray(space, bool),
            "embedding": emb.astype(np.float16), "mass": mass.astype(np.float16),
        })

    def table(self, n_layers: int, n_heads: int):
        """The shard's index as a pyarrow Table of :func:`schema`."""
        import pyarrow as pa

        meta = {**self.settings, "model_width": self.model_width, "n_layers": n_layers, "n_heads": n_heads,
                "model": self.loaded.info.name}
        sch = schema(self.width or self.settings["dims"] or 1, n_layers * n_heads, meta)
        if not self.blocks:
            return sch.empty_table()
        cols = {k: [b[k] for b in self.blocks] for k in self.blocks[0]}
        arrays = []
        for f in sch:
            parts = cols[f.name]
            if f.name in ("embedding", "mass"):
                flat = pa.array(np.concatenate(parts).reshape(-1), pa.float16())
                arrays.append(pa.FixedSizeListArray.from_arrays(flat, f.type.list_size))
            elif isinstance(parts[0], list):
                arrays.append(pa.array([x for p in parts for x in p], f.type))
            else:
                arrays.append(pa.array(np.concatenate(parts), f.type))
        return pa.Table.from_arrays(arrays, schema=sch)
