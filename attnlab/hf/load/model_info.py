"""What a loaded model is: the model, its tokenizer and facts about it (``LoadedModel``,
``ModelInfo``), the load error, and the devices a model may be put on. Shared by the Hugging Face
loader (``loading.py``) and attnlab's own checkpoints (``native.py``)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

__all__ = ["LoadedModel", "ModelInfo", "ModelLoadError", "resolve_device"]


class ModelLoadError(ValueError):
    """A model directory that cannot be loaded; the message says why and what to do."""


@dataclass(frozen=True)
class ModelInfo:
    """What the analysis needs to know about a loaded model."""

    path: str  # resolved model directory
    name: str  # display name
    model_type: str  # config.model_type, e.g. "bert"
    architecture: str  # class of the loaded base model, e.g. "BertModel"
    n_layers: int  # attention layers (L)
    n_heads: int  # query heads per layer (H)
    n_kv_heads: int  # key/value heads (< H for grouped-query attention)
    max_length: int  # longest input the model takes, special tokens included
    causal: bool  # decoder (j <= i) attention
    embedded: bool  # the packaged default model
    # encoder-decoders (attnlab/hf/analysis/seq2seq.py): n_layers, n_heads, causal describe the encoder;
    # the decoder's layers and heads are these (0 for encoder-only and decoder-only models)
    encoder_decoder: bool = False
    decoder_layers: int = 0
    decoder_heads: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class LoadedModel:
    """A model in eval mode, its tokenizer and facts about it. ``lock`` serializes forwards that
    switch the attention implementation (the app calls ``analyze`` from several threads)."""

    model: torch.nn.Module
    tokenizer: object
    info: ModelInfo
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)
    # what loading adjusted that the analysis should say (e.g. a tokenizer class other than the saved
    # one); every analysis of the model carries them in its ``notes``
    notes: tuple[str, ...] = ()

    @property
    def device(self) -> torch.device:
        """Where the model's weights are (and its forwards run)."""
        for p in self.model.parameters():
            return p.device
        return torch.device("cpu")


def resolve_device(device, name: str = "device") -> torch.device:
    """``"cpu"``, ``"cuda"``, ``"cuda:1"``, a ``torch.device`` or ``"auto"`` (CUDA when available, else
    the CPU) -> a ``torch.device`` with an index for CUDA. Raises ValueError naming ``name`` for
    anything else, and when CUDA (or that CUDA device) is asked for but not available."""
    if isinstance(device, str) and device.strip().lower() == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device.strip() if isinstance(device, str) else device)
    except (RuntimeError, TypeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(
            f"{name} must be 'cpu', 'cuda', 'cuda:<index>', 'auto' or a torch.device, got {device!r}"
        )
    if dev.type == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else "no CUDA device is visible"
        raise ValueError(
            f"{name}={str(device)!r} asks for CUDA, but torch {torch.__version__} cannot use it ({build}); "
            f"use {name}='cpu' (or 'auto')"
        )
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= count:
        raise ValueError(
            f"{name}={str(device)!r}: there are only {count} CUDA device(s) (cuda:0 .. cuda:{count - 1})"
        )
    return torch.device("cuda", index)
