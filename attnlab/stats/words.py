"""Tokens to words: word units from a tokenizer's word ids, word-level attention (columns summed, rows
averaged) and word labels from WordPiece "##", byte-level BPE "Ġ" and SentencePiece "▁" pieces."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from attnlab.stats._checks import check_weights


def _check_word_ids(word_ids) -> list[int | None]:
    if isinstance(word_ids, (str, bytes)) or not isinstance(word_ids, Sequence):
        raise ValueError(f"word_ids must be a sequence of ints or None (one per token), got "
                         f"{type(word_ids).__name__}")
    bad = [w for w in word_ids
           if w is not None and (isinstance(w, bool) or not isinstance(w, numbers.Integral))]
    if bad:
        raise ValueError(f"word_ids must hold ints or None (one per token), got {bad[0]!r}")
    return [None if w is None else int(w) for w in word_ids]


def word_units(word_ids: Sequence[int | None]) -> list[list[int]]:
    """Token indices of each unit: a word's pieces (in order of the word's first token), or one
    special token (word id None) on its own."""
    units: list[list[int]] = []
    seen: dict[int, int] = {}
    for t, wid in enumerate(_check_word_ids(word_ids)):
        if wid is None:
            units.append([t])
        elif wid in seen:
            units[seen[wid]].append(t)
        else:
            seen[wid] = len(units)
            units.append([t])
    return units
def word_aggregate(weights: torch.Tensor, word_ids: Sequence[int | None]) -> torch.Tensor:
    """Token-level (..., N, N) weights -> word-level (..., U, U), U = len(word_units(word_ids)).

    Convention (Clark et al., 2019): attention *received* by a word is the sum over its pieces
    (columns summed), attention *given* by a word is the mean over its pieces (rows averaged). Rows
    that summed to 1 still sum to 1. Special tokens (word id None) stay units of their own; padding
    should be removed before aggregating (it would otherwise become units too).
    """
    w = check_weights("weights", weights)
    word_ids = _check_word_ids(word_ids)
    N = w.shape[-1]
    if w.shape[-2] != N or len(word_ids) != N:
        raise ValueError(
            f"weights must be (..., N, N) with N == len(word_ids); got weights "
            f"{tuple(w.shape)} and {len(word_ids)} word ids"
        )
    units = word_units(word_ids)
    assign = w.new_zeros(len(units), N)  # (U, N) one-hot: token t belongs to unit u
    for u, toks in enumerate(units):
        assign[u, toks] = 1.0
    rows = assign / assign.sum(-1, keepdim=True)  # averaging over a unit's tokens
    return rows @ w @ assign.T  # (..., U, U)


_WORD_START = ("Ġ", "▁")  # byte-level BPE (GPT-2, RoBERTa) and SentencePiece word-start markers
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (byte-level BPE alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, map(chr, cs), strict=True))


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def _decode_byte_level(text: str) -> str:
    if all(c in _UNICODE_TO_BYTE for c in text):
        return bytes(_UNICODE_TO_BYTE[c] for c in text).decode("utf-8", errors="replace")
    return text


def merge_tokens(
    tokens: Sequence[str], word_ids: Sequence[int | None], byte_level: bool | None = None
) -> list[str]:
    """One label per unit of ``word_units(word_ids)``: the unit's pieces joined into a word.

    WordPiece continuation markers "##" and word-start markers "Ġ" / "▁" are removed; special tokens
    are kept as they are. ``byte_level`` (default: auto, True when a token starts with "Ġ") decodes
    GPT-2 byte-level pieces back to UTF-8 text (e.g. "Ã©" -> "é").
    """
    word_ids = _check_word_ids(word_ids)
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence) or not all(
            isinstance(t, str) for t in tokens):
        raise ValueError(f"tokens must be a sequence of str (one per token), got {type(tokens).__name__}")
    if len(tokens) != len(word_ids):
        raise ValueError(f"tokens and word_ids must have one length, got {len(tokens)} and {len(word_ids)}")
    if byte_level is None:
        byte_level = any(t.startswith("Ġ") for t in tokens)
    labels = []
    for toks in word_units(word_ids):
        if word_ids[toks[0]] is None:
            labels.append(tokens[toks[0]])
            continue
        pieces = []
        for t in (tokens[i] for i in toks):
            if t.startswith("##"):
                t = t[2:]
            elif t.startswith(_WORD_START):
                t = t[1:]
            pieces.append(t)
        word = "".join(pieces)
        labels.append(_decode_byte_level(word) if byte_level else word)
    return labels


