"""numpy scalars and 0-d tensors are ordinary numbers (docs/DESIGN.md §4) at every public entry that
takes a count, an index, a size or a rate: each call below gives what the same call with Python
numbers gives, and what it records (the corpus manifest, the windowing) holds Python numbers, so
the JSON files are written. Before, ``window=np.int64(32)``, ``seed=np.int64(0)``,
``batch_size=np.int64(4)`` and the like were refused ("must be an integer"). Tiny models, offline."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import CORPUS

from attnlab import hf
from attnlab.corpus import analyze_corpus
from attnlab.corpus.summary import summarize
from attnlab.corpus.token_classes import frequency_bins
from attnlab.hf.analysis.one_window import text_window
from attnlab.hf.beyond.faithfulness import faithfulness
from attnlab.hf.beyond.interventions import head_interventions
from attnlab.hf.beyond.retrofit import theta_for
from attnlab.modules import AttentionConfig
from attnlab.schema import check_threads

TEXT = " ".join(CORPUS)
# the same number as numpy scalars of two widths and as a 0-d tensor
KINDS = {"np64": (np.int64, np.float64), "np32": (np.int32, np.float32),
         "tensor": (lambda v: torch.tensor(v), lambda v: torch.tensor(v, dtype=torch.float64))}


@pytest.fixture(params=list(KINDS))
def num(request):
    """(integer maker, real maker) of one kind."""
    return KINDS[request.param]


def test_analysis_windows_and_indices(num, tiny_model_dir):
    i, _ = num
    loaded = hf.load_model(tiny_model_dir("llama"))
    plain = hf.analyze(TEXT, loaded, ["unas"], window=32, overlap=4)
    got = hf.analyze(TEXT, loaded, ["unas"], window=i(32), overlap=i(4))
    assert got.windowing == plain.windowing and type(got.windowing.overlap) is int
    assert got.table().equals(plain.table())
    stream = hf.stream_analysis(TEXT, loaded, ["unas"], window=32, overlap=4)
    assert stream.window(i(1)).table().equals(stream.window(1).table())
    a, b = text_window(loaded, TEXT, i(1), window=i(32)), text_window(loaded, TEXT, 1, window=32)
    assert (a.index, a.start, a.stop, list(a.input_ids)) == (b.index, b.start, b.stop, list(b.input_ids))
    acts = hf.massive_activations(TEXT, loaded, max_tokens=i(20))
    assert acts.equals(hf.massive_activations(TEXT, loaded, max_tokens=20))


def test_swaps_interventions_and_faithfulness(num, tiny_model_dir):
    i, r = num
    directory = tiny_model_dir("bert")
    loaded = hf.load_model(directory)
    a = head_interventions(loaded, TEXT[:120], "dnas", batch_size=i(4))
    b = head_interventions(loaded, TEXT[:120], "dnas", batch_size=4)
    assert a.table().equals(b.table())
    a = faithfulness(loaded, TEXT[:120], ["unas"], batch_size=i(4), window_index=i(0))
    assert a.table.equals(faithfulness(loaded, TEXT[:120], ["unas"], batch_size=4).table)
    assert theta_for(r(0.25)) == pytest.approx(theta_for(0.25), abs=1e-7)


def test_modules_threads_and_corpus_helpers(num, tmp_path):
    i, _ = num
    config = AttentionConfig(d_model=i(32), n_heads=i(4))
    assert (config.d_model, config.n_heads) == (32, 4) and type(config.d_model) is int
    assert check_threads(i(1)) == 1
    counts = np.array([5, 0, 3, 9, 1, 1])
    assert np.array_equal(frequency_bins(counts, i(3)), frequency_bins(counts, 3))


def test_a_corpus_run_records_python_numbers(num, tmp_path):
    i, r = num
    docs = tmp_path / "docs"
    docs.mkdir()
    for k in range(2):
        (docs / f"d{k}.txt").write_text(" ".join(CORPUS[k::2]), encoding="utf-8")
    common = dict(variants=["unas", "hnas"], max_docs=2, shard_docs=1)
    plain = analyze_corpus(docs, out=tmp_path / "plain", window=24, bootstrap=20, seed=0, u=0.25,
                           index=True, index_dims=8, **common)
    got = analyze_corpus(docs, out=tmp_path / "got", window=i(24), bootstrap=i(20), seed=i(0), u=r(0.25),
                         index=True, index_dims=i(8), **{**common, "max_docs": i(2), "shard_docs": i(1)})
    manifest = json.loads((got.out / "manifest.json").read_text())
    want = json.loads((plain.out / "manifest.json").read_text())
    for key in ("settings", "documents"):
        if key in want:
            assert manifest[key] == want[key], key
    assert summarize(got.rows, resamples=i(20)).equals(summarize(plain.rows, resamples=20))


def test_lm_loss_window_and_rate(num, tmp_path):
    from test_lm_loss import build_lm

    i, r = num
    loaded = hf.load_language_model(build_lm("gpt2", tmp_path / "lm"))
    want = hf.language_model_loss([TEXT], loaded, window=32, mask_rate=0.5)
    assert hf.language_model_loss([TEXT], loaded, window=i(32), mask_rate=r(0.5)) == want


def test_a_swap_eval_run_records_python_numbers(num, tmp_path):
    from test_lm_loss import build_lm

    from attnlab.swap_eval import swap_eval

    i, r = num
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "d.txt").write_text(TEXT, encoding="utf-8")
    model = build_lm("gpt2", tmp_path / "lm")
    common = dict(source=docs, model=model, variants=["dnas"], layers="all")
    plain = swap_eval(**common, out=tmp_path / "plain", window=32, mask_rate=0.5, bootstrap=10, seed=0,
                      max_docs=1)
    got = swap_eval(**common, out=tmp_path / "got", window=i(32), mask_rate=r(0.5), bootstrap=i(10),
                    seed=i(0), max_docs=i(1))
    manifest = json.loads((got.out / "manifest.json").read_text())
    assert manifest["settings"] == json.loads((plain.out / "manifest.json").read_text())["settings"]
