"""Property-based and case suite over the files and paths a user gives (issue 26, part A): attnlab
checkpoint configs, trainer state, figure manifests, Hugging Face config.json, tokenizer files,
corpus files, the CLI's --threads / --device, and the app's model paths.

Every case ends in one of two outcomes: the file is read as it should be, or a ValueError whose
message names the file (or argument), the field, what was expected and what was seen; never a
RecursionError, IndexError, KeyError, TypeError or a BaseException, never minutes of allocation, and
never the contents of a file the user did not name. (Rows for docs/RELIABILITY.md come from
tests/test_reliability.py; this module writes none, so the fuzz section is not rewritten by it.)
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from fuzzkit import fuzz_settings, one_thread  # noqa: F401 - autouse fixture
from hypothesis import given
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "checkpoints" / "enc-unas"
sys.path.insert(0, str(REPO / "app"))

# values of every JSON type, and numbers far outside any bound
ODD = st.one_of(
    st.integers(-(2**63), 2**63), st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
    st.text(max_size=8), st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def _step(run: Path) -> Path:
    return run / json.loads((run / "latest.json").read_text())["dir"]


@pytest.fixture(autouse=True)
def own_model_caches(monkeypatch):
    """The model caches swapped for empty ones while a test here runs (its hf.clear_model_cache() empties
    those): the session's loaded models (the minilm fixture) stay cached for the other tests."""
    from attnlab.hf.load import loading, native

    monkeypatch.setattr(loading, "_CACHE", {})
    monkeypatch.setattr(loading, "_DEVICE_CACHE", {})
    monkeypatch.setattr(native, "_CACHE", {})


@pytest.fixture(scope="module")
def run_copy(tmp_path_factory):
    """A private copy of a shipped checkpoint (configs are rewritten per example, then restored)."""
    run = tmp_path_factory.mktemp("ck") / "run"
    shutil.copytree(SHIPPED, run)
    return run


@pytest.fixture(scope="module")
def tiny_copy(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("hf") / "bert"
    shutil.copytree(tiny_model_dir("bert"), d)
    return d


# ----------------------------------------------------------------------------------------------
# attnlab checkpoint configs: bounded, typed, checked against the weights' header
# ----------------------------------------------------------------------------------------------

MODEL_FIELDS = ["vocab_size", "max_len", "d_model", "n_layers", "n_heads", "d_ff", "iters", "kind", "variant",
                "gam", "u", "dropout", "pad_id", "learn_u", "gam_options"]


@fuzz_settings(30)
@given(field=st.sampled_from(MODEL_FIELDS), value=ODD)
def test_checkpoint_config_fields_are_validated(run_copy, field, value):
    from attnlab.models import load

    cfg_file = _step(run_copy) / "config.json"
    original = cfg_file.read_text()
    cfg = json.loads(original)
    if cfg["model"].get(field) == value and type(cfg["model"].get(field)) is type(value):
        return
    cfg["model"][field] = value
    try:
        cfg_file.write_text(json.dumps(cfg))
        started = time.monotonic()
        try:
            load(run_copy)
        except ValueError as e:
            assert "config.json" in str(e) or "model.safetensors" in str(e), str(e)
        assert time.monotonic() - started < 20, "a crafted config took a long time to refuse"
    finally:
        cfg_file.write_text(original)


@pytest.mark.parametrize("missing", ["model", "format", "n_layers", "d_model", "vocab_size"])
def test_checkpoint_config_required_fields(run_copy, missing):
    from attnlab.models import load

    cfg_file = _step(run_copy) / "config.json"
    original = cfg_file.read_text()
    cfg = json.loads(original)
    (cfg if missing in cfg else cfg["model"]).pop(missing)
    try:
        cfg_file.write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match=f"config.json.*{missing}"):
            load(run_copy)
    finally:
        cfg_file.write_text(original)


