"""Compare: two or more models or variants side by side on the same text — maps on one colour scale,
difference maps on one diverging scale, Jensen-Shannon distance per head, column-mass ECDFs overlaid."""

import streamlit as st
from appkit import state
from appkit.analysis import LONG_CONTEXT, view_for
from appkit.controls import inputs, window_view
from appkit.pick import focus_line, layer_head
from appkit.show import bundle, show
from appkit.sources import EMBEDDED, checkpoint_sources

P = "compare"

st.title("Compare models and variants")
text, settings = inputs(P)
others = {s.label: s for s in [EMBEDDED, *checkpoint_sources()] if s != settings.source}
with st.sidebar:
    extra = state.remembered(
        P,
        "others",
        st.multiselect,
        [],
        "Compare with models",
        list(others),
        valid=lambda v: set(v) <= set(others),
        url=state.LIST,
        help="Each model analyses the same text with the settings above.",
    )
first = window_view(P, settings, text)
views = [first] + [view_for(others[label], settings, text, first.window) for label in extra]

# A panel is (source, variant); its role "k.variant" (k = 0 for the main model, k for the k-th model
# compared with) survives a change of model, where its display name does not.
panels, role_of = {}, {}
for k, v in enumerate(views):
    for variant in v.weights:
        name = f"{v.settings.source.label} · {variant}"
        panels[name], role_of[name] = (v, variant), f"{k}.{variant}"
by_role = {r: n for n, r in role_of.items()}
roles = state.shared().get("panel_roles") or state.url_value("panels", state.LIST, None)
seed = [by_role[r] for r in roles if r in by_role] if roles else list(panels)[:3]
current = st.session_state.get(f"{P}_panels")
if current is not None and set(current) <= set(panels):
    seed = current
else:
    st.session_state.pop(f"{P}_panels", None)
chosen = st.multiselect(
    "Panels (the first is the reference A)",
    list(panels),
    default=seed[:6],
    key=f"{P}_panels",
    max_selections=6,
)
state.shared()["panel_roles"] = [role_of[n] for n in chosen]
state.set_url("panels", [role_of[n] for n in chosen], state.LIST, [role_of[n] for n in list(panels)[:3]])
if len(chosen) < 2:
    st.info("Pick at least two panels (two variants, or two models) to compare.")
    st.stop()

L = min(panels[n][0].shape[0] for n in chosen)
H = min(panels[n][0].shape[1] for n in chosen)
layer, head = layer_head(P, L, H)
shared_scale = state.remembered(
    P,
    "shared_scale",
    st.toggle,
    True,
    "One colour scale for every panel",
    url=state.BOOL,
    help="Off: each panel gets its own range and colour bar (then equal colours are not equal weights).",
)
ref_view, ref_variant = panels[chosen[0]]
focus = focus_line(P, ref_view)
same = [n for n in chosen if panels[n][0].tokens == ref_view.tokens]

st.subheader("Maps")
if len(same) == len(chosen):
    show(
        P,
        "maps",
        "panels",
        [panels[n][0] for n in chosen],
        {
            "variants": [panels[n][1] for n in chosen],
            "layer": layer,
            "head": head,
            "shared_scale": shared_scale,
            "focus": focus,
        },
        labels=chosen,
        text=text,
        width="stretch",
    )
else:
    st.info("The panels tokenize the text differently, so they cannot share axes: one map each.")
    zmax = max(float(panels[n][0].weights[panels[n][1]][layer, head].max()) for n in chosen)
    for col, name in zip(st.columns(len(chosen)), chosen, strict=True):
        view, variant = panels[name]
        with col:
            params = {
                "variant": variant,
                "layer": layer,
                "head": head,
                "zmax": zmax if shared_scale else None,
            }
            # a long context: the map in token blocks (each on its own colour scale), as Inspect draws it
            kind = "heatmap_blocks" if view.shape[2] > LONG_CONTEXT else "heatmap"
            show(P, f"map_{chosen.index(name)}", kind, view, params, text=text, width="stretch")

st.subheader(f"Differences from A = {chosen[0]}")
if len(same) < 2:
    st.info("No other panel tokenizes the text as A does: no difference map (see the overlay below).")
else:
    if len(same) < len(chosen):
        st.caption("Panels that tokenize the text differently from A get no difference map.")
    show(
        P,
        "diffs",
        "differences",
        [panels[n][0] for n in same],
        {"variants": [panels[n][1] for n in same], "layer": layer, "head": head, "focus": focus},
        labels=same,
        text=text,
        width="stretch",
    )
    # one under another, each at its own width (side by side in columns the maps shrank until their
    # cell values ran together, seen at 1280x800), on one colour range: the largest distance of all
    pairs = {n: ([ref_view, panels[n][0]], {"variants": [ref_variant, panels[n][1]]}) for n in same[1:]}
    if ref_view.shape[2] > LONG_CONTEXT:  # every head's whole map, twice per pair: not on a long context
        st.info(f"The Jensen-Shannon distance per layer and head is drawn for windows of up to "
                f"{LONG_CONTEXT} tokens and this one has {ref_view.shape[2]:,} (it needs every head's whole "
                "map of both panels); the maps above show one head.")
    else:
        top = max(float(bundle("js_distance", *pair).arrays["js_distance"].max()) for pair in pairs.values())
        for name, (pair, params) in pairs.items():
            show(P, f"js_{chosen.index(name)}", "js_distance", pair, {**params, "zmax": max(top, 1e-6)},
                 labels=["A", name], text=text)
        if len(pairs) > 1:
            st.caption(f"The Jensen-Shannon maps share one colour range, 0 to {top:.3g} (the largest "
                       "distance).")

st.subheader("Column-mass distributions, overlaid")
show(
    P,
    "overlay",
    "column_mass",
    [panels[n][0] for n in chosen],
    {"variants": [panels[n][1] for n in chosen], "layer": None},
    labels=[panels[n][0].settings.source.label for n in chosen],  # the figure adds " · variant"
    text=text,
    width="stretch",
)
