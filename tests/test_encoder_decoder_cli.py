"""``attnlab analyze FILE --model DIR --target TEXT|FILE`` on a tiny random BART: statistics with a
``kind`` column, the cross-attention column masses with their floors, weights and figures per kind
(the cross map target rows x source columns), and worded refusals (exit status 2)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from conftest import build_tiny_model
from test_analyze_cli import _plotly_figure, _run, _z

SOURCE = "Attention lets every word look at every other word."
TARGET = "A key that no query wants is explained away."


@pytest.fixture(scope="module")
def bart_dir(tmp_path_factory):
    return build_tiny_model("bart", tmp_path_factory.mktemp("cli-bart"), scale=0.3)


def test_outputs_per_kind(tmp_path, capsys, bart_dir, monkeypatch):
    import attnlab.figures.export as export

    monkeypatch.setattr(export, "chromium_available", lambda: False)
    src = tmp_path / "source.txt"
    src.write_text(SOURCE, encoding="utf-8")
    out = tmp_path / "out"
    rc, err = _run([src, "--model", bart_dir, "--target", TARGET, "--out", out,
                    "--variants", "unas,dnas,hnas", "--u", "0.4", "--formats", "none"], capsys)
    assert rc == 0, err
    assert "encoder, decoder and cross attention" in err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"]["encoder_decoder"]
    assert manifest["settings"]["kinds"] == ["encoder", "decoder", "cross"]
    files = {p.name for p in out.iterdir()} - {"figures"}
    files |= {f"figures/{p.name}" for p in (out / "figures").iterdir()}
    assert set(manifest["files"]) == files
    table = pd.read_csv(out / "statistics.csv")
    assert list(table.columns[:2]) == ["kind", "variant"]
    assert set(table.kind) == {"encoder", "decoder", "cross"}
    tokens = json.loads((out / "tokens.json").read_text())
    N, M = len(tokens["source"]["tokens"]), len(tokens["target"]["tokens"])
    mass = pd.read_csv(out / "column_mass.csv")
    assert set(mass.kind) == {"cross"} and len(mass) == 3 * 2 * 4 * N
    hnas = mass[mass.variant == "hnas"]
    assert np.allclose(hnas.floor, 0.4 / N) and (hnas.column_mass >= hnas.floor * (1 - 1e-4)).all()
    assert np.allclose(mass[mass.variant == "dnas"].floor, 1 / N)
    assert (mass[mass.variant == "unas"].floor == 0).all()
    with np.load(out / "weights.npz") as npz:
        assert npz["cross.dnas"].shape == (2, 4, M, N) and npz["decoder.unas"].shape == (2, 4, M, M)
        assert [str(t) for t in npz["target_tokens"]] == tokens["target"]["tokens"]
        cross = npz["cross.unas"][0, 0]
    names = {p.name for p in (out / "figures").iterdir()}
    for kind in ("encoder", "decoder", "cross"):
        assert {f"grid_{kind}_dnas.html", f"column_mass_{kind}.html", f"explained_away_{kind}.html",
                f"heatmap_{kind}_unas_layer0_head0.html"} <= names
    data, _ = _plotly_figure((out / "figures" / "heatmap_cross_unas_layer0_head0.html").read_text())
    np.testing.assert_array_equal(_z(data[0]), cross)  # rectangular: M target rows x N source columns


def test_target_from_a_file_equals_the_text(tmp_path, capsys, bart_dir):
    src, tgt = tmp_path / "source.txt", tmp_path / "target.txt"
    src.write_text(SOURCE, encoding="utf-8")
    tgt.write_text(TARGET, encoding="utf-8")
    for name, target in (("a", TARGET), ("b", tgt)):
        rc, err = _run([src, "--model", bart_dir, "--target", target, "--out", tmp_path / name,
                        "--variants", "dnas", "--no-figures", "--quiet"], capsys)
        assert rc == 0, err
    a, b = (pd.read_csv(tmp_path / name / "statistics.csv") for name in "ab")
    assert a.equals(b)


def test_bad_targets_are_refused_with_exit_status_2(tmp_path, capsys, bart_dir, minilm):
    src = tmp_path / "source.txt"
    src.write_text(SOURCE, encoding="utf-8")
    cases = [
        (["--model", bart_dir, "--target", " "], "target is empty"),
        (["--model", bart_dir, "--target", "word " * 100], "target is too long"),
        (["--target", TARGET], "target is for encoder-decoder models"),  # the embedded MiniLM
        (["--model", bart_dir, "--target", TARGET, "--contributions"], "expected none of them"),
        (["--model", bart_dir, "--target", TARGET, "--window", "16"], "window: an encoder-decoder"),
    ]
    for i, (argv, words) in enumerate(cases):
        out = tmp_path / f"out{i}"
        rc, err = _run([src, *argv, "--out", out, "--no-figures", "--quiet"], capsys)
        assert rc == 2 and words in err, (argv[-2:], err)
        assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
