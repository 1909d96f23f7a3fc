"""Encoder-decoder models: which attention call is which kind, and the scores each one computes.

An encoder-decoder (T5, BART, mBART, Pegasus, Marian) runs three kinds of attention
(docs/ANALYSIS.md, "Encoder-decoder models"):

- ``encoder``: the encoder's self-attention, bidirectional, source x source, (B, H, N, N);
- ``decoder``: the decoder's self-attention, causal, target x target, (B, H, M, M);
- ``cross``: the decoder's attention over the encoder's output, target queries x source keys, (B, H, M, N).

One declaration per family (``FAMILIES``: where each kind's modules live, by their names in the
model) tells the calls apart. :func:`capture_scores` records, for every call, the scores the model
normalizes, ``S = scaling · q kᵀ + position_bias`` (T5 scales by 1 and adds its relative position
bias; the BART family scales by 1/sqrt(D) and adds none), with its boolean mask, while the layer's
output is the model's own eager attention, softmax(S + mask) v. Every variant is recomputed from S.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

from attnlab.hf.capture.interface import to_bool_mask
from attnlab.hf.capture.run_state import UnsupportedModelError

__all__ = ["KINDS", "FAMILIES", "ScoreRecord", "family_of", "check_family", "capture_scores", "kind_modules"]

KINDS = ("encoder", "decoder", "cross")
CAPTURE_SCORES = "attnlab_capture_seq2seq"

_BART = (r"encoder\.layers\.(\d+)\.self_attn$", r"decoder\.layers\.(\d+)\.self_attn$",
         r"decoder\.layers\.(\d+)\.encoder_attn$")
_T5 = (r"encoder\.block\.(\d+)\.layer\.0\.SelfAttention$", r"decoder\.block\.(\d+)\.layer\.0\.SelfAttention$",
       r"decoder\.block\.(\d+)\.layer\.1\.EncDecAttention$")
# model_type -> (display name, module-name patterns of the kinds in KINDS' order, the layer in group 1,
# whether swap mode reproduces it: attnlab_<variant> has no position bias, which T5 adds)
FAMILIES: dict[str, tuple[str, tuple[str, str, str], bool]] = {
    "t5": ("T5", _T5, False),
    "mt5": ("mT5", _T5, False),
    "bart": ("BART", _BART, True),
    "mbart": ("mBART", _BART, True),
    "pegasus": ("Pegasus", _BART, True),
    "marian": ("Marian", _BART, True),
}
_NOT_TEXT = {"whisper": "Whisper's encoder reads audio features, not text tokens"}


def family_of(model_type: str | None) -> tuple[str, tuple[str, str, str], bool] | None:
    """The declaration of an encoder-decoder ``model_type`` (``FAMILIES``), or None."""
    return FAMILIES.get(model_type or "")


def check_family(model_type: str | None, where: str) -> None:
    """UnsupportedModelError naming ``model_type`` and the families attnlab analyses when it has no
    declaration (Whisper: why, in words)."""
    if family_of(model_type) is not None:
        return
    names = ", ".join(name for name, _, _ in FAMILIES.values())
    why = _NOT_TEXT.get(model_type or "", "attnlab has no declaration of its attention modules")
    raise UnsupportedModelError(
        f"the model in {where} is an encoder-decoder ({model_type}): {why}; attnlab analyses the "
        f"encoder-decoders {names} (and encoder-only and decoder-only models)")


def kind_modules(model: torch.nn.Module, model_type: str) -> dict[int, tuple[str, int]]:
    """id(attention module) -> (kind, layer) for every attention module of the three kinds."""
    _, patterns, _ = FAMILIES[model_type]
    found = {}
    for name, module in model.named_modules():
        for kind, pattern in zip(KINDS, patterns, strict=True):
            m = re.search(pattern, name)
            if m:
                found[id(module)] = (kind, int(m.group(1)))
    return found


@dataclass
class ScoreRecord:
    """One attention call of an encoder-decoder, as its eager attention normalizes it."""

    kind: str  # "encoder", "decoder" or "cross"
    layer: int  # the layer within its stack (encoder or decoder), from 0
    scores: torch.Tensor  # (B, H, M, N) float32: scaling · q kᵀ + position bias (T5), before the mask
    mask: torch.Tensor  # (B, 1, M, N) bool, True = may attend; causal for the decoder kind


@dataclass
class _Capture:
    modules: dict[int, tuple[str, int]]
    records: list[ScoreRecord]
    consume: Callable[[ScoreRecord], None] | None = None  # takes each record in place of the list


_ACTIVE: contextvars.ContextVar[_Capture | None] = contextvars.ContextVar("attnlab_seq2seq", default=None)


def _full_mask(mask: torch.Tensor | None, causal: bool, B: int, M: int, N: int, device) -> torch.Tensor:
    """transformers' mask (None when it skipped one) -> bool (B, 1, M, N) with causality applied."""
    full = torch.ones(B, 1, M, N, dtype=torch.bool, device=device)
    if mask is not None:
        full = full & mask
    if causal:  # queries at the end of the keys (no cache: M == N)
        full = full & torch.ones(M, N, dtype=torch.bool, device=device).tril(N - M)
    return full


def _capture_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Records S and the mask, then runs the eager attention: softmax(S masked) v.
    query (B, H, M, D); key, value (B, H, N, D) -> out (B, M, H, D)."""
    capture = _ACTIVE.get()
    B, H, M, _ = query.shape
    N = key.shape[-2]
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale  # (B, H, M, N)
    bias = kwargs.get("position_bias")
    if bias is not None:  # T5: the relative position bias (zeros in cross-attention)
        scores = scores + bias.float()
    where = capture.modules.get(id(module)) if capture is not None else None
    if where is None:
        raise UnsupportedModelError(f"{type(module).__name__} is an attention module of no declared kind "
                                    "(encoder, decoder or cross); attnlab cannot tell what it attends")
    kind, layer = where
    mask = _full_mask(to_bool_mask(attention_mask, N), kind == "decoder", B, M, N, query.device)
    record = ScoreRecord(kind=kind, layer=layer, scores=scores.detach(), mask=mask)
    if capture.consume is not None:
        capture.consume(record)
    else:
        capture.records.append(record)
    weights = torch.softmax(scores.masked_fill(~mask, torch.finfo(scores.dtype).min), dim=-1)
    out = torch.matmul(weights.to(value.dtype), value)  # (B, H, M, D)
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def capture_scores(model: torch.nn.Module, model_type: str,
                   consume: Callable[[ScoreRecord], None] | None = None) -> Iterator[list[ScoreRecord]]:
    """Record every attention call's scores and mask while ``model`` (an encoder-decoder of
    ``FAMILIES``) runs its own eager attention; its implementation is restored on exit, also on error.
    ``consume``: called with each record as it is made, which is then not kept (the list stays empty),
    so that one call's (B, H, M, N) scores at a time are held."""
    AttentionInterface.register(CAPTURE_SCORES, _capture_attention)
    AttentionMaskInterface.register(CAPTURE_SCORES, sdpa_mask)
    capture = _Capture(modules=kind_modules(model, model_type), records=[], consume=consume)
    previous = model.config._attn_implementation
    token = _ACTIVE.set(capture)
    try:
        model.set_attn_implementation(CAPTURE_SCORES)
        yield capture.records
    finally:
        _ACTIVE.reset(token)
        if model.config._attn_implementation != previous:
            model.set_attn_implementation(previous)
