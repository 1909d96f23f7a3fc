"""A long causal window's q and k kept in a file (attnlab/hf/capture/spill.py): the same bytes back,
the same analysis, bit for bit, and the budget read from the environment with a worded error."""

import pytest
import torch

from attnlab.hf.capture import spill as spill_mod
from attnlab.hf.capture.spill import Spill
from attnlab.hf.compute import streamed
from attnlab.hf.compute.head_maps import HeadMaps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_stored_tensors_come_back_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    spill = Spill(0, 1)
    base = (torch.randn(2, 5, 7, 3, generator=g) * 100).to(dtype)
    tensors = [base, base.transpose(1, 2), base[:, 1:4, ::2], torch.empty(0, 3, dtype=dtype),
               base[0, 0, 0, 0]]
    where = [spill.put(t) for t in tensors]
    for t, w in zip(tensors, where, strict=True):
        back = spill.get(w)
        assert back.dtype == t.dtype and back.shape == t.shape
        assert torch.equal(back.reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8))
    again = spill.get(where[0])
    again.zero_()  # a private mapping: writing to it leaves the file (and every other mapping) as it was
    assert torch.equal(spill.get(where[0]), base)


def test_nan_and_infinities_survive_the_file():
    spill = Spill(0, 1)
    t = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45])
    back = spill.get(spill.put(t))
    assert torch.equal(back.view(torch.int32), t.view(torch.int32))


@pytest.mark.parametrize(("raw", "ok"), [("0", 0), ("123", 123), ("-1", None), ("lots", None), ("1.5", None)])
def test_the_budget_comes_from_the_environment(raw, ok, monkeypatch):
    monkeypatch.setenv("ATTNLAB_SPILL_BYTES", raw)
    if ok is None:
        with pytest.raises(ValueError, match=f"ATTNLAB_SPILL_BYTES must be a non-negative integer .*{raw!r}"):
            spill_mod.spill_bytes()
    else:
        assert spill_mod.spill_bytes() == ok
    monkeypatch.delenv("ATTNLAB_SPILL_BYTES")
    assert spill_mod.spill_bytes() == spill_mod.SPILL_BYTES


def test_small_windows_stay_in_memory():
    spill = Spill(10**9, 12)
    from attnlab.hf.capture.run_state import CapturedLayer

    c = CapturedLayer(query=torch.ones(1, 2, 3, 4), key_heads=torch.ones(1, 1, 3, 4), mask=None, scaling=0.5,
                      causal=True)
    assert spill.layer(c) is c and spill.active is False


def _analyse(loaded, text, budget, monkeypatch):
    from attnlab import hf

    monkeypatch.setenv("ATTNLAB_SPILL_BYTES", str(budget))
    return hf.analyze(text, loaded, variants=("unas", "dnas", "hnas", "sinkhorn", "softmax1", "sparsemax"),
                      u=0.3).windows[0]


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])
def test_a_spilled_window_analyses_bit_for_bit_as_in_memory(arch, tiny_model_dir, english_text, monkeypatch):
    """Table, every head's weights, column masses and sink statistics of a spilled window equal those
    of the same window kept in memory (the same bytes are read back; GQA, softcap, sliding windows)."""
    from attnlab import hf

    loaded = hf.load_model(tiny_model_dir(arch))
    text = english_text[:400]
    kept = _analyse(loaded, text, 10**12, monkeypatch)
    spilled = _analyse(loaded, text, 0, monkeypatch)
    assert isinstance(spilled.weights["unas"], HeadMaps)
    window = spilled.weights["unas"].window
    assert isinstance(window.layers, streamed.MappedLayers)
    assert not isinstance(kept.weights["unas"].window.layers, streamed.MappedLayers)
    a, b = kept.table(), spilled.table()
    assert a.equals(b)
    L, H = kept.weights["unas"].shape[:2]
    for v in kept.weights:
        for layer in range(L):
            for h in range(H):
                assert torch.equal(kept.weights[v][layer, h], spilled.weights[v][layer, h]), (v, layer, h)
    assert a.equals(spilled.table())  # and again, after every head was read
    assert kept.sinks().equals(spilled.sinks())
    for v, m in kept.weights["unas"].window.column_masses().items():
        assert torch.equal(m, window.column_masses()[v])


def test_mapped_layers_map_afresh_and_refuse_slices(tiny_model_dir, english_text, monkeypatch):
    from attnlab import hf

    loaded = hf.load_model(tiny_model_dir("llama"))
    layers = _analyse(loaded, english_text[:200], 0, monkeypatch).weights["unas"].window.layers
    first, again = layers[0], layers[0]
    assert torch.equal(first.query, again.query) and first.query.data_ptr() != again.query.data_ptr()
    assert len(list(layers)) == len(layers) == loaded.info.n_layers
    with pytest.raises(TypeError, match="one layer index"):
        layers[0:2]


def test_a_spill_folder_without_room_is_a_worded_error_before_writing(tiny_model_dir, english_text,
                                                                      monkeypatch, tmp_path):
    """Too little free space where the q and k file would go (a small tmpfs /tmp, a full disk): a
    ValueError naming the sizes, the folder and ATTNLAB_SPILL_DIR, at the first layer; nothing written."""
    import shutil
    from collections import namedtuple

    from attnlab import hf

    loaded = hf.load_model(tiny_model_dir("llama"))
    monkeypatch.setenv("ATTNLAB_SPILL_DIR", str(tmp_path))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda folder: usage(10**9, 10**9 - 100, 100))
    with pytest.raises(ValueError, match=rf"keeps its q and k in a file of .* GiB, and {tmp_path} has "
                                         r"0.0 GiB free: set ATTNLAB_SPILL_DIR"):
        _analyse(loaded, english_text[:400], 0, monkeypatch)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(shutil, "disk_usage", lambda folder: usage(10**12, 0, 10**12))
    assert isinstance(_analyse(loaded, english_text[:400], 0, monkeypatch).weights["unas"], HeadMaps)