@fuzz_settings(12)
@given(depth=st.integers(33, 200_000))
def test_deeply_nested_json_is_a_worded_error(tmp_path_factory, depth):
    from attnlab.schema import SchemaError, loads

    text = "[" * depth + "]" * depth
    with pytest.raises(SchemaError, match="nested more than 32 levels"):
        loads(text, "x.json")
    d = tmp_path_factory.mktemp("deep")
    (d / "config.json").write_text('{"format": "attnlab-checkpoint/1", "model": ' + text + "}")
    (d / "model.safetensors").write_bytes(b"")
    from attnlab.models import load

    with pytest.raises(ValueError, match="nested more than"):
        load(d)


@pytest.mark.parametrize("name", ["/etc/passwd", "../../etc/passwd", "..", "a/b", "", "link"])
def test_vocab_file_stays_inside_the_checkpoint(run_copy, tmp_path, name):
    from attnlab import hf
    from attnlab.data import load_tokenizer

    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-LINE\n" * 5)
    step = _step(run_copy)
    cfg_file = step / "config.json"
    original = cfg_file.read_text()
    cfg = json.loads(original)
    if name == "link":
        (step / "link").symlink_to(secret)
    cfg["tokenizer"] = {"kind": "wordpiece", "vocab_file": name}
    try:
        cfg_file.write_text(json.dumps(cfg))
        with pytest.raises(ValueError) as e:
            load_tokenizer(run_copy)
        hf.clear_model_cache()
        with pytest.raises(hf.ModelLoadError) as e2:
            hf.load_model(run_copy)
        for msg in (str(e.value), str(e2.value)):
            assert "TOP-SECRET" not in msg and "root:" not in msg and "config.json" in msg, msg
    finally:
        cfg_file.write_text(original)
        if (step / "link").is_symlink():
            (step / "link").unlink()
        hf.clear_model_cache()


def test_weights_header_is_checked_before_allocating(run_copy):
    """A config whose sizes fit the bounds but not the weights is refused from the header's shapes."""
    from attnlab.models import load

    cfg_file = _step(run_copy) / "config.json"
    original = cfg_file.read_text()
    for change in ({"n_layers": 200}, {"d_ff": 60_000}, {"vocab_size": 1_000_000}, {"max_len": 60_000}):
        cfg = json.loads(original)
        cfg["model"].update(change)
        cfg_file.write_text(json.dumps(cfg))
        started = time.monotonic()
        try:
            with pytest.raises(ValueError, match="does not match .*config.json"):
                load(run_copy)
        finally:
            cfg_file.write_text(original)
        assert time.monotonic() - started < 10


# ----------------------------------------------------------------------------------------------
# Trainer state
# ----------------------------------------------------------------------------------------------

STATE = {"step": 10, "data_position": {"epoch": 0, "cursor": 3}, "tokens_seen": 100, "corpus_sha256": "ab",
         "world_size": 1, "loss_window": [1.5, 2]}


@fuzz_settings(40)
@given(path=st.sampled_from(["step", "tokens_seen", "world_size", "loss_window", "data_position",
                             "data_position.epoch", "data_position.cursor"]), value=ODD)
def test_trainer_state_is_validated(tmp_path_factory, path, value):
    from attnlab.train.checkpoint import CheckpointError, load_trainer_state

    state = copy.deepcopy(STATE)
    where, _, key = path.rpartition(".")
    target = state[where] if where else state
    if target.get(key) == value and type(target.get(key)) is type(value):
        return
    target[key] = value
    d = tmp_path_factory.mktemp("state")
    (d / "trainer_state.json").write_text(json.dumps(state))
    try:
        got = load_trainer_state(d, 10)
    except CheckpointError as e:
        assert "trainer_state.json" in str(e) and key in str(e), str(e)
    else:  # accepted: it is a valid state
        assert got["step"] == 10 and got["data_position"]["cursor"] >= 0


