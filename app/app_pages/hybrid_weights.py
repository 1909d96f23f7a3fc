"""Hybrid weights: HNAS's per-layer u = sigmoid(θ) over training steps (live while a run trains) and
the final u per layer and head, from a checkpoint or a metrics log (u = 1 is DNAS, u = 0 UNAS)."""


import numpy as np
import streamlit as st
from appkit import runs
from appkit.show import show_bundle
from appkit.sources import CHECKPOINTS

from attnlab.figures import app_views
from attnlab.train.checkpoint import CheckpointError
from attnlab.train.config import recipe_file_kind
from attnlab.train.retrofit import is_retrofit_run, retrofit_hybrid_weights

P = "hybrid"
UPLOAD = "Upload a metrics.jsonl…"

st.title("Hybrid weights")
st.caption(
    "HNAS mixes u·DNAS + (1−u)·UNAS per head, u = sigmoid(θ) learned from θ₀ = 0 (u₀ = 0.5). The "
    "paper reports u above 0.5 in every layer, with more UNAS near the output. Runs of `attnlab train "
    "--recipe retrofit-hnas --out runs/NAME` (HNAS learned on a frozen pretrained model), of "
    "`--recipe s2s-hnas` (HNAS in an encoder-decoder's encoder) and runs of "
    "`attnlab train --out runs/GROUP/NAME` started from a shell are listed too; seeds of one recipe "
    "(NAME-s0, NAME-s1, …) are drawn together with a 95 % CI band."
)

sources = {f"{p.name} (shipped)": p for p in sorted(CHECKPOINTS.glob("*")) if (p / "metrics.jsonl").is_file()}
sources |= {f"{r.name} (run, {r.status})": r.dir for r in runs.list_runs()}
# a retrofit of a pretrained model, or HNAS in an encoder-decoder's encoder (recipe s2s-hnas)
KIND_LABEL = {"retrofit-hnas": "retrofit", "s2s-hnas": "seq2seq encoder"}
retrofits, command_line = runs.recipe_runs()  # one scan of the runs folder
for r in retrofits:
    kind = KIND_LABEL.get(recipe_file_kind(r.dir / "recipe.json"), "retrofit")
    sources[f"{r.dir.relative_to(runs.runs_dir())} ({kind}, {r.status})"] = r.dir
sources |= {f"{r.dir.relative_to(runs.runs_dir())} (command-line run, {r.status})": r.dir
            for r in command_line}
options = [*sources, UPLOAD]
choice = st.selectbox(
    "Run or checkpoint",
    options,
    key=f"{P}_source",
    index=next((i for i, k in enumerate(options) if "hnas" in k), 0),
)
if choice == UPLOAD:
    upload = st.file_uploader(
        "metrics.jsonl written by attnlab train",
        key=f"{P}_upload",
        max_upload_size=50,
    )
    if upload is not None and not upload.name.endswith((".jsonl", ".json")):
        st.error(f"{upload.name} is not a metrics log: upload the metrics.jsonl of a run.")
        st.stop()
    if upload is None:
        st.info("Upload the metrics.jsonl of a run (one JSON object per line, with a 'u' field).")
        st.stop()
    from attnlab.train import parse_metrics

    records = parse_metrics(upload.getvalue().decode("utf-8", errors="replace"))
    run_dir, active, retrofit = None, False, False
else:
    run_dir = sources[choice]
    retrofit = is_retrofit_run(run_dir)
    active = runs.inspect(run_dir).active if (run_dir / runs.CONFIG).is_file() or retrofit else False


def final_u(run_dir, records):
    """(L, H) u of the latest checkpoint (attnlab.models.load; a retrofit's theta), else of the last
    logged step."""
    if retrofit and (run_dir / "latest.json").is_file():
        try:
            u, step = retrofit_hybrid_weights(run_dir)
            return u.numpy(), f"checkpoint of step {step}"
        except (OSError, ValueError, CheckpointError) as e:
            st.warning(f"The checkpoint does not load ({e}); using the metrics log.")
    elif run_dir is not None and (run_dir / "latest.json").is_file():
        from attnlab.models import load

        try:
            return load(run_dir).hybrid_weights().numpy(), "latest checkpoint"
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            st.warning(f"The checkpoint does not load ({e}); using the metrics log.")
    with_u = [r for r in records if r.get("u") is not None]
    return (
        (np.array(with_u[-1]["u"], dtype=float), f"step {with_u[-1]['step']} of the log")
        if with_u
        else (None, "")
    )


# A fragment's id is its function's name + place, and every page runs as __main__: named per page.
# It polls only while the run trains, and redraws the page without polling once the run has ended (it
# polled on every 3 s until the page was left, and one refresh landing after a page change blanked it).
@st.fragment(run_every=3.0 if active else None)
def hybrid_live():
    from attnlab.train import read_metrics

    if active and not runs.inspect(run_dir).active:
        st.rerun()
    recs = read_metrics(run_dir / "metrics.jsonl") if run_dir is not None else records
    if not any(r.get("u") is not None for r in recs):
        st.warning("This log has no hybrid weights (no 'u' field); pick an HNAS run.")
        return
    if active:
        st.caption(f"Live: step {recs[-1]['step']} (refreshes every 3 s).")
    manifest = {"metrics": str(run_dir / "metrics.jsonl") if run_dir else "uploaded"}
    show_bundle(P, "u_curves", app_views.hybrid_weight_curves(recs), manifest)
    u, where = final_u(run_dir, recs)
    if u is not None:
        if np.isnan(u).all() or ((u == 0) | (u == 1)).all():
            st.info("No HNAS layer here: u is fixed (0 = UNAS, 1 = DNAS, blank = Sinkhorn).")
        show_bundle(
            P,
            "u_final",
            app_views.hybrid_weight_heatmap(u, title=f"u per layer and head ({where})"),
            manifest,
        )


hybrid_live()

# Seeds of one recipe (runs named NAME-s0, NAME-s1, ...: the shipped enc8-hnas-s*, app runs, retrofits)
# together: per layer the mean over seeds of u (mean over heads) with its 95 % CI band.
seeds = runs.seed_siblings(choice, sources) if choice != UPLOAD else {}
if len(seeds) >= 2:
    st.subheader("Seeds of this recipe together")
    shown = st.multiselect("Seeds shown", list(seeds), default=list(seeds), key=f"{P}_seeds")
    if len(shown) >= 2:
        from attnlab.figures.training import seed_band
        from attnlab.train import read_metrics

        per_seed = {name: read_metrics(seeds[name] / "metrics.jsonl") for name in shown}
        try:
            show_bundle(P, "seed_band", seed_band(per_seed),
                        {"metrics": [str(seeds[n] / "metrics.jsonl") for n in shown]})
        except ValueError as e:
            st.warning(f"These runs cannot be shown together: {e}")
    else:
        st.caption("Choose at least two seeds for the band.")
