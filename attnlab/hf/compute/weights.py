"""Weights of every variant for a padded batch: recompute (captured q, k) and swap modes.

- ``recompute``: one forward with the model's own attention, capturing every layer's q and k (after
  projection and rotary embedding); each variant's weights are computed from those same q and k with
  the real padding mask: "what would DNAS do with this model's queries and keys".
- ``swap``: one forward per variant with the variant in place of the model's attention, so later
  layers see different inputs too.

Unmasked inputs (one window) take a fast path that computes all variants from one score matrix per
layer; masked ones (padding, causal models) use :func:`attnlab.attention_weights` directly. One window
of a bidirectional model on the CPU takes the fused path (attnlab/hf/compute/fused_sums.py), which also
computes the statistics' row sums while each head is in cache; attnlab/hf/compute/layers.py holds the
unmasked all-variant layer passes, attnlab/hf/compute/pool.py the weights' buffer pool. The forward stops
after the last layer's q and k; for one unpadded window of a bidirectional model on the CPU its
attention is the kernel's, which takes the row sums as the layers run (attnlab/hf/compute/fused_forward.py).
On a GPU the weights are computed there and copied to the CPU, with the row sums.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from attnlab.hf.capture.interface import CapturedLayer, capture_qk, check_settings, use_variant
from attnlab.hf.capture.spill import spill_for
from attnlab.hf.compute import causal_kernel, fused_sums, mixed, streamed
from attnlab.hf.compute.fused_sums import ROW_SUMS  # noqa: F401  (re-exported)
from attnlab.hf.compute.head_maps import HeadMaps
from attnlab.hf.compute.layers import (  # noqa: F401  (re-exported)
    KERNEL_VARIANTS,
    LINEAR_SPAN_MAX,
    _check_kernel_variants,
    _variants_unmasked,
    fused_slot,
)
from attnlab.hf.compute.lazy_weights import LazyWeights, stored
from attnlab.hf.compute.pool import _POOL  # noqa: F401  (re-exported)
from attnlab.hf.load.loading import LoadedModel, model_on
from attnlab.normalizers import (
    DEFAULT_VARIANTS,
    VARIANTS,
    attention_weights,
    check_params,
    check_variant,
    variant_spec,
)
from attnlab.stats import distance_matrix
from attnlab.stats.engine import row_sums_dict

__all__ = ["MODES", "KERNEL_VARIANTS", "LINEAR_SPAN_MAX", "batch_weights", "check_arguments",
           "window_weights_and_sums"]

# The heads in attnlab's CPU kernel attnlab_hf.heads when it is built (attnlab.kernels); False: PyTorch.
_USE_KERNEL = True

MODES = ("recompute", "swap")


def check_arguments(variants, mode, params: Mapping[str, Any], info=None) -> tuple[tuple[str, ...], dict]:
    """-> (the variants as a tuple without repeats, the given parameters checked); ValueError naming
    any bad argument. ``params`` holds every variant parameter the caller passed (None = not given);
    with ``info`` (a ModelInfo) per-head tensors must broadcast to (L, H) and a causal model applies
    each variant's causal rule (Sinkhorn: iters=1 unless given; iters > 1 refused)."""
    if isinstance(variants, str):
        variants = (variants,)
    variants = tuple(variants)
    if not variants:
        raise ValueError("variants must name at least one of " + ", ".join(VARIANTS))
    for v in variants:
        check_variant(v, "variants")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    shape = (info.n_layers, info.n_heads) if info is not None else (None, None)
    given = check_settings(params, *shape).params
    if info is not None and info.causal:
        for v in variants:
            check_params(v, given, causal=True)
    return tuple(dict.fromkeys(variants)), given


_noted: set[str] = set()  # variants whose generic analysis path was noted (once each)


def _fused_plan(variants, params: Mapping[str, Mapping[str, Any]], split: bool = False):
    """variant -> its slot in attnlab.hf's fused analysis (derived from the specs,
    :func:`attnlab.hf.compute.layers.fused_slot`), with a one-time note for each variant that has none.
    Without ``split``: the plan when every variant has a slot and no two share one, else None (the
    generic materialized path for all). With ``split``: (the plan of the variants that have a slot,
    the first of any two sharing one; the other variants), for attnlab/hf/compute/mixed.py."""
    plan: dict[str, str] = {}
    for v in variants:
        slot = fused_slot(variant_spec(v), params[v])
        if slot is not None and slot not in plan.values():
            plan[v] = slot
    extras = tuple(v for v in variants if v not in plan)
    for v in extras:
        if v not in _noted:
            _noted.add(v)
            warnings.warn(f"attnlab.hf: variant {v!r} has no fused analysis path (its spec declares no "
                          "hf_kernel for these parameters, or the fused analysis does not implement its "
                          "normalizer); its weights come from its reference function (and a single "
                          "window's statistics stream per head)", stacklevel=5)
    if split:
        return plan, extras
    return None if extras else plan


