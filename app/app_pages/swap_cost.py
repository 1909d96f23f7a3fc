"""Swap cost: what a normalizer costs a pretrained model's language modelling (`attnlab swap-eval` in the
background, like a corpus run): the loss change per swapped layer with 95 % CIs over documents, and the
loss by token position (the StreamingLLM-style curve); open a run folder. docs/SWAP_EVAL.md."""

import time

import streamlit as st
from appkit import corpus_runs
from appkit.run_panel import run_panel
from appkit.show import show_bundle

import attnlab
from attnlab.swap_eval import figures as swap_figures
from attnlab.swap_eval import open_result

P = "swap"
KIND = "swap-eval"
LAYERS = {"Each layer in turn": "each", "All layers at once": "all", "Both": "each,all"}

st.title("Swap cost")
st.caption("Each document is scored by the model with its LM head (causal: next-token loss; encoders: "
           "seeded masked-token loss), unswapped and with each variant swapped into each layer or all of "
           "them. The change in loss is averaged over documents (95 % bootstrap CI). The model folder "
           "must hold the LM head (MiniLM ships without one: train it with `attnlab train --recipe "
           f"mlm-head`). Runs live in `{corpus_runs.corpus_dir(KIND)}`.")

with st.expander("New swap-eval run", expanded=not corpus_runs.list_runs(KIND)), st.form(f"{P}_form"):
    a, b = st.columns(2)
    name = a.text_input("Name", value=time.strftime("swap-%Y%m%d-%H%M%S"), key=f"{P}_name")
    model = b.text_input("Model folder (save_pretrained, with its LM head)", key=f"{P}_model")
    kind = st.radio("Corpus", ["Shipped (KJV, one document per chapter)", "Upload", "Server path"],
                    key=f"{P}_kind", horizontal=True)
    upload = st.file_uploader("Upload .jsonl / .csv / .parquet, or a .zip of .txt files", key=f"{P}_upload",
                              type=["jsonl", "csv", "parquet", "zip"])
    path = st.text_input("Server path (folder of .txt/.md, or a .jsonl/.csv/.parquet file)", key=f"{P}_path")
    # a row of its own: in a fifth of the form its chips were cut at 1280 px
    variants = st.multiselect("Variants swapped in", list(attnlab.VARIANTS),
                              default=["dnas", "sinkhorn", "softmax1"], key=f"{P}_variants")
    b, c, d, e = st.columns(4)
    layers = b.selectbox("Layers", list(LAYERS), key=f"{P}_layers")
    window = c.number_input("Window (tokens, 0 = the model's)", 0, 8192, 0, key=f"{P}_window")
    max_docs = d.number_input("Max documents (0 = all)", 0, 10_000_000, 100, key=f"{P}_max_docs")
    shard_docs = e.number_input("Documents per shard", 1, 10_000, 8, key=f"{P}_shard_docs",
                                help="the unit of progress and of resume: a Stop keeps finished shards")
    submitted = st.form_submit_button("Start", type="primary")

if submitted:
    config = {"model": model.strip(), "variants": variants, "layers": LAYERS[layers],
              "window": int(window) or None, "max_docs": int(max_docs) or None, "shard_docs": int(shard_docs)}
    try:
        if not variants:
            raise ValueError("variants: choose at least one variant to swap in")
        started = corpus_runs.start(
            name.strip(), config,
            upload=(upload.name, upload.getvalue()) if kind == "Upload" and upload else None,
            path=path.strip() if kind == "Server path" else None, kind=KIND,
        )
        st.session_state[f"{P}_run"] = started.name
    except ValueError as e:
        st.error(str(e))


def show_result(result, label: str) -> None:
    """The run's two figures, each with its Export menu (the data: the run's Parquet tables)."""
    m = result.manifest
    manifest = {"run": str(result.out), "loss_delta": str(result.out / "loss_delta.parquet"),
                "loss_by_position": str(result.out / "loss_by_position.parquet")}
    st.caption(f"{m['n_documents']} documents, {m['n_tokens']:,} tokens, {len(m['skipped'])} skipped, "
               f"model {m['model']['name']}")
    show_bundle(P, f"{label}_delta", swap_figures.loss_delta(result.loss_delta()), manifest)
    show_bundle(P, f"{label}_position", swap_figures.loss_by_position(result.loss_by_position()), manifest)


with st.expander("Open a finished run's folder"):
    folder = st.text_input("Run folder (the --out of attnlab swap-eval)", key=f"{P}_folder")
    if folder:
        try:
            show_result(open_result(folder.strip()), "folder")
        except ValueError as e:
            st.error(str(e))

all_runs = {r.name: r for r in corpus_runs.list_runs(KIND)}
if not all_runs:
    st.info("No swap-eval runs yet: start one above.")
    st.stop()
if st.session_state.get(f"{P}_run") not in all_runs:
    st.session_state[f"{P}_run"] = next(iter(all_runs))
chosen = st.selectbox("Run", list(all_runs), key=f"{P}_run",
                      format_func=lambda n: f"{n} — {all_runs[n].status}")


# named per page: a fragment's id is its name + place, and every page runs as __main__ (issue 30)
@st.fragment(run_every=2.0 if all_runs[chosen].active else None)
def swap_cost_live(run_dir):
    run_panel(run_dir, KIND, all_runs[chosen].status, P,
              lambda run: show_result(open_result(run.result), "run"))


swap_cost_live(all_runs[chosen].dir)
