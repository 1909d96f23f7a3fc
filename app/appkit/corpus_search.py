"""Inspect's "Find similar tokens in a corpus run" (exBERT's search, issue 30 item 14): the focused
token's last hidden state, or its received-mass profile over layers and heads, against the token
index of a finished corpus run of this server (``attnlab corpus --index``), the k nearest shown
with their documents and contexts.

The query is computed as the index's rows were (attnlab/corpus/index.py): the hidden state by
``token_embeddings`` on this window's input, the profile as the column masses m_j = sum_i pi_ij of
this window's weights under the index's variant. A run of another model is refused; so is a mass
search when the index's variant is not analysed on the page. While the toggle is on, a focus click
reruns the page (appkit/neuron.py's ``note_focus_click``), so the results follow the focus.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import streamlit as st

from appkit import state
from appkit.analysis import LONG_CONTEXT, WindowView
from appkit.corpus_runs import list_runs
from appkit.show import focus
from appkit.sources import load
from attnlab.corpus.index import FOLDER, token_embeddings
from attnlab.corpus.search import search

SEARCH = "corpus_search"  # shared state: the toggle (the focus bar reruns the page while it is on)
BY = {"embedding": "hidden state (last layer)", "mass": "received-mass profile (layers × heads)"}
MAX_K = 200


def indexed_runs() -> dict[str, Path]:
    """{name: result folder} of this server's finished corpus runs that wrote a token index."""
    return {r.name: r.result for r in list_runs()
            if r.status == "finished" and (r.result / FOLDER).is_dir()}


@st.cache_resource(max_entries=4, ttl=1800, show_spinner=False)
def _hidden(view_key: str, _view: WindowView) -> np.ndarray:
    """(N, C) this window's last hidden states (the index's definition)."""
    return token_embeddings(load(_view.settings.source), _view.input_ids)


def _params(view: WindowView) -> dict:
    """The variant parameters this page's analysis used (u as a float only when it is one)."""
    s = view.settings
    return {"u": view.u if isinstance(view.u, float) else None, "iters": view.iters, **dict(s.extra)}


def query_vector(view: WindowView, run: Path, by: str, position: int) -> tuple[np.ndarray, list[str]]:
    """(the query for :func:`attnlab.corpus.search.search`, notes) of token ``position`` of this
    window; ValueError for people when the run's index cannot be compared with this analysis."""
    import attnlab

    manifest = json.loads((run / "manifest.json").read_text())
    model, settings = manifest.get("model") or {}, manifest.get("settings") or {}
    if (model.get("path"), model.get("name")) != (view.info.path, view.info.name):
        raise ValueError(f"this corpus run was analysed with {model.get('name')!r} and this page shows "
                         f"{view.info.name!r}: hidden states and masses of two models cannot be compared; "
                         "pick a run of this model, or this model on the sidebar")
    if by == "embedding":
        return _hidden(view.key, view)[position], []
    variant = (settings.get("index") or {}).get("variant")
    if variant not in view.weights:
        raise ValueError(f"the run's index holds the masses each token receives under {variant}, which "
                         "this page does not analyse: add it to the variants on the sidebar")
    if view.shape[2] > LONG_CONTEXT:
        raise ValueError(f"a received-mass search needs every head's map of this window, and it has "
                         f"{view.shape[2]:,} tokens (more than {LONG_CONTEXT}); search by hidden state")
    mass = np.asarray(view.weights[variant]).sum(-2)[:, :, position]  # (L, H): m_j of every head
    ours, theirs = _params(view), settings.get("params") or {}
    names = [p.name for p in attnlab.variant_spec(variant).params]
    differ = [f"{n} {theirs.get(n)!r} there, {ours.get(n)!r} here" for n in names
              if theirs.get(n) != ours.get(n)]
    notes = [f"{variant}'s parameters differ ({'; '.join(differ)})"] if differ else []
    return mass, notes


def display(table: pd.DataFrame) -> pd.DataFrame:
    """The results as the page shows them: the token marked ⟦ ⟧ in its context."""
    context = ["…" + left + "⟦" + text + "⟧" + right + "…"
               for left, text, right in zip(table["left"], table["text"], table["right"], strict=True)]
    return pd.DataFrame({"similarity": table["similarity"].round(4), "document": table["doc_id"],
                         "token #": table["token_index"], "token": table["token"], "context": context,
                         "window": table["window"], "position": table["position"]})


def corpus_search_section(prefix: str, view: WindowView) -> None:
    """The toggle, then (on) the run, kind of search and k, and the table of the nearest tokens."""
    on = state.remembered(prefix, SEARCH, st.toggle, False, "Find similar tokens in a corpus run",
                          help="the nearest tokens of a finished corpus run to the focused token, by "
                               "hidden state or by the attention it receives in every layer and head")
    if not on:
        return
    runs = indexed_runs()
    if not runs:
        st.info("No finished corpus run of this server has a token index: start one on the Corpus page "
                "with \"Token index for search\" on (or `attnlab corpus SOURCE --out DIR --index`).")
        return
    a, b, c = st.columns([2, 2, 1])
    run = state.remembered(prefix, "search_run", a.selectbox, next(iter(runs)), "Corpus run", list(runs),
                           valid=lambda name: name in runs)
    by = state.remembered(prefix, "search_by", b.radio, "embedding", "Nearest by", list(BY),
                          format_func=BY.get, horizontal=True)
    k = state.remembered(prefix, "search_k", c.number_input, 20, "Results", 1, MAX_K)
    position = focus(view)
    if position is None:
        st.info("Click a token to focus it: its nearest tokens in the corpus run are listed here.")
        return
    try:
        query, notes = query_vector(view, runs[run], by, position)
        table = search(runs[run], query, by=by, k=int(k))
    except ValueError as e:
        st.warning(str(e))
        return
    how = "cosine of the last hidden states" if by == "embedding" else \
        "correlation of the log received masses over layers and heads"
    st.caption(f"The {len(table)} tokens of run **{run}** nearest to **{position}: {view.tokens[position]}** "
               f"({how}); its vector is this window's ({view.shape[2]} tokens), theirs their run's windows.")
    for note in notes:
        st.caption(f"Note: {note}")
    st.dataframe(display(table), hide_index=True, key=f"{prefix}_search_table", width="stretch")