# ----------------------------------------------------------------------------------------------
# Figure manifests
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def analyze_out(tmp_path_factory):
    """A minimal `attnlab analyze` output: manifest.json + weights.npz of 2 layers x 3 heads x 4 tokens."""
    d = tmp_path_factory.mktemp("out")
    (d / "manifest.json").write_text(json.dumps({"input": {"sha256": "s" * 64}}))
    w = np.full((2, 3, 4, 4), 0.25, dtype=np.float32)
    np.savez(d / "weights.npz", tokens=np.array(["[CLS]", "a", "b", "[SEP]"]), unas=w, dnas=w)
    return d


def _manifest(**params) -> dict:
    return {"format": "attnlab-figure/1", "input": {"sha256": "s" * 64},
            "figure": {"kind": "heatmap", "window": 0, "labels": [],
                       "params": {"variant": "unas", "layer": 1, "head": 2, "focus": None, **params}},
            "sources": [{"model": {}, "settings": {"u": 0.5}}]}


def test_a_valid_manifest_reproduces(analyze_out):
    from attnlab.figures import reproduce_figure

    assert reproduce_figure(_manifest(), [analyze_out]).figure is not None


@fuzz_settings(40)
@given(field=st.sampled_from(["layer", "head", "focus", "variant", "variants", "eps", "max_tokens"]),
       value=ODD)
def test_crafted_manifest_params(analyze_out, field, value):
    from attnlab.figures import reproduce_figure

    try:
        reproduce_figure(_manifest(**{field: value}), [analyze_out])
    except ValueError as e:
        assert "manifest" in str(e), str(e)


@fuzz_settings(30)
@given(path=st.sampled_from(["format", "figure", "input", "sources", "figure.kind", "figure.window",
                             "figure.params", "figure.labels", "input.sha256"]), value=ODD)
def test_crafted_manifest_structure(analyze_out, path, value):
    from attnlab.figures import reproduce_figure

    m = _manifest()
    where, _, key = path.rpartition(".")
    (m[where] if where else m)[key] = value
    with pytest.raises(ValueError):
        reproduce_figure(m, [analyze_out])


def test_negative_head_is_refused(analyze_out):
    from attnlab.figures import reproduce_figure

    with pytest.raises(ValueError, match=r"figure.params.head must be an integer >= 0.*got -1"):
        reproduce_figure(_manifest(head=-1), [analyze_out])
    with pytest.raises(ValueError, match=r"figure.params.head must be in \[0, 2\].*got 3"):
        reproduce_figure(_manifest(head=3), [analyze_out])


# ----------------------------------------------------------------------------------------------
# Hugging Face config.json: bounded and checked against the safetensors headers
# ----------------------------------------------------------------------------------------------

HF_FIELDS = ["num_hidden_layers", "num_attention_heads", "hidden_size", "intermediate_size", "vocab_size",
             "max_position_embeddings", "type_vocab_size"]


@fuzz_settings(25)
@given(field=st.sampled_from(HF_FIELDS), value=st.one_of(st.integers(2**10, 2**40), st.integers(-5, 0),
                                                          st.text(max_size=4), st.floats()))
def test_hf_config_sizes_are_bounded(tiny_copy, field, value):
    from attnlab import hf

    cfg_file = tiny_copy / "config.json"
    original = cfg_file.read_text()
    cfg = json.loads(original)
    cfg[field] = value
    try:
        cfg_file.write_text(json.dumps(cfg))
        hf.clear_model_cache()
        started = time.monotonic()
        with pytest.raises(hf.ModelLoadError):
            hf.load_model(tiny_copy)
        assert time.monotonic() - started < 20
    finally:
        cfg_file.write_text(original)
        hf.clear_model_cache()


@pytest.mark.parametrize("change, field", [({"num_hidden_layers": 1_000_000}, "num_hidden_layers"),
                                           ({"num_hidden_layers": 50}, "num_hidden_layers"),
                                           ({"hidden_size": 60_000}, "hidden_size"),
                                           ({"max_position_embeddings": 100_000}, "max_position_embeddings")])
def test_hf_config_is_checked_against_the_weights(tiny_copy, change, field):
    from attnlab import hf

    cfg_file = tiny_copy / "config.json"
    original = cfg_file.read_text()
    try:
        cfg_file.write_text(json.dumps({**json.loads(original), **change}))
        hf.clear_model_cache()
        with pytest.raises(hf.ModelLoadError, match=f"config.json: {field}"):
            hf.load_model(tiny_copy)
    finally:
        cfg_file.write_text(original)
        hf.clear_model_cache()