def _slot_params(plan: Mapping[str, str], params: Mapping[str, Mapping[str, Any]]) -> tuple[Any, int]:
    """(u, iters) of the fused analysis for ``plan``: HNAS's weight and Sinkhorn's rounds from the
    variants in those slots (0.5 and 1 when a slot is empty)."""
    by_slot = {slot: v for v, slot in plan.items()}
    u = params[by_slot["hnas"]]["u"] if "hnas" in by_slot else 0.5
    iters = params[by_slot["sinkhorn"]]["iters"] if "sinkhorn" in by_slot else 1
    return u, iters


def _layer_mask(c: CapturedLayer, valid: torch.Tensor) -> torch.Tensor | None:
    """bool (B, 1, N, N): the model's mask, and padded queries removed. None when nothing is masked."""
    if c.mask is None and bool(valid.all()):
        return None
    base = c.mask if c.mask is not None else valid[:, None, None, :]
    return base & valid[:, None, :, None]


def _u_per_layer(u, n_layers: int, n_heads: int, device=None):
    """u as a float or (L, 1, H, 1, 1) on ``device``, broadcastable over (L, B, H, N, N)."""
    if not isinstance(u, torch.Tensor) or u.numel() == 1:
        return float(u)
    try:
        u2 = u.float().to(device).reshape(u.shape if u.dim() == 2 else (1, -1))  # (L|1, H|1)
        table = torch.broadcast_to(u2, (n_layers, n_heads))
    except RuntimeError:
        raise ValueError(
            f"u must be broadcastable to (L, H) = ({n_layers}, {n_heads}), got shape {tuple(u.shape)}"
        ) from None
    return table[:, None, :, None, None]


def _recompute(loaded: LoadedModel, input_ids, attention_mask, variants, given) -> dict[str, torch.Tensor]:
    return _recompute_with_sums(loaded, input_ids, attention_mask, variants, given)[0]


def _recompute_with_sums(loaded, input_ids, attention_mask, variants, given, specials=None, lazy=False):
    """-> (weights as in :func:`_recompute`, row sums of every variant for the tidy table or None).
    ``lazy`` (with ``specials`` None): on the fused CPU path the weights are computed on first read
    (attnlab.hf.compute.lazy_weights), with no row sums.

    The row sums (``attnlab.stats.engine.row_sums_dict`` layout over L*H maps, special-token masses for each
    mask of ``specials``) come with the fused CPU path only: one unmasked text (B = 1) of a
    bidirectional model, with ``specials`` given (a list of bool (N,) key masks). Tensors stay on the
    model's device.
    """
    if loaded.info.causal and input_ids.device.type == "cpu":
        causal_kernel.bound_allocator(input_ids.shape[1])  # ATTNLAB_BOUNDED_MALLOC=1: memory over time
    hook = _layerwise(loaded, input_ids, attention_mask, variants, given, specials)
    spill = spill_for(loaded.info, input_ids, attention_mask)  # a long causal text's q, k to a file
    # no work after the last q, k; the hook's attention outputs in place of SDPA's where it applies
    with capture_qk(loaded.model, stop_after=loaded.info.n_layers, layer_hook=hook, spill=spill) as captured:
        loaded.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    valid = attention_mask.bool()  # (B, N)
    causal = {c.causal for c in captured}
    if len(causal) != 1:
        raise ValueError("models mixing causal and bidirectional self-attention layers are not supported")
    causal = causal.pop() and input_ids.shape[1] > 1
    stacked: list = []

    def qk() -> tuple[torch.Tensor, torch.Tensor]:
        """q, k (L, B, H, N, D), stacked on first use (the lazy weights may never need them)."""
        if not stacked:
            stacked.extend(torch.stack([getattr(c, name) for c in captured]).float()
                           for name in ("query", "key"))
        return stacked[0], stacked[1]

    params = {v: check_params(v, given, causal=causal) for v in variants}
    if streamed.streamed_window(captured, valid) and (specials is not None or lazy):  # bounded, per head
        return streamed.streamed_analysis(captured, variants, params, specials, hook)
    first = captured[0].query  # (B, H, N, D)
    scale = [c.scaling for c in captured]
    masks = [_layer_mask(c, valid) for c in captured]
    unmasked = not causal and all(m is None for m in masks)
    if unmasked and (specials is not None or lazy) and first.shape[0] == 1 and first.device.type == "cpu":
        plan, extras = _fused_plan(variants, params, split=True)
        fused = functools.partial(_fused_lazily, captured, qk, scale, plan, params, specials, hook)
        if not extras:  # every variant in a slot: its sums now, its weights on first access
            return fused()
        # the fused variants fused, the others streamed (attnlab/hf/compute/mixed.py)
        materialize = functools.partial(_materialized, captured, qk, masks, False, params=params, given=given)
        return mixed.split_window(variants, plan, lambda: streamed.layer_inputs(captured), params, specials,
                                  fused, materialize)
    plan = _fused_plan(variants, params) if unmasked else None
    if plan is not None:  # every variant from one score matrix per layer, in its slot
        u, iters = _slot_params(plan, params)
        u_l = _u_per_layer(u, len(captured), first.shape[1], first.device)
        weights = _variants_unmasked(*qk(), scale, tuple(plan.values()), u_l, iters)
        return {v: weights[plan[v]] for v in variants}, None
    return _materialized(captured, qk, masks, causal, variants, params, given), None


