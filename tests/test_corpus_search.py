"""Corpus search (issue 30 item 14): the token index a corpus run writes (attnlab/corpus/index.py)
and the nearest tokens in it (attnlab/corpus/search.py). A synthetic index against a float64
brute-force reference; a small MiniLM run whose index holds the analysis' own column masses and the
model's last hidden states, every token once, also after a resume."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import CORPUS

from attnlab.corpus import analyze_corpus
from attnlab.corpus.index import FOLDER, owned_ranges, project, schema
from attnlab.corpus.search import EPS, load_index, search

WINDOW = 16


def _synthetic(tmp_path, docs=(30, 7, 45), width=24, heads=(3, 4), shard_docs=2, seed=0, meta=None):
    """A run directory with only an index: random embeddings and masses, words "w<doc>_<t>"."""
    rng = np.random.default_rng(seed)
    L, H = heads
    run = tmp_path / "run"
    (run / FOLDER).mkdir(parents=True)
    rows = []
    for d, n in enumerate(docs):
        for t in range(n):
            rows.append(dict(doc_index=d, doc_id=f"doc{d}", window=t // 10, position=1 + t % 10,
                             token_index=t, token=f"w{d}_{t}", text=f"w{d}_{t}", space_before=t > 0))
    frame = pd.DataFrame(rows)
    emb = rng.standard_normal((len(frame), width)).astype(np.float16)
    mass = rng.gamma(0.5, 2.0, (len(frame), L * H)).astype(np.float16)
    mass[rng.random(mass.shape) < 0.05] = 0  # exact zeros, as sparsemax gives
    sch = schema(width, L * H, {"dims": None, "n_layers": L, "n_heads": H, **(meta or {})})
    for shard, first in enumerate(range(0, len(docs), shard_docs)):
        keep = frame["doc_index"].between(first, first + shard_docs - 1).to_numpy()
        arrays = [pa.array(frame.loc[keep, f.name].to_numpy(), f.type) for f in sch if f.name not in
                  ("embedding", "mass")]
        for values, size in ((emb[keep], width), (mass[keep], L * H)):
            arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1), pa.float16()), size))
        pq.write_table(pa.Table.from_arrays(arrays, schema=sch), run / FOLDER / f"shard-{shard:05d}.parquet")
    return run, frame, emb, mass


def _reference(matrix, q, k):
    """Brute force in float64: (indices by decreasing cosine, ties by index; their cosines)."""
    x = matrix.astype(np.float64)
    norm = np.linalg.norm(x, axis=1)
    sims = x @ q / np.where(norm > 0, norm, 1.0) / np.linalg.norm(q)
    order = np.lexsort((np.arange(len(sims)), -sims))[:k]
    return order, sims[order]


def _log_profile(m):
    z = np.log(m.astype(np.float64) + EPS)
    return z - z.mean(-1, keepdims=True)


@pytest.mark.parametrize("by", ["embedding", "mass"])
def test_nearest_neighbours_are_the_brute_force_ones(tmp_path, by):
    run, frame, emb, mass = _synthetic(tmp_path)
    rng = np.random.default_rng(1)
    stored = emb if by == "embedding" else mass
    matrix = stored if by == "embedding" else _log_profile(stored)
    for _ in range(5):
        n = stored.shape[1]
        q = rng.standard_normal(n) if by == "embedding" else rng.gamma(0.5, 2.0, n)
        ref_q = q if by == "embedding" else _log_profile(q)
        found = search(run, q, by=by, k=10)
        order, sims = _reference(matrix, ref_q, 10)
        np.testing.assert_array_equal(found["token"], frame["token"].to_numpy()[order])
        np.testing.assert_allclose(found["similarity"], sims, atol=2e-6)
        assert list(found["rank"]) == list(range(1, 11))
    if by == "mass":  # a profile given as (L, H) is read layer-major
        pd.testing.assert_frame_equal(search(run, mass[5].reshape(3, 4), by=by), search(run, mass[5], by=by))


def test_a_token_finds_itself_first_and_its_context(tmp_path):
    run, frame, *_ = _synthetic(tmp_path)
    for doc, token in ((0, 0), (1, 6), (2, 20), ("doc2", 44)):
        for by in ("embedding", "mass"):
            top = search(run, (doc, token), by=by, k=3, context=2).iloc[0]
            d = doc if isinstance(doc, int) else 2
            assert (top["doc_index"], top["token_index"], top["similarity"]) == (d, token, pytest.approx(1.0))
    hit = search(run, (2, 20), k=1, context=2).iloc[0]
    assert (hit["left"], hit["text"], hit["right"]) == ("w2_18 w2_19 ", "w2_20", " w2_21 w2_22")
    assert hit["doc_id"] == "doc2" and (hit["window"], hit["position"]) == (2, 1)
    first = search(run, (1, 0), k=1, context=3).iloc[0]  # a document's first token: no doc 0 left of it
    assert (first["left"], first["right"]) == ("", " w1_1 w1_2 w1_3")
    last = search(run, (0, 29), k=1, context=3).iloc[0]  # ... and nothing of doc 1 right of its last
    assert (last["left"], last["right"]) == ("w0_26 w0_27 w0_28 ", "")
    others = search(run, (0, 3), k=4, exclude_self=True)
    assert not ((others["doc_index"] == 0) & (others["token_index"] == 3)).any() and len(others) == 4
    assert len(search(run, (0, 3), k=1000)) == 82  # k beyond the index: every token, in order


def test_a_projected_index_takes_a_query_of_the_model_width(tmp_path):
    run, _, emb, _ = _synthetic(tmp_path, width=8, meta={"dims": 8, "model_width": 32, "seed": 0})
    hidden = np.random.default_rng(3).standard_normal(32)
    pd.testing.assert_frame_equal(search(run, hidden), search(run, project(hidden, 8)))
    x = np.random.default_rng(4).standard_normal((2000, 256))  # JL: cosines kept to ~1/sqrt(dims)
    y = project(x, 128)
    cos = (x[:1000] * x[1000:]).sum(1) / np.linalg.norm(x[:1000], axis=1) / np.linalg.norm(x[1000:], axis=1)
    cos_p = (y[:1000] * y[1000:]).sum(1) / np.linalg.norm(y[:1000], axis=1) / np.linalg.norm(y[1000:], axis=1)
    assert np.abs(cos - cos_p).max() < 0.4 and np.abs(cos - cos_p).std() < 1.5 / np.sqrt(128)


def test_the_matrix_is_cached_until_the_shards_change(tmp_path):
    run, *_ = _synthetic(tmp_path)
    first = load_index(run)
    assert load_index(run) is first and first.vectors.dtype == np.float32 and first.vectors.shape == (82, 24)
    _synthetic(tmp_path.parent / (tmp_path.name + "-b"), seed=5)  # another run: its own entry
    shard = run / FOLDER / "shard-00000.parquet"
    pq.write_table(pq.read_table(shard).slice(0, 10), shard)
    assert load_index(run) is not first and len(load_index(run).doc_index) == 10 + 45


@pytest.mark.parametrize("call, expected", [
    (dict(by="keys"), r"by must be one of \('embedding', 'mass'\), got 'keys'"),
    (dict(k=0), "k must be an integer >= 1, got 0"),
    (dict(context=-1), "context must be an integer >= 0, got -1"),
    (dict(query=np.ones(5)), r"query must be a finite vector of shape \(24,\) for by='embedding' on this "
                             r"index, got shape \(5,\)"),
    (dict(query=np.full(24, np.nan)), "with NaN/inf"),
    (dict(query=np.ones(5), by="mass"), r"shape \(L\*H,\) or \(L, H\) for by='mass'"),
    (dict(query=(0, 30)), r"query \(0, 30\): document 0 has 30 indexed tokens \(token index 0..29\)"),
    (dict(query=(9, 0)), r"document 9 has 0 indexed tokens \(no such document"),
    (dict(query=("nope", 0)), "query names document 'nope', which the index does not hold"),
    (dict(query=(0, 1, 2)), "got a tuple of 3"),
    (dict(query=(0, 1.5)), "integer indices"),
])
def test_bad_queries_are_worded(tmp_path, call, expected):
    run, *_ = _synthetic(tmp_path)
    args = {"query": np.ones(24), **call}
    with pytest.raises(ValueError, match=expected):
        search(run, args.pop("query"), **args)


def test_a_run_without_index_says_how_to_write_one(tmp_path):
    (tmp_path / "run" / "rows").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"has no token index \(index/\); write one with `attnlab corpus "
                                         r"SOURCE --out .* --index`"):
        search(tmp_path / "run", np.ones(4))
    with pytest.raises(ValueError, match="is not a directory"):
        search(tmp_path / "missing", np.ones(4))


def test_owned_ranges_cover_every_token_once():
    from attnlab.hf.capture.windows import plan_windows

    for n, window, overlap in ((5, 16, 4), (21, 16, 4), (100, 16, 0), (100, 16, 13), (1000, 130, None)):
        w = plan_windows(n, window, 2, overlap)
        ranges = owned_ranges(w)
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        for (lo, hi), (nlo, _), s in zip(ranges, ranges[1:] + [(n, n)], w.starts, strict=True):
            assert hi == nlo and s <= lo < hi <= min(s + w.content, n)


# ------------------------------------------------------------------------- a real run (MiniLM)


@pytest.fixture(scope="module")
def indexed_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("indexed")
    root = tmp / "docs"
    root.mkdir()
    for i in range(3):
        (root / f"d{i}.txt").write_text(" ".join(CORPUS[i:i + 2]) + "\n\n  " + CORPUS[4 - i])
    settings = dict(variants=["dnas", "unas"], window=WINDOW, overlap=4, shard_docs=2, bootstrap=20,
                    index=True)
    return root, analyze_corpus(str(root), out=tmp / "run", **settings), settings


@pytest.mark.slow  # one small MiniLM run (~20 s on 2 loaded cores)
def test_the_index_holds_each_token_once_with_its_mass_and_hidden_state(indexed_run, minilm):
    from attnlab import hf
    from attnlab.corpus.index import token_embeddings

    root, result, settings = indexed_run
    index = pq.read_table(result.out / FOLDER).to_pandas()
    assert len(index) == result.manifest["n_tokens"]
    assert not index.duplicated(["doc_index", "token_index"]).any()
    for d, group in index.groupby("doc_index"):
        assert list(group["token_index"]) == list(range(len(group)))
        text = (root / f"d{d}.txt").read_text()
        pieces = zip(group["text"], group["space_before"], strict=True)
        rebuilt = "".join((" " if s else "") + t for t, s in pieces)
        assert rebuilt.strip() == " ".join(text.split())  # the document, whitespace as single spaces
    meta = json.loads(pq.read_schema(result.out / FOLDER / "shard-00000.parquet").metadata[b"attnlab_index"])
    assert meta["variant"] == "dnas" and meta["n_layers"] == 6 and meta["model_width"] == 384
    assert result.manifest["settings"]["index"]["variant"] == "dnas"
    text = (root / "d1.txt").read_text()  # one window of document 1: the analysis' own numbers
    stream = hf.stream_analysis(text, minilm, ["dnas"], window=WINDOW, overlap=4)
    window = stream.window(1)
    rows = index[(index["doc_index"] == 1) & (index["window"] == 1)]
    assert len(rows) > 3
    masses = window.column_masses()["dnas"].reshape(72, -1).numpy()  # (L*H, N)
    got = np.stack(rows["mass"].to_numpy()).astype(np.float32)
    positions = rows["position"].to_numpy()
    np.testing.assert_allclose(got, masses[:, positions].T, rtol=1e-3, atol=1e-3)
    hidden = token_embeddings(minilm, window.window.input_ids)[positions]  # (n, 384)
    np.testing.assert_allclose(np.stack(rows["embedding"].to_numpy()).astype(np.float32), hidden,
                               rtol=1e-2, atol=1e-2)
    assert list(rows["token"]) == [window.window.tokens[p] for p in positions]
    found = search(result.out, hidden[0], k=1)  # a hidden state finds its own token
    assert (found["doc_index"][0], found["position"][0], found["window"][0]) == (1, positions[0], 1)


@pytest.mark.slow  # resumes of the small run
def test_resume_rewrites_a_shard_whole_and_refuses_other_index_settings(indexed_run, tmp_path):
    root, result, settings = indexed_run
    index_dir, rows_dir = result.out / FOLDER, result.out / "rows"
    before = pq.read_table(index_dir).to_pandas()
    (index_dir / "shard-00001.parquet").unlink()  # killed between the index and the rows: rows kept
    (rows_dir / "shard-00000.parquet").unlink()  # killed after the index, before the rows
    (index_dir / ".shard-00000.parquet.99.tmp").write_bytes(b"half")  # a half-written shard
    stamp = {p.name: p.stat().st_mtime_ns for p in index_dir.glob("*.parquet")}
    again = analyze_corpus(str(root), out=result.out, **settings)
    assert again.manifest["last_run"]["shards"] == 2 and not list(index_dir.glob(".*.tmp"))
    assert {p.name: p.stat().st_mtime_ns for p in index_dir.glob("*.parquet")} != stamp
    after = pq.read_table(index_dir).to_pandas()
    assert len(after) == len(before) and not after.duplicated(["doc_index", "token_index"]).any()
    pd.testing.assert_frame_equal(after.drop(columns=["embedding", "mass"]),
                                  before.drop(columns=["embedding", "mass"]))
    with pytest.raises(ValueError, match=r"other settings \(settings.index.dims: None -> 64"):
        analyze_corpus(str(root), out=result.out, **settings, index_dims=64)
    with pytest.raises(ValueError, match=r"settings.index: \{.*\} -> None"):
        analyze_corpus(str(root), out=result.out, **{**settings, "index": False})
    with pytest.raises(ValueError, match="index_dims=64 needs index=True"):
        analyze_corpus(str(root), out=tmp_path / "x", **{**settings, "index": False}, index_dims=64)
    with pytest.raises(ValueError, match="index_dims must be an integer >= 1 or None, got 0"):
        analyze_corpus(str(root), out=tmp_path / "x", **settings, index_dims=0)
    with pytest.raises(ValueError, match="index must be True or False, got 'yes'"):
        analyze_corpus(str(root), out=tmp_path / "x", **{**settings, "index": "yes"})
    assert not (tmp_path / "x").exists()


@pytest.mark.slow  # a second small run, without the index
def test_the_index_leaves_the_rows_unchanged(indexed_run, tmp_path):
    """The index's own forward (the last hidden states) is no analysis forward: the rows, the sink
    rows' massive activations among them, are those of the same run without an index."""
    root, result, settings = indexed_run
    plain = analyze_corpus(str(root), out=tmp_path / "plain", **{**settings, "index": False})
    assert not (plain.out / FOLDER).exists()
    pd.testing.assert_frame_equal(pd.read_parquet(plain.rows), pd.read_parquet(result.rows), check_exact=True)
