"""The app's Swap cost page: `attnlab swap-eval` started in the background from the page
(appkit.corpus_runs, kind "swap-eval"), its progress, and the finished run's figures."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from conftest import CORPUS
from test_lm_loss import build_lm

pytest.importorskip("streamlit.testing.v1")
from streamlit.testing.v1 import AppTest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
APP = str(REPO / "app" / "streamlit_app.py")
sys.path.insert(0, str(REPO / "app"))


@pytest.fixture
def runs_env(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNLAB_DEBUG", "1")
    monkeypatch.setenv("ATTNLAB_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("ATTNLAB_UPLOADS_DIR", str(tmp_path / "uploads"))
    return tmp_path


def test_the_command_is_attnlab_swap_eval_with_the_forms_settings(tmp_path):
    from appkit import corpus_runs

    config = {"model": "/m", "variants": ["dnas", "softmax1"], "layers": "each,all", "window": 64,
              "max_docs": None, "shard_docs": 2}
    cmd = corpus_runs.swap_command(tmp_path, config, "kjv")
    assert cmd[1:4] == ["-m", "attnlab.cli", "swap-eval"]
    i = cmd.index("--quiet")  # a flag without a value: the others are pairs around it
    pairs = dict(zip(cmd[4:i:2], cmd[5:i:2], strict=True))
    pairs |= dict(zip(cmd[i + 1::2], cmd[i + 2::2], strict=True))
    assert pairs == {"--model": "/m", "--corpus": "kjv", "--out": str(tmp_path / "result"),
                     "--text-column": "text", "--variants": "dnas,softmax1", "--layers": "each,all",
                     "--window": "64", "--shard-docs": "2"}
    import argparse

    from attnlab.swap_eval.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(cmd[4:])  # the CLI takes every flag the page writes
    assert args.layers == "each,all" and args.window == 64 and args.quiet


def test_start_refuses_a_folder_without_a_model(runs_env):
    from appkit import corpus_runs

    for model in ("", str(runs_env / "nowhere")):
        with pytest.raises(ValueError, match="a local model directory with a config.json and an LM head"):
            corpus_runs.start("s", {"model": model}, kind="swap-eval")
    root = corpus_runs.corpus_dir("swap-eval")
    assert not root.exists() or not any(root.iterdir())  # nothing created


def _page() -> AppTest:
    at = AppTest.from_file(APP, default_timeout=240).run()
    at.switch_page("app_pages/swap_cost.py").run()
    assert not at.exception, [e.message for e in at.exception]
    return at


@pytest.mark.slow  # a background `attnlab swap-eval` on a tiny GPT-2: ~1 min on a shared 2-core machine
def test_page_runs_swap_eval_in_the_background_and_shows_its_figures(runs_env):
    from appkit import corpus_runs

    model = build_lm("gpt2", runs_env / "gpt2")
    docs = runs_env / "docs"
    docs.mkdir()
    for i in range(3):
        (docs / f"{i}.txt").write_text(" ".join(CORPUS[i:] + CORPUS[:i]))
    at = _page()
    assert any("No swap-eval runs yet" in i.value for i in at.info)
    at.text_input(key="swap_name").set_value("tiny")
    at.text_input(key="swap_model").set_value(str(model))
    at.radio(key="swap_kind").set_value("Server path")
    at.text_input(key="swap_path").set_value(str(docs))
    at.multiselect(key="swap_variants").set_value(["dnas"])
    at.selectbox(key="swap_layers").set_value("Both")
    at.number_input(key="swap_shard_docs").set_value(1)
    at.get("form_submit_button")[0].click()
    at.run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert at.selectbox(key="swap_run").value == "tiny"
    run_dir = corpus_runs.corpus_dir("swap-eval") / "tiny"
    t0 = time.monotonic()
    while corpus_runs.inspect(run_dir, "swap-eval").active and time.monotonic() - t0 < 600:
        time.sleep(0.5)
    run = corpus_runs.inspect(run_dir, "swap-eval")
    assert run.status == "finished", run.log_tail()
    at = _page()  # a new session draws the finished run
    assert "finished" in at.get("progress")[0].proto.text
    assert {"swap_run_delta", "swap_run_position"} <= {c.key for c in at.get("plotly_chart")}
    at.text_input(key="swap_folder").input(str(run.result)).run()
    assert {"swap_folder_delta", "swap_folder_position"} <= {c.key for c in at.get("plotly_chart")}
    at.text_input(key="swap_folder").input(str(docs)).run()
    assert any("is not a finished swap-eval run" in e.value for e in at.error)
