"""Explaining away's attention-sink views, as the literature measures sinks (docs/STATISTICS.md §6):
the causal-corrected importance of the first keys by layer and the sink rate by layer (Gu et al.
2024), the first-token mass per layer and head (Xiao et al. 2023), massive activations by layer (Sun
et al. 2024). The math is in ``attnlab.sinks`` and ``attnlab.hf.beyond.activations``, the figures in
``attnlab.figures.sinks``.

Everything comes from column masses (L, H, N) and the queries that may attend each key (L, N): on a
long context's streamed window (HeadMaps) from its streamed sums (``StreamedWindow.column_masses()``,
``counts()``; no map is computed), on a shorter window from its weights and, for the counts, the
layers' masks of one capture forward of the model (a causal, sliding-window or padded layer lets
fewer queries see a key). Massive activations take one plain forward of the model.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import streamlit as st
import torch

from appkit.analysis import WindowView
from appkit.show import show_bundle, table_columns
from appkit.sources import load
from attnlab import hf, sinks
from attnlab.figures import sinks as figs
from attnlab.hf.beyond.activations import activations_table
from attnlab.hf.compute.head_maps import HeadMaps

EPS_CHOICES = [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 0.9]  # Gu et al. 2024 use 0.3


def _streamed(view: WindowView):
    """The streamed window behind a long context's HeadMaps, or None (a shorter window's arrays)."""
    w = next(iter(view.weights.values()))
    return w.window if isinstance(w, HeadMaps) and w.window is not None else None


@st.cache_resource(max_entries=4, ttl=1800, show_spinner="Reading the layers' masks…")
def _counts(key: str, text: str, _view: WindowView) -> torch.Tensor:
    """(L, N) queries that may attend each key: from the streamed window, or the layers' masks the
    window's own capture forward saw (``WindowView.key_counts``, kept by appkit.analysis: no forward
    here); every query of a bidirectional model. Only a causal view without them (swap mode: its
    weights are not streamed) reads the masks of one more capture forward (unas only: the counts
    depend on the model, not on the variant)."""
    window = _streamed(_view)
    if window is not None:
        return window.counts()
    if _view.key_counts is not None:
        return _view.key_counts
    L, _, N = _view.shape
    if not _view.info.causal:
        return torch.full((L, N), float(N))
    if isinstance(load(_view.settings.source), hf.NativeModel):  # its weights are never streamed: N - j
        return sinks.queries_per_key(N, N).expand(L, N)
    plan = hf.stream_analysis(text, load(_view.settings.source), ("unas",), statistics=False)
    return _streamed_counts(plan.window(_view.window).weights["unas"], L, N)


def _streamed_counts(w, L: int, N: int) -> torch.Tensor:
    window = getattr(w, "window", None)
    return window.counts() if window is not None else sinks.queries_per_key(N, N).expand(L, N)


@st.cache_resource(max_entries=4, ttl=1800, show_spinner="Summing the attention each key receives…")
def _masses(key: str, _view: WindowView) -> dict[str, torch.Tensor]:
    """{variant: (L, H, N) column masses}: streamed on a long context, else from the weights."""
    if _view.column_masses is not None:  # taken by the capture forward (appkit.analysis)
        return dict(_view.column_masses)
    window = _streamed(_view)
    if window is not None:
        return window.column_masses()
    return {v: torch.from_numpy(np.asarray(w)).sum(-2) for v, w in _view.weights.items()}


@st.cache_resource(max_entries=4, ttl=1800, show_spinner="One forward of the model for its hidden states…")
def _activations(key: str, _view: WindowView) -> pd.DataFrame:
    return activations_table(load(_view.settings.source), _view.input_ids)


def importance(view: WindowView, text: str) -> dict[str, torch.Tensor]:
    """{variant: (L, H, N)} I_j = m_j / n_j (Gu et al. 2024; ``attnlab.sinks.sink_importance``), 0 for
    a key no query may attend."""
    counts = _counts(view.key, text, view)[:, None, :]  # (L, 1, N)
    return {v: sinks.importance_from_masses(m, counts) for v, m in _masses(view.key, view).items()}


def sink_views(prefix: str, view: WindowView, text: str) -> None:
    """The four views with their controls (variant, heads, eps) and Export menus."""
    L, H, N = view.shape
    if view.info.causal:
        st.caption("In a causal layer key j is seen by the N − j queries at or after it (fewer in a sliding "
                   "window), so its column mass is divided by that count: the **causal-corrected "
                   "importance** I_j (Gu et al. 2024). A head is a sink when I_0 > ε; the **sink rate** is "
                   "the share of such heads per layer.")
    else:
        st.caption("This model is bidirectional: every query sees every key, so the causal correction "
                   "is trivial, I_j = m_j / N (the mean attention key j receives; I_0 is the first-token "
                   "mass). The views below are that analogue; the sinks of Gu et al. 2024 are a causal "
                   "language model's.")
    variants = list(view.weights)
    a, b, c = st.columns(3)
    variant = a.selectbox("Variant", variants, key=f"{prefix}_sink_variant")
    heads = b.selectbox("Heads", ["mean over heads", *range(H)], key=f"{prefix}_sink_heads")
    eps = c.select_slider("ε (a head is a sink when I_0 > ε)", EPS_CHOICES, value=0.3,
                          key=f"{prefix}_sink_eps")
    imp = importance(view, text)
    head = None if heads == "mean over heads" else int(heads)
    by_key = figs.importance_by_layer(imp[variant], view.tokens, variant, head=head)
    show_bundle(prefix, "sink_importance", by_key, width="stretch")
    rates = {v: sinks.rate_from_importance(i[..., 0], eps) for v, i in imp.items()}  # (L,) each
    show_bundle(prefix, "sink_rate", figs.sink_rate_by_layer(rates, eps), width="stretch")
    first = _masses(view.key, view)[variant][..., 0] / N  # (L, H): sum_i pi_i0 / M, M = N queries
    show_bundle(prefix, "first_token_mass", figs.first_token_mass_heatmap(first, variant), width="stretch")
    st.markdown("**Massive activations** (Sun et al. 2024): the largest |hidden state| of the residual "
                "stream after each layer, where it sits, and how far above the median it stands.")
    if isinstance(load(view.settings.source), hf.NativeModel):
        st.info("Massive activations are measured on Hugging Face models (hooks on their transformer "
                "layers); attnlab's own checkpoints have none.")
        return
    table = _activations(view.key, view)
    show_bundle(prefix, "massive_activations", figs.massive_activations_by_layer(table), width="stretch")
    st.dataframe(table, hide_index=True, key=f"{prefix}_massive_table",
                 column_config=table_columns(figs.MASSIVE_ACTIVATIONS_COLUMNS))