def _materialized(captured, qk, masks, causal: bool, variants, params, given) -> dict[str, torch.Tensor]:
    """{variant: (L, B, H, N, N)}: the generic materialized path, every registered variant's reference
    function on the captured scores with the layers' masks (``masks[l]`` bool (B, 1, N, N) or None)."""
    q, k = qk()
    B, N = q.shape[1], q.shape[3]
    everything = torch.ones(B, 1, N, N, dtype=torch.bool, device=q.device)  # a layer without a mask
    mask = torch.stack([everything if m is None else m for m in masks])  # (L, B, 1, N, N)
    scale_l = torch.tensor([c.scaling for c in captured], dtype=q.dtype, device=q.device)
    scale_l = scale_l.reshape(-1, 1, 1, 1, 1)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale_l)  # (L, B, H, N, N)
    for layer, c in enumerate(captured):
        if c.softcap is not None:  # Gemma 2: s -> cap * tanh(s / cap), before every variant's normalizer
            scores[layer].div_(c.softcap).tanh_().mul_(c.softcap)
    per_head = {name: _u_per_layer(value, len(captured), q.shape[2], q.device)
                for name, value in given.items() if isinstance(value, torch.Tensor)}
    return {  # (L, B, H, N, N) each
        variant: attention_weights(scores, variant, mask=mask, causal=causal,
                                   **{**params[variant], **{k: t for k, t in per_head.items()
                                                            if k in params[variant]}})
        for variant in variants
    }


def _fused_lazily(captured, qk, scale, plan, params, specials, hook) -> tuple[LazyWeights, dict | None]:
    """The fused variants of one window (B = 1, CPU): their row sums (from the capture forward's hook when
    it took them) and their weights on first access (:func:`_lazy_with_sums`)."""
    first = captured[0].query  # (1, H, N, D)
    u, iters = _slot_params(plan, params)
    u_l = _u_per_layer(u, len(captured), first.shape[1], first.device)
    taken = hook is not None and hook.slots == tuple(plan.values())  # the capture forward took the sums
    done = hook.sums() if taken else None
    weights, sums = _lazy_with_sums(qk, scale, plan, u_l, iters, specials, done)
    if sums is not None and plan.get("unas", "unas") != "unas":  # the js reference is unas by name
        sums = {v: {**raw, "js": None} for v, raw in sums.items()}
    return weights, sums


def _swap(loaded: LoadedModel, input_ids, attention_mask, variants, given) -> dict[str, torch.Tensor]:
    out = {}
    for variant in variants:
        with use_variant(loaded.model, variant, return_weights=True, **given):
            res = loaded.model(
                input_ids=input_ids, attention_mask=attention_mask, output_attentions=True, use_cache=False
            )
        out[variant] = torch.stack(res.attentions)  # (L, B, H, N, N)
    return out


