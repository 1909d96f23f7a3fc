"""``attnlab train --recipe causal-lm``: a small GPT-2 trained from scratch with its own softmax attention.

No pretrained causal LM ships with attnlab or its dependencies, so the HNAS retrofit's Fig. 4 question
(docs/RETROFIT.md) needs one trained here. This recipe builds ``transformers.GPT2LMHeadModel`` from
``arch`` (``GPT2Config``: n_layer, n_embd, n_head, n_inner; n_positions = data.seq_len; dropout 0, so a
step is a function of its batch and resume is exact), random init from the run's seed, over the corpus's
WordPiece vocabulary (:func:`attnlab.train.scratch.corpus_tokenizer`, the s2s-hnas rule), and
trains *every* weight with plain softmax attention (no swap) on next-token loss over the corpus windows
of :class:`attnlab.train.hf_data.HFWindows` (``[CLS]`` + seq_len - 2 tokens + ``[SEP]``)::

    logits = gpt2(input_ids)                   # input_ids (B, N) -> (B, N, V)
    loss = CE(logits[:, :-1], input_ids[:, 1:])  # summed nats over B * (N - 1) tokens, / count

The loop, metrics, checkpoints, resume and SIGTERM are :func:`attnlab.train.hf_trainer.train_objective`'s.
A run directory holds, besides the trainer's files::

    RUN/base-model/    the random-init model and tokenizer the run started from (built once)
    RUN/model/         the model of the latest checkpoint (save_pretrained, safetensors) + tokenizer +
                       attnlab_step.json; written at the end of the run (temporary directory, renamed),
                       loaded by attnlab.hf.load_language_model and by --recipe retrofit-hnas --model

    attnlab train --recipe causal-lm --out runs/gpt2-kjv
    attnlab train --recipe retrofit-hnas --model runs/gpt2-kjv/model --corpus kjv+shakespeare --out R
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from attnlab.checkpoint_io import atomic_write_json, fsync_dir
from attnlab.train.checkpoint import CheckpointError, read_latest
from attnlab.train.config import _check, _is_int

if TYPE_CHECKING:
    from attnlab.train.retrofit_config import HFRunConfig

__all__ = ["CausalLMArch", "CausalLMObjective", "EXPORT_DIR", "STEP_FILE", "build_tiny_gpt2",
           "causal_lm_objective"]

EXPORT_DIR = "model"  # RUN/model: the model of the latest checkpoint, for hf.load_language_model
STEP_FILE = "attnlab_step.json"  # RUN/model/attnlab_step.json: {"step", "kind"}


@dataclass
class CausalLMArch:
    """causal-lm: the GPT-2 built from scratch (transformers' GPT2Config; n_positions = data.seq_len)."""

    n_layer: int = 4  # transformer blocks
    n_embd: int = 256  # hidden size (head dim n_embd / n_head)
    n_head: int = 4  # attention heads per block
    n_inner: int = 1024  # feed-forward width of every block
    vocab_size: int = 4096  # WordPiece pieces kept from the corpus (the s2s-hnas tokenizer rule)

    def __post_init__(self):
        s = "arch"
        for name, hi in (("n_layer", 64), ("n_embd", 8192), ("n_head", 128), ("n_inner", 65536)):
            _check(s, self, name, _is_int(getattr(self, name)) and 1 <= getattr(self, name) <= hi,
                   f"an integer in [1, {hi}]")
        _check(s, self, "vocab_size", _is_int(self.vocab_size) and 64 <= self.vocab_size <= 65536,
               "an integer in [64, 65536]")
        if self.n_embd % self.n_head:
            raise ValueError(f"arch.n_embd must be a multiple of arch.n_head ({self.n_head}), "
                             f"got {self.n_embd}")


def build_tiny_gpt2(arch: CausalLMArch, corpus: str, directory: str | os.PathLike, *, seq_len: int,
                    seed: int) -> Path:
    """A random-init GPT2LMHeadModel (``arch``, n_positions ``seq_len``, dropout 0, weights drawn from
    ``seed``, output layer tied to the token embedding) with the corpus's WordPiece tokenizer, saved with
    save_pretrained (safetensors) in ``directory``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from attnlab.train.scratch import corpus_tokenizer

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = corpus_tokenizer(corpus, arch.vocab_size, seq_len)
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=seq_len, n_embd=arch.n_embd, n_layer=arch.n_layer,
        n_head=arch.n_head, n_inner=arch.n_inner, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(config)
    with _no_progress_bars():
        model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


@contextlib.contextmanager
def _no_progress_bars():
    """transformers' progress bars off (save_pretrained's "Writing model shards" in every run log)."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()


