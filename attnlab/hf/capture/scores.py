"""Score-level capture and swap for models whose attention bypasses transformers' ``AttentionInterface``
(the families of attnlab/hf/capture/score_adapters.py: MPNet, DeBERTa-v2, GPT-Neo, BLOOM, Falcon).

While an attention module of the family runs its forward, ``torch.nn.functional.softmax`` is the
module's own normalization: its input is the layer's scores S (B, H, M, N) with every bias the model
adds (relative positions, disentangled c2p/p2c terms, ALiBi) and its additive mask (masked entries at
finfo.min or -inf). :func:`run_on_scores` intercepts that one call, nothing else:

- recompute mode records S and returns the model's own softmax, so the forward is the model's;
- swap mode returns the variant's weights of S in place of the softmax, so every later layer sees the
  variant (exact: the module uses whatever the softmax returns, dropout and head masks included).

A recorded layer is a :class:`~attnlab.hf.capture.run_state.CapturedLayer` whose ``query`` is S (masked
entries 0, the mask apart) and whose keys are the identity I_N with scale 1, so that q kᵀ · 1 = S
exactly (each entry a product with 1 plus exact zeros): every path that computes the variants from
captured q and k (fused, streamed, lazy, GPU) computes them from the model's own scores. ``scores_of``
names the family, for consumers that need real query and key vectors. The cost: a layer holds
(B, H, N, N) where q and k would hold (B, H, N, Dh), and score products take N in place of Dh.

The patch is installed while any run is active (a reference count under a lock) and acts only in the
thread and context whose module is running (a context variable); forward hooks always restore it.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnlab.hf.capture.run_state import (
    CapturedLayer,
    UnsupportedModelError,
    _CaptureComplete,
    _layer_value,
    _Run,
    _settings_for,
)
from attnlab.hf.capture.score_adapters import ScoreAdapter, attention_modules
from attnlab.normalizers import attention_weights

__all__ = ["run_on_scores", "observe_softmax", "scores_as_layer", "variant_weights", "allowed_entries"]

_SOFTMAX = F.softmax  # torch's own, called for every softmax outside an observed module


@dataclass
class _Call:
    """One forward of one observed attention module."""

    module: torch.nn.Module
    layer: int  # its order among the attention calls of the model's forward
    on_scores: Callable[[int, torch.nn.Module, torch.Tensor, torch.dtype | None], torch.Tensor | None]
    seen: int = 0  # softmax calls so far (one expected)


_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("attnlab_score_call", default=None)
_lock = threading.Lock()
_installed = 0  # runs holding the patch


def _softmax(input, dim=None, _stacklevel=3, dtype=None):  # noqa: A002  (torch's signature)
    call = _CALL.get()
    if call is None:
        return _SOFTMAX(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)
    call.seen += 1
    name = type(call.module).__name__
    if call.seen > 1:
        raise UnsupportedModelError(f"{name} called softmax twice in one forward; attnlab's score capture "
                                    "expects one call on the layer's scores (a transformers version it "
                                    "does not know)")
    if input.dim() != 4 or dim not in (-1, 3):
        raise UnsupportedModelError(f"{name} normalizes scores of shape {tuple(input.shape)} over dim {dim}; "
                                    "attnlab's score capture expects (B, H, M, N) over the keys (dim -1)")
    out = call.on_scores(call.layer, call.module, input, dtype)
    return _SOFTMAX(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype) if out is None else out


@contextlib.contextmanager
def _patched() -> Iterator[None]:
    global _installed
    with _lock:
        if _installed == 0:
            F.softmax = _softmax
        _installed += 1
    try:
        yield
    finally:
        with _lock:
            _installed -= 1
            if _installed == 0:
                F.softmax = _SOFTMAX


def allowed_entries(scores: torch.Tensor) -> torch.Tensor:
    """bool (B, H, M, N): the entries the model's additive mask leaves (masked: <= finfo.min / 2, -inf)."""
    return scores > torch.finfo(scores.dtype).min / 2


def scores_as_layer(scores: torch.Tensor, causal: bool, family: str) -> CapturedLayer:
    """A layer record of the model's scores (B, H, M, N) as its softmax receives them: query = S with
    masked entries 0 (float32), keys I_N (an expanded view, no memory), scale 1 (q kᵀ = S exactly);
    the mask (B, 1|H, M, N), None when nothing is masked."""
    B, H, M, N = scores.shape
    allowed = allowed_entries(scores)
    query = scores.detach().float().masked_fill(~allowed, 0.0)  # (B, H, M, N)
    keys = torch.eye(N, dtype=query.dtype, device=query.device).expand(B, H, N, N)  # key j = e_j
    if bool(allowed.all()):
        mask = None
    else:
        mask = allowed[:, :1] if bool((allowed == allowed[:, :1]).all()) else allowed
    return CapturedLayer(query=query, key_heads=keys, mask=mask, scaling=1.0, causal=causal, scores_of=family)


