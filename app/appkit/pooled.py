"""The Embeddings page's linked points (AttentionViz's joint view): queries and keys pooled over
heads, layers and texts, the texts being the page's window and, optionally, the first documents of
a finished corpus run (analysed with the page's model, each cut to its first ``DOC_TOKENS``
tokens); a selection in the scatter focuses this text's tokens for every page, and the focus is
ringed in the scatter.

q and k come from the analysis' capture path (``attnlab.hf.analysis.query_key.query_keys``, one
forward per text); grouped-query layers give each query head its key head.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import streamlit as st

from appkit import state
from appkit.analysis import WindowView
from appkit.corpus_runs import list_runs
from appkit.export import export_menu
from appkit.show import CHART_CONFIG, focus, set_focus
from appkit.sources import load
from attnlab.figures.linked_embeddings import POINT_COLUMNS, linked_view, pool_query_key
from attnlab.hf.analysis.query_key import query_keys
from attnlab.hf.capture.windows import iter_windows, plan_windows, special_affixes, tokenize_text

DOC_TOKENS = 64  # text tokens taken from each corpus document
PART_CHARS = 4000  # characters read from each document (more than DOC_TOKENS tokens)
MAX_DOCS = 20
THIS_TEXT = "this text"
SELECTION = "embed_selection"  # shared state: the last selection that set the focus
COLOR_BY = ("token", "position", "column mass", "kind", "layer", "head", "text")


def finished_corpus_runs() -> list[str]:
    """Names of the corpus runs of this server that finished (their documents can be pooled)."""
    return [r.name for r in list_runs() if r.status == "finished"]


def corpus_documents(run_name: str, n_docs: int) -> list[tuple[str, str]]:
    """(id, text) of the first ``n_docs`` documents of finished corpus run ``run_name`` (from the
    source its manifest names); ValueError with what is wrong otherwise."""
    from attnlab.corpus.sources import KJV, open_source

    runs = {r.name: r for r in list_runs()}
    if run_name not in runs or runs[run_name].status != "finished":
        raise ValueError(f"corpus run {run_name!r} is not a finished run of this server")
    try:
        src = json.loads((runs[run_name].result / "manifest.json").read_text())["source"]
        source = open_source(KJV if src["kind"] == KJV else src["path"], src["text_column"], src["id_column"])
        docs = []
        for doc in source:
            docs.append((doc.id, next(iter(doc.parts(PART_CHARS)), "")))
            if len(docs) >= n_docs:
                break
    except (OSError, KeyError, ValueError, json.JSONDecodeError) as e:
        raise ValueError(f"the documents of corpus run {run_name!r} cannot be read: {e}") from None
    return docs


def _first_window(model, text: str) -> tuple[list[int], list[str]]:
    """(input_ids, tokens) of the first ``DOC_TOKENS`` text tokens of ``text`` (special tokens around)."""
    prefix, suffix = special_affixes(model.tokenizer)
    tokenized = tokenize_text(model.tokenizer, text)
    n_special = len(prefix) + len(suffix)
    window = min(model.info.max_length, DOC_TOKENS + n_special)
    w = next(iter_windows(model.tokenizer, text, tokenized, plan_windows(len(tokenized), window, n_special)))
    return w.input_ids, w.tokens


@st.cache_resource(max_entries=4, ttl=1800, show_spinner=False)
def pooled(
    view_key: str, layers: tuple, heads: tuple, run: str | None, n_docs: int, _view: WindowView
) -> tuple[np.ndarray, pd.DataFrame]:
    """(x (n, D), points table) of the queries and keys of ``heads`` x ``layers`` of this window and
    of the first ``n_docs`` documents of corpus run ``run`` (None: this window only)."""
    model = load(_view.settings.source)
    texts = [(THIS_TEXT, _view.input_ids, list(_view.tokens), True)]
    for doc_id, text in corpus_documents(run, n_docs) if run else []:
        if text.strip():
            texts.append((f"{run}: {doc_id}", *_first_window(model, text), False))
    groups = []
    for label, ids, tokens, linked in texts:
        captured = query_keys(model, ids, list(layers))
        for layer in layers:
            qk = captured[layer]
            for head in heads:
                q, k = qk.query[head].numpy(), qk.key_heads[qk.key_head(head)].numpy()
                groups.append(
                    {
                        "q": q,
                        "k": k,
                        "tokens": tokens,
                        "layer": layer,
                        "head": head,
                        "text": label,
                        "linked": linked,
                    }
                )
    return pool_query_key(groups)


def hidden_points(view: WindowView, layer: int) -> pd.DataFrame:
    """The points table of this window's token representations after ``layer``."""
    n = len(view.tokens)
    return pd.DataFrame(
        {
            "kind": ["token"] * n,
            "token": view.tokens,
            "position": range(n),
            "layer": layer,
            "head": -1,
            "text": THIS_TEXT,
            "linked": True,
        },
        columns=list(POINT_COLUMNS),
    )


