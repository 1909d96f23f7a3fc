"""Training batches for a pretrained Hugging Face model: its own tokenizer over a corpus, fixed windows.

The corpus (``attnlab.data.load_corpus``: 'kjv', 'shakespeare', 'kjv+shakespeare' or a text file) is
tokenized once without special tokens and cut into consecutive windows of ``seq_len`` tokens, the
tokenizer's special tokens around each (``[CLS] ... [SEP]``, LLaMA's BOS, nothing for GPT-2: what the
model saw in pretraining); every 50th window (at least one) is held out for the eval loss. The window
order of epoch e is a permutation seeded by (seed, e) (:class:`attnlab.data.LMData`'s rule), so a
batch is a pure function of (seed, step, data position) and a resume sees the same batch.

Labels: a causal LM's are its inputs (the loss shifts them); a masked LM's come from BERT's rule,
:func:`attnlab.hf.beyond.lm_loss.mask_tokens` (the masking of ``language_model_loss``), drawn from
numpy's PCG64 seeded with (seed, step, row) (held-out batches: (seed, -1 - batch, row)).
"""

from __future__ import annotations

import numpy as np
import torch

from attnlab.data import DataPosition, _generator
from attnlab.hf.beyond.lm_loss import mask_tokens
from attnlab.hf.capture.windows import special_affixes, tokenize_text

__all__ = ["HFWindows", "EVAL_STRIDE"]

EVAL_STRIDE = 50  # every 50th window is held out


class HFWindows:
    """Windows (n, seq_len) of one corpus under a model's tokenizer, and their batches."""

    def __init__(self, tokenizer, text: str, *, seq_len: int, causal: bool, vocab_size: int,
                 mask_rate: float = 0.15, seed: int = 0):
        prefix, suffix = special_affixes(tokenizer)
        content = seq_len - len(prefix) - len(suffix)
        if content < 1:
            raise ValueError(f"data.seq_len must leave room for at least 1 text token besides the "
                             f"{len(prefix) + len(suffix)} special tokens, got {seq_len}")
        ids = tokenize_text(tokenizer, text).ids  # (T,)
        n = len(ids) // content
        body = torch.as_tensor(ids[: n * content], dtype=torch.long).reshape(n, content)  # (n, content)
        pre = torch.tensor(prefix, dtype=torch.long).expand(n, len(prefix))
        post = torch.tensor(suffix, dtype=torch.long).expand(n, len(suffix))
        self.windows = torch.cat([pre, body, post], dim=1)  # (n, seq_len)
        self.special = np.zeros(seq_len, dtype=bool)  # (seq_len,) True at the special tokens
        self.special[: len(prefix)] = True
        self.special[len(prefix) + content :] = True
        is_eval = (torch.arange(n) % EVAL_STRIDE) == EVAL_STRIDE - 1
        if n >= 2 and not is_eval.any():
            is_eval[-1] = True
        self.train_rows, self.eval_rows = torch.nonzero(~is_eval)[:, 0], torch.nonzero(is_eval)[:, 0]
        self.n_tokens, self.seq_len, self.causal, self.seed = len(ids), seq_len, causal, seed
        self.mask_id = getattr(tokenizer, "mask_token_id", None)
        self.vocab_size, self.mask_rate = vocab_size, mask_rate
        if not causal and self.mask_id is None:
            raise ValueError("the model's tokenizer has no mask token, which the masked-LM loss needs; "
                             "expected a tokenizer saved with its [MASK] token")

    @property
    def n_train(self) -> int:
        return len(self.train_rows)

    def check_batch(self, batch_size: int, corpus: str) -> None:
        """ValueError unless one batch of training windows and one held-out window fit."""
        if self.n_train < batch_size or len(self.eval_rows) == 0:
            raise ValueError(
                f"data.corpus {corpus!r} is too small: {self.n_tokens} tokens give {self.n_train} training "
                f"windows of {self.seq_len} tokens (+{len(self.eval_rows)} held out), but "
                f"train.batch_size={batch_size} needs at least {batch_size} (+1 held out); use a longer "
                "text, a smaller batch_size or a smaller seq_len"
            )

    def _labelled(self, rows: torch.Tensor, key: int) -> dict[str, torch.Tensor]:
        """Windows ``rows`` -> {"input_ids", "labels"} (B, seq_len); masks seeded by (seed, key, row)."""
        ids = self.windows[rows]  # (B, seq_len)
        if self.causal:
            return {"input_ids": ids, "labels": ids.clone()}
        inputs, labels = [], []
        for b, row in enumerate(ids.numpy()):
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, key + 2**31, b])))
            x, y = mask_tokens(row, self.special, rng, self.mask_id, self.vocab_size, self.mask_rate)
            inputs.append(x)
            labels.append(y)
        return {"input_ids": torch.from_numpy(np.stack(inputs)), "labels": torch.from_numpy(np.stack(labels))}

    def batch(self, step: int, position: DataPosition, batch_size: int):
        """The batch of training step ``step`` from ``position`` -> (batch, position after it)."""
        idx, have, epoch, cursor = [], 0, position.epoch, position.cursor
        while have < batch_size:
            order = torch.randperm(self.n_train, generator=_generator(self.seed, 1, epoch))
            take = order[cursor : cursor + batch_size - have]
            idx.append(take)
            have, cursor = have + len(take), cursor + len(take)
            if cursor >= self.n_train:
                epoch, cursor = epoch + 1, 0
        return self._labelled(self.train_rows[torch.cat(idx)], step), DataPosition(epoch, cursor)

    def eval_batches(self, batch_size: int, n_batches: int) -> list[dict[str, torch.Tensor]]:
        """Fixed held-out batches (the same windows and masks every time)."""
        out = []
        for b in range(n_batches):
            rows = self.eval_rows[b * batch_size : (b + 1) * batch_size]
            if len(rows) == 0:
                break
            out.append(self._labelled(rows, -1 - b))
        return out
