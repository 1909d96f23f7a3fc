"""The live panel of a background corpus job (the Corpus and Swap cost pages): its progress bar, Stop and
Resume, the end of its log when it failed, and its result when it finished. Each page calls it from its
own ``st.fragment`` (a fragment's id is its function's name and place, every page runs as __main__: the
fragment is named per page, so another page's timer cannot rerun it)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import streamlit as st

from appkit import corpus_runs


def run_panel(run_dir: Path, kind: str, shown_status: str, prefix: str, show_finished: Callable) -> None:
    """Draw the panel of the run in ``run_dir`` (``kind``: a key of corpus_runs.KINDS); ``shown_status``
    is the status the page's picker shows (a change reruns the page, so both agree); ``show_finished(run)``
    draws a finished run's result."""
    run = corpus_runs.inspect(run_dir, kind)
    if run.status != shown_status:
        st.rerun()  # it ended (redraw without polling) or started: the picker says the same as the bar
    st.progress(*corpus_runs.progress_line(run))
    a, b, _ = st.columns([1, 1, 4])
    if a.button("Stop", key=f"{prefix}_stop", disabled=not run.active):
        corpus_runs.stop(run)
        st.rerun()
    if b.button("Resume", key=f"{prefix}_resume", disabled=run.active or run.status == "finished"):
        corpus_runs.resume(run)
        st.rerun()
    if run.status == "failed":
        st.error("The run failed; the end of its log:")
        st.code(run.log_tail(), language="text")
    if run.status == "finished":
        show_finished(run)