def colours(view: WindowView, points: pd.DataFrame, by: str) -> list:
    """One colour value per point: a column of the table, or (``column mass``) the attention the
    token receives as a key in its layer and head (mean over the layer's heads for token
    representations), from the analysis of this text (first variant)."""
    if by != "column mass":
        return points[by].tolist()
    if not points["linked"].all():
        raise ValueError("column mass is known for this text's points only: colour by another property")
    w = view.weights[next(iter(view.weights))]  # (L, H, N, N); only the first variant is computed
    mass = w.sum(-2)  # (L, H, N)
    out = []
    for r in points.itertuples():
        m = mass[r.layer].mean(0) if r.head < 0 else mass[r.layer, r.head]
        out.append(round(float(m[r.position]), 4))
    return out


def selected_rows(key: str) -> list[int]:
    """The table rows of the points selected in chart ``key`` (click, box or lasso)."""
    event = st.session_state.get(key)
    points = (
        (event or {}).get("selection", {}).get("points", [])
        if isinstance(event, dict)
        else (event.selection.points if event is not None and hasattr(event, "selection") else [])
    )
    rows = set()
    for p in points:
        data = p.get("customdata")
        if data:
            rows.add(int(float(data[0])))
    return sorted(rows)


def take_selection(view: WindowView, points: pd.DataFrame, rows: list[int]) -> list[int]:
    """A new selection's tokens of this text focus the first of them (for every page); returns the
    selected positions of this text, in reading order."""
    linked = points.iloc[rows] if rows else points.iloc[[]]
    positions = sorted({int(p) for p in linked.loc[linked["linked"], "position"]})
    signature = (view.key, tuple(rows))
    if rows and state.shared().get(SELECTION) != signature:
        state.shared()[SELECTION] = signature
        if positions:
            set_focus(view, positions[0])
    return positions


def pool_controls(prefix: str, L: int, H: int, layer: int, head: int) -> tuple[tuple, tuple, str | None, int]:
    """The pooling expander: more layers, heads, and the documents of a finished corpus run ->
    (layers, heads, run or None, documents), the sliders' layer and head always among them."""
    with st.expander("Pool over more layers, heads and texts (AttentionViz's joint view)"):
        a, b = st.columns(2)
        layers = {layer, *a.multiselect("Also layers", range(L), key=f"{prefix}_pool_layers")}
        heads = {head, *b.multiselect("Also heads", range(H), key=f"{prefix}_pool_heads")}
        runs = finished_corpus_runs()
        run = a.selectbox(
            "Also documents of a finished corpus run",
            [None, *runs],
            key=f"{prefix}_pool_run",
            format_func=lambda r: "none" if r is None else r,
            help=f"the first {DOC_TOKENS} tokens of each, through this page's model",
        )
        n_docs = b.slider("Documents", 1, MAX_DOCS, 4, key=f"{prefix}_pool_docs", disabled=run is None)
        if not runs:
            st.caption("No finished corpus run on this server yet (the Corpus page starts one).")
    return tuple(sorted(layers)), tuple(sorted(heads)), run, n_docs if run else 0


def linked_chart(prefix, view, x, points, coords, color, color_by: str, title: str, manifest: dict) -> None:
    """The scatter (key ``{prefix}_scatter``; a selection focuses its first token of this text for
    every page, the others offered as pills), its Export menu (the manifest names the focus), and
    a line saying what is focused or how to focus."""
    key = f"{prefix}_scatter"
    selected = take_selection(view, points, selected_rows(key))
    f = focus(view)
    b = linked_view(coords, x, points, color, color_label=color_by, title=title, focus=f)
    st.plotly_chart(
        b.figure,
        key=key,
        on_select="rerun",
        selection_mode=("points", "box", "lasso"),
        theme=None,
        config=CHART_CONFIG,
    )
    export_menu(prefix, "scatter", b, {**manifest, "focus": f})
    if f is not None:
        st.caption(
            f"Token {f} “{view.tokens[f]}” is focused (on every page): its points are ringed in orange."
        )
    else:
        st.caption("Select points (click, box or lasso) to focus their token on Inspect and every page.")
    if len(selected) > 1:
        st.pills(
            "Selected tokens of this text — focus",
            selected,
            key=f"{prefix}_pick",
            format_func=lambda i: f"{i}: {view.tokens[i]}",
            on_change=lambda: set_focus(view, st.session_state.get(f"{prefix}_pick")),
        )
