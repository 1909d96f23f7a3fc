"""Embeddings: token representations, or a head's queries and keys in one space (AttentionViz), in 2-D.
PCA shows at once; UMAP runs in a background process warmed when this page first opens."""

import streamlit as st
from appkit import embeddings as emb
from appkit.controls import inputs, window_view
from appkit.pick import layer_head
from appkit.show import show_bundle

from attnlab.figures import app_views

P = "embed"
WHAT = {"hidden": "token representations (layer output)", "qk": "queries and keys of one head (AttentionViz)"}

st.title("Embeddings")
emb.start_warmup()
text, settings = inputs(P)
view = window_view(P, settings, text)
L, H, N = view.shape
if N < 4:
    st.info("Embeddings need at least 4 tokens; use a longer text.")
    st.stop()

a, b, c = st.columns(3)
what = a.radio("Vectors", list(WHAT), format_func=WHAT.get, key=f"{P}_what")
layer, head = layer_head(P, L, H, (b, c))  # the head matters only for queries and keys
a, b = st.columns(2)
color_by = a.radio("Colour by", emb.COLOR_BY, horizontal=True, key=f"{P}_color")
method = b.radio(
    "Projection", ["PCA", "UMAP"], horizontal=True, key=f"{P}_method", help=f"UMAP worker: {emb.status()}"
)

try:
    x, kinds = emb.vectors(view.key, layer, head, what, _view=view)
except ValueError as e:
    st.warning(str(e))
    st.stop()
color = emb.colors(view, layer, None if what == "hidden" else head, color_by, kinds)
where = f"layer {layer}" + ("" if what == "hidden" else f", head {head}")
manifest = {
    "model": view.info.as_dict(),
    "text_sha256": view.text_sha256,
    "window": view.window,
    "vectors": what,
    "layer": layer,
    "head": None if what == "hidden" else head,
    "colour": color_by,
}


def draw(coords, name):
    title = f"{WHAT[what]} — {where} — {name}"
    b = app_views.embedding_view(coords, x, view.tokens, color, kinds, color_label=color_by, title=title)
    show_bundle(P, "scatter", b, {**manifest, "projection": name})


if method == "PCA" or not emb.enabled():
    if method == "UMAP":
        st.info("UMAP is turned off on this server (ATTNLAB_UMAP=off); showing PCA.")
    draw(app_views.pca_2d(x), "PCA")
else:
    job = emb.umap_job(f"{view.key}|{layer}|{head}|{what}", x)

    @st.fragment(run_every=None if job.done() else 1.5)
    def umap_view():
        if not job.done():
            state = "warming up (its first use compiles it)" if emb.status() == "warming" else "running"
            st.info(f"UMAP is {state}… showing PCA meanwhile; the view switches by itself.")
            draw(app_views.pca_2d(x), "PCA (UMAP pending)")
        elif job.exception() is not None:
            st.warning(f"UMAP failed ({job.exception()}); showing PCA.")
            draw(app_views.pca_2d(x), "PCA")
        else:
            draw(job.result(), "UMAP")

    umap_view()
