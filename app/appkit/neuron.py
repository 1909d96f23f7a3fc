"""Inspect's neuron view (bertviz's): for the focused token as the query and a chosen key, in the
page's layer and head, the products scale · q_d · k_d per dimension, their sum (the pair's score)
and the weight each analysed variant gives the pair.

q and k come from the analysis' capture path (``attnlab.hf.analysis.query_key.layer_query_key``),
one forward up to the layer per (analysis, layer), cached. The view is off until its toggle is on;
while it is on, a click that focuses a token reruns the page (not only the focus bar), so the view
follows the focus.
"""

from __future__ import annotations

import numpy as np
import streamlit as st
import torch

from appkit import state
from appkit.analysis import WindowView
from appkit.corpus_search import SEARCH
from appkit.show import focus, show_bundle
from appkit.sources import load
from attnlab.figures.neuron_view import neuron_bundle
from attnlab.hf.analysis.query_key import LayerQueryKey, layer_query_key

NEURON = "neuron"  # shared state: the toggle's value (the focus bar reruns the page while it is on)
RERUN = "neuron_rerun"  # shared state: a focus click asked for a whole-page rerun
FOLLOWERS = (NEURON, SEARCH)  # toggles of Inspect's sections that follow the focus (the corpus search's too)
DNAS_NOTE = (
    "**Why the variants differ on one score.** UNAS is the softmax of the query's row of scores. "
    "DNAS (Eq. 5) first divides each exp(score) by its key's column sum — how much every query "
    "attends to that key — and then normalizes the row: the same score weighs less on a key many "
    "queries attend to and more on one few attend to. HNAS mixes the two with u; Sinkhorn repeats "
    "DNAS's column and row normalization."
)


@st.cache_resource(max_entries=4, ttl=1800, show_spinner=False)
def _layer_qk(view_key: str, layer: int, _view: WindowView) -> LayerQueryKey:
    return layer_query_key(load(_view.settings.source), _view.input_ids, layer)


def wants_page_rerun() -> bool:
    """True once after a focus click while the neuron view is on (read by the focus bar)."""
    return bool(state.shared().pop(RERUN, False))


def note_focus_click() -> None:
    """A focus click: the whole page must rerun if the neuron view (or the corpus search) is on: they
    follow the focus."""
    if any(state.shared().get(name) for name in FOLLOWERS):
        state.shared()[RERUN] = True


def _label(view: WindowView, i: int) -> str:
    return f"{i}: {view.tokens[i]}"


def neuron_section(prefix: str, view: WindowView, variant: str, layer: int, head: int, text: str) -> None:
    """The toggle, then (on) the key picker, the neuron view with its Export menu and the notes."""
    on = state.remembered(
        prefix,
        NEURON,
        st.toggle,
        False,
        "Show the neuron view",
        url=state.BOOL,
        help="q_d · k_d per dimension for the focused token (query) and a key you choose",
    )
    if not on:
        return
    query = focus(view)
    if query is None:
        st.info("Click a token to focus it: it becomes the query whose score for a key is taken apart here.")
        return
    N = view.shape[2]
    row = np.asarray(view.weights[variant][layer, head, query])  # (N,)
    strongest = int(np.nanargmax(row)) if np.isfinite(row).any() else 0
    key = state.remembered(
        prefix,
        "neuron_key",
        st.selectbox,
        strongest,
        f"Key token (query: {_label(view, query)}, layer {layer}, head {head})",
        list(range(N)),
        format_func=lambda j: _label(view, j),
        valid=lambda v: isinstance(v, int) and 0 <= v < N,
        url=state.INT,
    )
    try:
        qk = _layer_qk(view.key, layer, _view=view)
    except ValueError as e:
        st.warning(f"Neuron view: {e}")
        return
    if qk.mask is not None and not bool(qk.mask[query, key]):
        st.warning(
            f"The model's mask keeps query {_label(view, query)} from key {_label(view, key)} "
            "(a later token of a causal model, or outside its sliding window): every variant gives "
            "the pair 0. Pick another key."
        )
        return
    kv = qk.key_head(head)
    weights = {v: float(view.weights[v][layer, head, query, key]) for v in view.weights}
    b = neuron_bundle(
        qk.query[head, query],
        qk.key_heads[kv, key],
        qk.scaling,
        query_label=_label(view, query),
        key_label=_label(view, key),
        weights=weights,
        title=f"layer {layer}, head {head}",
        softcap=qk.softcap,
    )
    manifest = {
        "figure": {
            "kind": "neuron_view",
            "layer": layer,
            "head": head,
            "key_head": kv,
            "query": query,
            "key": key,
            "scale": qk.scaling,
            "softcap": qk.softcap,
            "weights": weights,
        },
        "text_sha256": view.text_sha256,
        "window": view.window,
        "source": view.source_manifest(),
    }
    show_bundle(prefix, "neuron_view", b, manifest, width="stretch")  # fits 1280 px windows too
    score = float(b.arrays["score"])
    unas = float(torch.softmax(qk.scores(head)[query], -1)[key])
    lines = [
        f"Score = Σ_d scale · q_d · k_d = **{score:.4f}** (scale {qk.scaling:.4g}, {qk.query.shape[-1]} "
        f"dimensions); the softmax of query {query}'s row of scores gives this key **{unas:.4f}**"
        + (f", the UNAS map's {weights['unas']:.4f}." if "unas" in weights else ".")
    ]
    if qk.group > 1:
        lines.append(
            f"Grouped-query layer: {qk.group} query heads share a key head; head {head} reads key head {kv}."
        )
    if qk.softcap is not None:
        lines.append(f"This layer caps its scores: softcap · tanh(score / softcap), softcap {qk.softcap:g}.")
    st.caption(" ".join(lines))
    st.caption(DNAS_NOTE)
