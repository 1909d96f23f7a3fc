"""``attnlab analyze`` beyond weights: --contributions, --sinks, --flow, --interventions, --faithfulness
(files in the output folder and the manifest; worded errors with nothing left behind)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from attnlab import VARIANTS, beyond_cli, contributions, sinks
from attnlab.cli import main

TEXT = "Attention that does not explain away. Every key keeps a share!"


def _run(argv, capsys) -> tuple[int, str]:
    rc = main(["analyze", *map(str, argv)])
    return rc, capsys.readouterr().err


def _src(tmp_path: Path, text: str = TEXT) -> Path:
    src = tmp_path / "text.txt"
    src.write_text(text, encoding="utf-8")
    return src


@pytest.mark.slow
def test_every_beyond_output_is_written_and_listed(tmp_path, capsys, tiny_model_dir):
    out = tmp_path / "out"
    rc, err = _run(
        [
            _src(tmp_path),
            "--model",
            tiny_model_dir("bert"),
            "--out",
            out,
            "--quiet",
            "--formats",
            "none",
            "--variants",
            ",".join(VARIANTS),
            "--contributions",
            "--sinks",
            "--flow",
            "--flow-outputs",
            "0,3",
            "--interventions",
            "dnas",
            "--faithfulness",
        ],
        capsys,
    )
    assert rc == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    files = set(manifest["files"])
    assert {"sinks.csv", "flow.npz", "interventions.csv", "faithfulness.csv", "sink_rate.csv",
            "sink_importance.csv", "massive_activations.csv"} <= files
    assert {
        f"figures/{n}.html" for n in ("contributions", "sinks", "flow", "interventions", "faithfulness")
    } <= files
    assert all((out / f).exists() for f in files)
    assert manifest["settings"]["beyond"] == {
        "contributions": True,
        "sinks": "first+special",
        "sink_eps": 0.3,
        "flow_outputs": [0, 3],
        "interventions": "dnas",
        "faithfulness": True,
        "window_index": 0,
    }
    stats_ = pd.read_csv(out / "statistics.csv")
    assert set(contributions.CONTRIBUTION_STATISTICS) <= set(stats_.statistic)
    sink_rows = pd.read_csv(out / "sinks.csv")
    assert set(sink_rows.statistic) == set(sinks.SINK_STATISTICS) and set(sink_rows.variant) == set(VARIANTS)
    flows = np.load(out / "flow.npz")
    assert flows["outputs"].tolist() == [0, 3] and flows["dnas"].shape == (2, len(flows["tokens"]))
    iv = pd.read_csv(out / "interventions.csv")
    assert len(iv) == 2 * 4 * 2 and set(iv.measure) == {"hidden_cosine", "pooled_cosine"}
    fa = pd.read_csv(out / "faithfulness.csv")
    assert set(fa.variant) == set(VARIANTS)


def test_sink_choices_match_the_library():
    assert beyond_cli.SINK_CHOICES == sinks.SINK_CHOICES


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--flow"], "over attnlab.flow.MAX_FLOW_WORK"),  # 512-token window, every output
        (["--flow", "--flow-outputs", "0,x"], "comma-separated integers"),
        (["--flow-outputs", "1"], "needs --flow"),
        (["--flow", "--flow-outputs", "999"], "must be positions in"),
        (["--interventions", "softmax"], "--interventions must be one of"),
        (["--interventions", "dnas", "--window-index", "2"], "--window-index must be in [0, 1]: the text"),
        (["--faithfulness", "--window-index", "-1"], "--window-index must be >= 0"),
    ],
)
def test_bad_beyond_flags_fail_with_a_message_and_leave_nothing(tmp_path, capsys, minilm, extra, message):
    out = tmp_path / "out"
    long_text = " ".join(["Attention that does not explain away."] * 80)
    rc, err = _run([_src(tmp_path, long_text), "--out", out, "--quiet", "--no-figures", *extra], capsys)
    assert rc == 2 and message in err, err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_interventions_on_a_causal_model_without_lm_head_is_refused(tmp_path, capsys, tiny_model_dir):
    # the tiny LLaMA was saved without LM head weights and does not tie them (GPT-2 would: that is fine)
    out = tmp_path / "out"
    rc, err = _run(
        [
            _src(tmp_path),
            "--model",
            tiny_model_dir("llama"),
            "--out",
            out,
            "--quiet",
            "--no-figures",
            "--interventions",
            "dnas",
        ],
        capsys,
    )
    assert rc == 2 and "no LM head" in err, err
    assert not out.exists()


@pytest.mark.slow
def test_window_index_picks_the_window_flow_interventions_and_faithfulness_describe(
    tmp_path, capsys, tiny_model_dir
):
    from attnlab import flow, hf

    text = " ".join([TEXT] * 12)  # several 64-token windows of the tiny model
    model = tiny_model_dir("bert")
    out = tmp_path / "out"
    argv = [_src(tmp_path, text), "--model", model, "--out", out, "--quiet", "--formats", "none",
            "--variants", "unas,dnas", "--flow", "--flow-outputs", "0,2", "--interventions", "dnas",
            "--faithfulness", "--window-index", "1"]
    rc, err = _run(argv, capsys)
    assert rc == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["settings"]["beyond"]["window_index"] == 1
    assert any("describe window 1 only" in n for n in manifest["notes"])
    window = hf.stream_analysis(text, hf.load_model(model), ("unas", "dnas")).window(1)
    flows = np.load(out / "flow.npz")
    assert int(flows["window"]) == 1 and flows["tokens"].tolist() == window.tokens
    np.testing.assert_allclose(flows["dnas"], flow.attention_flow(window.weights["dnas"], [0, 2]).numpy())
    assert set(pd.read_csv(out / "interventions.csv").window) == {1}
    assert set(pd.read_csv(out / "faithfulness.csv").window) == {1}


@pytest.mark.slow
def test_flow_and_the_other_beyond_outputs_on_a_causal_model(tmp_path, capsys, tiny_model_dir):
    # a causal window's weights are HeadMaps (computed per head on access): --flow once failed on them
    # with "weights must be a torch.Tensor, got HeadMaps"
    from attnlab import flow, hf

    model = tiny_model_dir("gpt2")
    out = tmp_path / "out"
    rc, err = _run([_src(tmp_path), "--model", model, "--out", out, "--quiet", "--formats", "none",
                    "--variants", "unas,dnas", "--flow", "--flow-outputs", "0,3", "--contributions",
                    "--sinks", "--faithfulness"], capsys)
    assert rc == 0, err
    window = hf.stream_analysis(TEXT, hf.load_model(model), ("unas", "dnas")).window(0)
    assert type(window.weights["dnas"]).__name__ == "HeadMaps"
    flows = np.load(out / "flow.npz")
    for v in ("unas", "dnas"):
        whole = window.weights[v].materialize()  # (L, H, N, N) tensor
        np.testing.assert_allclose(flows[v], flow.attention_flow(whole, [0, 3]).numpy())
    assert set(pd.read_csv(out / "faithfulness.csv").variant) == {"unas", "dnas"}
