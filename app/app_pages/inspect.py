"""Inspect: a text's attention under every variant — one head's map, the head view, the tokens
shaded by the attention they receive, every layer and head as head views (model view) and as maps.
A click on a token focuses it in every view of the page."""

import streamlit as st
from appkit import beyond
from appkit.analysis import LONG_CONTEXT
from appkit.controls import inputs, window_view
from appkit.corpus_search import corpus_search_section
from appkit.gam import NOTE as GAM_NOTE
from appkit.gam import gam_maps, is_gam
from appkit.long_context import long_map
from appkit.neuron import neuron_section
from appkit.pick import layer_head, variant
from appkit.token_views import focus_bar, token_view

from attnlab.figures.head_view import MODEL_VIEW_MAX_TOKENS

P = "inspect"
HEAD_VIEW_MAX_TOKENS = 64
SIDE_BY_SIDE_MAX_TOKENS = 32  # beyond, a map beside the head view has cells too narrow to label every token

st.title("Inspect attention")
text, settings = inputs(P)
view = window_view(P, settings, text)
L, H, N = view.shape
side = max(N, len(view.query_tokens or ()))  # the line views' rows (cross-attention: M targets, N sources)
st.caption(
    f"**{view.info.name}** — {L} layers × {H} heads, {N:,} tokens in this window. Mode: {settings.mode}."
)
for note in view.notes:
    st.caption(f"Note: {note}")
if is_gam(view):
    st.caption(GAM_NOTE)

left, mid, right = st.columns([2, 1, 1])
chosen = variant(P, view, left)
layer, head = layer_head(P, L, H, (mid, right))

focus_bar(P, view)  # a click on a token redraws every view at once in the browser, then reruns only the bar
span = None  # a long context: the tokens [lo, hi) the head view and the strip draw, around the focus
if N > LONG_CONTEXT:  # one head's map downsampled, a region at full resolution; the rest around the focus
    span = long_map(P, view, chosen, layer, head, text)
    token_view(P, "head_view", view, chosen, layer, head, text=text, span=span)
elif side <= SIDE_BY_SIDE_MAX_TOKENS:  # the map and the head view side by side
    maps, lines = st.columns([3, 2])
    with maps:
        token_view(P, "heatmap", view, chosen, layer, head, text=text)
    with lines:
        token_view(P, "head_view", view, chosen, layer, head, text=text)
elif side <= HEAD_VIEW_MAX_TOKENS:  # the map over the whole width (every token labelled), the head view below
    token_view(P, "heatmap", view, chosen, layer, head, text=text)
    token_view(P, "head_view", view, chosen, layer, head, text=text)
else:  # a long window: the map gets the whole width
    st.caption(f"The head view draws up to {HEAD_VIEW_MAX_TOKENS} tokens; this window has {side:,}.")
    token_view(P, "heatmap", view, chosen, layer, head, text=text)

st.subheader("Neuron view: what makes one weight")
neuron_section(P, view, chosen, layer, head, text)

st.subheader("Similar tokens in a corpus run")
corpus_search_section(P, view)

st.subheader("Attention each token receives")
whole_layer = st.toggle("Mean over the layer's heads", value=True, key=f"{P}_mass_all_heads")
token_view(P, "token_mass", view, chosen, layer, None if whole_layer else head, text=text, span=span)

st.subheader("Every layer and head: head views (model view)")
if side <= MODEL_VIEW_MAX_TOKENS:
    token_view(P, "model_view", view, chosen, layer, head, text=text)
else:
    st.info(
        f"The model view draws up to {MODEL_VIEW_MAX_TOKENS} tokens and this window has {side:,}: "
        "the layer × head grid below shows every map of it."
    )


if is_gam(view):  # a GAM checkpoint's parts
    st.subheader("GAM: content (Φ), relative position (Θ) and the combined weights")
    gam_maps(P, view, chosen, layer, head)

st.subheader("Every layer and head: maps")
if span is None:
    token_view(P, "grid", view, chosen, layer, head, text=text)
    st.subheader("Rollout and attention flow")
    beyond.rollout_and_flow(P, view, chosen)
else:  # every head's whole map: L x H heads computed
    st.info(f"The layer × head grid, rollout and attention flow draw windows of up to {LONG_CONTEXT} tokens "
            f"and this one has {N:,} (they need every head's whole map); the map above shows one head.")
