"""The architectures whose attention bypasses transformers' ``AttentionInterface``, declared once each.

One row per family (as TransformerLens v3's adapters: a table of declarations, not a branch per model
inside the analysis): the module whose forward computes a layer's attention, calling
``torch.nn.functional.softmax`` once on its scores (B, H, M, N); whether the family is causal; what
those scores hold besides the mask; and where the value and output projections are.
attnlab/hf/capture/scores.py captures (recompute mode) and replaces (swap mode) the weights at that
softmax; attnlab/hf/capture/values.py reads the projections for contribution norms.

    family      attention module            scores s_ij (before the additive mask)
    MPNet       MPNetSelfAttention          q_i.k_j / sqrt(Dh) + relative position bias (buckets)
    DeBERTa-v2  DisentangledSelfAttention   (q_i.k_j + c2p + p2c) / sqrt(3 Dh)  (disentangled terms)
    GPT-Neo     GPTNeoSelfAttention         q_i.k_j, unscaled; local layers: a window of keys
    BLOOM       BloomAttention              q_i.k_j / sqrt(Dh) + ALiBi slope_h * j
    Falcon      FalconAttention             q_i.k_j / sqrt(Dh) (rotary), or (q_i.k_j + ALiBi) / sqrt(Dh)

Value columns: a projection's output (B, N, W) holds the values at ``columns`` (H_kv * Dh,), ordered
(value head, dim), as attnlab/hf/capture/value_trace.py orders traced ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["ScoreAdapter", "ADAPTERS", "adapter_for", "attention_modules", "kv_heads", "output_projection"]


def _plain(module, H: int, Dh: int) -> tuple[torch.Tensor, int]:
    """A value projection of its own: every column, H value heads."""
    return torch.arange(H * Dh), H


def _per_head_qkv(module, H: int, Dh: int) -> tuple[torch.Tensor, int]:
    """Fused q/k/v with heads outermost, (H, 3, Dh) along the output (BLOOM, Falcon's original layout)."""
    h, d = torch.arange(H)[:, None], torch.arange(Dh)[None, :]
    return (h * 3 * Dh + 2 * Dh + d).reshape(-1), H  # (H * Dh,)


def _falcon(module, H: int, Dh: int) -> tuple[torch.Tensor, int]:
    """Falcon's three layouts (``FalconAttention._split_heads``): grouped (H_kv, H / H_kv + 2, Dh) with the
    group's value last; multi-query (H + 2, Dh) with the one value head last; else (H, 3, Dh)."""
    if module.new_decoder_architecture:
        H_kv = module.num_kv_heads
        per = H // H_kv + 2  # query heads of the group, its key, its value
        g, d = torch.arange(H_kv)[:, None], torch.arange(Dh)[None, :]
        return (g * per * Dh + (per - 1) * Dh + d).reshape(-1), H_kv
    if module.multi_query:
        return (H + 1) * Dh + torch.arange(Dh), 1
    return _per_head_qkv(module, H, Dh)


@dataclass(frozen=True)
class ScoreAdapter:
    """Where one family's attention, scores and projections are."""

    family: str  # as messages and docs name it, e.g. "BLOOM"
    model_types: tuple[str, ...]  # config.model_type values it covers
    attention: str  # class name of the module whose forward calls F.softmax once on (B, H, M, N) scores
    causal: bool  # decoder attention (j <= i): the variants take their causal form
    scores: str  # what the softmax's input holds besides the mask (for messages and docs)
    value: str  # attribute of the attention module: the value projection (nn.Linear)
    value_columns: Callable[[torch.nn.Module, int, int], tuple[torch.Tensor, int]]  # (module, H, Dh) ->
    # (columns (H_kv * Dh,) of the value projection's output holding the values, H_kv)
    output: str  # the output projection: an attribute of the attention module, or "<parent>.a.b"


ADAPTERS = (
    ScoreAdapter("MPNet", ("mpnet",), "MPNetSelfAttention", False,
                 "q k^T / sqrt(Dh) + the relative position bias", "v", _plain, "o"),
    ScoreAdapter("DeBERTa-v2", ("deberta-v2",), "DisentangledSelfAttention", False,
                 "(q k^T + c2p + p2c) / sqrt(3 Dh), the disentangled position terms", "value_proj", _plain,
                 "<parent>.output.dense"),
    ScoreAdapter("GPT-Neo", ("gpt_neo",), "GPTNeoSelfAttention", True,
                 "q k^T (unscaled), a window of keys in local layers", "v_proj", _plain, "out_proj"),
    ScoreAdapter("BLOOM", ("bloom",), "BloomAttention", True, "q k^T / sqrt(Dh) + ALiBi",
                 "query_key_value", _per_head_qkv, "dense"),
    ScoreAdapter("Falcon", ("falcon",), "FalconAttention", True,
                 "q k^T / sqrt(Dh) with rotary positions, or with ALiBi", "query_key_value", _falcon,
                 "dense"),
)


def attention_modules(model, adapter: ScoreAdapter) -> list[tuple[str, torch.nn.Module]]:
    """(qualified name, module) of every attention module of ``adapter``'s family, in layer order."""
    return [(name, m) for name, m in model.named_modules() if type(m).__name__ == adapter.attention]


def adapter_for(model) -> ScoreAdapter | None:
    """The adapter of a model whose attention bypasses transformers' AttentionInterface, or None (the
    model routes its attention through the interface, or no adapter declares its family)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    if can_set is not None and can_set():  # the AttentionInterface path, where it exists
        return None
    for adapter in ADAPTERS:
        if model_type in adapter.model_types and attention_modules(model, adapter):
            return adapter
    return None


def kv_heads(model, adapter: ScoreAdapter, n_heads: int) -> int:
    """Key/value heads of ``adapter``'s family in ``model``, as its value layout declares them (Falcon:
    1 multi-query, ``num_kv_heads`` grouped, H in its original layout); the captured keys (I_N) say
    nothing of them."""
    _, module = attention_modules(model, adapter)[0]
    return adapter.value_columns(module, n_heads, 1)[1]  # (columns for Dh = 1, H_kv)


def output_projection(modules: dict, name: str, adapter: ScoreAdapter) -> torch.nn.Module | None:
    """The output projection of the attention module ``name`` (``modules``: the model's named modules)."""
    owner, path = modules[name], adapter.output
    if path.startswith("<parent>."):
        owner, path = modules.get(name.rsplit(".", 1)[0]) if "." in name else None, path[len("<parent>."):]
    for part in path.split("."):
        owner = getattr(owner, part, None)
    return owner
