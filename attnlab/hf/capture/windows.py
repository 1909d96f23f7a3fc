"""Tokenizing a text once and cutting it into overlapping windows of the model's length.

The text is tokenized in chunks of about ``CHUNK_CHARS`` characters cut at whitespace (so memory stays
bounded for very long texts), into compact int arrays: ~16 bytes per token. A window holds
``content`` text tokens between the model's special tokens ([CLS] ... [SEP] for BERT, <s> ... </s> for
RoBERTa, BOS for LLaMA, nothing for GPT-2); consecutive windows start ``stride`` tokens apart, so
they share ``overlap = content - stride`` tokens. The last window ends at the last token.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import unicodedata
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

__all__ = ["TokenizedText", "Windowing", "Window", "tokenize_text", "plan_windows", "iter_windows",
           "tokenizer_source", "check_token_ids"]

CHUNK_CHARS = 200_000  # characters tokenized at once
MAX_DEFAULT_WINDOW = 512  # default cap on the window (weights are L x H x N^2 per variant)
_WHITESPACE = re.compile(r"\s")


@dataclass(frozen=True)
class TokenizedText:
    """The text's tokens without special tokens; arrays of length T."""

    ids: np.ndarray  # (T,) int64 token ids
    word_ids: np.ndarray  # (T,) int64 word index in the whole text (pre-tokenizer words)
    starts: np.ndarray  # (T,) int64 character offset where the token starts (-1 if unknown)
    ends: np.ndarray  # (T,) int64 character offset where the token ends (-1 if unknown)

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class Windowing:
    """How a text was cut into windows (token counts exclude special tokens unless stated)."""

    window: int  # tokens per full window, special tokens included
    content: int  # text tokens per full window
    stride: int  # text tokens between the starts of consecutive windows
    overlap: int  # text tokens shared by consecutive windows (content - stride)
    n_tokens: int  # text tokens in the whole text
    n_windows: int
    starts: tuple[int, ...]  # first text token of each window

    def as_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class Window:
    """One model input: text tokens [start, stop) between the special tokens."""

    index: int
    start: int  # first text token (index into the TokenizedText)
    stop: int  # one past the last text token
    input_ids: list[int]  # (N,) with special tokens
    tokens: list[str]  # (N,) tokenizer pieces, e.g. "##ing" or "Ġthe"
    word_ids: list[int | None]  # (N,) word index in the whole text; None for special tokens
    special: np.ndarray  # (N,) bool, special tokens ([CLS], [SEP], <s>, ...)
    punctuation: np.ndarray  # (N,) bool, pieces made only of punctuation/symbol characters
    char_spans: list[tuple[int, int]]  # (N,) character span in the text; (-1, -1) for special tokens


def _chunks(text: str, size: int) -> Iterator[tuple[int, str]]:
    """(offset, piece) with pieces of about ``size`` characters, cut just before a whitespace."""
    start = 0
    while start < len(text):
        stop = min(start + size, len(text))
        if stop < len(text):
            m = _WHITESPACE.search(text, stop, stop + size)
            stop = m.start() if m else stop  # no whitespace near: cut inside a word (bounded memory)
        yield start, text[start:stop]
        start = stop


def tokenizer_source(tokenizer) -> str:
    """The file a tokenizer was read from, for messages: a native checkpoint's vocabulary, a Hugging
    Face directory's tokenizer.json (or the directory), else the tokenizer's class."""
    path = getattr(tokenizer, "source", None) or getattr(tokenizer, "name_or_path", None)
    if not path:
        return f"the {type(tokenizer).__name__} tokenizer"
    file = os.path.join(path, "tokenizer.json")
    return file if os.path.isfile(file) else path


def _encode(tokenizer, piece: str, offset: int, **kwargs):
    """``tokenizer(piece, **kwargs)``; a worded ValueError when the tokenizer fails on it: text it cannot
    encode (a lone surrogate), or a panic of the Rust tokenizers library (a BaseException)."""
    try:
        return tokenizer(piece, add_special_tokens=False, verbose=False, **kwargs)
    except (TypeError, UnicodeEncodeError):
        bad = next((i for i, ch in enumerate(piece) if 0xD800 <= ord(ch) <= 0xDFFF), None)
        if bad is None:
            raise
        raise ValueError(f"text has a lone surrogate U+{ord(piece[bad]):04X} at character {offset + bad}, "
                         f"which {tokenizer_source(tokenizer)} cannot encode; expected valid Unicode text "
                         "(decode files with errors='replace')") from None
    except BaseException as e:  # pyo3's PanicException derives from BaseException, not Exception
        if type(e).__name__ != "PanicException":
            raise
        raise ValueError(f"the tokenizer {tokenizer_source(tokenizer)} failed on the text near character "
                         f"{offset} (a panic in the tokenizers library: {str(e)[:120]}); expected a "
                         "tokenizer that can encode any text") from None


def check_token_ids(tokenized: TokenizedText, extra_ids, n_embeddings: int, tokenizer) -> None:
    """ValueError naming the tokenizer file when it gave an id beyond the model's ``n_embeddings``
    embedding rows (the forward would fail with IndexError): a tokenizer of another model."""
    top = max(int(tokenized.ids.max()) if len(tokenized) else -1, max(extra_ids, default=-1))
    if top >= n_embeddings:
        raise ValueError(f"the tokenizer {tokenizer_source(tokenizer)} gave token id {top}, but the model "
                         f"has {n_embeddings} embedding rows; expected a tokenizer whose ids fit the model "
                         "(ids < vocab_size)")


