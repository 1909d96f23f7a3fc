"""A note when NaN reaches the statistics: which layer it first appears in.

NaN in a model's weights or hidden states makes the attention of that layer and of every later one NaN
(docs/DESIGN.md §4: NaN propagates, the statistics it enters are NaN). A table that is then mostly NaN
must say so: :func:`nan_note` finds the first layer from what is already computed -- the tidy table's
(variant, layer, head) values, or a probe of a few rows of the weights -- never from a pass over the
(L, H, N, N) weights when nothing is NaN.

    nan_note(table)            -> "NaN from layer 2 on: ..." or None (one pass over the table's values)
    with_nan_note(table)       -> table, its ``attrs["notes"]`` holding that note
    weights_nan_note(weights)  -> the same note from {variant: (L, H, N, N)} weights (the app's views)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["NOTE_PREFIX", "nan_note", "with_nan_note", "weights_nan_note", "first_nan_layers"]

NOTE_PREFIX = "NaN from layer"


def _text(first: Mapping[str, int], share: float | None, window=None) -> str:
    """The note, from {variant: first layer with NaN}."""
    layer = min(first.values())
    by_variant = ", ".join(f"{v} from layer {layer_}" for v, layer_ in first.items() if layer_ != layer)
    names = ", ".join(v for v, layer_ in first.items() if layer_ == layer)
    share_text = "" if share is None else f"{share:.0%} of the statistics are NaN, "
    where = "" if window is None else f" (first in window {window})"
    return (f"{NOTE_PREFIX} {layer} on{where}: {share_text}the attention of {names}"
            + (f" ({by_variant})" if by_variant else "")
            + f" is NaN from layer {layer}: the model's weights or hidden states hold NaN there "
            "(check the checkpoint)")


def nan_note(table: pd.DataFrame) -> str | None:
    """The note for a tidy table (columns variant, layer, head, statistic, value[, window]) with NaN
    values, None without. One vectorized pass over the table's values (V * L * H * S numbers)."""
    if "value" not in table.columns or not len(table):
        return None
    values = table["value"].to_numpy(dtype=np.float64, na_value=np.nan)
    nan = np.isnan(values)
    if not nan.any():
        return None
    rows = table.loc[nan]
    window = None
    if "window" in rows.columns:  # the first window with NaN (named when the table has several)
        first_window = rows["window"].iloc[0]
        rows = rows[rows["window"] == first_window]
        window = first_window if table["window"].nunique() > 1 else None
    first = {str(v): int(layer) for v, layer in rows.groupby("variant", sort=False)["layer"].min().items()}
    return _text(first, float(nan.mean()), window)


def with_nan_note(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` with ``attrs["notes"]`` holding its NaN note (and no stale one) when it has NaN."""
    note = nan_note(table)
    notes = [n for n in table.attrs.get("notes", []) if not str(n).startswith(NOTE_PREFIX)]
    if note is not None:
        notes.append(note)
    if notes or "notes" in table.attrs:
        table.attrs["notes"] = notes
    return table


def first_nan_layers(weights: Mapping[str, object]) -> dict[str, int]:
    """{variant: first layer holding NaN} of {variant: (L, H, M, N)} weights (numpy or torch).

    A probe first: the last query row of every layer and head (L * H * N numbers). NaN in a layer's
    hidden states reaches that row there (every query of a bidirectional model, and the last one of a
    causal model, reads every key) or one layer later (a NaN query); so only when the probe finds NaN
    are the layers up to it searched in full, to name the first exactly. A NaN confined to other rows of
    the last layer is not seen.
    """
    out = {}
    for name, w in weights.items():
        a = np.asarray(w) if not hasattr(w, "numpy") else w.detach().cpu().numpy()
        if a.ndim != 4 or not a.size:
            continue
        probe = np.isnan(a[:, :, -1, :].sum(axis=(1, 2)))  # (L,)
        if not probe.any():
            continue
        last = int(np.argmax(probe))
        out[name] = next(layer for layer in range(last + 1) if np.isnan(a[layer].sum()))
    return out


def weights_nan_note(weights: Mapping[str, object]) -> str | None:
    """The NaN note from {variant: (L, H, N, N)} weights (see :func:`first_nan_layers`), or None."""
    first = first_nan_layers(weights)
    return _text(first, None) if first else None
