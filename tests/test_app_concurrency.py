"""Concurrent users (issue 6, item 3): 8 app sessions analysing different texts at the same time get
their own results, through one shared copy of the model."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest
from test_app import APP, TIMEOUT, app_env, views  # noqa: F401 (app_env is a fixture)

from attnlab import hf

WORDS = ["harbor", "violin", "glacier", "lantern", "meadow", "compass", "orchard", "thunder"]


def _text(i: int) -> str:
    return f"Session {i} writes about the {WORDS[i]}, and nothing else: the {WORDS[i]} is the topic here."


@pytest.fixture
def one_runtime(monkeypatch):
    """One Streamlit runtime for every AppTest of the test, as one server has. AppTest sets the
    runtime singleton (a mock) when a run starts and clears it when the run ends, so eight runs at
    once cleared it under each other ("Runtime hasn't been created!" where a page mounts a custom
    component, which looks its registry up there). Here the first run's runtime stays until the end."""
    from streamlit.runtime import Runtime
    from streamlit.testing.v1 import app_test

    class _KeepFirst(type):
        def __setattr__(cls, name, value):
            if name == "_instance" and value is not None and Runtime._instance is None:
                Runtime._instance = value

    monkeypatch.setattr(app_test, "Runtime", _KeepFirst("OneRuntime", (), {}))
    yield
    Runtime._instance = None


@pytest.mark.slow
@pytest.mark.usefixtures("app_env", "one_runtime")
def test_eight_sessions_get_their_own_results(reliability):
    sessions = [AppTest.from_file(APP, default_timeout=TIMEOUT).run() for _ in range(8)]
    for at in sessions:
        assert not at.exception, [e.message for e in at.exception]

    def analyse(i: int):
        at = sessions[i]
        at.text_area(key="inspect_text").set_value(_text(i)).run()
        assert not at.exception, [e.message for e in at.exception]
        return views(at)["inspect_heatmap"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # all 8 script runs at once
        figures = list(pool.map(analyse, range(8)))

    model = hf.load_model(None)  # the app's cached loader and this one share the one copy
    assert hf.load_model(None) is model
    from attnlab.hf.load import loading

    embedded = [k for k in loading._CACHE if k == str(hf.default_model_path().resolve())]
    assert len(embedded) == 1  # one copy of the model for all 8 sessions
    for i, fig in enumerate(figures):
        keys = fig["tokens"]
        assert any(WORDS[i] in k for k in keys), (i, keys)
        assert not any(w in k for w in WORDS if w != WORDS[i] for k in keys), (i, keys)
        # the numbers are this text's own: layer 2, head 0 of unas (the page's defaults)
        expect = hf.analyze(_text(i), model, variants=("unas",)).weights["unas"][2, 0].numpy()
        np.testing.assert_allclose(fig["map"], expect, atol=1e-5)
    reliability(
        "8 concurrent app sessions",
        "8 AppTest sessions of the Inspect page, each with its own text, run at the same time",
        "each session shows its own tokens and exactly its own text's weights (≤ 1e-5); one loaded "
        "copy of the model serves all of them; results caches are bounded (max_entries, ttl)",
    )


@pytest.mark.slow
@pytest.mark.usefixtures("app_env")
def test_training_does_not_block_analysis_in_another_session(reliability):
    """A training run started from the app lives in its own process: while it trains, another
    session's analysis runs to the end with correct results, and the run is still training after."""
    import sys
    import time
    from pathlib import Path

    from test_app import CORPUS

    sys.path.insert(0, str(Path(APP).parent))
    from appkit import runs

    config = runs.make_config("busy", kind="encoder", variant="dnas", n_layers=1, n_heads=2, d_model=32,
                              steps=100_000, batch_size=4, seq_len=16, threads=1, tokenizer="byte")
    run = runs.start("busy", config, ("corpus.txt", CORPUS))
    try:
        t0 = time.monotonic()
        while runs.inspect(run.dir).step < 2 and time.monotonic() - t0 < 120:
            time.sleep(0.3)
        assert runs.inspect(run.dir).active, "the training run did not start"
        step_before = runs.inspect(run.dir).step
        at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
        at.text_area(key="inspect_text").set_value(_text(3)).run()
        assert not at.exception, [e.message for e in at.exception]
        keys = views(at)["inspect_heatmap"]["tokens"]
        assert any(WORDS[3] in k for k in keys)
        after = runs.inspect(run.dir)
        assert after.active and after.step >= step_before  # still training, alongside
        reliability(
            "training beside analysis",
            "a training run started from the app's Train page, then another session analyses a text",
            f"the analysis completed with its own results while the run kept training (step "
            f"{step_before} → {after.step}, its own process)",
        )
    finally:
        runs.stop(runs.inspect(run.dir))
