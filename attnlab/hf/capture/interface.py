"""attnlab variants inside Hugging Face models: ``AttentionInterface`` registration and q/k capture.

Two kinds of attention functions are registered with transformers (5.x contract
``(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs) -> (out, weights)``
with query (B, H, M, D), key/value (B, H_kv, N, D) and out (B, M, H, D)):

- ``attnlab_<variant>`` for every variant in ``attnlab.VARIANTS`` (*swap* mode): the layer's attention
  is computed by :func:`attnlab.attend`. The weights are returned when ``output_attentions`` is
  requested (or while an analysis captures them), so ``model(..., output_attentions=True)`` works.
  ``scaling``, ``sliding_window`` and ``softcap`` (Gemma 2: s -> softcap * tanh(s / softcap) before the
  variant's normalizer) are honoured; attention sinks (``s_aux``, ``sinks``) and a ``position_bias``
  are refused with an :class:`UnsupportedModelError` (here and in ``attnlab_capture``). A position
  bias inside the additive mask (Falcon's ALiBi from transformers 5.25) is honoured: both modes then
  work on the layer's scores S = scale q kᵀ + bias (attnlab/hf/capture/mask_bias.py).
- ``attnlab_capture`` (*recompute* mode): records each layer's q and k (after projection and rotary
  embedding, after repeating grouped kv heads) and delegates to transformers' own SDPA attention, so
  the forward pass is the model's own.

Each name also gets a mask function in ``AttentionMaskInterface``; without one transformers passes
``attention_mask=None`` to custom implementations and padding would be silently ignored. The variant
mask additionally excludes padded *queries*, which must not enter DNAS's column normalization.

Settings (HNAS ``u``, Sinkhorn ``iters``) come from, in order: keyword arguments ``attnlab_u`` /
``attnlab_iters`` of the forward call (transformers hands extra kwargs to the attention function),
the module attributes of the same names, the innermost :func:`use_variant` context, the defaults
(u = 0.5, iters = 3). ``u`` may be a tensor broadcastable to (L, H): one value per layer and head.

A model whose attention bypasses the interface but whose family has a score adapter
(attnlab/hf/capture/score_adapters.py: MPNet, DeBERTa-v2, GPT-Neo, BLOOM, Falcon) runs both context
managers at its modules' softmax instead (attnlab/hf/capture/scores.py): the same records and the same
settings; ``capture_qk``'s ``layer_hook`` is not called for it. Any other such model is refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from attnlab.hf.capture.mask_bias import KWARG, biased_scores, family_of, split_mask
from attnlab.hf.capture.run_state import (  # noqa: F401  (re-exported)
    _ACTIVE,
    DEFAULT_ITERS,
    DEFAULT_U,
    CapturedLayer,
    UnsupportedModelError,
    VariantSettings,
    _CaptureComplete,
    _layer_value,
    _next_layer,
    _Run,
    _settings_for,
    check_settings,
)
from attnlab.hf.capture.score_adapters import adapter_for
from attnlab.hf.capture.scores import run_on_scores, scores_as_layer, variant_weights
from attnlab.hf.capture.softcap import softcapped_attention
from attnlab.normalizers import (
    VARIANTS,
    attend,
    attention_weights,
    check_variant,
)

__all__ = [
    "PREFIX",
    "CAPTURE",
    "UnsupportedModelError",
    "VariantSettings",
    "CapturedLayer",
    "register_attention_functions",
    "implementation_name",
    "use_variant",
    "window_mask",
    "softcapped_weights",
    "is_causal",
    "refuse_unmodelled",
    "capture_qk",
    "to_bool_mask",
]

PREFIX = "attnlab_"  # registered names: attnlab_unas, attnlab_dnas, attnlab_hnas, attnlab_sinkhorn
CAPTURE = "attnlab_capture"


# ----------------------------------------------------------------------------------------------
# Masks
# ----------------------------------------------------------------------------------------------


def to_bool_mask(attention_mask: torch.Tensor | None, n_keys: int) -> torch.Tensor | None:
    """transformers' mask -> bool (B, 1|H, M, N), True = may attend.

    Boolean masks pass through; additive float masks (0 = attend, large negative = masked) are
    thresholded. An additive mask carrying other values is a position bias (ALiBi, T5) and raises
    :class:`UnsupportedModelError` here; the attention functions below take such a mask through
    attnlab/hf/capture/mask_bias.py first (the variants of S = scale q kᵀ + bias).
    """
    allowed, bias = split_mask(attention_mask, n_keys)
    if bias is not None:
        raise UnsupportedModelError(
            "the model adds a position bias to its attention scores (e.g. ALiBi or relative position "
            "buckets); attnlab variants support plain dot-product attention only"
        )
    return allowed


def _mask_function(*args, attention_mask=None, **kwargs):
    """Mask function for ``attnlab_<variant>``: transformers' boolean SDPA mask, and padded queries
    excluded (a padded query must not enter DNAS's column normalization c_j)."""
    mask = sdpa_mask(*args, attention_mask=attention_mask, **kwargs)
    q_len, kv_len = kwargs.get("q_length"), kwargs.get("kv_length")
    if (
        mask is not None
        and attention_mask is not None
        and attention_mask.dim() == 2
        and q_len == kv_len == attention_mask.shape[-1]
        and not kwargs.get("q_offset")
        and not kwargs.get("kv_offset")
    ):
        mask = mask & attention_mask.bool()[:, None, :, None]  # (B, 1, M, N)
    return mask


# ----------------------------------------------------------------------------------------------
# Attention functions
# ----------------------------------------------------------------------------------------------


def is_causal(module: torch.nn.Module, kwargs: dict) -> bool:
    causal = kwargs.get("is_causal")
    return bool(getattr(module, "is_causal", False) if causal is None else causal)


# attention keyword arguments that add terms attnlab's variants do not model: refused, never ignored
_UNMODELLED = {
    "s_aux": "attention sinks (a per-head sink logit beside the keys)",
    "sinks": "attention sinks (a sink logit beside the keys)",
    "position_bias": "an additive position bias",
}


def refuse_unmodelled(module: torch.nn.Module, kwargs: dict, what: str) -> None:
    """UnsupportedModelError naming the module and the term when the call adds one attnlab does not model."""
    for name, term in _UNMODELLED.items():
        if kwargs.get(name) is not None:
            raise UnsupportedModelError(
                f"{type(module).__name__} passes {name}= ({term}) to its attention; {what} has no such "
                "term, so it would silently compute another attention: not supported"
            )


def window_mask(mask: torch.Tensor | None, causal: bool, window: int | None, M: int, N: int,
                device) -> torch.Tensor | None:
    """The layer's mask with its sliding window: keys with i - j >= window masked (queries at the end of
    the keys, Gemma 2's and Mistral's rule). transformers' mask already holds the window when it is
    given; None (the causal fast path) gets it here when the window cuts into the span.
    -> bool broadcastable to (B, H, M, N)."""
    if mask is not None or not window or N <= window:
        return mask
    i = torch.arange(M, device=device)[:, None] + (N - M)  # (M, 1)
    j = torch.arange(N, device=device)[None, :]  # (1, N)
    if not causal:
        raise UnsupportedModelError(f"a bidirectional sliding window ({window} keys) came without a mask; "
                                    "attnlab cannot tell which keys it allows")
    return (j <= i) & (i - j < window)  # (M, N)


def softcapped_weights(query, key, variant: str, softcap: float, mask, causal: bool, scale: float,
                       params: dict) -> torch.Tensor:
    """A variant's weights over capped scores: s = softcap * tanh(scale * q k^T / softcap), then the
    variant's normalizer (as the model's eager attention caps before its softmax). query (B, H, M, D),
    key (B, H, N, D) -> (B, H, M, N) in the query's dtype."""
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)).mul_(scale)  # (B, H, M, N)
    scores = scores.div_(softcap).tanh_().mul_(softcap)
    return attention_weights(scores, variant, mask=mask, causal=causal, **params).to(query.dtype)


