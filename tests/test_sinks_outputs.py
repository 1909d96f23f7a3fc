"""Issue 32 item 4's outputs: ``attnlab analyze --sinks`` (sink_rate.csv, sink_importance.csv,
massive_activations.csv and their figures) and the corpus rows (sink_importance_first, sink_rate,
massive_*), each against a literal float64 computation on the model's own eager attention
(``output_attentions=True``) and hidden states. Tiny random causal models, seeded, offline."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from test_sinks_causal import _literal_importance  # sum_i a_ij / (N - j), a loop over keys

from attnlab.cli import main

TEXT = ("The quick brown fox jumps over the lazy dog. A sink takes the attention nobody else wants, "
        "and the first token is where it goes.")


def _eager(directory, ids: list[int]):
    """(attentions (L, H, N, N) float64, hidden states after each layer (L, N, d) float64) of one
    eager forward."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(directory, attn_implementation="eager")
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_attentions=True, output_hidden_states=True)
    return torch.stack([a[0] for a in out.attentions]).double(), out.hidden_states


def _literal_massive(h: torch.Tensor) -> dict:
    """Sun et al. 2024 on one layer's (N, d) states, in float64 with Python loops over tokens."""
    a = h.double().abs()
    top, where = -1.0, (0, 0)
    for i in range(a.shape[0]):
        j = int(a[i].argmax())
        if float(a[i, j]) > top:
            top, where = float(a[i, j]), (i, j)
    median = float(a.flatten().median())
    return {"max_abs": top, "token_index": where[0], "dim": where[1], "median_abs": median,
            "ratio": top / median}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_analyze_sinks_writes_rate_importance_and_massive_activations(arch, tiny_model_dir, tmp_path, capsys):
    from attnlab import hf

    directory = tiny_model_dir(arch)
    src = tmp_path / "text.txt"
    src.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "out"
    rc = main(["analyze", str(src), "--model", str(directory), "--out", str(out), "--quiet", "--formats",
               "none", "--variants", "unas,dnas", "--sinks", "--sink-eps", "0.2"])
    assert rc == 0, capsys.readouterr().err
    manifest = json.loads((out / "manifest.json").read_text())
    files = set(manifest["files"])
    assert {"sink_rate.csv", "sink_importance.csv", "massive_activations.csv"} <= files
    assert {"figures/sink_rate.html", "figures/sink_importance_unas.html",
            "figures/sink_importance_dnas.html", "figures/massive_activations.html"} <= files
    assert manifest["settings"]["beyond"]["sink_eps"] == 0.2

    ids = hf.stream_analysis(TEXT, hf.load_model(directory), ("unas",)).window(0).window.input_ids
    a, hidden = _eager(directory, ids)  # the model's own (softmax) attention: unas
    L, H, N, _ = a.shape
    literal = _literal_importance(a)
    imp = pd.read_csv(out / "sink_importance.csv", keep_default_na=False, na_values=[""])
    unas = imp[imp.variant == "unas"].sort_values(["layer", "head", "key"])
    n = min(16, N)
    assert len(unas) == L * H * n and set(imp.window) == {0}
    got = unas.importance.to_numpy().reshape(L, H, n)
    np.testing.assert_allclose(got, literal[..., :n].numpy(), atol=2e-6)
    rate = pd.read_csv(out / "sink_rate.csv")
    got = rate[rate.variant == "unas"].sort_values("layer")
    want = [sum(float(literal[layer, h, 0]) > 0.2 for h in range(H)) / H for layer in range(L)]
    assert got.sink_rate.tolist() == want and set(got.eps) == {0.2}
    act = pd.read_csv(out / "massive_activations.csv", keep_default_na=False, na_values=[""])
    assert act.layer.tolist() == list(range(L))
    for layer in range(L - 1):  # the last hidden state has the final norm applied; a layer's output has not
        ref = _literal_massive(hidden[layer + 1][0])
        row = act.iloc[layer]
        assert (row.token_index, row.dim) == (ref["token_index"], ref["dim"])
        for col in ("max_abs", "median_abs", "ratio"):
            assert row[col] == pytest.approx(ref[col], rel=1e-6)


def test_analyze_sink_eps_is_checked(tmp_path, capsys):
    src = tmp_path / "text.txt"
    src.write_text(TEXT, encoding="utf-8")
    for bad in ("1.5", "-0.1", "nan"):
        argv = ["analyze", str(src), "--out", str(tmp_path / "o"), "--quiet", "--sinks", "--sink-eps", bad]
        rc = main(argv)
        assert rc != 0 and "--sink-eps must be a number in [0, 1]" in capsys.readouterr().err
        assert not (tmp_path / "o").exists()


