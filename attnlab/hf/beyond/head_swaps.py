"""Many one-head swaps in few layer passes: the machinery behind :func:`attnlab.hf.head_interventions`.

A swap of head h in layer l (the model's attention everywhere, the variant's weights in that one
head) leaves layers 0 .. l-1 as they are in the unmodified model, and at layer l itself everything
up to the attention output but head h. So one unmodified forward records, per layer, the block's
input and output and the attention output (1, N, H, D); then the swaps of layer l run as one batch
of B copies of the text, element b swapping head h_b:

- blocks 0 .. l-1 do not run: stand-ins return their recorded outputs, expanded to B (no copy);
- block l gets its recorded input expanded to B (stride 0). Its parameterized leaf modules
  (projections, norms) that see such a batch of identical rows compute one row and expand it
  (:func:`_shared_rows`), and its attention returns the recorded attention output with head h_b of
  element b replaced by the variant's, all B swapped heads in one :func:`attnlab.attend` call;
- blocks l+1 .. L-1 run on the B different hidden states.

Cost of all L x H swaps: H (L - 1 - l) full layer passes per layer l plus, per swapped head, layer
l's attention-output projection and feed-forward: for MiniLM's 6 x 12 heads 180 full layer passes
and 72 post-attention halves (~0.6 of a layer each), ~37 forward-equivalents instead of 72 forwards.

The attention function ``attnlab_intervene`` is registered with transformers' ``AttentionInterface``;
every stand-in, hook and the model's attention implementation are restored on exit, also on error. A
family whose attention bypasses the interface (attnlab/hf/capture/score_adapters.py) swaps the head at
its module's softmax instead (:func:`attnlab.hf.capture.scores.observe_softmax`): the model's weights,
head h_b of element b replaced by the variant's weights of its scores.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from attnlab.hf.capture.interface import (
    UnsupportedModelError,
    is_causal,
    refuse_unmodelled,
    softcapped_weights,
    window_mask,
)
from attnlab.hf.capture.mask_bias import biased_scores, split_mask
from attnlab.hf.capture.score_adapters import adapter_for
from attnlab.hf.capture.scores import observe_softmax, variant_weights
from attnlab.normalizers import attend

__all__ = ["INTERVENE", "BATCH_BYTES", "SwapPlan", "swap_runner", "default_batch_size"]

INTERVENE = "attnlab_intervene"
BATCH_BYTES = 1 << 30  # activation bytes one batched forward may take (~1 GiB): sets the default batch
_BLOCK = re.compile(r"^(.*\.\d+)\.")  # "encoder.layer.3.attention.self" -> "encoder.layer.3"


@dataclass
class SwapPlan:
    """State of one run, read by ``attnlab_intervene``."""

    variant: str
    params: Mapping  # the variant's keyword arguments for attend (validated)
    layer_of: dict[int, int] = field(default_factory=dict)  # id(attention module) -> layer (call order)
    attention_out: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (1, M, H, D) unmodified
    layer: int | None = None  # the layer whose heads are swapped in the current batch
    heads: list[int] | None = None  # per batch element, the head swapped at ``layer``


_PLAN: contextvars.ContextVar[SwapPlan | None] = contextvars.ContextVar("attnlab_intervene", default=None)


def _own_attention(module, query, key, value, attention_mask, scaling, dropout, kwargs) -> torch.Tensor:
    """The model's attention, (B, M, H, D): transformers' SDPA function, or, for a layer with a logit
    softcap (Gemma 2, which SDPA refuses), softmax(cap tanh(s / cap) + mask) v as its eager attention."""
    softcap = kwargs.get("softcap")
    if softcap is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )[0]
    n_rep = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)  # (B, H, N, D)
    M, N = query.shape[-2], key.shape[-2]
    causal = _causal(module, kwargs, M, N)
    mask, bias = split_mask(attention_mask, N)
    if bias is not None:  # a softcap beside a position bias: refused, with biased_scores' message
        biased_scores(module, query, key, bias, 1.0, softcap)
    mask = window_mask(mask, causal, kwargs.get("sliding_window"), M, N, query.device)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    weights = softcapped_weights(query, key, "unas", float(softcap), mask, causal, scale, {})
    return torch.matmul(weights, value).transpose(1, 2).contiguous()


def _causal(module, kwargs, M: int, N: int) -> bool:
    return is_causal(module, kwargs) and M == N and M > 1


def _intervene_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query (B, H, M, D); key, value (B, H_kv, N, D) -> (B, M, H, D). Unmodified forward: the model's
    attention (:func:`_own_attention`), recorded per layer. At the swapped layer (where every batch
    element's q, k, v are the unmodified ones): the recorded output, head h_b of element b recomputed
    with the variant, under the layer's mask, sliding window and softcap; a position bias in the mask
    (Falcon's ALiBi, transformers >= 5.25) makes it the variant of S = scale q k^T + bias."""
    kwargs.pop("output_attentions", None)
    refuse_unmodelled(module, kwargs, INTERVENE)  # attention sinks, a position_bias: never ignored
    plan = _PLAN.get()
    layer = None if plan is None else plan.layer_of.setdefault(id(module), len(plan.layer_of))
    if plan is None or plan.heads is None or layer != plan.layer:
        out = _own_attention(module, query, key, value, attention_mask, scaling, dropout, kwargs)
        if plan is not None and plan.heads is None:
            plan.attention_out[layer] = out.detach().clone()
        return out, None
    heads = torch.tensor(plan.heads, device=query.device)  # (B,)
    n_rep = getattr(module, "num_key_value_groups", 1)
    M, N = query.shape[-2], key.shape[-2]
    causal = _causal(module, kwargs, M, N)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    softcap = kwargs.get("softcap")
    # the B swapped heads side by side (batch rows are equal): q (1, B, M, D), k and v (1, B, N, D)
    q, k, v = query[:1, heads], key[:1, heads // n_rep], value[:1, heads // n_rep]
    mask, bias = split_mask(attention_mask, N)  # (B | 1, 1 | H, M, N) each, or None

    def of_heads(t):  # (1, 1 | B, M, N)
        return t[:1] if t.shape[1] == 1 else t[:1, heads]

    if bias is not None:
        scores = biased_scores(module, q, k, of_heads(bias), scale, softcap)  # (1, B, M, N)
        weights = variant_weights(scores, plan.variant, causal, None, dict(plan.params), torch.float32)
        swapped = torch.matmul(weights, v.float())[0]
    else:
        mask = window_mask(None if mask is None else of_heads(mask), causal, kwargs.get("sliding_window"),
                           M, N, query.device)
        if softcap is not None:
            weights = softcapped_weights(q, k, plan.variant, float(softcap), mask, causal, scale,
                                         dict(plan.params))
            swapped = torch.matmul(weights, v)[0]
        else:
            swapped = attend(q, k, v, plan.variant, mask=mask, causal=causal, scale=scale, **plan.params)[0]
    base = plan.attention_out[layer]  # (1, M, H, D)
    # (B, M, H, D), a copy (never written into the recording, also when B = 1)
    out = base.expand(len(heads), *base.shape[1:]).clone(memory_format=torch.contiguous_format)
    out[torch.arange(len(heads), device=out.device), :, heads] = swapped.to(out.dtype)  # swapped (B, M, D)
    return out, None


AttentionInterface.register(INTERVENE, _intervene_attention)
AttentionMaskInterface.register(INTERVENE, sdpa_mask)


def _intervene_scores(adapter):
    """The softmax of a family whose attention bypasses the AttentionInterface (score_adapters.py), as
    ``attnlab_intervene`` for it: the model's own weights, and at the swapped layer head h_b of element b
    the variant's weights of that head's scores (B, H, M, N) (the module then applies them to v)."""

    def on_scores(_order, module, scores, dtype):
        plan = _PLAN.get()
        layer = None if plan is None else plan.layer_of.setdefault(id(module), len(plan.layer_of))
        if plan is None or plan.heads is None or layer != plan.layer:
            return None
        B = scores.shape[0]
        rows, heads = torch.arange(B, device=scores.device), torch.tensor(plan.heads, device=scores.device)
        probs = scores.softmax(-1, dtype=dtype)  # (B, H, M, N), the model's own (F.softmax's op)
        chosen = scores[rows, heads][None]  # (1, B, M, N): the B swapped heads side by side
        probs[rows, heads] = variant_weights(chosen, plan.variant, adapter.causal, None, dict(plan.params),
                                             probs.dtype)[0]
        return probs

    return on_scores


@contextlib.contextmanager
def _intervening(model, plan: SwapPlan) -> Iterator[None]:
    adapter = adapter_for(model)
    if adapter is not None:  # attention outside the AttentionInterface: at the module's softmax
        token = _PLAN.set(plan)
        try:
            with observe_softmax(model, adapter, _intervene_scores(adapter)):
                yield
        finally:
            _PLAN.reset(token)
        return
    previous = model.config._attn_implementation
    if not type(model)._can_set_attn_implementation():
        raise UnsupportedModelError(
            f"{type(model).__name__} does not route its attention through "
            "transformers' AttentionInterface, so its heads cannot be swapped"
        )
    token = _PLAN.set(plan)
    try:
        model.set_attn_implementation(INTERVENE)
        yield
    finally:
        _PLAN.reset(token)
        if model.config._attn_implementation != previous:
            model.set_attn_implementation(previous)


def blocks_of(model, n_layers: int) -> list[torch.nn.Module]:
    """The transformer blocks holding the attention modules, in layer order (one per layer)."""
    modules = dict(model.named_modules())
    names = []
    for name, m in modules.items():
        if "Attention" in type(m).__name__ and (match := _BLOCK.match(name + ".")):
            if match.group(1) not in names and match.group(1) != name:
                names.append(match.group(1))
    if len(names) != n_layers:
        raise UnsupportedModelError(
            f"{type(model).__name__}: found {len(names)} transformer blocks around its attention modules, "
            f"expected {n_layers} (one per layer); per-head interventions cannot batch this model"
        )
    return [modules[n] for n in names]


def _expand(x, batch: int):
    """Batch-1 tensors (also inside tuples) as views of ``batch`` equal rows (stride 0)."""
    if isinstance(x, torch.Tensor):
        return x.expand(batch, *x.shape[1:]) if x.dim() and x.shape[0] == 1 else x
    if isinstance(x, tuple):
        return tuple(_expand(y, batch) for y in x)
    return x


@contextlib.contextmanager
def _replaced_forwards(modules: list[torch.nn.Module], make) -> Iterator[None]:
    """Each module's forward replaced by ``make(module, original_forward)``; the originals restored."""
    saved = [(m, m.__dict__.get("forward")) for m in modules]
    try:
        for m in modules:
            m.forward = make(m, m.forward)
        yield
    finally:
        for m, own in saved:
            if own is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = own


def _shared_rows(block: torch.nn.Module, batch: int):
    """Parameterized leaf modules of ``block`` called on a batch of identical rows (a stride-0 batch
    dimension) compute one row and return it expanded: exact, B times less work."""
    leaves = [m for m in block.modules() if not any(m.children()) and any(True for _ in m.parameters(False))]

    def make(_m, forward):
        def shared(*args, **kwargs):
            x = args[0] if len(args) == 1 and not kwargs else None
            if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[0] == batch > 1 and x.stride(0) == 0:
                y = forward(x[:1])
                if isinstance(y, torch.Tensor) and y.dim() >= 1 and y.shape[0] == 1:
                    return y.expand(batch, *y.shape[1:])
            return forward(*args, **kwargs)

        return shared

    return _replaced_forwards(leaves, make)


class _Runner:
    """Runs a model under one :class:`SwapPlan`: :meth:`unmodified` once, then :meth:`swapped` per batch."""

    def __init__(self, model, plan: SwapPlan, n_layers: int):
        self.model, self.plan, self.n_layers = model, plan, n_layers
        self.blocks = blocks_of(model, n_layers)
        self.inputs: list = []  # per block, its hidden-state input in the unmodified forward (1, N, D)
        self.outputs: list = []  # per block, its output in the unmodified forward

    def unmodified(self, forward):
        def pre(_m, args, kwargs):
            self.inputs.append(args[0] if args else kwargs["hidden_states"])

        hooks = [b.register_forward_pre_hook(pre, with_kwargs=True) for b in self.blocks]
        hooks += [b.register_forward_hook(lambda _m, _i, o: self.outputs.append(o)) for b in self.blocks]
        try:
            result = forward(1)
        finally:
            for h in hooks:
                h.remove()
        calls = len(self.plan.layer_of)
        if calls != self.n_layers or len(self.inputs) != self.n_layers:
            raise UnsupportedModelError(
                f"{type(self.model).__name__} made {calls} attention calls in {len(self.inputs)} blocks, "
                f"expected {self.n_layers}"
            )
        return result

    def swapped(self, forward, layer: int, heads: list[int]):
        """``forward(len(heads))`` with element b's head heads[b] of ``layer`` swapped."""
        B = len(heads)
        below = self.blocks[:layer]
        hidden = self.inputs[layer].expand(B, *self.inputs[layer].shape[1:])  # (B, N, D), stride 0

        def feed(_m, args, kwargs):
            return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})

        outputs = {id(b): _expand(o, B) for b, o in zip(below, self.outputs, strict=False)}

        def stand_in(m, _forward):
            recorded = outputs[id(m)]
            return lambda *_a, **_k: recorded
        hook = self.blocks[layer].register_forward_pre_hook(feed, with_kwargs=True)
        self.plan.layer, self.plan.heads = layer, list(heads)
        try:
            with (
                _replaced_forwards(below, stand_in),
                _shared_rows(self.blocks[layer], B),
            ):
                return forward(B)
        finally:
            hook.remove()
            self.plan.layer = self.plan.heads = None


@contextlib.contextmanager
def swap_runner(model, plan: SwapPlan, n_layers: int) -> Iterator[_Runner]:
    """The model set to ``attnlab_intervene`` for ``plan``; yields the runner (restored on exit)."""
    runner = _Runner(model, plan, n_layers)
    with _intervening(model, plan):
        yield runner


def default_batch_size(config, n_tokens: int, n_heads: int, lm_head: bool) -> int:
    """Swaps per forward: all ``n_heads`` of a layer, fewer when one copy's activations (float32: the
    feed-forward's widest, a few of width D, every layer's hidden states, one swapped head's N x N
    weights, and the logits N x V of an LM head) times the batch would pass ``BATCH_BYTES``."""
    D = getattr(config, "hidden_size", None) or getattr(config, "n_embd", 768)
    inner = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * D
    L = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", 12)
    V = getattr(config, "vocab_size", 0) if lm_head else 0
    per_copy = 4 * n_tokens * (inner + 6 * D + (L + 1) * D + n_tokens + V)
    return max(1, min(n_heads, int(BATCH_BYTES // per_copy)))
