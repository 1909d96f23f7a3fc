"""``attnlab train --recipe mlm-head [--model DIR]``: a masked-LM head for an encoder that ships
without one (the embedded MiniLM), the encoder frozen.

The head is transformers' own for the model type (``AutoModelForMaskedLM``; BERT's
``BertOnlyMLMHead``): a transform (dense d -> d, GELU, LayerNorm) and a decoder whose matrix is tied
to the input embeddings (frozen with the encoder) plus a learned bias over the vocabulary. Only the
transform and the bias train, initialized as transformers initializes a missing head. Each step runs
the frozen encoder without gradients and the head only at the masked positions:

    h = encoder(x)                      # (B, N, d), no grad
    logits = head(h[labels != -100])    # (K, V): K masked positions
    loss = CE(logits, labels[scored])   # BERT's masking (attnlab.hf.beyond.lm_loss.mask_tokens)

At the end the model with its head is saved to ``RUN/model/`` (safetensors, ``save_pretrained``, with
the tokenizer), which :func:`attnlab.hf.load_language_model` loads.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from attnlab.hf.beyond.retrofit import masked_lm_head
from attnlab.train.checkpoint import CheckpointError

__all__ = ["MLMHeadObjective", "EXPORT_DIR"]

EXPORT_DIR = "model"  # RUN/model: the encoder with its trained head


class MLMHeadObjective:
    """The masked-LM head of ``base`` (a LoadedModel of an encoder), its encoder frozen."""

    def __init__(self, base, device: torch.device):
        import transformers
        from transformers.utils import logging as hf_logging

        if base.info.causal:
            raise ValueError("--model: mlm-head trains a masked-LM head for an encoder, but "
                             f"{base.info.name} is a causal LM (it has its LM head already: use --recipe "
                             "retrofit-hnas)")
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the missing head is expected: it is what we train
        try:
            lm = transformers.AutoModelForMaskedLM.from_pretrained(
                base.info.path, use_safetensors=True, dtype=torch.float32, local_files_only=True,
                trust_remote_code=False)
        except Exception as e:  # noqa: BLE001 -- a model type without a masked-LM class, ...
            raise ValueError(f"--model {base.info.name}: transformers has no masked-LM head for this model "
                             f"({e.__class__.__name__}); mlm-head supports BERT-like encoders") from None
        finally:
            hf_logging.set_verbosity(verbosity)
        encoder, head = lm.base_model, masked_lm_head(lm)
        if head is None:
            raise ValueError(f"--model {base.info.name}: {type(lm).__name__}'s masked-LM head is not one "
                             "module; "
                             "mlm-head supports BERT-like encoders (BERT, RoBERTa, ...)")
        self.lm, self.encoder, self.head = lm.to(device).eval(), encoder, head
        self.info, self.tokenizer = base.info, base.tokenizer
        frozen = {id(p) for p in encoder.parameters()}  # the tied decoder matrix is the input embedding
        for p in lm.parameters():
            p.requires_grad_(id(p) not in frozen)
        self.trainable = {n: p for n, p in lm.named_parameters() if p.requires_grad}

    def param_groups(self, config) -> list[dict]:
        decay = [p for p in self.trainable.values() if p.dim() >= 2]
        rest = [p for p in self.trainable.values() if p.dim() < 2]
        return [{"params": decay, "weight_decay": config.train.weight_decay, "lr_scale": 1.0},
                {"params": rest, "weight_decay": 0.0, "lr_scale": 1.0}]

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
        """input_ids, labels (B, N) -> (summed masked-token loss in nats, masked tokens)."""
        with torch.no_grad():
            hidden = self.encoder(input_ids=input_ids).last_hidden_state  # (B, N, d)
        keep = labels != -100  # (B, N)
        logits = self.head(hidden[keep])  # (K, V)
        return nn.functional.cross_entropy(logits.float(), labels[keep], reduction="sum"), int(keep.sum())

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f"head.{n}": p for n, p in self.trainable.items()}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        mine = self.tensors()
        if set(tensors) != set(mine) or any(tensors[k].shape != mine[k].shape for k in mine):
            raise CheckpointError("the checkpoint's tensors do not fit this model's masked-LM head (expected "
                                  f"{sorted(mine)[:3]}..., got {sorted(tensors)[:3]}...)")
        with torch.no_grad():
            for k, p in mine.items():
                p.copy_(tensors[k])

    def hybrid_weights(self) -> None:
        return None

    def export(self, run_dir: Path) -> None:
        out = Path(run_dir) / EXPORT_DIR
        self.lm.save_pretrained(out, safe_serialization=True)
        self.tokenizer.save_pretrained(out)