def test_sink_figures_check_their_inputs():
    from attnlab.figures import sinks as fig

    imp = np.random.default_rng(0).random((2, 3, 5))
    b = fig.importance_by_layer(imp, list("abcde"), "unas", keys=3, head=1)
    np.testing.assert_allclose(b.arrays["importance"], imp[:, 1, :3])
    assert b.figure.data[0].x == ("0: a", "1: b", "2: c")
    np.testing.assert_allclose(fig.importance_by_layer(imp, list("abcde"), "unas").arrays["importance"],
                               imp.mean(1), rtol=1e-6)
    with pytest.raises(ValueError, match="head must be None"):
        fig.importance_by_layer(imp, list("abcde"), "unas", head=3)
    with pytest.raises(ValueError, match="table must be a non-empty DataFrame"):
        fig.massive_activations_by_layer(pd.DataFrame({"layer": [0]}))
    with pytest.raises(ValueError, match="rates must be a non-empty dict"):
        fig.sink_rate_by_layer({}, 0.3)


# ----------------------------------------------------------------------------------------------
# Corpus rows (attnlab/corpus/sink_rows.py)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_corpus_sink_rows_equal_literal_float64(mode, tiny_model_dir, tmp_path):
    """sink_importance_first and sink_rate per (layer, head), massive_* per layer (head = -1) of each
    document (one window each on a causal model) against the eager attention and hidden states; the
    summary's head = -1 row of sink_rate is the layer's sink rate, and massive_* rows keep head = -1."""
    from attnlab import hf
    from attnlab.corpus import analyze_corpus
    from attnlab.corpus.sink_rows import SINK_EPS

    directory = tiny_model_dir("llama")
    docs = [TEXT, "Another document, shorter. The first token again takes what is left."]
    root = tmp_path / "docs"
    root.mkdir()
    for i, t in enumerate(docs):
        (root / f"d{i}.txt").write_text(t)
    result = analyze_corpus(str(root), str(directory), ["unas", "dnas"], mode, out=tmp_path / "run",
                            bootstrap=10)
    rows = result.table()
    loaded = hf.load_model(directory)
    for index, text in enumerate(docs):
        ids = hf.stream_analysis(text, loaded, ("unas",)).window(0).window.input_ids
        a, hidden = _eager(directory, ids)
        L, H, N, _ = a.shape
        first = _literal_importance(a)[..., 0]  # (L, H)
        mine = rows[(rows.doc_index == index) & (rows.variant == "unas")]
        mine = mine.set_index(["statistic", "layer", "head"]).value

        np.testing.assert_allclose(_grid(mine, "sink_importance_first", L, H), first.numpy(), atol=2e-6)
        assert np.array_equal(_grid(mine, "sink_rate", L, H), (first.numpy() > SINK_EPS).astype(float))
        # the first-token mass per (layer, head) is the key-class row received:first_position
        mass = _grid(mine, "received:first_position", L, H)
        np.testing.assert_allclose(mass, a[..., 0].mean(-1).numpy(), atol=2e-6)
        layers = L - 1 if mode == "recompute" else L  # the capture forward stops before the last layer
        massive = rows[(rows.doc_index == index) & rows.statistic.str.startswith("massive_")]
        assert set(massive["head"]) == {-1} and sorted(set(massive.layer)) == list(range(layers))
        for layer in range(min(layers, L - 1)):  # (the last hidden state has the final norm applied)
            ref = _literal_massive(hidden[layer + 1][0])
            for v in ("unas", "dnas") if mode == "recompute" else ("unas",):
                at = massive[(massive.variant == v) & (massive.layer == layer)].set_index("statistic").value
                assert (at["massive_token"], at["massive_dim"]) == (ref["token_index"], ref["dim"])
                for k in ("max_abs", "median_abs", "ratio"):
                    assert at[f"massive_{k}"] == pytest.approx(ref[k], rel=1e-5)
    summary = result.summary().set_index(["variant", "statistic", "layer", "head"])
    per_doc = rows[(rows.variant == "unas") & (rows.statistic == "sink_rate") & (rows.layer == 0)]
    want = per_doc.groupby("doc_index").value.mean().mean()  # the layer's share of sink heads, over documents
    assert summary.loc[("unas", "sink_rate", 0, -1), "mean"] == pytest.approx(want)
    m = rows[(rows.variant == "unas") & (rows.statistic == "massive_ratio") & (rows.layer == 0)].value
    assert summary.loc[("unas", "massive_ratio", 0, -1), "mean"] == pytest.approx(m.mean())
    assert not summary.index.duplicated().any()
    from attnlab.figures.corpus import head_heatmap, layer_curves

    one_column = head_heatmap(result.summary(), "massive_ratio", "unas")  # a statistic of whole layers
    assert one_column.arrays["mean"].shape == (L - 1 if mode == "recompute" else L, 1)
    assert head_heatmap(result.summary(), "sink_rate", "unas").arrays["mean"].shape == (L, H)
    layer_curves(result.summary(), ["sink_rate", "massive_ratio"])


def _grid(values: pd.Series, statistic: str, L: int, H: int) -> np.ndarray:
    """(L, H) of one statistic from values indexed by (statistic, layer, head)."""
    return np.array([[values.loc[(statistic, layer, h)] for h in range(H)] for layer in range(L)])
