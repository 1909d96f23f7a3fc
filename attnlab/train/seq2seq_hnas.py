"""``attnlab train --recipe s2s-hnas``: HNAS in the encoder of an encoder-decoder (the paper's Fig. 5).

Eq. (12) of "Attention that does not Explain Away", in the *encoder's* self-attention only, per encoder
layer l and head h::

    pi^HNAS_lh = u_lh * pi^DNAS_lh + (1 - u_lh) * pi^UNAS_lh,      u_lh = sigmoid(theta_lh)

The decoder's self-attention and its cross-attention stay the model's softmax. The swap is the HNAS
retrofit's (:func:`attnlab.hf.beyond.layer_swap.swapped_layers` with u as a per-head tensor), applied to
the encoder's blocks alone; it is exact for the BART family (BART, mBART, Pegasus, Marian; T5 adds a
position bias that attnlab's variants do not, so it is refused). Without ``base.model`` the recipe
builds a tiny random BART (``arch``) over the corpus's WordPiece vocabulary (the scale runs' rule,
:func:`attnlab.data.build_tokenizer`), saved with ``save_pretrained`` in ``RUN/base-model``, and trains
every parameter and theta together on lead summaries (:mod:`attnlab.train.seq2seq_data`).

    python -m attnlab.train.seq2seq_hnas RUN [RUN ...]   # u per encoder layer over seeds, trend, losses
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

from attnlab.hf.beyond.layer_swap import Swap, swapped_layers
from attnlab.hf.beyond.retrofit import LearnedMix, hybrid_weight, lm_loss_sum
from attnlab.train.retrofit import RetrofitObjective
from attnlab.train.retrofit_config import HFRunConfig, Seq2SeqArch
from attnlab.train.scratch import BASE_DIR, base_model_dir, corpus_tokenizer

__all__ = ["BASE_DIR", "EncoderHNAS", "Seq2SeqObjective", "build_tiny_bart", "corpus_tokenizer",
           "load_seq2seq_lm", "seq2seq_objective", "u_report"]



class EncoderHNAS(LearnedMix):
    """An encoder-decoder LM (``loaded``: model with its LM head) whose encoder self-attention runs HNAS.

    ``theta`` (L_enc, H) learns; with ``train_rest`` the model's own parameters train too. The model is
    kept in eval mode (the s2s-hnas models have dropout 0; a step is a function of its batch)."""

    def __init__(self, loaded, u0: float = 0.5, train_rest: bool = True):
        super().__init__()
        from attnlab.hf.capture.seq2seq import family_of

        info, net = loaded.info, loaded.model
        seq2seq = getattr(info, "encoder_decoder", False)
        family = family_of(getattr(info, "model_type", None)) if seq2seq else None
        if family is None or not family[2]:
            raise ValueError(f"base.model must be an encoder-decoder of the BART family (BART, mBART, "
                             f"Pegasus, Marian), got {getattr(info, 'model_type', None)!r} from {info.path}")
        self.info, self.causal, self.net = info, False, net
        self.blocks = list(net.get_encoder().layers)  # plain list: not registered twice
        self.pad_id = net.config.pad_token_id
        self.start_id = net.config.decoder_start_token_id
        self._init_mix(info.n_layers, info.n_heads, u0, train_rest)  # theta (L_enc, H)

    def logits(self, input_ids: torch.Tensor, labels: torch.Tensor, u: torch.Tensor | None = None):
        """source input_ids (B, N), labels (B, M) (-100 = padding) -> logits (B, M, V): the decoder reads
        the labels shifted right (the start token first), teacher-forced; HNAS at u (default
        sigmoid(theta), (L_enc, H)) in the encoder."""
        from transformers.models.bart.modeling_bart import shift_tokens_right

        u = hybrid_weight(self.theta) if u is None else u  # (L_enc, H)
        decoder_ids = shift_tokens_right(labels, self.pad_id, self.start_id)  # (B, M)
        with swapped_layers(self.net, self.blocks, Swap("hnas", None, None, {"u": u})):
            return self.net(input_ids=input_ids, attention_mask=(input_ids != self.pad_id).long(),
                            decoder_input_ids=decoder_ids, use_cache=False).logits

    def forward(self, input_ids, labels, u=None) -> tuple[torch.Tensor, int]:
        """-> (summed -ln p of the target tokens in nats, scored tokens)."""
        return lm_loss_sum(self.logits(input_ids, labels, u), labels, causal=False)


class Seq2SeqObjective(RetrofitObjective):
    """theta and the model's own weights of an EncoderHNAS (the retrofit objective's groups, checkpoint
    tensors ``theta`` + ``rest.*``, resume), with the lead-summary pairs and, at the end, ``RUN/model``."""

    def __init__(self, loaded, config: HFRunConfig, device: torch.device):
        self.module = EncoderHNAS(loaded, u0=config.base.u0, train_rest=config.base.train_rest).to(device)
        self.info, self.tokenizer = loaded.info, loaded.tokenizer

    def make_data(self, tokenizer, corpus: str, config: HFRunConfig):
        from attnlab.train.seq2seq_data import LeadSummaries

        dc = config.data
        return LeadSummaries(tokenizer, corpus, seq_len=dc.seq_len, target_len=dc.target_len,
                             seed=config.train.seed)

    def export(self, run_dir: Path) -> None:
        """RUN/model: the trained model (save_pretrained; its attention is softmax when loaded alone) and
        hnas_u.json, the encoder's learned u."""
        out = Path(run_dir) / "model"
        self.module.net.save_pretrained(out, safe_serialization=True)
        self.tokenizer.save_pretrained(out)
        (out / "hnas_u.json").write_text(json.dumps(
            {"u": self.hybrid_weights(), "applies_to": "encoder self-attention (decoder: softmax)"}) + "\n")


