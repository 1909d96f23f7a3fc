"""attnlab.data's tokenizers (WordPiece, bytes) behind the calls :mod:`attnlab.hf.capture.windows` makes of a
transformers tokenizer, so native checkpoints are windowed like Hugging Face models."""

from __future__ import annotations

import re

__all__ = ["NativeTokenizer"]


class _Encoding(dict):
    """``{"input_ids", "offset_mapping"}`` plus ``word_ids()``, as a transformers BatchEncoding."""

    def __init__(self, ids, offsets, words):
        super().__init__(input_ids=ids, offset_mapping=offsets)
        self._words = words

    def word_ids(self) -> list[int | None]:
        return self._words


_WORD = re.compile(r"\S+")


class NativeTokenizer:
    """An ``attnlab.data`` tokenizer (WordPiece or bytes) with the interface of a transformers
    tokenizer that the windowing needs: ``tok(text, add_special_tokens=..., return_offsets_mapping=...)``
    and ``convert_ids_to_tokens``. Encoders get [CLS] ... [SEP], as in training; decoders nothing."""

    def __init__(self, base, causal: bool, source: str | None = None):
        self.base = base  # attnlab.data.WordPieceTokenizer or ByteTokenizer
        self.source = source  # the checkpoint file it was read from (named in errors)
        self.prefix = [] if causal else [base.cls_id]
        self.suffix = [] if causal else [base.sep_id]
        self.model_max_length = None

    def _encode(self, text: str) -> tuple[list[int], list[tuple[int, int]], list[int | None]]:
        if self.base.kind == "wordpiece":
            enc = self.base._tok.encode(text, add_special_tokens=False)
            return list(enc.ids), [tuple(o) for o in enc.offsets], list(enc.word_ids)
        ids, offsets, words = [], [], []
        spans = {m.start() + i: w for w, m in enumerate(_WORD.finditer(text)) for i in range(len(m.group()))}
        for c, ch in enumerate(text):  # one id per UTF-8 byte, each spanning its character
            b = self.base.encode(ch)
            ids += b
            offsets += [(c, c + 1)] * len(b)
            words += [spans.get(c)] * len(b)
        return ids, offsets, words

    def __call__(self, text: str, add_special_tokens: bool = True, return_offsets_mapping: bool = False,
                 verbose: bool = False) -> _Encoding:
        ids, offsets, words = self._encode(text)
        if add_special_tokens:
            n0, n1 = len(self.prefix), len(self.suffix)
            ids = [*self.prefix, *ids, *self.suffix]
            offsets = [(0, 0)] * n0 + offsets + [(0, 0)] * n1
            words = [None] * n0 + words + [None] * n1
        return _Encoding(ids, offsets, words)

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return self.base.convert_ids_to_tokens(ids)
