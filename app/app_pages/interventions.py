"""Interventions: swap one head's normalizer at a time and see how much the output changes (L × H
map); pick a cell to compare that head's map before (the model's softmax) and after the swap, on one
colour scale, and their difference centred at 0."""

import streamlit as st
from appkit import seq2seq
from appkit.analysis import Settings, settings_input, text_input, window_view
from appkit.beyond import before_after, intervention_result, intervention_table
from appkit.export import export_menu
from appkit.show import CHART_CONFIG, table_columns
from appkit.sources import load

import attnlab
from attnlab.figures import beyond as figs
from attnlab.hf.beyond.interventions import encoder_decoder_message

P = "interventions"

st.title("Interventions: where does explaining away matter?")
st.caption(
    "Each cell: the model with only that head's normalizer replaced by the chosen variant. Encoders: "
    "cosine distance of the final hidden states (mean over tokens) and of the mean-pooled embedding; "
    "causal LMs: change of the text's log-likelihood per token (nats)."
)
base = settings_input(P, variants=False)
if refused := seq2seq.is_encoder_decoder(base.source):  # said first; no target box, kind or variant
    st.warning(encoder_decoder_message(load(base.source).info))
text = text_input(P)  # kept (the text follows the user to the other pages)
if refused:
    st.stop()
variant = st.selectbox("Swap each head to", [v for v in attnlab.VARIANTS if v != "unas"], key=f"{P}_variant")
settings = Settings(base.source, tuple(dict.fromkeys(("unas", variant))), "recompute", base.u, base.iters)
view = window_view(P, settings, text)
L, H, N = view.shape
try:
    result = intervention_result(view.key, variant, view)
except ValueError as e:
    st.warning(str(e))
    st.stop()
bundle = figs.intervention_heatmap(result.measures, variant)
event = st.plotly_chart(
    bundle.figure, key=f"{P}_map", on_select="rerun", selection_mode="points", theme=None, config=CHART_CONFIG
)
export_menu(P, "map", bundle)
points = event.selection.points if event is not None else []
if points:  # a clicked cell picks the head below
    st.session_state[f"{P}_layer"], st.session_state[f"{P}_head"] = int(points[0]["y"]), int(points[0]["x"])
a, b = st.columns(2)
layer = a.number_input("Layer", 0, L - 1, key=f"{P}_layer")
head = b.number_input("Head", 0, H - 1, key=f"{P}_head")
before_after(P, view, variant, layer, head, text)
st.dataframe(  # "output change" in the map's format (figs.MEASURE_FORMATS)
    intervention_table(result),
    hide_index=True,
    key=f"{P}_table",
    column_config=table_columns(figs.intervention_columns(result.measures)),
)
