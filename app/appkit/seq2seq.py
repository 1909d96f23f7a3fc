"""An encoder-decoder in the app (T5, BART, mBART, Pegasus, Marian; docs/APP.md): a target box beside
the text, one selector of the kind of attention shown (encoder, decoder, cross) that follows the user
from page to page and lives in the URL, and the chosen kind's analysis as a :class:`WindowView`, so
the pages draw it as they draw any model's. Cross-attention is rectangular (target rows x source
columns: ``view.query_tokens`` name the rows): the browser's head view and model view draw it (target
tokens left, source tokens right, the focus a source token: appkit/token_views.py); its map and layer
x head grid are the library's figures and its token strip shows each source token's column mass
(:func:`rectangular_view`).
"""

from __future__ import annotations

import numpy as np
import streamlit as st

import attnlab
from appkit import state
from appkit.analysis import Settings, WindowView, _fail
from appkit.sources import Source, load
from attnlab import hf
from attnlab.hf.capture.seq2seq import KINDS

KIND_LABELS = {
    "encoder": "Encoder (source × source)",
    "decoder": "Decoder (target × target, causal)",
    "cross": "Cross (target → source)",
}
MAX_TARGET_CHARS = 4000
TARGET = "target"  # shared state and URL: the target text; "kind": the kind shown


def is_encoder_decoder(source: Source) -> bool:
    """The source loads as an encoder-decoder (a model that does not load: False, the page says why)."""
    try:
        return bool(load(source).info.encoder_decoder)
    except (ValueError, OSError):
        return False


def seq2seq_inputs(prefix: str) -> tuple[str | None, str]:
    """The target box and the kind selector; -> (target or None: the decoder start token alone, kind)."""
    target = state.remembered(
        prefix, TARGET, st.text_area, "", "Target (the text the decoder reads)", height=80,
        max_chars=MAX_TARGET_CHARS, url=state.TEXT,
        help="The decoder reads its start token, then this text (teacher-forced); empty: the start token "
        "alone, one query row.",
    )
    kind = state.remembered(
        prefix, "kind", st.radio, "cross", "Attention shown", list(KINDS), horizontal=True,
        format_func=KIND_LABELS.get, valid=list(KINDS).__contains__, url=state.TEXT,
    )
    return (target if target.strip() else None), kind


@st.cache_resource(max_entries=3, ttl=1800, show_spinner=False)
def _result(kind: str, path: str | None, text: str, target: str | None, variants: tuple, mode: str, u: float,
            iters: int, extra: tuple = ()):
    """The encoder-decoder's analysis (``hf.analyze(text, model, target=...)``) of source and target.
    Sinkhorn's rounds apply per kind: the encoder's and the cross-attention take the box's value, the
    decoder's causal self-attention its causal rule's one round (a note says so)."""
    model = load(Source(kind, path, ""))
    if iters == attnlab.variant_spec("sinkhorn").param("iters").default:
        iters = None
    return hf.analyze(text, model, variants, mode, u, iters, target=target, **dict(extra))


def kind_view(s: Settings, text: str, target: str | None, attention: str) -> WindowView:
    """The ``attention`` kind of the analysis as a WindowView: ``tokens`` the keys, ``query_tokens``
    the queries (cross only), ``weights`` {variant: (L, H, M, N)}. Bad input: a message, the page stops."""
    try:
        result = _result(s.source.kind, s.source.path, text, target, s.variants, s.mode, s.u, s.iters,
                         s.extra)
    except (ValueError, OSError) as e:
        _fail(e)
    view = result.view(attention)
    queries, keys = result.windows_of(attention)
    n = len(keys.tokens)
    return WindowView(
        s, view.model, tokens=list(keys.tokens), input_ids=list(keys.input_ids), special=keys.special,
        weights={v: w.numpy() for v, w in view.weights.items()}, u=float(result.u) if not hasattr(
            result.u, "numel") else result.u.numpy(), iters=result.iters, window=0,
        windowing={"window": n, "content": n, "stride": n, "overlap": 0, "n_tokens": n, "n_windows": 1,
                   "starts": [0]},
        text_sha256=result.text_sha256, characters=len(text), notes=list(result.notes),
        query_tokens=list(queries.tokens) if attention == "cross" else None, kind=attention)


def seq2seq_view(prefix: str, s: Settings, text: str, busy) -> WindowView:
    """The target box, the kind selector and the chosen kind's view (``controls.window_view``, whose
    ``busy`` spinner shows while it is computed)."""
    target, attention = seq2seq_inputs(prefix)
    st.caption(f"**{s.source.label}** is an encoder-decoder: the text above is its source; showing "
               f"{KIND_LABELS[attention].lower()}.")
    with busy():
        return kind_view(s, text, target, attention)


def rectangular_view(prefix: str, what: str, view: WindowView, variant: str, layer: int, head: int | None):
    """``what`` (the map, the grid or the strip) of a cross-attention view, M target rows x N source
    columns, as the library's figure (the head and model views: the browser's, appkit/token_views.py)."""
    from attnlab import figures
    from attnlab.figures.views import token_mass_strip

    w = np.asarray(view.weights[variant])  # (L, H, M, N)
    queries, keys = view.query_tokens, view.tokens
    key = f"{prefix}_{what}_cross"
    if what == "heatmap":
        fig = figures.attention_heatmap(w[layer, head], keys, query_tokens=queries,
                                        title=f"{variant}: cross-attention, layer {layer}, head {head}")
    elif what == "grid":
        fig = figures.attention_grid(w, keys, title=f"{variant}: cross-attention by layer and head")
    else:  # token_mass
        mass = w[layer].sum(-2).mean(0) if head is None else w[layer, head].sum(-2)  # (N,)
        where = "mean over heads" if head is None else f"head {head}"
        fig = token_mass_strip(keys, mass, bound=1.0 / len(keys), what="mass",
                               title=f"{variant}: attention each source token receives from the "
                               f"{len(queries)} target tokens (layer {layer}, {where})")
    st.plotly_chart(fig, key=key, width="stretch")
