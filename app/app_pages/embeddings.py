"""Embeddings: token representations, or queries and keys in one space (AttentionViz's joint view),
pooled over heads, layers and the documents of a corpus run, in 2-D. Linked with Inspect: selecting
points focuses their token on every page, and the focused token's points are ringed here. PCA
shows at once; UMAP (seeded) runs in a background process warmed when this page first opens."""

import streamlit as st
from appkit import embeddings as emb
from appkit import pooled
from appkit.controls import inputs, window_view
from appkit.pick import layer_head

from attnlab.figures import app_views

P = "embed"
WHAT = {"hidden": "token representations (layer output)", "qk": "queries and keys (AttentionViz)"}

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
layers, heads, run, n_docs = (
    pooled.pool_controls(P, L, H, layer, head) if what == "qk" else ((layer,), (), None, 0)
)
a, b = st.columns(2)
options = pooled.COLOR_BY if what == "qk" else pooled.COLOR_BY[:3]
color_by = a.radio("Colour by", options, horizontal=True, key=f"{P}_color")
method = b.radio(
    "Projection", ["PCA", "UMAP"], horizontal=True, key=f"{P}_method", help=f"UMAP worker: {emb.status()}"
)

try:
    if what == "hidden":
        x, _ = emb.vectors(view.key, layer, head, what, _view=view)
        points = pooled.hidden_points(view, layer)
    else:
        with st.spinner("Queries and keys…"):
            x, points = pooled.pooled(view.key, layers, heads, run, n_docs, _view=view)
    color = pooled.colours(view, points, color_by)
except ValueError as e:
    st.warning(str(e))
    st.stop()
where = (
    f"layer {layer}"
    if what == "hidden"
    else (
        f"layer{'s' * (len(layers) > 1)} {', '.join(map(str, layers))}, "
        f"head{'s' * (len(heads) > 1)} {', '.join(map(str, heads))}"
        + ("" if run is None else f", this text + {points['text'].nunique() - 1} documents of {run}")
    )
)
manifest = {
    "model": view.info.as_dict(),
    "text_sha256": view.text_sha256,
    "window": view.window,
    "vectors": what,
    "layers": list(map(int, layers)) if what == "qk" else [layer],
    "heads": list(map(int, heads)) if what == "qk" else [],
    "corpus_run": run,
    "texts": list(dict.fromkeys(points["text"])),
    "colour": color_by,
    "umap_seed": 0,
}


def draw(coords, name):
    title = f"{WHAT[what]} — {where} — {name}"
    pooled.linked_chart(P, view, x, points, coords, color, color_by, title, {**manifest, "projection": name})


if method == "PCA" or not emb.enabled():
    if method == "UMAP":
        st.info("UMAP is turned off on this server (ATTNLAB_UMAP=off); showing PCA.")
    draw(app_views.pca_2d(x), "PCA")
else:
    job = emb.umap_job(f"{view.key}|{what}|{layers}|{heads}|{run}|{n_docs}", x)

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
