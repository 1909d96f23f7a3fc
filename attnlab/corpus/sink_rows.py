"""A corpus window's attention-sink rows, as the literature measures sinks (docs/STATISTICS.md §6):

    sink_importance_first  (layer, head)  I_0 = sum_i pi_i0 / (queries that may attend key 0): the
                                          causal-corrected importance of the first key (Gu et al. 2024)
    sink_rate              (layer, head)  1 when I_0 > SINK_EPS (the head is a sink), else 0; the
                                          summary's head = -1 row (the mean over a layer's heads) is
                                          Gu et al.'s sink rate of the layer
    massive_max_abs, massive_median_abs, massive_ratio, massive_token, massive_dim   (layer, head = -1)
                                          the largest |h| of the residual stream after the layer, the
                                          median |h|, their ratio, and the token position and dimension
                                          of the largest (Sun et al. 2024)

The first-token mass per (layer, head), sum_i pi_i0 / M (Xiao et al. 2023's sink), is already a row:
``received:first_position`` (attnlab/corpus/token_classes.py).

Massive activations are read from the analysis' own forwards (``recording``: hooks on the model's
layers, no extra forward): in swap mode each variant's forward (so each variant has its own rows); in
recompute mode the model's own forward, the same rows for every variant, and only for the layers it
ran -- the capture forward stops once the last layer's queries and keys are taken, so the last
layer has no massive_* rows there. attnlab's own checkpoints have none (no hooks on their blocks).
"""

from __future__ import annotations

import contextlib

import numpy as np

__all__ = ["SINK_EPS", "SINK_ROW_STATISTICS", "MASSIVE", "recording", "recorded", "sink_columns",
           "join_columns"]

SINK_EPS = 0.3  # Gu et al. 2024's threshold on the first key's importance
MASSIVE = ("max_abs", "median_abs", "ratio", "token", "dim")  # attnlab.sinks.massive_activations' keys
SINK_ROW_STATISTICS = ("sink_importance_first", "sink_rate", *(f"massive_{k}" for k in MASSIVE))


def recording(loaded):
    """Context yielding the list the model's forwards append their per-layer massive activations to
    (``attnlab.hf.beyond.activations.recording_activations``), or None for a model without
    transformers layers (attnlab's own checkpoints)."""
    from attnlab.hf.beyond.activations import recording_activations
    from attnlab.hf.load.native import NativeModel

    if isinstance(loaded, NativeModel):
        return contextlib.nullcontext(None)
    return recording_activations(loaded.model)


def recorded(stream, loaded):
    """(WindowResult, the massive activations its forwards recorded) per window of ``stream``: the
    hooks stay on while the stream is iterated and are removed when it ends (or is closed)."""
    with recording(loaded) as found:
        for result in stream:
            yield result, found


def join_columns(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The rows of ``a`` then those of ``b`` (the same columns)."""
    return {k: np.concatenate([a[k], b[k]]) for k in a}


def sink_columns(result, masses, activations: list[dict] | None, mode: str) -> dict[str, np.ndarray]:
    """Columns variant, layer, head, statistic, value of one window's sink rows (module docstring);
    ``masses``: the window's column masses {variant: (L, H, N)} (taken once for every row kind);
    ``activations``: what :func:`recording` recorded during this window's analysis (emptied here)."""
    importance = result.sink_importance(masses)  # {variant: (L, H, N)}
    variants = list(importance)
    first = np.stack([importance[v][..., 0].double().numpy() for v in variants])  # (V, L, H)
    V, L, H = first.shape
    values = np.stack([first, (first > SINK_EPS).astype(np.float64)], -1)  # (V, L, H, 2)
    cols = {"variant": np.repeat(np.asarray(variants, dtype=object), L * H * 2),
            "layer": np.tile(np.repeat(np.arange(L, dtype=np.int16), H * 2), V),
            "head": np.tile(np.repeat(np.arange(H, dtype=np.int16), 2), V * L),
            "statistic": np.tile(np.asarray(SINK_ROW_STATISTICS[:2], dtype=object), V * L * H),
            "value": values.reshape(-1)}
    per_variant = _massive(activations, variants, L, mode)
    if per_variant is None:
        return cols
    n = per_variant.shape[1]  # layers recorded (L, or L - 1 from a capture forward that stops early)
    S = len(MASSIVE)
    extra = {"variant": np.repeat(np.asarray(variants, dtype=object), n * S),
             "layer": np.tile(np.repeat(np.arange(n, dtype=np.int16), S), V),
             "head": np.full(V * n * S, -1, np.int16),
             "statistic": np.tile(np.asarray(SINK_ROW_STATISTICS[2:], dtype=object), V * n),
             "value": per_variant.reshape(-1)}
    return join_columns(cols, extra)


def _massive(activations: list[dict] | None, variants: list[str], n_layers: int, mode: str):
    """(V, n, len(MASSIVE)) float64 per variant and recorded layer, or None when nothing usable was
    recorded; empties ``activations``."""
    if not activations:
        return None
    rows = np.asarray([[float(a[k]) for k in MASSIVE] for a in activations])  # (forwards x layers, S)
    activations.clear()
    V = len(variants)
    if mode != "recompute":  # one whole forward per variant, in the variants' order
        return rows.reshape(V, n_layers, -1) if len(rows) == V * n_layers else None
    return np.broadcast_to(rows[:n_layers], (V, *rows[:n_layers].shape))  # the model's own forward
