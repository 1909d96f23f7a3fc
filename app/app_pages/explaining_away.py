"""Explaining away: how much attention each key receives (column mass), per layer and variant, and
which tokens fall below a threshold ε of the average key (docs/DESIGN.md §4)."""

import streamlit as st
from appkit import beyond, sinks_view
from appkit.controls import inputs, window_view
from appkit.show import show, table_columns

from attnlab.figures import app_views
from attnlab.figures.stat_views import MOST_EXPLAINED_AWAY_COLUMNS

P = "away"
EPS_CHOICES = [0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5]

st.title("Explaining away")
st.caption(
    "Column mass m_j = Σ_i π_ij is the attention key j receives. UNAS can drive it to 0 (the key is "
    "*explained away*); DNAS guarantees m_j ≥ 1/N and HNAS m_j ≥ u/N (dashed lines)."
)
text, settings = inputs(P)
view = window_view(P, settings, text)
L, H, N = view.shape
variants = list(view.weights)
if nan := view.nan_note():  # NaN in the model's weights or outputs: the statistics below are NaN
    st.warning(nan)

st.subheader("Column-mass distributions")
c1, c2, c3 = st.columns(3)
layer_choice = c1.selectbox("Layer", ["every layer", *range(L)], key=f"{P}_layer")
dist = c2.radio(
    "Plot",
    ["ecdf", "histogram"],
    horizontal=True,
    key=f"{P}_dist",
    format_func={"ecdf": "ECDF", "histogram": "histogram"}.get,
)
group = c3.radio("One curve per", ["variant", "layer"], horizontal=True, key=f"{P}_group")
shown = variants if group == "variant" else [c3.selectbox("Variant", variants, key=f"{P}_dist_variant")]
layer = None if layer_choice == "every layer" else int(layer_choice)
show(
    P,
    "column_mass",
    "column_mass",
    view,
    {"variants": shown, "layer": layer, "group": group, "dist": dist},
    text=text,
    width="stretch",
)

st.subheader("Explained-away fraction per layer and head")
eps = st.select_slider(
    "ε (relative column mass: share of the average key's mass)", EPS_CHOICES, value=0.1, key=f"{P}_eps"
)
st.caption(
    f"A key is ε-explained away when m_j · N / M < {eps:g}, i.e. it gets less than {eps:.0%} of "
    "what an average key gets."
)
by = st.segmented_control("Explained away by", beyond.BY, default="weight", key=f"{P}_by", required=True)
no_sinks = st.toggle("Exclude sink keys (first position, special tokens)", key=f"{P}_no_sinks")
if by == "weight" and not no_sinks:
    show(P, "explained_away", "explained_away", view, {"eps": eps, "variants": variants}, text=text,
         width="stretch")
else:  # attnlab.contributions / attnlab.sinks: c_j = m_j ||f(x_j)||, rows renormalized without sinks
    beyond.explained_away(P, view, eps, by, no_sinks)

st.subheader("Most explained-away tokens")
a, b = st.columns(2)
table_variant = a.selectbox("Variant", variants, key=f"{P}_table_variant")
table_layer = b.selectbox("Layer", ["every layer", *range(L)], key=f"{P}_table_layer")
frame = app_views.most_explained_away(
    view.weights[table_variant],
    view.tokens,
    eps,
    layer=None if table_layer == "every layer" else int(table_layer),
)
st.dataframe(
    frame,
    hide_index=True,
    key=f"{P}_table",
    column_config=table_columns(MOST_EXPLAINED_AWAY_COLUMNS, shares=("share_of_heads",)),
)
st.download_button(
    "All statistics of this window (CSV)",
    data=lambda: view.statistics_csv(eps),
    file_name="statistics.csv",
    mime="text/csv",
    key=f"{P}_stats_csv",
    on_click="ignore",
    help="attnlab.stats.tidy_table: one row per variant, layer, head and statistic",
)

st.subheader("Attention sinks")  # Gu et al. 2024, Xiao et al. 2023, Sun et al. 2024 (appkit/sinks_view.py)
sinks_view.sink_views(P, view, text)