def build_tiny_bart(arch: Seq2SeqArch, corpus: str, directory: str | os.PathLike, *, max_len: int,
                    seed: int) -> Path:
    """A random-init BART (``arch``, dropout 0, weights drawn from ``seed``) with a BERT WordPiece
    tokenizer restricted to ``corpus`` (``arch.vocab_size`` pieces), saved with save_pretrained."""
    from transformers import BartConfig, BartForConditionalGeneration

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = corpus_tokenizer(corpus, arch.vocab_size, max_len)
    config = BartConfig(
        vocab_size=len(tokenizer), d_model=arch.d_model, encoder_layers=arch.encoder_layers,
        decoder_layers=arch.decoder_layers, encoder_attention_heads=arch.heads,
        decoder_attention_heads=arch.heads, encoder_ffn_dim=arch.ffn_dim, decoder_ffn_dim=arch.ffn_dim,
        max_position_embeddings=max_len, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id, decoder_start_token_id=tokenizer.sep_token_id,
        forced_eos_token_id=None, scale_embedding=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = BartForConditionalGeneration(config)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def load_seq2seq_lm(path, device="cpu"):
    """An encoder-decoder directory with its LM head (``AutoModelForSeq2SeqLM``), checked and probed by
    :func:`attnlab.hf.load_model` (its tokenizer and facts reused)."""
    from transformers import AutoModelForSeq2SeqLM

    from attnlab.hf.load.loading import load_model
    from attnlab.hf.load.model_info import LoadedModel

    base = load_model(path, device=device)
    if not base.info.encoder_decoder:
        raise ValueError(f"base.model must be an encoder-decoder directory, got {path} "
                         f"({base.info.model_type}, not an encoder-decoder)")
    lm = AutoModelForSeq2SeqLM.from_pretrained(base.info.path, use_safetensors=True, dtype=torch.float32,
                                               local_files_only=True)
    return LoadedModel(model=lm.eval().to(base.device), tokenizer=base.tokenizer, info=base.info)


def seq2seq_objective(config: HFRunConfig, run_dir, resume: bool, device, corpus: str) -> Seq2SeqObjective:
    """The objective of an s2s-hnas run: ``base.model``, or ``RUN/base-model`` (built at the start from
    ``arch`` and the run's seed; on --resume the saved one)."""
    if config.base.model is not None:
        return Seq2SeqObjective(load_seq2seq_lm(config.base.model, device), config, device)
    dc = config.data
    base_dir = base_model_dir(run_dir, resume, lambda d: build_tiny_bart(
        config.arch, corpus, d, max_len=max(dc.seq_len, dc.target_len + 2), seed=config.train.seed))
    return Seq2SeqObjective(load_seq2seq_lm(base_dir, device), config, device)


def u_report(run_dirs) -> dict:
    """u per encoder layer over runs (seeds) of one s2s-hnas recipe: the head mean per layer with its 95 %
    t-interval (:func:`attnlab.train.scale_results.u_per_layer`), the trend over layers
    (:func:`~attnlab.train.scale_results.trend_test`, needs 3+ layers), each run's step and last
    held-out loss (nats per target token)."""
    from attnlab.train.metrics import read_metrics
    from attnlab.train.retrofit import retrofit_hybrid_weights
    from attnlab.train.scale_results import trend_test, u_per_layer

    if not run_dirs:
        raise ValueError("run_dirs must name at least one s2s-hnas run, got none")
    u, steps, losses = {}, {}, {}
    for run in run_dirs:
        value, steps[str(run)] = retrofit_hybrid_weights(run)
        u[str(run)] = value.numpy()
        evals = [r["eval_loss"] for r in read_metrics(Path(run) / "metrics.jsonl") if "eval_loss" in r]
        losses[str(run)] = evals[-1] if evals else None
    out = {"u_per_layer": u_per_layer(u), "step": steps, "eval_loss": losses,
           "u_per_head": {run: v.tolist() for run, v in u.items()}}
    layer_means = np.stack([v.mean(1) for v in u.values()])  # (runs, L)
    out["trend"] = trend_test(layer_means) if layer_means.shape[1] >= 3 else None
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m attnlab.train.seq2seq_hnas RUN [RUN ...]``: :func:`u_report` as JSON."""
    from attnlab.train.checkpoint import CheckpointError

    args = sys.argv[1:] if argv is None else list(argv)
    try:
        print(json.dumps(u_report(args), indent=2))
    except (ValueError, OSError, CheckpointError) as e:
        print(f"attnlab.train.seq2seq_hnas: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
