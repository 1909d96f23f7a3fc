"""Corpus atlas (attnlab.corpus): sources, key classes, rows = hf.analyze's statistics, summary,
manifest checks and bad input. Small corpora on the embedded MiniLM; Ray and subprocesses are in
tests/test_corpus_slow.py."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import CORPUS

import attnlab
from attnlab.corpus import analyze_corpus, open_result
from attnlab.corpus.sources import Document, open_source, split_parts
from attnlab.corpus.summary import bootstrap_counts, summarize
from attnlab.corpus.token_classes import class_statistics, frequency_bins, key_classes

WINDOW = 16  # short windows: several per document, fast


def _folder(tmp_path, texts=CORPUS):
    root = tmp_path / "docs"
    (root / "sub").mkdir(parents=True)
    for i, t in enumerate(texts):
        (root / ("sub" if i % 2 else "") / f"d{i}.txt").write_text(t)
    return root


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("corpus")
    root = _folder(tmp, [" ".join(CORPUS[i:i + 2]) for i in range(4)])
    result = analyze_corpus(str(root), out=tmp / "run", window=WINDOW, overlap=4, shard_docs=3)
    return root, result


# ---------------------------------------------------------------------------------------------- sources


def test_folder_recursive_sorted_and_bad_files_skipped(tmp_path):
    root = _folder(tmp_path)
    (root / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (root / "binary.md").write_bytes(b"abc\x00def")
    (root / "empty.txt").write_text("   \n")
    (root / "image.png").write_bytes(b"\x89PNG")  # not a document suffix: ignored
    src = open_source(str(root))
    docs = list(src)
    assert [d.id for d in docs] == ["d0.txt", "d2.txt", "d4.txt", "sub/d1.txt", "sub/d3.txt"]
    assert "".join(docs[0].parts()) == CORPUS[0]
    reasons = {s["id"]: s["reason"] for s in src.skipped}
    assert set(reasons) == {"latin1.txt", "binary.md", "empty.txt"}
    assert reasons["latin1.txt"].startswith("not UTF-8") and "NUL" in reasons["binary.md"]


def test_tables_jsonl_csv_parquet(tmp_path):
    rows = [{"text": t, "name": f"n{i}"} for i, t in enumerate(CORPUS[:3])]
    jl = tmp_path / "c.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows) + '\n[1, 2]\n{"text": 5, "name": "x"}\nnot json\n')
    src = open_source(str(jl), id_column="name")
    assert [d.id for d in src] == ["n0", "n1", "n2"]
    assert [s["id"] for s in src.skipped] == ["line-4", "x", "line-6"]
    pd.DataFrame(rows).to_csv(tmp_path / "c.csv", index=False)
    pd.DataFrame(rows).to_parquet(tmp_path / "c.parquet")
    for name in ("c.csv", "c.parquet"):
        docs = list(open_source(str(tmp_path / name)))
        assert [d.id for d in docs] == ["row-1", "row-2", "row-3"]
        assert ["".join(d.parts()) for d in docs] == CORPUS[:3]


@pytest.mark.slow  # ~1 s: .ci/run runs it, the inner loop does not
def test_kjv_by_chapter_is_the_trainers_corpus():
    from attnlab.data import default_corpus

    docs = list(open_source("kjv"))
    assert len(docs) == 1189 and docs[0].id == "kjv/1001-Genesis/001"
    assert "".join(docs[0].parts()).startswith("In the beginning God created the heavens and the earth.")
    assert "".join("".join(d.parts()) for d in docs) == default_corpus().replace("\n\n", "\n")


@pytest.mark.parametrize("make, arg, expected", [
    (lambda p: p / "missing", "source", "does not exist"),
    (lambda p: (p / "x.png").write_bytes(b"\x89PNG") and p / "x.png", "source", "is a .png file"),
])
def test_bad_source_path(tmp_path, make, arg, expected):
    with pytest.raises(ValueError, match=expected):
        open_source(str(make(tmp_path)))


def test_missing_or_non_string_column(tmp_path):
    pd.DataFrame({"body": ["a b c"]}).to_csv(tmp_path / "c.csv", index=False)
    with pytest.raises(ValueError, match="text_column 'text' is not a column .* 'body'"):
        list(open_source(str(tmp_path / "c.csv")))
    pd.DataFrame({"text": [1, 2]}).to_parquet(tmp_path / "n.parquet")
    with pytest.raises(ValueError, match="must hold strings, got Parquet type int64"):
        list(open_source(str(tmp_path / "n.parquet")))
    (tmp_path / "j.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match="text_column 'text' is not a column"):
        list(open_source(str(tmp_path / "j.jsonl")))
    (tmp_path / "bad.csv").write_bytes(b"text\n\xff\xfe\n")
    with pytest.raises(ValueError, match="not UTF-8"):
        list(open_source(str(tmp_path / "bad.csv")))


def test_long_documents_are_read_in_parts(tmp_path):
    text = " ".join(CORPUS) * 40  # ~11,000 characters
    parts = list(split_parts(text, 500))
    assert "".join(parts) == text and max(map(len, parts)) < 1000 and len(parts) > 10
    (tmp_path / "long.txt").write_text(text)
    doc = next(iter(open_source(str(tmp_path))))
    assert list(doc.parts(500)) == parts
    assert list(Document("x", len(text), _text=text).parts(500)) == parts


# ---------------------------------------------------------------------------------------------- classes


def test_frequency_bins():
    counts = np.array([0, 50, 30, 10, 10])  # 100 occurrences
    assert frequency_bins(counts, 2).tolist() == [-1, 0, 1, 1, 1]
    assert frequency_bins(counts, 5).tolist() == [-1, 0, 2, 4, 4]
    assert frequency_bins(np.zeros(3, int), 4).tolist() == [-1, -1, -1]
    with pytest.raises(ValueError, match="n_bins"):
        frequency_bins(counts, 0)


def test_class_statistics_match_a_loop():
    gen = torch.Generator().manual_seed(0)
    w = torch.rand(2, 3, 7, 7, generator=gen)
    w = w / w.sum(-1, keepdim=True)
    tokens = ["[CLS]", "a", ",", "b", "c", ".", "[SEP]"]
    special = np.array([1, 0, 0, 0, 0, 0, 1], bool)
    punct = np.array([0, 0, 1, 0, 0, 1, 0], bool)
    bins = np.array([-1, 0, 1, 0, 1, 1, 0, -1])
    names, member = key_classes(tokens, [0, 1, 2, 3, 4, 5, 6], special, punct, bins, 2)
    names_out, values = class_statistics({"x": w}, names, member)["x"]
    got = dict(zip(names_out, values.permute(2, 0, 1), strict=True))
    ref = {"special": [0, 6], "special:[CLS]": [0], "special:[SEP]": [6], "punctuation": [2, 5],
           "first_position": [0], "position_d0": [0], "position_d8": [6], "position_d9": [],
           "frequency_q1": [1, 3], "frequency_q2": [2, 4, 5]}
    for name, keys in ref.items():
        expected = sum((w[..., i, j] for i in range(7) for j in keys), torch.zeros(2, 3)) / 7
        torch.testing.assert_close(got[f"received:{name}"], expected.double())
    deciles = sum(got[f"received:position_d{k}"] for k in range(10))
    assert deciles.sub(1).abs().max() < 1e-6  # rows of w sum to 1
    cols = w.sum(-2).double()
    torch.testing.assert_close(got["relative_column_mass_q50"], cols.median(-1).values)


# ---------------------------------------------------------------------------------------------- the job


@pytest.mark.slow  # 1-4 s: .ci/run runs it, the inner loop does not
def test_rows_are_hf_analyze_statistics(small_run, minilm):
    root, result = small_run
    rows = result.table()
    assert set(rows["variant"]) == set(attnlab.VARIANTS)
    docs = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.txt"))
    assert [d["id"] for d in result.manifest["documents"]] == docs
    from attnlab import hf

    for index, doc_id in enumerate(docs):
        ref = hf.analyze((root / doc_id).read_text(), minilm, attnlab.VARIANTS, window=WINDOW,
                         overlap=4).table()
        extra = rows["statistic"].str.contains(r"^received:|_q\d\d$|^sink_|^massive_")  # classes, sinks
        got = rows[(rows["doc_index"] == index) & ~extra]
        got = got.sort_values(["window", "variant", "layer", "head", "statistic"], ignore_index=True)
        ref = ref.sort_values(["window", "variant", "layer", "head", "statistic"], ignore_index=True)
        assert (got["doc_id"] == doc_id).all() and got["window"].max() >= 1  # several windows
        pd.testing.assert_frame_equal(
            got[["window", "variant", "layer", "head", "statistic", "value"]],
            ref[["window", "variant", "layer", "head", "statistic", "value"]], check_dtype=False,
        )


@pytest.mark.slow  # 1-4 s: .ci/run runs it, the inner loop does not
def test_every_document_once_and_summary_from_rows(small_run):
    _, result = small_run
    rows = result.table()
    assert sorted(rows["doc_index"].unique()) == [0, 1, 2, 3]
    assert len(list(result.rows.glob("shard-*.parquet"))) == 2  # 3 documents per shard
    s = result.summary()
    pd.testing.assert_frame_equal(s, summarize(result.rows, 1000, 0))  # deterministic
    per_doc = (rows.groupby(["variant", "layer", "head", "statistic", "doc_index"])["value"].mean())
    key = ("dnas", 2, 5, "explained_away_relative")
    values = per_doc.loc[key].to_numpy()
    row = s.set_index(["variant", "layer", "head", "statistic"]).loc[key]
    assert row["mean"] == pytest.approx(values.mean()) and row["n_documents"] == 4
    assert row["q50"] == pytest.approx(np.quantile(values, 0.5))
    boot = bootstrap_counts(4, 1000, 0) @ values / 4
    assert (row["ci_low"], row["ci_high"]) == pytest.approx(tuple(np.quantile(boot, [0.025, 0.975])))
    assert row["ci_low"] <= row["mean"] <= row["ci_high"]
    layer = s.set_index(["variant", "layer", "head", "statistic"]).loc[("dnas", 2, -1, "received:special")]
    heads = per_doc.loc[("dnas", 2)].xs("received:special", level="statistic").groupby("doc_index").mean()
    assert layer["mean"] == pytest.approx(heads.mean())
    assert open_result(result.out).manifest["n_documents"] == 4


def _summary_from_all_rows(rows, resamples, seed):
    """The summary computed the direct way, from every row at once (the reference of the streamed one)."""
    from attnlab.corpus.summary import ALL_HEADS, _describe

    frames = []
    for variant in rows["variant"].unique():
        part = rows[rows["variant"] == variant]
        means = part.groupby(["doc_index", "statistic", "layer", "head"])["value"].mean()
        layer = means.groupby(level=["doc_index", "statistic", "layer"]).mean().reset_index()
        both = pd.concat([means.reset_index(), layer.assign(head=ALL_HEADS)])
        wide = both.pivot_table(index="doc_index", columns=["statistic", "layer", "head"], values="value",
                                aggfunc="first").sort_index(axis=1)
        stats = _describe(wide.to_numpy(np.float64), bootstrap_counts(len(wide), resamples, seed))
        windows = part.groupby("doc_index")["window"].nunique().reindex(wide.index).to_numpy()
        keys = wide.columns.to_frame(index=False)
        frames.append(keys.assign(variant=variant, **stats,
                                  n_windows=(~np.isnan(wide.to_numpy()) * windows[:, None]).sum(0)))
    return pd.concat(frames, ignore_index=True)


@pytest.mark.slow  # 1-4 s: .ci/run runs it, the inner loop does not
def test_streamed_summary_equals_the_all_rows_summary(small_run):
    _, result = small_run
    got = summarize(result.rows, 300, 3)
    ref = _summary_from_all_rows(result.table(), 300, 3)
    key = ["variant", "layer", "head", "statistic"]
    ref = ref.astype({"layer": np.int64, "head": np.int64, "n_documents": np.int64, "n_windows": np.int64})
    ref = ref.set_index(key).loc[got.set_index(key).index].reset_index()[list(got.columns)]
    assert len(got) == len(ref) and (got["head"] == -1).any()
    pd.testing.assert_frame_equal(got, ref, check_exact=True)


@pytest.mark.slow  # three small runs
def test_resume_skips_done_shards_and_mismatch_is_refused(small_run, tmp_path):
    root, result = small_run
    before = {p.name: p.stat().st_mtime_ns for p in result.rows.glob("*.parquet")}
    again = analyze_corpus(str(root), out=result.out, window=WINDOW, overlap=4, shard_docs=3)
    assert {p.name: p.stat().st_mtime_ns for p in again.rows.glob("*.parquet")} == before
    pd.testing.assert_frame_equal(again.summary(), result.summary())
    with pytest.raises(ValueError, match=r"other settings \(.*settings.variants: \[.unas., .dnas"):
        analyze_corpus(str(root), out=result.out, variants=["unas"], window=WINDOW, overlap=4, shard_docs=3)
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "a.txt").write_text(CORPUS[0])
    analyze_corpus(str(copy), out=tmp_path / "r", variants=["unas"], window=WINDOW, bootstrap=20)
    (copy / "a.txt").write_text(CORPUS[1])  # the source changed
    with pytest.raises(ValueError, match="source.fingerprint"):
        analyze_corpus(str(copy), out=tmp_path / "r", variants=["unas"], window=WINDOW, bootstrap=20)
    redone = analyze_corpus(str(copy), out=tmp_path / "r", variants=["unas"], window=WINDOW, overwrite=True,
                            bootstrap=20)
    assert set(redone.table()["doc_id"]) == {"a.txt"}


@pytest.mark.slow
def test_long_document_streamed_in_parts(tmp_path):
    root = tmp_path / "long"
    root.mkdir()
    (root / "long.txt").write_text(" ".join(CORPUS) * 3)
    import attnlab.corpus.job as job
    from attnlab.corpus.variants import resolve

    small = job.CorpusSettings(variants=("unas",), params=resolve(["unas"], {})[1], window=WINDOW,
                               part_chars=300)
    run = job.prepare(str(root), tmp_path / "parts", small)
    assert job.run_local(run)["shards"] == 1
    rows = summarize(tmp_path / "parts" / "rows", resamples=20)
    windows = pd.read_parquet(tmp_path / "parts" / "rows")["window"].unique()
    assert sorted(windows) == list(range(len(windows))) and len(windows) > 4
    assert (rows["n_documents"] == 1).all()


@pytest.mark.parametrize("kwargs, expected", [
    (dict(workers=0, engine="ray"), "workers must be an integer >= 1, got 0"),
    (dict(workers=2), "workers=2 needs engine='ray'"),
    (dict(engine="spark"), "engine must be one of"),
    (dict(window=10_000), r"window must be an integer in \[1, 512\]"),
    (dict(variants=["nope"]), "variants must be one of"),
    (dict(params={"zz": 1}), "params: \\['zz'\\] are not parameters"),
    (dict(u=2.0), "u must be a number in \\[0, 1\\]"),
    (dict(u=torch.ones(6, 12)), "u must be a number for a corpus run"),
    (dict(max_docs=0), "max_docs must be an integer >= 1"),
])
def test_bad_settings(tmp_path, kwargs, expected):
    root = _folder(tmp_path, CORPUS[:1])
    with pytest.raises(ValueError, match=expected):
        analyze_corpus(str(root), out=tmp_path / "r", **kwargs)


def test_empty_corpus_and_not_a_run_dir(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="has no documents to analyse .1 skipped: blank.txt: empty"):
        analyze_corpus(str(tmp_path / "empty"), out=tmp_path / "r")
    (tmp_path / "none").mkdir()
    with pytest.raises(ValueError, match="no documents to analyse .it is empty"):
        analyze_corpus(str(tmp_path / "none"), out=tmp_path / "r")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not an attnlab corpus run"):
        analyze_corpus(str(_folder(tmp_path, CORPUS[:1])), out=busy, overwrite=True)
    assert (busy / "notes.txt").read_text() == "mine"


def test_unreachable_ray_address_is_one_error_fast():
    from attnlab.corpus.ray_engine import probe

    with pytest.raises(ValueError, match=r"ray_address '127.0.0.1:9' is unreachable"):
        probe("127.0.0.1:9")
    with pytest.raises(ValueError, match="ray_address must be"):
        probe("host:port")


def test_cli_errors_are_one_line(tmp_path, capsys):
    from attnlab.cli import main

    pd.DataFrame({"body": ["x y"]}).to_csv(tmp_path / "c.csv", index=False)
    assert main(["corpus", str(tmp_path / "c.csv"), "--out", str(tmp_path / "r"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("attnlab corpus: error: text_column 'text'")
    assert main(["corpus", "kjv", "--out", str(tmp_path / "r"), "--engine", "ray", "--workers", "0"]) == 2
    assert "--workers must be >= 1, got 0" in capsys.readouterr().err
    assert main(["corpus", "kjv", "--out", str(tmp_path / "r"), "--engine", "ray",
                 "--ray-address", "127.0.0.1:9"]) == 2
    assert "unreachable" in capsys.readouterr().err


def test_class_statistics_from_the_fused_column_masses_without_weights(minilm):
    """The corpus's key-class breakdown reads the analysis pass's column masses: no weights are
    computed for it, and they equal the weights' column sums (float32 rounding)."""
    from attnlab import hf
    from attnlab.hf.compute.lazy_weights import _PENDING

    result = hf.analyze("The cat sat on the mat because it was warm, and the dog watched.", minilm)
    window = result._single("weights")
    masses = window.column_masses()
    assert all(dict.get(window.weights, v) is _PENDING for v in masses)  # nothing computed
    for v, m in masses.items():
        torch.testing.assert_close(m, window.weights[v].sum(-2), atol=1e-4, rtol=1e-5)
