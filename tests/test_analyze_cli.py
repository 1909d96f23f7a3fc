"""``attnlab analyze``: readable outputs, windows, figures, and clean failures on bad input."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import CORPUS

from attnlab import analyze_outputs
from attnlab.cli import main

REPO = Path(__file__).resolve().parents[1]
TEXT = "Attention that does not explain away. Every key keeps a share of the attention!"


def _run(argv, capsys) -> tuple[int, str]:
    rc = main(["analyze", *map(str, argv)])
    err = capsys.readouterr().err
    return rc, err


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


@pytest.mark.slow  # ~1 s: .ci/run runs it, the inner loop does not
def test_writes_readable_statistics_weights_tokens_and_manifest(tmp_path, capsys, minilm):
    src = tmp_path / "text.txt"
    src.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "out"
    rc, err = _run([src, "--out", out, "--variants", "unas,dnas", "--no-figures", "--quiet"], capsys)
    assert rc == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"]["name"] == minilm.info.name
    assert manifest["settings"]["variants"] == ["unas", "dnas"]
    assert manifest["settings"]["mode"] == "recompute"
    assert manifest["input"]["sha256"] == hashlib.sha256(TEXT.encode()).hexdigest()
    assert manifest["windowing"]["n_windows"] == 1
    assert set(manifest["files"]) == {p.name for p in out.iterdir()}
    assert "attnlab_version" in manifest
    assert manifest["settings"]["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")  # auto

    table = pd.read_csv(out / "statistics.csv")
    assert {"variant", "layer", "head", "statistic", "value", "window"} <= set(table.columns)
    assert (
        set(table.variant) == {"unas", "dnas"}
        and len(table) == table.groupby(["variant", "layer", "head", "statistic"]).ngroups
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary and {"variant", "statistic", "value", "std", "n_windows"} <= set(summary[0])
    assert len(pd.read_csv(out / "summary.csv")) == len(summary)

    tokens = json.loads((out / "tokens.json").read_text())["windows"][0]
    with np.load(out / "weights.npz") as npz:
        assert list(npz["tokens"]) == tokens["tokens"]
        n = len(tokens["tokens"])
        assert npz["dnas"].shape == (6, 12, n, n) and npz["unas"].dtype == np.float32
        np.testing.assert_allclose(npz["dnas"].sum(-1), 1.0, atol=1e-5)
        assert (npz["dnas"].sum(-2) >= (1 - 1e-4) / n).all()
    assert _leftovers(tmp_path) == []


def _plotly_figure(html: str) -> tuple[list[dict], dict]:
    """(data, layout) of the figure in a plotly HTML file: the JSON arguments of Plotly.newPlot."""
    decoder, i, args = json.JSONDecoder(), html.index("Plotly.newPlot(") + len("Plotly.newPlot("), []
    for _ in range(3):  # div id, data, layout
        while html[i] in " \n\t,":
            i += 1
        obj, i = decoder.raw_decode(html, i)
        args.append(obj)
    return args[1], args[2]


def _z(trace: dict) -> np.ndarray:
    z = trace["z"]  # plotly writes numpy arrays as base64 typed arrays
    if isinstance(z, dict):
        shape = [int(n) for n in z["shape"].split(",")]
        return np.frombuffer(base64.b64decode(z["bdata"]), dtype=np.dtype(z["dtype"])).reshape(shape)
    return np.asarray(z, dtype=float)


def test_html_figures_and_a_note_without_chromium(tmp_path, capsys, minilm, monkeypatch):
    import attnlab.figures.export as export

    monkeypatch.setattr(export, "chromium_available", lambda: False)
    src = tmp_path / "text.txt"
    src.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "out"
    rc, err = _run([src, "--out", out, "--variants", "dnas,hnas", "--formats", "png"], capsys)
    assert rc == 0, err
    assert "note: figures: HTML only, no PNG" in err and "Chromium" in err
    names = {p.name for p in (out / "figures").iterdir()}
    assert {"grid_dnas.html", "grid_hnas.html", "explained_away.html", "column_mass.html"} <= names
    assert "plotly.min.js" in names and not any(n.endswith(".png") for n in names)
    html = (out / "figures" / "column_mass.html").read_text()
    assert 'src="plotly.min.js"' in html and "DNAS floor" in html
    data, layout = _plotly_figure((out / "figures" / "grid_dnas.html").read_text())
    with np.load(out / "weights.npz") as npz:
        w, tokens = npz["dnas"], [str(t) for t in npz["tokens"]]
    L, H, N, _ = w.shape
    assert len(data) == 1 and data[0]["type"] == "heatmap"  # the whole grid is one trace
    z = np.pad(_z(data[0]), ((0, 1), (0, 1)), constant_values=np.nan).reshape(L, N + 1, H, N + 1)
    np.testing.assert_array_equal(z[:, :N, :, :N].transpose(0, 2, 1, 3), w)  # each tile = one map
    assert data[0]["x"][N + 1 + 2] == f"head 1 · key 2 {tokens[2]!r}"
    assert [a["text"] for a in layout["annotations"]] == [f"head {h}" for h in range(H)] + [
        f"layer {layer}" for layer in range(L)
    ]
    assert layout["title"]["text"].startswith("dnas: attention weights by layer and head")
    manifest = json.loads((out / "manifest.json").read_text())
    assert any("Chromium" in note for note in manifest["notes"])


@pytest.mark.slow  # ~1 s: .ci/run runs it, the inner loop does not
def test_long_text_windows_with_weights_per_window(tmp_path, capsys, tiny_model_dir):
    src = tmp_path / "long.txt"
    src.write_text(" ".join(CORPUS * 5), encoding="utf-8")
    out = tmp_path / "out"
    argv = [src, "--model", tiny_model_dir("gpt2"), "--out", out, "--weights", "all", "--no-figures"]
    # one causal rule everywhere (the spec's): iters > 1 asked of a causal model is refused, worded
    rc, err = _run([*argv, "--mode", "swap", "--iters", "5"], capsys)
    assert rc == 2 and "iters must be 1 for causal sinkhorn (got iters=5)" in err
    rc, err = _run([*argv, "--mode", "swap"], capsys)
    assert rc == 0, err
    assert "analysing" in err  # the progress bar
    manifest = json.loads((out / "manifest.json").read_text())
    n_windows = manifest["windowing"]["n_windows"]
    assert n_windows > 2 and len(list((out / "weights").glob("window_*.npz"))) == n_windows
    assert manifest["settings"]["iters"] == 1 and manifest["settings"]["iters_requested"] is None
    assert any("causal" in note for note in manifest["notes"])
    table = pd.read_csv(out / "statistics.csv")
    assert sorted(table.window.unique()) == list(range(n_windows))
    summary = pd.read_csv(out / "summary.csv")
    assert (summary.n_windows == n_windows).all()
    windows = json.loads((out / "tokens.json").read_text())["windows"]
    assert [w["start"] for w in windows] == manifest["windowing"]["starts"]


def test_multi_window_text_saves_no_weights_by_default(tmp_path, capsys, tiny_model_dir):
    src = tmp_path / "long.txt"
    src.write_text(" ".join(CORPUS * 3), encoding="utf-8")
    out = tmp_path / "out"
    rc, err = _run([src, "--model", tiny_model_dir("bert"), "--out", out, "--no-figures"], capsys)
    assert rc == 0, err
    assert not (out / "weights.npz").exists() and not (out / "weights").exists()
    assert "weights were not saved" in err


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[list, str]]:
    d = tmp_path / "in"
    d.mkdir()
    (d / "empty.txt").write_text("")
    (d / "blank.txt").write_text("  \n\t \n")
    (d / "binary.txt").write_bytes(b"PK\x03\x04\x00\x00binary")
    (d / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    with open(d / "huge.txt", "wb") as f:
        f.truncate(50_000_001)  # a 50 MB (sparse) file: refused before it is read
    (d / "ok.txt").write_text(TEXT)
    (d / "notamodel").mkdir()
    (d / "notamodel" / "weights.txt").write_text("x")
    (d / "exists").mkdir()
    ok = d / "ok.txt"
    return {
        "empty": ([d / "empty.txt"], "empty"),
        "whitespace": ([d / "blank.txt"], "empty"),
        "binary": ([d / "binary.txt"], "binary"),
        "non-utf8": ([d / "latin1.txt"], "not valid UTF-8"),
        "too large": ([d / "huge.txt"], "over the 20 MB limit"),
        "missing": ([d / "missing.txt"], "does not exist"),
        "not a model": ([ok, "--model", d / "notamodel"], "not a model directory"),
        "missing model": ([ok, "--model", d / "nope"], "does not exist"),
        "variant": ([ok, "--variants", "unas,softmax"], "--variants"),
        "u": ([ok, "--u", "2"], "--u"),
        "existing out": ([ok, "--out", d / "exists"], "already exists"),
        "device": ([ok, "--device", "tpu"], "--device must be"),
        **({} if torch.cuda.is_available() else
           {"no cuda": ([ok, "--device", "cuda"], "--device='cuda' asks for CUDA")}),
    }


def test_bad_input_fails_cleanly_with_exit_status_2(tmp_path, capsys, minilm):
    for name, (argv, message) in _bad_inputs(tmp_path).items():
        out = tmp_path / f"out-{name.replace(' ', '-')}"
        if "--out" not in argv:
            argv = [*argv, "--out", out]
        rc, err = _run([*argv, "--no-figures"], capsys)
        assert rc == 2, name
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("attnlab analyze: error:"), (name, err)
        assert message in err, (name, err)
        assert "Traceback" not in err
        assert not out.exists(), name
    assert _leftovers(tmp_path) == []


def test_failure_while_writing_leaves_no_output_directory(tmp_path, capsys, minilm, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("figure builder exploded")

    monkeypatch.setattr(analyze_outputs, "figures_of", broken)
    src = tmp_path / "text.txt"
    src.write_text(TEXT)
    out = tmp_path / "out"
    rc, err = _run([src, "--out", out, "--variants", "dnas", "--quiet"], capsys)
    assert rc == 2 and "figure builder exploded" in err
    assert not out.exists() and _leftovers(tmp_path) == []


def test_overwrite_replaces_the_output_directory(tmp_path, capsys, minilm):
    src = tmp_path / "text.txt"
    src.write_text(TEXT)
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    argv = [src, "--out", out, "--variants", "dnas", "--overwrite", "--no-figures", "--quiet"]
    rc, err = _run(argv, capsys)
    assert rc == 0, err
    assert not (out / "stale.txt").exists() and (out / "manifest.json").exists()
    assert _leftovers(tmp_path) == []


@pytest.mark.slow
def test_command_line_process_prints_no_traceback(tmp_path):
    src = tmp_path / "empty.txt"
    src.write_text("   ")
    proc = subprocess.run(
        [sys.executable, "-m", "attnlab.cli", "analyze", str(src), "--out", str(tmp_path / "o")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("attnlab analyze: error:") and "Traceback" not in proc.stderr


def test_u_from_a_trained_checkpoint(tmp_path, capsys, tiny_model_dir, minilm):
    import torch

    from attnlab import models

    torch.manual_seed(0)
    config = models.ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=4, variant="hnas")
    lm = models.TransformerLM(config)
    models.save(lm, tmp_path / "ckpt")
    src = tmp_path / "text.txt"
    src.write_text(TEXT)
    base = [src, "--variants", "hnas", "--no-figures", "--u-from", tmp_path / "ckpt"]
    rc, err = _run([*base, "--model", tiny_model_dir("bert"), "--out", tmp_path / "same"], capsys)
    assert rc == 0, err  # 2 layers x 4 heads, like the checkpoint: u per layer and head
    manifest = json.loads((tmp_path / "same" / "manifest.json").read_text())
    np.testing.assert_allclose(manifest["settings"]["u"], lm.hybrid_weights().numpy(), atol=1e-6)
    rc, err = _run([*base, "--out", tmp_path / "other", "--mode", "swap"], capsys)  # MiniLM: 6 x 12
    assert rc == 0, err
    assert "using its mean u" in err


def test_attnlabs_own_warnings_print_as_the_commands_notes(tmp_path, capsys, minilm, monkeypatch):
    """A warning of attnlab's own on the command line is one ``attnlab <command>: note:`` line (not
    Python's ``file:line: UserWarning:`` and the source line); another package's shows as Python shows it,
    and the handler is put back after the command."""
    import warnings

    from attnlab.cli_errors import worded_warnings
    from attnlab.hf.compute import weights

    monkeypatch.setattr(weights, "_noted", set())  # the once-per-process warning, afresh
    text = tmp_path / "t.txt"
    text.write_text(TEXT, encoding="utf-8")
    before = warnings.showwarning
    # Sinkhorn with a tolerance: no fused analysis path, a warning of attnlab.hf's
    rc, err = _run([text, "--variants", "sinkhorn", "--tol", "0.01", "--no-figures", "--out", tmp_path / "o"],
                   capsys)
    assert rc == 0 and warnings.showwarning is before
    noted = [ln for ln in err.splitlines() if "fused analysis path" in ln]
    assert len(noted) == 1 and noted[0].startswith("attnlab analyze: note: variant 'sinkhorn' has no fused "
                                                   "analysis path"), err
    assert "UserWarning" not in err and "Traceback" not in err
    with warnings.catch_warnings(record=True) as caught:  # Python's own showing, recorded
        warnings.simplefilter("always")
        with worded_warnings("corpus"):
            warnings.warn("attnlab.hf: variant 'x' has no fused analysis path;\n   its weights ...",
                          stacklevel=1)
            warnings.warn("a foreign message", DeprecationWarning, stacklevel=1)
    err = capsys.readouterr().err
    assert err == "attnlab corpus: note: variant 'x' has no fused analysis path; its weights ...\n"
    assert [(w.category, str(w.message)) for w in caught] == [(DeprecationWarning, "a foreign message")]
