"""Compare: two or more models or variants side by side on the same text — maps, difference maps,
Jensen-Shannon distance per head, column-mass distributions overlaid."""

import streamlit as st
from appkit.analysis import settings_input, text_input, view_for, window_view
from appkit.show import show
from appkit.sources import EMBEDDED, checkpoint_sources

P = "compare"

st.title("Compare models and variants")
text = text_input(P)
settings = settings_input(P)
others = {s.label: s for s in [EMBEDDED, *checkpoint_sources()] if s != settings.source}
with st.sidebar:
    extra = st.multiselect(
        "Compare with models",
        list(others),
        key=f"{P}_others",
        help="Each model analyses the same text with the settings above.",
    )
first = window_view(P, settings, text)
views = [first] + [view_for(others[label], settings, text, first.window) for label in extra]

panels = {f"{v.settings.source.label} · {variant}": (v, variant) for v in views for variant in v.weights}
names = list(panels)
chosen = st.multiselect(
    "Panels (the first is the reference A)",
    names,
    default=names[: min(3, len(names))],
    key=f"{P}_panels",
    max_selections=6,
)
if len(chosen) < 2:
    st.info("Pick at least two panels (two variants, or two models) to compare.")
    st.stop()
L = min(panels[n][0].shape[0] for n in chosen)
H = min(panels[n][0].shape[1] for n in chosen)
a, b = st.columns(2)
layer = a.slider("Layer", 0, L - 1, min(2, L - 1), key=f"{P}_layer")
head = b.slider("Head", 0, H - 1, 0, key=f"{P}_head")

st.subheader("Maps")
for col, name in zip(st.columns(len(chosen)), chosen, strict=True):
    view, variant = panels[name]
    with col:
        st.markdown(f"**{name}**")
        show(
            P,
            f"map_{chosen.index(name)}",
            "heatmap",
            view,
            {"variant": variant, "layer": layer, "head": head},
            text=text,
            width="stretch",
        )

ref_view, ref_variant = panels[chosen[0]]
st.subheader(f"Differences from A = {chosen[0]}")
for col, name in zip(st.columns(len(chosen) - 1), chosen[1:], strict=True):
    view, variant = panels[name]
    with col:
        if view.tokens != ref_view.tokens:
            st.info(
                f"{name} tokenizes the text differently from A: no difference map (see the overlay below)."
            )
            continue
        k = chosen.index(name)
        show(
            P,
            f"diff_{k}",
            "difference",
            [ref_view, view],
            {"variants": [ref_variant, variant], "layer": layer, "head": head},
            labels=["A", name],
            text=text,
            width="stretch",
        )
        show(
            P,
            f"js_{k}",
            "js_distance",
            [ref_view, view],
            {"variants": [ref_variant, variant]},
            labels=["A", name],
            text=text,
            width="stretch",
        )

st.subheader("Column-mass distributions, overlaid")
show(
    P,
    "overlay",
    "column_mass",
    [panels[n][0] for n in chosen],
    {"variants": [panels[n][1] for n in chosen], "layer": None},
    labels=chosen,
    text=text,
)
