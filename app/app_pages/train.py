"""Train: start `attnlab train` in a background process, watch it live, stop and resume it.
Runs keep going when the tab closes and are found again on reload (they live in runs/)."""

import time

import streamlit as st
from appkit import runs
from appkit.show import show_bundle
from appkit.sources import runs_dir

import attnlab
from attnlab.figures import app_views

P = "train"

st.title("Train a small transformer")
st.caption(
    f"Each run is `attnlab train --config runs/NAME/app_config.json --out runs/NAME` in its own "
    f"process; runs are kept in `{runs_dir()}`."
)

with st.expander("New run", expanded=not runs.list_runs()), st.form(f"{P}_form"):
    a, b, c = st.columns(3)
    name = a.text_input("Name", value=time.strftime("run-%Y%m%d-%H%M%S"), key=f"{P}_name")
    kind = b.radio(
        "Model",
        ["encoder", "decoder"],
        horizontal=True,
        key=f"{P}_kind",
        help="encoder: masked LM (BERT-like); decoder: causal LM (GPT-like)",
    )
    variant = c.selectbox("Attention (every layer)", attnlab.VARIANTS, index=2, key=f"{P}_variant")
    a, b, c, d = st.columns(4)
    n_layers = a.number_input("Layers", 1, 12, 4, key=f"{P}_layers")
    n_heads = b.number_input("Heads", 1, 16, 4, key=f"{P}_heads")
    d_model = c.select_slider("Width", [32, 64, 128, 256], 128, key=f"{P}_width")
    per_layer = d.text_input(
        "Variant per layer (optional)", placeholder="unas,dnas,hnas,hnas", key=f"{P}_per_layer"
    )
    a, b, c, d = st.columns(4)
    steps = a.number_input("Steps", 1, 200_000, 600, key=f"{P}_steps")
    batch = b.number_input("Batch size", 1, 512, 32, key=f"{P}_batch")
    seq_len = c.select_slider("Sequence length", [16, 32, 64, 128], 64, key=f"{P}_seq")
    threads = d.number_input("CPU threads", 1, 8, 1, key=f"{P}_threads")
    a, b = st.columns([1, 2])
    tokenizer = a.radio("Tokenizer", ["wordpiece", "byte"], horizontal=True, key=f"{P}_tokenizer")
    with b:
        corpus = st.file_uploader(
            "Corpus (.txt; default: the King James Bible)",
            key=f"{P}_corpus",
            max_upload_size=50,
        )
    submitted = st.form_submit_button("Start training", type="primary")

if submitted:
    layers = [v.strip() for v in per_layer.split(",") if v.strip()] or variant
    config = runs.make_config(
        name,
        kind=kind,
        variant=layers,
        n_layers=n_layers,
        n_heads=n_heads,
        d_model=d_model,
        steps=steps,
        batch_size=batch,
        seq_len=seq_len,
        threads=threads,
        tokenizer=tokenizer,
    )
    try:
        started = runs.start(name.strip(), config, (corpus.name, corpus.getvalue()) if corpus else None)
        st.session_state[f"{P}_run"] = started.name
    except ValueError as e:
        st.error(str(e))

all_runs = {r.name: r for r in runs.list_runs()}
if not all_runs:
    st.info("No runs yet: start one above.")
    st.stop()
if st.session_state.get(f"{P}_run") not in all_runs:
    st.session_state[f"{P}_run"] = next(iter(all_runs))
chosen = st.selectbox(
    "Run", list(all_runs), key=f"{P}_run", format_func=lambda n: f"{n} — {all_runs[n].status}"
)


# A fragment's id is its function's name + place, and every page runs as __main__: named per page,
# so another page's timer cannot rerun it (and it stops polling once the run has ended: issue 30).
@st.fragment(run_every=2.0 if all_runs[chosen].active else None)
def train_live(run_dir):
    run = runs.inspect(run_dir)
    if run.status != all_runs[chosen].status:
        st.rerun()  # it ended (redraw without polling), started or resumed: the picker says as the bar
    st.progress(
        min(1.0, run.logged_step / max(run.steps, 1)),
        text=f"**{run.status}** — step {run.logged_step} of {run.steps} (checkpoint at step {run.step})",
    )
    stop_col, resume_col, _ = st.columns([1, 1, 4])
    if stop_col.button("Stop", key=f"{P}_stop", disabled=not run.active):
        runs.stop(run)
        st.rerun()
    if resume_col.button("Resume", key=f"{P}_resume", disabled=run.active or run.status == "finished"):
        try:
            runs.resume(run)
        except ValueError as e:
            st.error(str(e))
        else:
            st.rerun()
    if run.status == "failed":
        st.error("The run failed; the end of its log:")
        st.code(run.log_tail(), language="text")
    records = run.records()
    if not records:
        st.info("Waiting for the first metrics (loading the corpus and building the tokenizer)…")
        return
    last = records[-1]
    cols = st.columns(3)
    cols[0].metric("loss", f"{last['loss']:.3f}" if last.get("loss") is not None else "–")
    evals = [r for r in records if r.get("eval_loss") is not None]
    cols[1].metric("eval loss", f"{evals[-1]['eval_loss']:.3f}" if evals else "–")
    cols[2].metric("tokens/s", f"{last.get('tokens_per_s', 0):,.0f}")
    manifest = {
        "run": str(run.dir),
        "metrics": str(run.dir / "metrics.jsonl"),
        "config": str(run.dir / runs.CONFIG),
    }
    left, right = st.columns(2)
    with left:
        show_bundle(P, "loss", app_views.training_curves(records, title=f"{run.name}: loss"), manifest)
    with right:
        show_bundle(
            P, "u", app_views.hybrid_weight_curves(records, title=f"{run.name}: hybrid weight u"), manifest
        )


train_live(all_runs[chosen].dir)