def _variant_attention(variant: str):
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        # query (B, H, M, D); key, value (B, H_kv, N, D)
        refuse_unmodelled(module, kwargs, f"attnlab_{variant}")
        run = _ACTIVE.get()
        layer = _next_layer(run)
        settings = _settings_for(module, run, kwargs)
        n_rep = getattr(module, "num_key_value_groups", 1)
        key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)  # (B, H, N, D)
        M, N = query.shape[-2], key.shape[-2]
        causal = is_causal(module, kwargs)
        if causal and M != N and variant != "unas":
            raise UnsupportedModelError(
                f"attnlab_{variant} runs full-sequence forwards only (got {M} queries for {N} keys, i.e. "
                "cached decoding); call the model with use_cache=False"
            )
        window = kwargs.get("sliding_window")
        mask, bias = split_mask(attention_mask, N)  # bias (B, 1|H, M, N): a position bias, or None
        if bias is None:  # (a biased mask holds the window)
            mask = window_mask(mask, causal, window, M, N, query.device)
        causal = causal and M == N and M > 1
        params = {name: _layer_value(value, layer, query.shape[1]) for name, value in settings.items()}
        params = {name: value.to(query.device) if isinstance(value, torch.Tensor) else value
                  for name, value in params.items()}  # a CPU tensor of the user's, the model on a GPU
        want = bool(kwargs.get("output_attentions")) or (run is not None and run.return_weights)
        p = dropout if module.training else 0.0
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        softcap = kwargs.get("softcap")
        if bias is not None:  # Falcon's ALiBi (transformers >= 5.25): the variant of S = scale q kᵀ + bias
            scores = biased_scores(module, query, key, bias, scale, softcap)  # (B, H, M, N)
            weights = variant_weights(scores, variant, causal, None, params, query.dtype)
        elif softcap is not None:  # Gemma 2: s -> cap * tanh(s / cap) before the variant's normalizer
            weights = softcapped_weights(query, key, variant, float(softcap), mask, causal, scale, params)
        elif not (want or p > 0):
            kw = dict(mask=mask, causal=causal, scale=scale, **params)
            return attend(query, key, value, variant, **kw).transpose(1, 2).contiguous(), None
        else:
            kw = dict(mask=mask, causal=causal, scale=scale, **params)
            _, weights = attend(query, key, value, variant, return_weights=True, **kw)  # (B, H, M, N)
        out = torch.matmul(F.dropout(weights, p=p, training=p > 0), value)  # (B, H, M, D)
        # weights computed anyway go back even unasked: Falcon (transformers >= 5.25) keeps its
        # output_attentions from the attention function and collects whatever it returns
        return out.transpose(1, 2).contiguous(), weights  # (B, M, H, D)

    attention.__name__ = f"attnlab_{variant}_attention"
    attention.__doc__ = f"transformers attention function running attnlab's {variant!r} variant."
    return attention