def batch_weights(
    model: LoadedModel | str | os.PathLike | None,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    variants: Sequence[str] = DEFAULT_VARIANTS,
    mode: str = "recompute",
    u: float | torch.Tensor | None = None,
    iters: int | None = None,
    *,
    device=None,
    **params,
) -> dict[str, torch.Tensor]:
    """Weights of every variant for a (padded) batch.

    Args:
        model: a :class:`LoadedModel`, a model directory, or None for the embedded default.
        input_ids: (B, N) token ids, padded on the right.
        attention_mask: (B, N) 1 for real tokens, 0 for padding (default: all ones).
        variants, mode, u, iters, **params: as in :func:`analyze`.
        device: where the model runs, as in :func:`analyze` (None: the loaded model's device, the CPU
            for a directory).

    Returns:
        variant -> (L, B, H, N, N) float32 on the CPU; rows and columns of padded tokens are zero,
        valid rows sum to 1.
    """
    loaded = model_on(model, device)
    variants, given = check_arguments(variants, mode, {"u": u, "iters": iters, **params}, loaded.info)
    if loaded.info.encoder_decoder:  # three kinds of attention, two texts (attnlab/hf/analysis/seq2seq.py)
        raise ValueError(f"model {loaded.info.name} is an encoder-decoder ({loaded.info.model_type}): "
                         "expected hf.analyze(text, model, target=...), which gives its encoder, decoder and "
                         "cross attention; batch_weights takes one text's self-attention")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype in (torch.bool,) \
            or input_ids.is_floating_point() or input_ids.is_complex():
        seen = f"dtype {input_ids.dtype}" if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be an integer tensor (B, N), got {seen}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (B, N), got shape {tuple(input_ids.shape)}")
    if input_ids.numel() == 0:
        raise ValueError(f"input_ids must hold at least one token, got shape {tuple(input_ids.shape)}")
    vocab = loaded.model.get_input_embeddings().num_embeddings
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"input_ids must be token ids in [0, {vocab - 1}] for {loaded.info.name}, "
                         f"got values in [{lo}, {hi}]")
    attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask must match input_ids {tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}"
        )
    from attnlab.hf.load.native import NativeModel, native_weights

    if isinstance(loaded, NativeModel):  # attnlab's own checkpoint: its own capture
        return native_weights(loaded, input_ids, attention_mask, variants, mode, given)[0]
    run = _recompute if mode == "recompute" else _swap
    dev = loaded.device
    with loaded.lock, torch.no_grad():
        weights = run(loaded, input_ids.to(dev), attention_mask.to(dev), variants, given)
    return {v: w.cpu() for v, w in weights.items()}


def window_weights_and_sums(loaded: LoadedModel, input_ids, variants, mode, given, specials):
    """One window (input_ids (1, N), no padding): (weights {variant: (L, 1, H, N, N)} on the CPU, row
    sums for ``attnlab.stats.table_from_row_sums`` or None). On the CPU the sums come with the weights
    when the fused path applies (recompute mode, bidirectional model); on a GPU they are always
    computed there, from the weights, before these are copied to the CPU. ``specials`` None: no sums
    (on the CPU's fused path the weights are then still computed on first read, variant by variant)."""
    dev = loaded.device
    ids = input_ids.to(dev)
    ones = torch.ones_like(ids)
    with loaded.lock, torch.no_grad():
        if mode != "recompute":
            weights, sums = _swap(loaded, ids, ones, variants, given), None
        else:
            weights, sums = _recompute_with_sums(loaded, ids, ones, variants, given, specials, lazy=True)
        if any(isinstance(w, HeadMaps) for w in stored(weights)):  # streamed: sums where the model ran
            on_cpu = None if sums is None else {
                v: {k: None if t is None else t.cpu() for k, t in raw.items()} for v, raw in sums.items()}
            return weights, on_cpu
        if dev.type == "cpu" or specials is None:
            return weights, sums
        sums = _row_sums_of(weights, specials)
    return {v: w.cpu() for v, w in weights.items()}, sums


def _row_sums_of(weights: dict[str, torch.Tensor], specials) -> dict:
    """Row sums (``attnlab.stats.engine.row_sums_dict`` layout, on the CPU) of one window's weights {variant:
    (L, 1, H, N, N)}, computed where the weights are; ``js`` to unas when unas is among them."""
    first = next(iter(weights.values()))
    L, _, H, N, _ = first.shape
    spec = torch.stack([m.to(first.device, first.dtype) for m in specials], -1)  # (N, S)
    dist = distance_matrix(N, N, first)
    ref = "unas" if "unas" in weights else None
    raw = {}
    for v in weights:
        js = None if ref is None or v == ref else weights[ref]
        raw[v] = row_sums_dict(weights[v].reshape(L * H, N, N), spec, dist, js)
    return {v: {key: None if t is None else t.cpu() for key, t in raw[v].items()} for v in weights}