class CausalLMObjective:
    """Every weight of a causal LM (``loaded``: a LoadedModel from hf.load_language_model), its own
    attention; the model stays in eval mode (dropout 0 anyway)."""

    def __init__(self, loaded, device: torch.device):
        if not loaded.info.causal:
            raise ValueError(f"causal-lm trains a causal LM, but {loaded.info.path} is not one")
        self.model = loaded.model.to(device).eval()
        self.info, self.tokenizer = loaded.info, loaded.tokenizer
        for p in self.model.parameters():
            p.requires_grad_(True)
        self.params = dict(self.model.named_parameters())  # tied weights appear once

    def param_groups(self, config: HFRunConfig) -> list[dict]:
        decay = [p for p in self.params.values() if p.dim() >= 2]  # matrices and embeddings
        rest = [p for p in self.params.values() if p.dim() < 2]  # biases, LayerNorm
        return [{"params": decay, "weight_decay": config.train.weight_decay, "lr_scale": 1.0},
                {"params": rest, "weight_decay": 0.0, "lr_scale": 1.0}]

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (B, N) -> logits (B, N, V), the model's own attention (no padding in the windows)."""
        return self.model(input_ids=input_ids, use_cache=False).logits

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
        """input_ids, labels (B, N) -> (summed next-token -ln p in nats, scored tokens B * (N - 1))."""
        from attnlab.hf.beyond.retrofit import lm_loss_sum

        return lm_loss_sum(self.logits(input_ids), labels, causal=True)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f"model.{n}": p for n, p in self.params.items()}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        mine = self.tensors()
        if set(tensors) != set(mine) or any(tensors[k].shape != mine[k].shape for k in mine):
            raise CheckpointError(f"the checkpoint's tensors do not fit this model (expected {len(mine)} "
                                  f"tensors such as {sorted(mine)[0]}, got {len(tensors)})")
        with torch.no_grad():
            for k, p in mine.items():
                p.copy_(tensors[k])

    def hybrid_weights(self) -> None:
        return None

    def export(self, run_dir: Path) -> None:
        """At the end of the run: RUN/model <- this model and tokenizer (save_pretrained) and the final
        step, written into a temporary directory, fsynced and renamed over any old one (what a kill
        inside an earlier swap left, ``.model.tmp`` or ``.model.old``, is removed)."""
        run_dir = Path(run_dir)
        step = read_latest(run_dir)["step"]
        out, tmp, old = (run_dir / EXPORT_DIR, run_dir / f".{EXPORT_DIR}.tmp", run_dir / f".{EXPORT_DIR}.old")
        shutil.rmtree(tmp, ignore_errors=True)
        with _no_progress_bars():
            self.model.save_pretrained(tmp, safe_serialization=True)
        self.tokenizer.save_pretrained(tmp)
        atomic_write_json(tmp / STEP_FILE, {"step": step, "kind": "causal-lm"})
        for p in tmp.iterdir():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(tmp)
        shutil.rmtree(old, ignore_errors=True)
        if out.exists():
            os.rename(out, old)
        os.rename(tmp, out)
        fsync_dir(run_dir)
        shutil.rmtree(old, ignore_errors=True)


def causal_lm_objective(config: HFRunConfig, run_dir, resume: bool, device, corpus: str) -> CausalLMObjective:
    """The objective of a causal-lm run: ``RUN/base-model`` (built at the start from ``arch`` and the run's
    seed; on --resume the saved one), loaded with its LM head."""
    from attnlab.hf.load.loading import load_language_model
    from attnlab.train.scratch import base_model_dir

    base_dir = base_model_dir(run_dir, resume, lambda d: build_tiny_gpt2(
        config.arch, corpus, d, seq_len=config.data.seq_len, seed=config.train.seed))
    return CausalLMObjective(load_language_model(base_dir, device=device), device)