def _capture_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Records q and k of the layer, then runs transformers' SDPA attention unchanged (or, with the
    run's ``layer_hook``, the output it gives)."""
    run = _ACTIVE.get()
    if run is not None and run.capture is not None:
        refuse_unmodelled(module, kwargs, "the recompute mode's captured q kᵀ")
        n_rep = getattr(module, "num_key_value_groups", 1)
        scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
        causal = is_causal(module, kwargs)
        softcap = kwargs.get("softcap")
        window = kwargs.get("sliding_window")
        mask, bias = split_mask(attention_mask, key.shape[-2])
        if run.spill is not None and run.spill.active is not False:  # one copy for the file and the kernel
            query, key = query.contiguous(), key.contiguous()
        if bias is not None:  # a position bias in the mask: the layer's scores S, keys I_N (mask_bias.py)
            scores = biased_scores(module, query.detach(), key.detach(), bias, scale, softcap)
            run.capture.append(scores_as_layer(scores, causal, family_of(module)))
        else:
            run.capture.append(
                CapturedLayer(
                    query=query.detach(),
                    key_heads=key.detach(),  # (B, H_kv, N, D): repeated only where a consumer needs it
                    mask=mask,
                    scaling=scale,
                    causal=causal,
                    softcap=None if softcap is None else float(softcap),
                    sliding_window=None if window is None else int(window),
                )
            )
        last = run.stop_after is not None and len(run.capture) >= run.stop_after
        out = None
        if run.layer_hook is not None:  # a mask bias goes with the keywords (the analyses decline it)
            out = run.layer_hook(len(run.capture) - 1, query, repeat_kv(key, n_rep), repeat_kv(value, n_rep),
                                 run.capture[-1].mask, scale, dropout, module.training, causal, last,
                                 kwargs if bias is None else {**kwargs, KWARG: bias})
        if run.spill is not None:  # q and k to a file, mapped back on use
            run.capture[-1] = run.spill.layer(run.capture[-1])
        if last:
            raise _CaptureComplete  # nothing after the last q and k is needed
        if out is not None:
            return out, None
        if softcap is not None:  # SDPA refuses a softcap: the model's eager math, in tiles of rows
            c = run.capture[-1]
            return softcapped_attention(query, key, value, c.mask, scale, c.softcap, causal, window), None
    kwargs.pop("output_attentions", None)  # SDPA returns no weights; the analysis recomputes them
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


def implementation_name(variant: str) -> str:
    """``"dnas"`` -> ``"attnlab_dnas"`` (the name registered with transformers)."""
    check_variant(variant)
    return PREFIX + variant


def register_attention_functions() -> tuple[str, ...]:
    """Register ``attnlab_<variant>`` for every variant and ``attnlab_capture`` (idempotent).

    Returns the registered names. Called on import of :mod:`attnlab.hf`.
    """
    names = []
    for variant in VARIANTS:
        name = implementation_name(variant)
        AttentionInterface.register(name, _variant_attention(variant))
        AttentionMaskInterface.register(name, _mask_function)
        names.append(name)
    AttentionInterface.register(CAPTURE, _capture_attention)
    AttentionMaskInterface.register(CAPTURE, sdpa_mask)
    return (*names, CAPTURE)


