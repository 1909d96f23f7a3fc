"""Training pairs of the ``s2s-hnas`` recipe: a passage of the corpus and its *lead* summary.

The paper's summarization setting (Fig. 5 of "Attention that does not Explain Away") puts HNAS in the
encoder of an encoder-decoder trained on headline generation. The project's corpora (KJV, Shakespeare)
have no headlines, so the target is built from the passage itself, the "lead" rule of news summaries
(Gigaword's headlines are written from an article's first sentence; Lead-3 is the standard CNN/DM
baseline):

- **source**: ``[CLS]`` + the first ``seq_len - 2`` tokens of consecutive corpus lines + ``[SEP]``
  (fixed length, no padding). A passage starts at the beginning of a line that starts with a letter
  and is not all upper case (not a speaker's name such as ``BRUTUS.``, nor a stage direction
  ``[Exeunt.]``, nor a heading); the next passage starts at the line after the one that was cut.
- **target** (the labels): ``[CLS]`` + the passage's first sentence: its tokens up to and including the
  first ``.``, ``?`` or ``!``, at most ``target_len`` tokens (cut there otherwise) + ``[SEP]``; padded
  with -100. The decoder starts from ``[SEP]`` (BART's rule: decoder start = end-of-sequence token).

It is an extractive summary: the decoder must find where the first sentence ends and copy it, which
needs the encoder to carry each position's token and the sentence boundary. It is cheap, exact and
offline; it is not an abstractive headline (docs/TRAINING.md says so).

Every 50th pair is held out (:data:`attnlab.train.hf_data.EVAL_STRIDE`); batches follow
:class:`attnlab.train.hf_data.HFWindows`' order (epoch permutations seeded by (seed, epoch)), so a batch
is a pure function of (seed, step, data position) and a resume sees the same batch.
"""

from __future__ import annotations

import torch

from attnlab.train.hf_data import EVAL_STRIDE, HFWindows

__all__ = ["IGNORE", "SENTENCE_ENDS", "passage_starts", "lead_pairs", "LeadSummaries"]

IGNORE = -100  # label padding (transformers' ignore_index)
SENTENCE_ENDS = (".", "?", "!")  # tokens that end the lead sentence


def passage_starts(line: str) -> bool:
    """True for a line a passage may start at: it starts with a letter and is not all upper case."""
    line = line.strip()
    return line[:1].isalpha() and not line.isupper()


def lead_pairs(lines: list[str], line_ids: list[list[int]], content: int, target_len: int,
               ends: set[int]) -> tuple[list[list[int]], list[list[int]]]:
    """Lines and their token ids (no special tokens) -> (passages of ``content`` ids, their leads of
    1..``target_len`` ids), by the rule of the module docstring."""
    passages, leads, i, n = [], [], 0, len(lines)
    while i < n:
        if not passage_starts(lines[i]) or not line_ids[i]:
            i += 1
            continue
        toks, j = [], i
        while j < n and len(toks) < content:
            toks += line_ids[j]
            j += 1
        if len(toks) < content:
            break  # the end of the corpus: no full passage left
        passage = toks[:content]
        cut = next((k + 1 for k, t in enumerate(passage) if t in ends), len(passage))
        passages.append(passage)
        leads.append(passage[: min(cut, target_len)])
        i = j  # the line after the one that was cut (its rest is not used)
    return passages, leads


class LeadSummaries(HFWindows):
    """(source (n, seq_len), labels (n, target_len + 2)) pairs of one corpus under a BERT-style tokenizer;
    HFWindows' batching, held-out split and checks. Batches: {"input_ids" (B, seq_len), "labels"
    (B, M)} with M the longest target of the batch."""

    def __init__(self, tokenizer, text: str, *, seq_len: int, target_len: int, seed: int = 0):
        cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
        if cls is None or sep is None:
            raise ValueError("the tokenizer has no [CLS] / [SEP] token, which the s2s-hnas pairs need; "
                             "expected a BERT-style tokenizer (the one s2s-hnas saves with its model)")
        content = seq_len - 2
        if content < 1:
            raise ValueError(f"data.seq_len must leave room for at least 1 text token besides [CLS] and "
                             f"[SEP], got {seq_len}")
        lines = [ln for ln in text.splitlines() if ln.strip()]
        line_ids = tokenizer(lines, add_special_tokens=False, verbose=False)["input_ids"] if lines else []
        ends = {tokenizer.convert_tokens_to_ids(t) for t in SENTENCE_ENDS} - {tokenizer.unk_token_id}
        passages, leads = lead_pairs(lines, line_ids, content, target_len, ends)
        n = len(passages)
        body = torch.tensor(passages, dtype=torch.long).reshape(n, content)  # (n, content)
        self.windows = torch.cat([torch.full((n, 1), cls), body, torch.full((n, 1), sep)], 1)  # (n, seq_len)
        self.labels = torch.full((n, target_len + 2), IGNORE, dtype=torch.long)  # (n, target_len + 2)
        for r, lead in enumerate(leads):
            self.labels[r, : len(lead) + 2] = torch.tensor([cls, *lead, sep])
        self.target_lengths = torch.tensor([len(x) for x in leads], dtype=torch.long)  # (n,) lead tokens
        is_eval = (torch.arange(n) % EVAL_STRIDE) == EVAL_STRIDE - 1
        if n >= 2 and not is_eval.any():
            is_eval[-1] = True
        self.train_rows, self.eval_rows = torch.nonzero(~is_eval)[:, 0], torch.nonzero(is_eval)[:, 0]
        self.n_tokens = sum(len(x) for x in line_ids)
        self.seq_len, self.target_len, self.causal, self.seed = seq_len, target_len, False, seed

    def _labelled(self, rows: torch.Tensor, key: int) -> dict[str, torch.Tensor]:
        """Pairs ``rows`` -> {"input_ids" (B, seq_len), "labels" (B, M)}; ``key`` (the step) is unused:
        the pairs are fixed, nothing is drawn."""
        labels = self.labels[rows]  # (B, target_len + 2)
        width = int((labels != IGNORE).sum(1).max()) if len(rows) else 1
        return {"input_ids": self.windows[rows], "labels": labels[:, :width].contiguous()}

    def summary(self) -> dict:
        """Counts for the docs: pairs, training / held-out pairs, source tokens per pair, lead lengths."""
        lengths = self.target_lengths.double()
        at_limit = float((self.target_lengths == self.target_len).double().mean()) if len(lengths) else 0.0
        return {"pairs": len(self.windows), "train": self.n_train, "held_out": len(self.eval_rows),
                "source_tokens": self.seq_len, "corpus_tokens": self.n_tokens,
                "lead_mean": float(lengths.mean()) if len(lengths) else 0.0,
                "lead_at_limit": at_limit}
