"""Inspect: a text's attention under every variant — one head's map, the head view, the tokens
shaded by the attention they receive, and the layer x head grid."""

import streamlit as st
from appkit import beyond
from appkit.analysis import settings_input, text_input, window_view
from appkit.show import show

P = "inspect"
HEAD_VIEW_MAX_TOKENS = 64

st.title("Inspect attention")
text = text_input(P)
settings = settings_input(P)
view = window_view(P, settings, text)
L, H, N = view.shape
st.caption(
    f"**{view.info.name}** — {L} layers × {H} heads, {N} tokens in this window"
    + (f" (window {view.window + 1} of {view.n_windows})" if view.n_windows > 1 else "")
    + f". Mode: {settings.mode}."
)
for note in view.notes:
    st.caption(f"Note: {note}")

left, mid, right = st.columns([2, 1, 1])
variant = left.segmented_control(
    "Variant", list(view.weights), default=list(view.weights)[0], key=f"{P}_variant", required=True
)
layer = mid.slider("Layer", 0, L - 1, min(2, L - 1), key=f"{P}_layer")
head = right.slider("Head", 0, H - 1, 0, key=f"{P}_head")
if variant not in view.weights:  # the variant list changed under the control
    variant = list(view.weights)[0]

one_head = {"variant": variant, "layer": layer, "head": head}
if N <= HEAD_VIEW_MAX_TOKENS:  # the map and the head view side by side
    maps, lines = st.columns([3, 2])
    with maps:
        show(P, "heatmap", "heatmap", view, one_head, text=text, width="stretch")
    with lines:
        show(P, "head_view", "head_view", view, one_head, text=text)
else:  # a long window: the map gets the whole width
    st.caption(f"The head view draws up to {HEAD_VIEW_MAX_TOKENS} tokens; this window has {N}.")
    show(P, "heatmap", "heatmap", view, one_head, text=text, width="stretch")

GAM_MAPS = {"phi": "Φ: content brains", "theta": "Θ: relative position"}
if any(name in view.components.get(variant, {}) for name in GAM_MAPS):  # a GAM checkpoint's parts
    from attnlab.figures import attention_heatmap

    st.subheader("GAM: content (Φ), relative position (Θ) and the combined weights")
    maps = {**view.components[variant], "combined": view.weights[variant]}
    shown = [(k, GAM_MAPS.get(k, "combined")) for k in (*GAM_MAPS, "combined") if k in maps]
    for column, (key, label) in zip(st.columns(len(shown)), shown, strict=True):
        fig = attention_heatmap(maps[key][layer, head], view.tokens, title=f"{variant}: {label}")
        column.plotly_chart(fig, key=f"{P}_gam_{key}", width="stretch", theme=None)

st.subheader("Attention each token receives")
whole_layer = st.toggle("Mean over the layer's heads", value=True, key=f"{P}_mass_all_heads")
show(
    P,
    "token_mass",
    "token_mass",
    view,
    {"variant": variant, "layer": layer, "head": None if whole_layer else head},
    text=text,
)

st.subheader("Every layer and head")
show(P, "grid", "grid", view, {"variant": variant, "max_tokens": 48}, text=text)

st.subheader("Rollout and attention flow")
beyond.rollout_and_flow(P, view, variant)
