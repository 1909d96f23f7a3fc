"""HNAS retrofit: every attention layer of a pretrained model runs HNAS with a learned u per layer and head.

Eq. (12) of "Attention that does not Explain Away" (../shared/seeds/004_*), per layer l and head h::

    pi^HNAS_lh = u_lh * pi^DNAS_lh + (1 - u_lh) * pi^UNAS_lh,      u_lh = sigmoid(theta_lh)

u = 1 is DNAS (no key explained away: column mass >= 1/N), u = 0 the model's own softmax (UNAS), u = 0.5
(theta = 0) the default start. The model's weights stay frozen (unless ``train_rest``); only theta
(L, H) learns, from the model's own LM objective (:func:`lm_loss_sum`): next-token for causal LMs,
masked-token for MLM heads (masks from :func:`attnlab.hf.beyond.lm_loss.mask_tokens`). The paper's
Fig. 4 asks where, after training, u sits: above 0.5 everywhere, lower (more UNAS) near the output?

The variant runs through the same per-layer swap as :func:`attnlab.hf.language_model_loss`
(``attnlab_layer_swap`` with u as a per-head tensor), so gradients reach theta through
:func:`attnlab.attend`'s HNAS (``torch.lerp(unas, dnas, u)``, attnlab/normalizers/functions.py).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from attnlab.hf.beyond.head_swaps import blocks_of
from attnlab.hf.beyond.layer_swap import Swap, swapped_layers
from attnlab.hf.beyond.lm_loss import as_language_model
from attnlab.hf.load.loading import LoadedModel
from attnlab.normalizers.checks import plain_number

__all__ = ["IGNORE", "hybrid_weight", "theta_for", "lm_loss_sum", "masked_lm_head", "LearnedMix",
           "HNASRetrofit"]

IGNORE = -100  # label of a token that is not scored (transformers' ignore_index)


# ----------------------------------------------------------------------------------------------
# Math (pure functions)
# ----------------------------------------------------------------------------------------------


def hybrid_weight(theta: torch.Tensor) -> torch.Tensor:
    """theta (L, H) -> u = sigmoid(theta) (L, H), the DNAS share of Eq. (12)."""
    return torch.sigmoid(theta)


def theta_for(u: float) -> float:
    """The theta whose sigmoid is ``u`` (logit); ValueError unless 0 < u < 1."""
    u = plain_number(u)  # numpy and 0-d tensor numbers as Python ones
    if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 < u < 1.0:
        raise ValueError(f"u0 must be a number in (0, 1) (the initial hybrid weight), got {u!r}")
    return math.log(u / (1.0 - u))


def lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor, causal: bool) -> tuple[torch.Tensor, int]:
    """logits (B, N, V), labels (B, N) with IGNORE where not scored -> (summed -ln p in nats, scored
    tokens). Causal: the logits at t - 1 score labels[t] (transformers' shift); masked: position t scores
    labels[t]. Cross-entropy in float32 at least (float64 logits stay float64)."""
    if causal:
        logits, labels = logits[:, :-1], labels[:, 1:]  # (B, N-1, V), (B, N-1)
    dtype = torch.promote_types(logits.dtype, torch.float32)
    flat, target = logits.reshape(-1, logits.shape[-1]).to(dtype), labels.reshape(-1)  # (B*N, V), (B*N,)
    keep = target != IGNORE
    total = nn.functional.cross_entropy(flat[keep], target[keep], reduction="sum")
    return total, int(keep.sum())


def masked_lm_head(lm: nn.Module) -> nn.Module | None:
    """The one module of a masked LM that maps its encoder's hidden states (..., d) to logits (..., V)
    (BERT's ``cls``, RoBERTa's ``lm_head``), or None when the head is not one module (DistilBERT)."""
    encoder = getattr(lm, "base_model", None)
    heads = [m for m in lm.children() if m is not encoder]
    return heads[0] if encoder is not None and encoder is not lm and len(heads) == 1 else None


# ----------------------------------------------------------------------------------------------
# The module: theta is the parameter, the pretrained model runs HNAS with u = sigmoid(theta)
# ----------------------------------------------------------------------------------------------


class LearnedMix(nn.Module):
    """What every HNAS wrapper of a Hugging Face model shares: ``theta`` (L, H) with u = sigmoid(theta)
    (Eq. 12), the model's own parameters frozen unless ``train_rest``, and the model kept in eval mode
    (no dropout: a step is a deterministic function of its batch). Subclasses set ``self.net`` first."""

    def _init_mix(self, L: int, H: int, u0: float, train_rest: bool) -> None:
        dtype = next(self.net.parameters()).dtype
        self.theta = nn.Parameter(torch.full((L, H), theta_for(u0), dtype=dtype))  # (L, H)
        self.train_rest = bool(train_rest)
        for p in self.net.parameters():
            p.requires_grad_(self.train_rest)
        self.net.eval()

    def train(self, mode: bool = True):  # the wrapped model stays in eval mode (no dropout)
        super().train(mode)
        self.net.eval()
        return self

    def hybrid_weights(self) -> torch.Tensor:
        """(L, H) u = sigmoid(theta), detached, on the CPU."""
        return hybrid_weight(self.theta.detach()).cpu()

    def rest_parameters(self) -> dict[str, nn.Parameter]:
        """The model's own parameters that train (empty unless ``train_rest``)."""
        return {n: p for n, p in self.net.named_parameters() if p.requires_grad}


class HNASRetrofit(LearnedMix):
    """A pretrained LM (``loaded``, with its LM head) whose every attention layer runs HNAS.

    ``theta`` (L, H) is the only trainable parameter unless ``train_rest`` (then the model's own
    parameters train too). The model is kept in eval mode (no dropout): the retrofit asks which mix
    the *pretrained* weights prefer, and a step is a deterministic function of its batch.
    """

    def __init__(self, loaded: LoadedModel, u0: float = 0.5, train_rest: bool = False):
        super().__init__()
        loaded = as_language_model(loaded)  # ValueError naming the supported heads when it has none
        L, H = loaded.info.n_layers, loaded.info.n_heads
        self.info, self.causal = loaded.info, loaded.info.causal
        self.net = loaded.model  # (a submodule: .to(), state_dict() reach it)
        self.blocks = blocks_of(self.net, L)  # plain list: not registered twice
        self.head = None if self.causal else masked_lm_head(self.net)  # logits at scored positions only
        self._init_mix(L, H, u0, train_rest)

    def logits(self, input_ids: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids (B, N) -> logits (B, N, V) with HNAS at u (default sigmoid(theta), (L, H)) in every
        layer and head."""
        u = hybrid_weight(self.theta) if u is None else u  # (L, H)
        swap = Swap("hnas", None, None, {"u": u})
        with swapped_layers(self.net, self.blocks, swap):
            return self.net(input_ids=input_ids, use_cache=False).logits

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                u: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """input_ids, labels (B, N) -> (summed LM loss in nats, scored tokens) under HNAS. A masked LM's
        head runs at the K scored positions only ((K, V) logits, not (B, N, V))."""
        if self.head is None:
            return lm_loss_sum(self.logits(input_ids, u), labels, self.causal)
        u = hybrid_weight(self.theta) if u is None else u  # (L, H)
        with swapped_layers(self.net, self.blocks, Swap("hnas", None, None, {"u": u})):
            hidden = self.net.base_model(input_ids=input_ids).last_hidden_state  # (B, N, d)
        keep = labels != IGNORE  # (B, N)
        return lm_loss_sum(self.head(hidden[keep])[None], labels[keep][None], causal=False)
