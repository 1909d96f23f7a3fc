"""Corpus: explaining-away statistics over many documents (`attnlab corpus` in the background, like
training), per-layer curves with 95 % bands per variant, a layer x head heatmap; open a run folder."""

import time

import streamlit as st
from appkit import corpus_runs
from appkit.run_panel import run_panel
from appkit.show import show_bundle

import attnlab
from attnlab.corpus import open_result
from attnlab.figures import corpus as corpus_figures

P = "corpus"
CURVES = {
    "Column-mass quantiles": [f"relative_column_mass_q{q}" for q in ("10", "50", "90")],
    "Explained away": ["explained_away_relative"],
    "Attention received": ["received:special", "received:punctuation", "received:first_position"],
}

st.title("Corpus atlas")
st.caption("Every document is windowed and analysed as on the Inspect page; statistics are averaged "
           "per document, then over documents (95 % bootstrap CI). Runs live in "
           f"`{corpus_runs.corpus_dir()}`.")

with st.expander("New corpus run", expanded=not corpus_runs.list_runs()), st.form(f"{P}_form"):
    a, b = st.columns(2)
    name = a.text_input("Name", value=time.strftime("corpus-%Y%m%d-%H%M%S"), key=f"{P}_name")
    kind = b.radio("Corpus", ["Shipped (KJV, one document per chapter)", "Upload", "Server path"],
                   key=f"{P}_kind")
    upload = st.file_uploader("Upload .jsonl / .csv / .parquet, or a .zip of .txt files", key=f"{P}_upload",
                              type=["jsonl", "csv", "parquet", "zip"])
    path = st.text_input("Server path (folder of .txt/.md, or a .jsonl/.csv/.parquet file)", key=f"{P}_path")
    # a row of its own: in a fifth of the form its chips were cut at 1280 px
    variants = st.multiselect("Variants", list(attnlab.VARIANTS), default=list(attnlab.VARIANTS),
                              key=f"{P}_variants")
    b, c, d, e = st.columns(4)
    window = b.number_input("Window (tokens)", 8, 512, 128, key=f"{P}_window")
    max_docs = c.number_input("Max documents (0 = all)", 0, 10_000_000, 100, key=f"{P}_max_docs")
    shard_docs = d.number_input("Documents per shard", 1, 10_000, 8, key=f"{P}_shard_docs",
                                help="the unit of progress and of resume: a Stop keeps finished shards")
    column = e.text_input("Text column", "text", key=f"{P}_column")
    index = st.checkbox("Token index for search", value=True, key=f"{P}_index",
                        help="per token its last hidden state and the attention it receives, for Inspect's "
                             "\"Find similar tokens\" (~0.84 GB per million tokens with MiniLM)")
    submitted = st.form_submit_button("Start", type="primary")

if submitted:
    config = {"variants": variants, "window": int(window), "max_docs": int(max_docs) or None,
              "text_column": column, "overlap": 0, "shard_docs": int(shard_docs),
              "index": bool(index)}
    try:
        started = corpus_runs.start(
            name.strip(), config,
            upload=(upload.name, upload.getvalue()) if kind == "Upload" and upload else None,
            path=path.strip() if kind == "Server path" else None,
        )
        st.session_state[f"{P}_run"] = started.name
    except ValueError as e:
        st.error(str(e))


def show_result(result, label: str) -> None:
    summary = result.summary()
    manifest = {"run": str(result.out), "summary": str(result.out / "summary.parquet")}
    m = result.manifest
    st.caption(f"{m['n_documents']} documents, {m['n_tokens']:,} tokens, {len(m['skipped'])} skipped, "
               f"model {m['model']['name']}")
    for title, stats in CURVES.items():
        show_bundle(P, f"{label}_{title}", corpus_figures.layer_curves(summary, stats, title=title), manifest)
    a, b = st.columns(2)
    statistic = a.selectbox("Heatmap statistic", sorted(summary["statistic"].unique()),
                            key=f"{P}_{label}_stat")
    variant = b.selectbox("Variant", list(dict.fromkeys(summary["variant"])), key=f"{P}_{label}_variant")
    show_bundle(P, f"{label}_heatmap", corpus_figures.head_heatmap(summary, statistic, variant), manifest)


with st.expander("Open a finished run's folder"):
    folder = st.text_input("Run folder (the --out of attnlab corpus)", key=f"{P}_folder")
    if folder:
        try:
            show_result(open_result(folder.strip()), "folder")
        except ValueError as e:
            st.error(str(e))

all_runs = {r.name: r for r in corpus_runs.list_runs()}
if not all_runs:
    st.info("No corpus runs yet: start one above.")
    st.stop()
if st.session_state.get(f"{P}_run") not in all_runs:
    st.session_state[f"{P}_run"] = next(iter(all_runs))
chosen = st.selectbox("Run", list(all_runs), key=f"{P}_run",
                      format_func=lambda n: f"{n} — {all_runs[n].status}")


# A fragment's id is its function's name + place, and every page runs as __main__: named per page,
# so another page's timer cannot rerun it (and it stops polling once the run has ended: issue 30).
@st.fragment(run_every=2.0 if all_runs[chosen].active else None)
def corpus_live(run_dir):
    run_panel(run_dir, "corpus", all_runs[chosen].status, P,
              lambda run: show_result(open_result(run.result), "run"))


corpus_live(all_runs[chosen].dir)
