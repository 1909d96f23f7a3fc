"""What one capture (recompute mode) or swap run records and is configured with: the layer records
(:class:`CapturedLayer`), the variants' parameters (:class:`VariantSettings`), the run's state in a
context variable, and the refusal error. Shared by the AttentionInterface functions
(attnlab/hf/capture/interface.py) and the score-level capture (attnlab/hf/capture/scores.py).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.integrations.sdpa_attention import repeat_kv

from attnlab.normalizers import check_param, parameter_names, variant_spec
from attnlab.normalizers.checks import check_head_shape

__all__ = ["UnsupportedModelError", "VariantSettings", "CapturedLayer", "DEFAULT_U", "DEFAULT_ITERS",
           "check_settings"]

DEFAULT_U = variant_spec("hnas").param("u").default  # sigmoid(theta_0 = 0)
DEFAULT_ITERS = variant_spec("sinkhorn").param("iters").default


class UnsupportedModelError(ValueError):
    """The model cannot run attnlab variants (attention not routed through ``AttentionInterface``,
    additive position biases such as ALiBi, encoder-decoder, cached decoding, ...)."""


@dataclass(frozen=True)
class VariantSettings:
    """Parameters of the variants inside a model: name -> value, as given (checked against their
    declarations; a per-head parameter may be a tensor broadcastable to (L, H)). Missing ones take the
    spec's default (and its causal rule) in each layer."""

    params: Mapping[str, Any] = field(default_factory=dict)

    @property
    def u(self):
        return self.params.get("u", DEFAULT_U)

    @property
    def iters(self):
        return self.params.get("iters", DEFAULT_ITERS)


@dataclass
class CapturedLayer:
    """One self-attention call as seen by ``attnlab_capture``."""

    query: torch.Tensor  # (B, H, M, D), after projection and rotary embedding
    key_heads: torch.Tensor  # (B, H_kv, N, D): grouped kv heads as the layer has them (not repeated)
    mask: torch.Tensor | None  # bool, broadcastable to (B, H, M, N); True = may attend
    scaling: float  # score scale used by the layer
    causal: bool  # the layer is causal (the mask, when given, already contains j <= i)
    softcap: float | None = None  # logits -> softcap * tanh(logits / softcap) before masking (Gemma 2)
    sliding_window: int | None = None  # the layer's window (the mask, when given, already has it)
    # the model's own scores, not its q and k (attnlab/hf/capture/scores.py): query = S (B, H, M, N),
    # key_heads = I_N, scaling 1, so that q kᵀ = S exactly; the family's name, else None
    scores_of: str | None = None
    # spilled to a file (attnlab/hf/capture/spill.py): () -> fresh mappings of (query, key_heads), else None
    reload: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def key(self) -> torch.Tensor:
        """(B, H, N, D): the key heads repeated to the H query heads (a copy for grouped-query layers)."""
        n_rep = self.query.shape[1] // self.key_heads.shape[1]
        return self.key_heads if n_rep == 1 else repeat_kv(self.key_heads, n_rep)


@dataclass
class _Run:
    """State of the innermost use_variant / capture_qk context."""

    settings: VariantSettings
    capture: list[CapturedLayer] | None = None  # recompute mode: filled by attnlab_capture
    return_weights: bool = False  # swap mode during an analysis: always return weights
    layer: int = 0  # attention calls seen in the current forward = layer index
    stop_after: int | None = None  # recompute mode: end the forward once this many layers are captured
    # recompute mode: called after each layer's q, k are recorded (attnlab/hf/compute/fused_forward.py);
    # returns the layer's attention output in place of SDPA's, or None (SDPA runs)
    layer_hook: Callable[..., torch.Tensor | None] | None = None
    # recompute mode: keeps each layer's q and k in a file once the hook has run (attnlab/hf/capture/spill.py)
    spill: Any = None


class _CaptureComplete(Exception):
    """Raised by ``attnlab_capture`` once ``stop_after`` layers are recorded; ends the forward early
    (caught by :func:`capture_qk`)."""


_ACTIVE: contextvars.ContextVar[_Run | None] = contextvars.ContextVar("attnlab_hf_run", default=None)


def _layer_value(value, layer: int, n_heads: int):
    """A per-head parameter for one layer: a number, or (1, H, 1, 1) from a tensor broadcastable to (L, H)."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() == 2 and value.shape[0] > 1:
        if layer >= value.shape[0]:
            raise ValueError(f"u has values for {value.shape[0]} layers, but the model has more "
                             f"(layer {layer})")
        row = value[layer]  # (H,) or (1,)
    else:
        row = value.reshape(-1)  # (H,) or (1,): the same for every layer
    return row.expand(n_heads).reshape(1, n_heads, 1, 1)


def _settings_for(module: torch.nn.Module, run: _Run | None, kwargs: dict) -> dict:
    """The parameters given for this call: the run's, overridden by the module's ``attnlab_<name>``
    attributes and the call's ``attnlab_<name>`` keywords (e.g. a model's learned u per layer)."""
    params = dict(run.settings.params) if run is not None else {}
    for name in parameter_names():
        value = kwargs.get(f"attnlab_{name}", getattr(module, f"attnlab_{name}", None))
        if value is not None:
            params[name] = value
    return params


def _next_layer(run: _Run | None) -> int:
    if run is None:
        return 0
    run.layer += 1
    return run.layer - 1


def check_settings(params: Mapping[str, Any], n_layers: int | None = None,
                   n_heads: int | None = None) -> VariantSettings:
    """Variant parameters for a model, each checked against its declaration (one check per
    parameter, attnlab.normalizers.specs); a per-head tensor must broadcast to (L, H)."""
    given = {}
    for name, value in params.items():
        if value is None:
            continue
        value = check_param(name, value)
        if isinstance(value, torch.Tensor):
            if n_layers and n_heads:
                check_head_shape(name, value, (n_layers, n_heads), "(L, H)")
            elif value.dim() > 2:
                raise ValueError(f"{name} must be a number or a tensor broadcastable to (L, H), got shape "
                                 f"{tuple(value.shape)}")
        given[name] = value
    return VariantSettings(params=given)