# ----------------------------------------------------------------------------------------------
# Context managers (always restore the model's attention implementation)
# ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _implementation(model, name: str, run: _Run) -> Iterator[_Run]:
    adapter = adapter_for(model)
    if adapter is not None:  # attention outside the AttentionInterface: at the module's softmax
        variant = None if name == CAPTURE else name[len(PREFIX):]
        with run_on_scores(model, adapter, variant, run):
            yield run
        return
    previous = model.config._attn_implementation
    if not type(model)._can_set_attn_implementation():
        raise UnsupportedModelError(
            f"{type(model).__name__} does not route its attention through transformers' AttentionInterface, "
            "so attnlab cannot replace or observe it"
        )

    def reset_layer_counter(_module, _args):
        run.layer = 0

    hook = model.register_forward_pre_hook(reset_layer_counter)
    token = _ACTIVE.set(run)
    try:
        model.set_attn_implementation(name)
        if model.config._attn_implementation != name:
            raise UnsupportedModelError(
                f"{type(model).__name__} refused the attention implementation {name!r}"
            )
        yield run
    finally:
        _ACTIVE.reset(token)
        hook.remove()
        if model.config._attn_implementation != previous:
            model.set_attn_implementation(previous)


def _refuse_per_layer_on_seq2seq(config, params: dict) -> None:
    """ValueError naming the parameter when an encoder-decoder is given a per-layer or per-head tensor:
    the layer counter counts every attention call, which interleave the encoder's, the decoder's and
    the cross-attention's layers, so row l would not be layer l of its stack."""
    if not getattr(config, "is_encoder_decoder", False):
        return
    for name, value in params.items():
        if isinstance(value, torch.Tensor) and value.numel() > 1:
            raise ValueError(
                f"{name}: use_variant on an encoder-decoder ({getattr(config, 'model_type', '?')}) takes one "
                "value for every attention call (its calls interleave the encoder's, the decoder's and the "
                f"cross-attention's layers); expected a number, got a tensor of shape {tuple(value.shape)}; "
                "for one value per layer and head of each stack use hf.analyze(source, model, target=...)"
            )


@contextlib.contextmanager
def use_variant(
    model,
    variant: str,
    *,
    return_weights=False,
    **params,
) -> Iterator[None]:
    """Run ``model`` with an attnlab variant in place of its attention (swap mode).

    Example::

        with use_variant(model, "dnas"):
            out = model(**batch, output_attentions=True)   # out.attentions: DNAS weights per layer

    ``**params`` are the variants' parameters (``u``: HNAS, a float or a tensor broadcastable to
    (L, H); ``iters``, ``tol``: Sinkhorn, whose causal use takes iters=1). The previous implementation
    is restored on exit, also on error. A variant registered after import is registered with
    transformers here. On an encoder-decoder parameters are numbers (a tensor is refused: its
    attention calls interleave the three kinds, see ``hf.analyze(source, model, target=...)``).
    """
    register_attention_functions()
    config = getattr(model, "config", None)
    _refuse_per_layer_on_seq2seq(config, params)
    shape = (getattr(config, "num_hidden_layers", None), getattr(config, "num_attention_heads", None))
    run = _Run(settings=check_settings(params, *shape), return_weights=return_weights)
    with _implementation(model, implementation_name(variant), run):
        yield


@contextlib.contextmanager
def capture_qk(model, *, stop_after: int | None = None, layer_hook=None,
               spill=None) -> Iterator[list[CapturedLayer]]:
    """Record every self-attention call's q and k while the model runs its own (SDPA) attention.

    Yields the list that fills with one :class:`CapturedLayer` per attention call, in layer order.
    With ``stop_after`` (e.g. the model's number of layers) the forward ends as soon as that many
    calls are recorded, before the last one's attention, feed-forward and anything later run: the
    rest of the ``with`` block is skipped and execution continues after it. ``layer_hook(layer, query, key,
    value, mask, scaling, dropout, training, causal, last, kwargs)``, when given, is called after each
    layer's q and k are recorded (keys and values with grouped-query heads repeated, ``mask`` the
    recorded one: bool, True = may attend, or None; a position bias in the model's mask comes in ``kwargs``
    under ``mask_bias.KWARG``, the recorded layer then holding the scores); the
    tensor it returns, (B, N, H, Dv), is the layer's attention output in place of SDPA's (None: SDPA
    runs). attnlab/hf/compute/fused_forward.py's analysis is one. ``spill``
    (:class:`attnlab.hf.capture.spill.Spill`), when given, keeps each layer's q and k in a file once the
    hook has run (the records then map them back on use).
    """
    run = _Run(settings=VariantSettings(), capture=[], stop_after=stop_after, layer_hook=layer_hook,
               spill=spill)
    with _implementation(model, CAPTURE, run):
        try:
            yield run.capture
        except _CaptureComplete:
            pass