def variant_weights(scores: torch.Tensor, variant: str, causal: bool, valid: torch.Tensor | None,
                    params: dict, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A variant's weights (B, H, M, N) from the model's scores (B, H, M, N, additive mask included):
    the model's mask, padded queries removed (``valid`` (B, N), 1 = real token; they must not enter
    DNAS's column normalization), causal when ``causal`` and M = N. In ``dtype`` (default the scores')."""
    M, N = scores.shape[-2:]
    allowed = allowed_entries(scores)
    if valid is not None and valid.shape[-1] == M:
        allowed = allowed & valid.bool()[:, None, :, None]
    s = scores.float().masked_fill(~allowed, 0.0)
    weights = attention_weights(s, variant, mask=allowed, causal=causal and M == N and M > 1, **params)
    return weights.to(dtype or scores.dtype)


def _use_eager(config) -> Callable[[], None]:
    """Falcon takes its SDPA branch unless the config says eager: eager while observed; -> the undo."""
    previous = getattr(config, "_attn_implementation", None)
    if previous in (None, "eager"):
        return lambda: None
    config._attn_implementation = "eager"

    def undo():
        config._attn_implementation = previous

    return undo


@contextlib.contextmanager
def observe_softmax(model, adapter: ScoreAdapter, on_scores, on_start=None) -> Iterator[None]:
    """Inside the block, the softmax of every attention module of ``adapter``'s family in ``model`` calls
    ``on_scores(layer, module, scores, dtype)`` (``layer``: the module's order among the attention calls
    of the forward; ``scores`` (B, H, M, N) with the additive mask; ``dtype`` the softmax's argument),
    which returns the weights to use in its place, or None: the model's own softmax.
    ``on_start(args, kwargs)`` is called at the start of each forward of ``model``. Hooks, the patch and
    the attention implementation (Falcon: eager) are restored on exit, also on error."""
    modules = [m for _, m in attention_modules(model, adapter)]
    order = [0]  # attention calls so far in this forward
    tokens: list[contextvars.Token] = []

    def start(_model, args, kwargs):
        order[0] = 0
        if on_start is not None:
            on_start(args, kwargs)

    def enter(module, _args):
        tokens.append(_CALL.set(_Call(module, order[0], on_scores)))
        order[0] += 1

    def leave(module, _args, output):
        call = _CALL.get()
        _CALL.reset(tokens.pop())
        if output is not None and call is not None and call.seen == 0:
            raise UnsupportedModelError(f"{type(module).__name__} ran without calling softmax on its scores; "
                                        f"attnlab's score capture of {adapter.family} does not know this "
                                        "transformers version")

    handles = [model.register_forward_pre_hook(start, with_kwargs=True)]
    undo = _use_eager(model.config)
    try:
        with _patched():
            for m in modules:
                handles.append(m.register_forward_pre_hook(enter))
                handles.append(m.register_forward_hook(leave, always_call=True))
            yield
    finally:
        for h in handles:
            h.remove()
        undo()


@contextlib.contextmanager
def run_on_scores(model, adapter: ScoreAdapter, variant: str | None, run: _Run) -> Iterator[_Run]:
    """Observe (``run.capture`` a list: recompute mode) or replace (``variant``: swap mode) the softmax
    of every attention module of ``adapter``'s family in ``model``'s forwards inside the block.

    Recompute mode appends one :func:`scores_as_layer` record per layer to ``run.capture`` and raises
    ``_CaptureComplete`` once ``run.stop_after`` layers are recorded (``run.layer_hook`` is not called:
    no AttentionInterface call gives it q, k, v). Swap mode returns :func:`variant_weights` with the
    run's parameters (per layer and head: ``u`` (L, H); a module's ``attnlab_<name>`` attributes).
    """
    valid: list[torch.Tensor | None] = [None]  # the forward's (B, N) padding mask, for swap mode

    def on_scores(layer: int, module, scores: torch.Tensor, dtype) -> torch.Tensor | None:
        run.layer = layer + 1
        if run.capture is not None:
            run.capture.append(scores_as_layer(scores, adapter.causal, adapter.family))
            if run.stop_after is not None and len(run.capture) >= run.stop_after:
                raise _CaptureComplete
            return None
        M, N = scores.shape[-2:]
        if adapter.causal and M != N and variant != "unas":
            raise UnsupportedModelError(f"attnlab_{variant} runs full-sequence forwards only (got {M} "
                                        f"queries for {N} keys, i.e. cached decoding); call {adapter.family} "
                                        "with use_cache=False")
        H = scores.shape[1]
        params = {k: _layer_value(v, layer, H) for k, v in _settings_for(module, run, {}).items()}
        params = {k: v.to(scores.device) if isinstance(v, torch.Tensor) else v for k, v in params.items()}
        return variant_weights(scores, variant, adapter.causal, valid[0], params, dtype)

    def on_start(args, kwargs):
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        valid[0] = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None

    with observe_softmax(model, adapter, on_scores, on_start):
        yield run