def _variants_with_sums(q, k, scale, variants, u, iters, specials):
    """:func:`attnlab.hf.compute.fused_sums.variants_with_sums` with this module's ``_USE_KERNEL``: every
    variant's weights, written together with the row sums."""
    return fused_sums.variants_with_sums(q, k, scale, variants, u, iters, specials, use_kernel=_USE_KERNEL)


def _layerwise(loaded: LoadedModel, input_ids, attention_mask, variants, given, specials):
    """The capture forward's layer hook (attnlab/hf/compute/fused_forward.py) for one unpadded window of a
    bidirectional model on the CPU with attnlab's kernel, or None: the kernel's attention output in
    place of SDPA's in every such forward, and with ``specials`` and every variant in a slot of the
    fused analysis the row sums computed as the layers run."""
    from attnlab import kernels
    from attnlab.hf.compute.fused_forward import LayerwiseAnalysis

    info = loaded.info
    if input_ids.shape[0] != 1 or input_ids.device.type != "cpu":
        return None
    if info.causal:
        return _causal_layerwise(info, input_ids, attention_mask, variants, given, specials)
    kernel = kernels.analysis_ops() if _USE_KERNEL else None
    if kernel is None or not bool(attention_mask.bool().all()):
        return None
    workers = fused_sums._WORKERS if fused_sums._WORKERS is not None else torch.get_num_threads()
    L, H, N = info.n_layers, info.n_heads, input_ids.shape[1]
    plan = None
    if specials is not None:
        params = {v: check_params(v, given, causal=False) for v in variants}
        plan = _fused_plan(variants, params, split=True)[0]  # the others stream after the forward
    if not plan:  # the attention outputs alone
        return LayerwiseAnalysis(L, H, N, (), 0.5, 1, None, kernel, workers)
    u, iters = _slot_params(plan, params)
    return LayerwiseAnalysis(L, H, N, tuple(plan.values()), _u_per_layer(u, L, H), iters, specials, kernel,
                             workers)


def _causal_layerwise(info, input_ids, attention_mask, variants, given, specials):
    """The capture forward's layer hook for one unpadded window of a causal model on the CPU with the
    causal analysis kernel (attnlab/hf/compute/causal_forward.py), or None."""
    from attnlab.hf.compute.causal_forward import CausalLayerwise

    if not bool(attention_mask.bool().all()) or input_ids.shape[1] < 2:
        return None
    params = {v: check_params(v, given, causal=True) for v in variants}
    slots = causal_kernel.kernel_slots(variants, params, True)
    kernel = causal_kernel.causal_kernel() if slots else None
    if kernel is None:
        return None
    L, H, N = info.n_layers, info.n_heads, input_ids.shape[1]
    spec = streamed.key_masks(specials)
    return CausalLayerwise(H, slots, params, spec, streamed.new_sums(L, H, N, variants, spec), kernel)


def _lazy_with_sums(qk, scale, plan: Mapping[str, str], u, iters, specials,
                    sums=None) -> tuple[LazyWeights, dict]:
    """The row sums of :func:`_variants_with_sums` now, with no weights written, and the weights as a
    :class:`~attnlab.hf.compute.lazy_weights.LazyWeights`: a variant's are computed on first access by the
    same call with the same arguments (the same kernel or PyTorch path, the same torch threads), so
    they have the values the first call would have written; ``qk()`` gives q, k (L, 1, H, N, D) for that
    (the captured layers are kept, stacked on first use).
    ``plan``: variant -> its slot in the fused analysis; results are keyed by variant. ``specials``
    None: no row sums (None), the weights alone, lazily. ``sums``: the row sums already computed
    (by the capture forward's layer hook, :func:`_layerwise`), keyed by slot."""
    use_kernel, threads = _USE_KERNEL, torch.get_num_threads()
    slots = tuple(plan.values())
    by_slot = {slot: v for v, slot in plan.items()}
    if specials is not None and sums is None:
        _, sums = fused_sums.variants_with_sums(*qk(), scale, slots, u, iters, specials,
                                                use_kernel=use_kernel, write=())

    def compute(names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out = fused_sums.variants_with_sums(*qk(), scale, slots, u, iters, specials,
                                                use_kernel=use_kernel, write=[plan[n] for n in names],
                                                sums=False)[0]
        finally:
            torch.set_num_threads(previous)
        return {by_slot[slot]: t for slot, t in out.items()}

    by_variant = None if sums is None else {by_slot[slot]: raw for slot, raw in sums.items()}
    return LazyWeights(plan, compute), by_variant