def tokenize_text(tokenizer, text: str, chunk_chars: int = CHUNK_CHARS) -> TokenizedText:
    """Tokenize without special tokens, with global word ids and character offsets."""
    ids, words, starts, ends = [], [], [], []
    word_base = 0
    for offset, piece in _chunks(text, chunk_chars):
        try:
            enc = _encode(tokenizer, piece, offset, return_offsets_mapping=True)
            spans = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2) + offset
            w = enc.word_ids()
        except (NotImplementedError, ValueError, AttributeError):  # tokenizers without offsets
            enc = _encode(tokenizer, piece, offset)
            spans = np.full((len(enc["input_ids"]), 2), -1, dtype=np.int64)
            w = list(range(len(enc["input_ids"])))
        w = np.asarray([(-1 if x is None else x) for x in w], dtype=np.int64)
        ids.append(np.asarray(enc["input_ids"], dtype=np.int64))
        words.append(np.where(w >= 0, w + word_base, -1))
        starts.append(spans[:, 0])
        ends.append(spans[:, 1])
        if len(w):
            word_base += int(w.max()) + 1
    return TokenizedText(ids=_cat(ids), word_ids=_cat(words), starts=_cat(starts), ends=_cat(ends))


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


# tokenizer -> (its vocabulary size when asked, (prefix, suffix)): two tokenizer calls saved per window
_AFFIXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def special_affixes(tokenizer) -> tuple[list[int], list[int]]:
    """The special token ids the tokenizer puts before and after a single text (kept per tokenizer
    while its vocabulary keeps its size)."""
    try:
        size = len(tokenizer)
        kept_size, affixes = _AFFIXES.get(tokenizer, (None, None))
    except TypeError:  # no vocabulary size, or not weakly referable: not kept
        size, kept_size, affixes = None, None, None
    if affixes is None or kept_size != size:
        affixes = _find_affixes(tokenizer)
        if size is not None:
            with contextlib.suppress(TypeError):  # not weakly referable
                _AFFIXES[tokenizer] = (size, affixes)
    return list(affixes[0]), list(affixes[1])


def _find_affixes(tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    core = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    for i in range(len(full) - len(core) + 1):
        if full[i : i + len(core)] == core:
            return tuple(full[:i]), tuple(full[i + len(core) :])
    return (), ()


def plan_windows(n_tokens: int, window: int, n_special: int, overlap: int | None = None) -> Windowing:
    """Window starts for ``n_tokens`` text tokens; ``overlap`` defaults to a quarter of a window."""
    content = window - n_special
    if content < 2:
        raise ValueError(f"window must leave room for at least 2 text tokens, got window={window}")
    overlap = content // 4 if overlap is None else overlap
    if isinstance(overlap, bool) or not isinstance(overlap, int | np.integer) or not 0 <= overlap < content:
        raise ValueError(f"overlap must be an integer in [0, {content - 1}] tokens for this window, "
                         f"got {overlap!r}")
    overlap = int(overlap)  # a numpy integer as a Python int (the windowing goes into JSON manifests)
    stride = content - overlap
    starts = [0]
    while starts[-1] + content < n_tokens:
        starts.append(min(starts[-1] + stride, n_tokens - content))
    return Windowing(
        window=window,
        content=content,
        stride=stride,
        overlap=overlap,
        n_tokens=n_tokens,
        n_windows=len(starts),
        starts=tuple(starts),
    )


@functools.lru_cache(maxsize=1 << 16)  # a text's pieces repeat: each is classified once
def _is_punctuation(piece: str) -> bool:
    piece = piece.strip()
    return bool(piece) and all(unicodedata.category(ch)[0] in "PS" for ch in piece)


def iter_windows(tokenizer, text: str, tokenized: TokenizedText, windowing: Windowing) -> Iterator[Window]:
    """Yield the windows of ``windowing`` one at a time (nothing model-sized is held)."""
    prefix, suffix = special_affixes(tokenizer)
    for index, start in enumerate(windowing.starts):
        stop = min(start + windowing.content, len(tokenized))
        ids = [*prefix, *tokenized.ids[start:stop].tolist(), *suffix]
        n_pre, n_text = len(prefix), stop - start
        special = np.zeros(len(ids), dtype=bool)
        special[:n_pre] = True
        special[n_pre + n_text :] = True
        spans = [(-1, -1)] * n_pre
        spans += list(
            zip(tokenized.starts[start:stop].tolist(), tokenized.ends[start:stop].tolist(), strict=True)
        )
        spans += [(-1, -1)] * len(suffix)
        words = [None] * n_pre + tokenized.word_ids[start:stop].tolist() + [None] * len(suffix)
        words = [None if w is not None and w < 0 else w for w in words]
        punctuation = np.array(
            [
                not s and a >= 0 and _is_punctuation(text[a:b])
                for s, (a, b) in zip(special, spans, strict=True)
            ]
        )
        yield Window(
            index=index,
            start=start,
            stop=stop,
            input_ids=ids,
            tokens=tokenizer.convert_ids_to_tokens(ids),
            word_ids=words,
            special=special,
            punctuation=punctuation,
            char_spans=spans,
        )