# ----------------------------------------------------------------------------------------------
# Tokenizer failures
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from attnlab import hf

    return hf.load_model(tiny_model_dir("bert"))


@fuzz_settings(25)
@given(before=st.text(max_size=20), cp=st.integers(0xD800, 0xDFFF), after=st.text(max_size=20))
def test_lone_surrogates_are_a_worded_error(tiny, before, cp, after):
    from attnlab import hf

    where = f"U\\+{cp:04X} at character {len(before)}"
    with pytest.raises(ValueError, match=f"lone surrogate {where}.*tokenizer"):
        hf.analyze(before + chr(cp) + after + " text", tiny, variants=("unas",))


@fuzz_settings(25)
@given(overlap=st.one_of(st.floats(allow_nan=True), st.booleans(), st.integers(-100, -1),
                         st.integers(62, 10**6), st.text(max_size=3)))
def test_overlap_is_an_integer_in_range(tiny, overlap):
    from attnlab import hf

    with pytest.raises(ValueError, match="overlap must be an integer"):
        hf.analyze("a few words of text", tiny, variants=("unas",), window=64, overlap=overlap)


class PanicException(BaseException):  # as pyo3_runtime.PanicException: a BaseException
    pass


def test_a_tokenizer_panic_is_a_worded_error(tiny):
    from attnlab.hf.capture.windows import tokenize_text

    class Panicking:
        name_or_path = tiny.info.path

        def __call__(self, *a, **k):
            raise PanicException("regex backtrack limit exceeded")

    with pytest.raises(ValueError, match="tokenizer .*tokenizer.json failed .*panic"):
        tokenize_text(Panicking(), "some text")

    class Interrupted(Panicking):
        def __call__(self, *a, **k):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # other BaseExceptions pass through
        tokenize_text(Interrupted(), "some text")


def test_token_ids_beyond_the_embedding(tiny):
    from attnlab import hf

    small = dataclasses.replace(tiny, model=copy.deepcopy(tiny.model))
    small.model.resize_token_embeddings(50)
    with pytest.raises(ValueError, match=r"tokenizer .* gave token id \d+, but the model has 50 embedding"):
        hf.analyze("a sentence with common words", small, variants=("unas",))


# ----------------------------------------------------------------------------------------------
# Corpus files: nothing vanishes
# ----------------------------------------------------------------------------------------------

WORD = st.text(alphabet="abcdefghij ", min_size=1, max_size=12).filter(str.strip)


@fuzz_settings(40)
@given(texts=st.lists(WORD, min_size=1, max_size=12), bad=st.data())
def test_csv_unterminated_quote_loses_no_record(tmp_path_factory, texts, bad):
    from attnlab.corpus.sources import open_source

    k = bad.draw(st.integers(0, len(texts) - 1))
    quote = '"'
    lines = ["id,text"] + [f"{i},{quote if i == k else ''}{t}" for i, t in enumerate(texts)]
    path = tmp_path_factory.mktemp("csv") / "c.csv"
    path.write_text("\n".join(lines) + "\n")
    src = open_source(str(path), id_column="id")
    ids = [d.id for d in src]
    assert ids == [str(i) for i in range(len(texts)) if i != k]
    assert [s["line"] for s in src.skipped] == [k + 2]
    assert "unterminated quote" in src.skipped[0]["reason"]