def _spill_of(*tensors):
    """A spill holding ``tensors`` -> (spill, where each lies)."""
    spill = Spill(0, 1)
    return spill, [spill.put(t) for t in tensors]


def test_a_finished_file_is_written_over_by_the_next_spill():
    """Once a spill and every mapping of its file are gone, the next spill takes that file (its pages
    are reused, docs/BENCHMARKS.md "Twenty-first session"), keeps its length, and reads its own bytes."""
    spill_mod.clear_pool()
    g = torch.Generator().manual_seed(1)
    big, small = torch.randn(3, 70_000, generator=g), torch.randn(5, 7, generator=g)
    first, _ = _spill_of(big)
    handle, size = first._file.handle, first._file.size
    assert size >= big.numel() * 4
    del first
    second, where = _spill_of(small)
    assert second._file.handle is handle and second._file.size == size  # the same file, not truncated
    assert torch.equal(second.get(where[0]), small)
    third, _ = _spill_of(small)  # the file is taken: another spill meanwhile gets a new one
    assert third._file.handle is not handle
    del second, third
    assert spill_mod.clear_pool() == spill_mod.POOL_FILES  # one kept, the other closed
    assert handle.closed


def test_a_file_that_is_still_mapped_is_never_written_over():
    """A tensor that maps a finished spill's file keeps its values: the file is not reused until the
    last such tensor is gone."""
    spill_mod.clear_pool()
    original = torch.arange(20_000, dtype=torch.float32)
    first, where = _spill_of(original)
    held = first.get(where[0])[5:9]  # a view keeps the mapping
    handle = first._file.handle
    del first
    second, _ = _spill_of(torch.full((20_000,), -1.0))
    assert second._file.handle is not handle
    del second
    third, _ = _spill_of(torch.full((20_000,), -2.0))  # takes the second's file, not the held one
    assert third._file.handle is not handle
    assert torch.equal(held, original[5:9])
    del held, third
    fourth, where = _spill_of(torch.full((10,), 3.0))
    assert fourth._file.handle is not None and torch.equal(fourth.get(where[0]), torch.full((10,), 3.0))
    del fourth
    spill_mod.clear_pool()


def test_a_kept_file_of_another_folder_is_not_used(monkeypatch, tmp_path):
    spill_mod.clear_pool()
    first, _ = _spill_of(torch.ones(4))
    handle = first._file.handle
    del first
    monkeypatch.setenv("ATTNLAB_SPILL_DIR", str(tmp_path))
    second, where = _spill_of(torch.zeros(4))
    assert second._file.handle is not handle and second._file.folder == str(tmp_path)
    assert torch.equal(second.get(where[0]), torch.zeros(4))
    del second
    assert spill_mod.clear_pool() == 1 and handle.closed  # the pool keeps one file: the first was closed


def test_analyses_that_reuse_the_spill_file_agree_bit_for_bit(tiny_model_dir, english_text, monkeypatch):
    """Spilled analyses of two one-window texts one after the other, each result dropped before the
    next: after the first two, no new file is made, and each equals its text's first analysis (table
    and weights) over the file written over."""
    import tempfile

    from attnlab import hf

    spill_mod.clear_pool()
    made, temporary_file = [], tempfile.TemporaryFile
    monkeypatch.setattr(tempfile, "TemporaryFile", lambda **kw: made.append(1) or temporary_file(**kw))
    monkeypatch.setenv("ATTNLAB_SPILL_BYTES", "0")
    loaded = hf.load_model(tiny_model_dir("llama"))
    texts = [english_text[:150], english_text[-200:]]

    def analyse(text):
        result = hf.analyze(text, loaded, variants=("unas", "dnas", "hnas", "sinkhorn", "softmax1"), u=0.3)
        assert result.n_windows == 1
        return result

    first = [analyse(t) for t in texts]  # both alive: two files
    tables = [r.table() for r in first]
    maps = [r.weights["hnas"][1, 0].clone() for r in first]
    assert len(made) == 2
    del first
    for i in (1, 0, 1):
        again = analyse(texts[i])
        assert again.table().equals(tables[i])
        assert torch.equal(again.weights["hnas"][1, 0], maps[i])
        del again
    assert len(made) == 2  # every later analysis wrote over the kept file
    spill_mod.clear_pool()


def test_a_file_longer_than_the_pool_keeps_is_closed(monkeypatch):
    """A finished file longer than POOL_MAX_BYTES is closed, not kept (its disk space is freed)."""
    spill_mod.clear_pool()
    monkeypatch.setattr(spill_mod, "POOL_MAX_BYTES", 100_000)
    small, _ = _spill_of(torch.ones(10))
    big, _ = _spill_of(torch.ones(50_000))
    small_handle, big_handle = small._file.handle, big._file.handle
    del big
    assert big_handle.closed and spill_mod._POOL == []
    del small
    assert not small_handle.closed and spill_mod.clear_pool() == 1
