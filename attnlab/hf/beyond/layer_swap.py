"""A variant swapped into some layers (and heads) of a Hugging Face model: the ``attnlab_layer_swap``
attention function and the context manager that installs it.

A swap (:class:`Swap`) replaces the attention of some layers (all when None) and, within them, of some
heads (all when None) by a variant, computed by the ``attnlab_<variant>`` attention function of
:mod:`attnlab.hf.capture.interface` with the variant's parameters (a per-head (L, H) tensor, such as
HNAS's u, gives each layer its row). The swapped layers' attention modules get a copy of the config
naming ``attnlab_layer_swap`` (the other layers keep the model's own implementation, untouched);
everything is restored on exit, also on error. Used by :func:`attnlab.hf.beyond.lm_loss.language_model_loss`
(what a swap costs), the HNAS retrofit (:mod:`attnlab.hf.beyond.retrofit`, which trains u through it)
and the seq2seq HNAS recipe (:mod:`attnlab.train.seq2seq_hnas`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from attnlab.hf.capture.interface import UnsupportedModelError, implementation_name

__all__ = ["LAYER_SWAP", "Swap", "swapped_layers"]

LAYER_SWAP = "attnlab_layer_swap"  # the attention function of the swapped layers
_STATE = "_attnlab_layer_swap"  # attention-module attribute holding its _LayerState while swapped


@dataclass(frozen=True)
class Swap:
    """Which attention to run: the model's own (``variant`` None) or a variant in some layers and heads."""

    variant: str | None = None  # None: the model's own attention everywhere
    layers: tuple[int, ...] | None = None  # swapped layers; None = every layer
    heads: tuple[int, ...] | None = None  # swapped heads within them; None = every head
    params: Mapping = field(default_factory=dict)  # the variant's parameters, validated, defaults filled



@dataclass
class _LayerState:
    """What ``attnlab_layer_swap`` does in one swapped layer."""

    variant: str
    heads: list[int] | None  # None: every head
    kwargs: dict  # attnlab_<param> keyword arguments of the variant's attention function (this layer's)
    own: str  # the model's implementation (the unswapped heads)
    calls: int = 0  # calls seen (one per forward)


def _layer_swap_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query (B, H, M, D); key, value (B, H_kv, N, D) -> (B, M, H, D): the variant's output in the
    swapped heads, the model's own in the others."""
    state: _LayerState = module.__dict__[_STATE]
    state.calls += 1
    variant = ALL_ATTENTION_FUNCTIONS[implementation_name(state.variant)]
    out, weights = variant(
        module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs, **state.kwargs
    )
    if state.heads is None:
        return out, weights
    kwargs.pop("output_attentions", None)
    own_fn = (
        ALL_ATTENTION_FUNCTIONS[state.own] if state.own in ALL_ATTENTION_FUNCTIONS else sdpa_attention_forward
    )
    own, _ = own_fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    own = own.clone()
    own[:, :, state.heads] = out[:, :, state.heads]
    return own, None


AttentionInterface.register(LAYER_SWAP, _layer_swap_attention)
AttentionMaskInterface.register(LAYER_SWAP, sdpa_mask)


def _layer_kwargs(params: Mapping, layer: int) -> dict:
    """The variant's parameters as ``attnlab_<name>`` keywords for one layer (a per-head (L, H) tensor
    gives its row)."""
    out = {}
    for name, value in params.items():
        if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[0] > 1:
            value = value[layer]
        out[f"attnlab_{name}"] = value
    return out


@contextlib.contextmanager
def swapped_layers(model, blocks: list[torch.nn.Module], swap: Swap) -> Iterator[None]:
    """The attention modules of the swapped layers' blocks run ``attnlab_layer_swap``; restored on exit.
    UnsupportedModelError when a swapped layer's attention did not run it (the model does not read its
    implementation per layer)."""
    own = model.config._attn_implementation
    layers = range(len(blocks)) if swap.layers is None else swap.layers
    states, saved = [], []
    for layer in layers:
        state = _LayerState(
            swap.variant,
            None if swap.heads is None else list(swap.heads),
            _layer_kwargs(swap.params, layer),
            own,
        )
        states.append(state)
        for m in blocks[layer].modules():
            config = getattr(m, "config", None)
            if config is not None and hasattr(config, "_attn_implementation"):
                saved.append((m, config))
                m.config = copy.copy(config)
                m.config._attn_implementation = LAYER_SWAP
                m.__dict__[_STATE] = state
    try:
        yield
        if any(s.calls == 0 for s in states):
            raise UnsupportedModelError(
                f"{type(model).__name__} does not read its attention implementation per layer, so attnlab "
                "cannot swap a variant into some of its layers"
            )
    finally:
        for m, config in saved:
            m.config = config
            m.__dict__.pop(_STATE, None)
