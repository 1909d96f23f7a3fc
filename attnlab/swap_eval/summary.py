"""The tables of a swap-eval run: loss delta per (variant, layer) with bootstrap CIs, loss by position.

Each swap's loss is token-weighted over the corpus, as :func:`attnlab.hf.language_model_loss` weights
texts: loss_k = sum_d S_dk / sum_d T_d (S_dk: document d's summed loss under swap k, T_d: its scored
tokens, the same tokens for every swap), and delta_k = loss_k - loss_model. Its 95 % CI is the
percentile bootstrap over documents: B resamples of the D documents with replacement (multinomial
counts c from numpy's PCG64 seeded with ``seed``, :func:`attnlab.corpus.summary.bootstrap_counts`, the
corpus summary's), each giving (c @ S_k - c @ S_model) / (c @ T); the CI is their 2.5 % and 97.5 %
quantiles. Documents are sorted by their source index, so the result does not depend on which engine
or shard order wrote the rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from attnlab.corpus.summary import bootstrap_counts

__all__ = ["ratio_bootstrap", "document_sums", "loss_delta_table", "position_table"]

_KEYS = ["variant", "layer"]


def ratio_bootstrap(sums: np.ndarray, tokens: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """sums (D, K), tokens (D,), counts (B, D) -> (B, K): per resample, sum of losses / sum of tokens."""
    return (counts @ sums) / (counts @ tokens)[:, None]


def _rows(rows_dir: str | Path, columns: list[str]):
    import pyarrow.dataset as ds

    files = sorted(Path(rows_dir).glob("shard-*.parquet"))
    if not files:
        raise ValueError(f"rows_dir {str(rows_dir)!r} holds no shard-*.parquet files; nothing to summarize")
    return ds.dataset([str(f) for f in files], format="parquet").to_table(columns=columns).to_pandas()


def document_sums(frame, baseline: str):
    """Rows -> (swaps DataFrame (K: variant, layer; baseline first), S (D, K) summed losses, T (D,)
    scored tokens), documents sorted by doc_index."""
    per_doc = frame.groupby(["doc_index", *_KEYS], sort=True)[["loss_sum", "n_tokens"]].sum()
    S = per_doc["loss_sum"].unstack(_KEYS)  # (D, K)
    base = [c for c in S.columns if c[0] == baseline]
    S = S[base + [c for c in S.columns if c[0] != baseline]]
    T = per_doc["n_tokens"].xs(baseline, level="variant").groupby("doc_index").sum().reindex(S.index)
    swaps = S.columns.to_frame(index=False)
    return swaps, S.to_numpy(np.float64), T.to_numpy(np.float64)


def loss_delta_table(rows_dir, baseline: str, resamples: int = 1000, seed: int = 0):
    """Per swap (variant, layer): loss, its CI, loss_model, delta, its CI, n_documents, n_tokens."""
    frame = _rows(rows_dir, ["doc_index", *_KEYS, "n_tokens", "loss_sum"])
    swaps, S, T = document_sums(frame, baseline)
    D = len(T)
    loss = S.sum(0) / T.sum()  # (K,)
    boot = ratio_bootstrap(S, T, bootstrap_counts(D, resamples, seed))  # (B, K)
    delta_boot = boot - boot[:, :1]
    out = swaps.assign(
        loss=loss,
        loss_ci_low=np.quantile(boot, 0.025, axis=0),
        loss_ci_high=np.quantile(boot, 0.975, axis=0),
        loss_model=loss[0],
        delta=loss - loss[0],
        ci_low=np.quantile(delta_boot, 0.025, axis=0),
        ci_high=np.quantile(delta_boot, 0.975, axis=0),
        n_documents=D,
        n_tokens=int(T.sum()),
    )
    out["layer"] = out["layer"].astype(np.int64)
    return out


def position_table(rows_dir, baseline: str):
    """Per swap and position (summed over documents): loss, loss_model, delta, n_tokens."""
    frame = _rows(rows_dir, [*_KEYS, "position", "n_tokens", "loss_sum"])
    out = frame.groupby([*_KEYS, "position"], sort=False)[["loss_sum", "n_tokens"]].sum().reset_index()
    out["loss"] = out["loss_sum"] / out["n_tokens"]
    model = out[out["variant"] == baseline].set_index("position")["loss"]
    out["loss_model"] = out["position"].map(model)
    out["delta"] = out["loss"] - out["loss_model"]
    order = {v: i for i, v in enumerate(dict.fromkeys([baseline, *out["variant"]]))}
    out = out.sort_values(
        ["variant", "layer", "position"],
        key=lambda s: s.map(order) if s.name == "variant" else s,
        ignore_index=True,
    )
    out["layer"] = out["layer"].astype(np.int64)
    return out[[*_KEYS, "position", "loss", "loss_model", "delta", "n_tokens"]]