@fuzz_settings(30)
@given(ids=st.lists(ODD, min_size=1, max_size=6))
def test_jsonl_ids_and_texts_every_record_accounted_for(tmp_path_factory, ids):
    from attnlab.corpus.sources import open_source

    path = tmp_path_factory.mktemp("jl") / "c.jsonl"
    path.write_text("".join(json.dumps({"text": f"text {i}", "id": v}) + "\n" for i, v in enumerate(ids))
                    + "[" * 5000 + "]" * 5000 + "\n" + json.dumps({"text": ["no"], "id": "z"}) + "\n")
    src = open_source(str(path), id_column="id")
    docs = list(src)
    lines = {s.get("line") for s in src.skipped}  # (a duplicate id is skipped without a line)
    assert len(docs) + len(src.skipped) == len(ids) + 2  # every record is a document or a skip
    assert {len(ids) + 1, len(ids) + 2} <= lines
    assert all(isinstance(d.id, str) for d in docs)


# ----------------------------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["analyze", "train", "corpus"])
@pytest.mark.parametrize("threads", ["max+1", 3000, 10**9])
def test_threads_are_bounded(capsys, tmp_path, threads, command):
    from attnlab.cli import main
    from attnlab.schema import max_threads

    threads = max_threads() + 1 if threads == "max+1" else threads
    out = tmp_path
    args = {"analyze": ["analyze", str(out / "x.txt")], "train": ["train", "--recipe", "enc-unas", "--out",
            str(out / "r")], "corpus": ["corpus", "kjv", "--out", str(out / "c")]}[command]
    rc = main([*args, "--threads", str(threads)])
    err = capsys.readouterr().err
    assert rc == 2 and f"--threads must be an integer in [1, {max_threads()}]" in err and str(threads) in err
    assert not any(out.iterdir())


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "gpu", "CPU"])
def test_train_device_is_worded(capsys, tmp_path, device):
    from attnlab.cli import main

    rc = main(["train", "--recipe", "enc-unas", "--out", str(tmp_path / "r"), "--device", device,
               "--no-progress", "--steps", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and f"--device must be 'cpu', 'cuda', 'cuda:<index>' or 'auto', got {device!r}" in err


# ----------------------------------------------------------------------------------------------
# The app's model paths
# ----------------------------------------------------------------------------------------------


@fuzz_settings(40)
@given(path=st.one_of(st.sampled_from(["/", "/etc", "/root", "..", "../..", "~", "/proc/self", "/tmp",
                                       "checkpoints/../..", str(REPO), str(REPO / "attnlab")]),
                      st.text(alphabet="abc./~", max_size=12)))
def test_app_model_paths_outside_the_roots_are_refused(path, tmp_path_factory):
    from appkit.sources import CHECKPOINTS, check_model_path

    old = {k: os.environ.get(k) for k in ("ATTNLAB_MODEL_ROOTS", "ATTNLAB_RUNS_DIR", "ATTNLAB_UPLOADS_DIR")}
    base = tmp_path_factory.mktemp("roots")
    os.environ.pop("ATTNLAB_MODEL_ROOTS", None)
    os.environ["ATTNLAB_RUNS_DIR"], os.environ["ATTNLAB_UPLOADS_DIR"] = str(base / "runs"), str(base / "up")
    try:
        try:
            target = Path(path).expanduser().resolve()
        except RuntimeError:  # "~user" of no such user
            target = None
        inside = target is not None and any(target == r.resolve() or r.resolve() in target.parents
                                            for r in (CHECKPOINTS, base / "runs", base / "up"))
        if inside:
            assert check_model_path(path) == target
        else:
            with pytest.raises(ValueError, match="outside the folders this app loads|cannot be resolved"):
                check_model_path(path)
        assert check_model_path(str(CHECKPOINTS / "enc-unas")) == (CHECKPOINTS / "enc-unas").resolve()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_model_sizes_with_defaults_may_be_left_out():
    """d_ff, n_heads and max_len take ModelConfig's defaults when a checkpoint leaves them out (the
    sizes every checkpoint writes, vocab_size, d_model and n_layers, are required)."""
    from attnlab.models import ModelConfig
    from attnlab.schema import _DEFAULT, check_model_config

    model = {"vocab_size": 16, "d_model": 8, "n_layers": 1}
    assert check_model_config(model, "config.json") is model
    defaults = ModelConfig()
    assert _DEFAULT == {name: getattr(defaults, name) for name in _DEFAULT}
