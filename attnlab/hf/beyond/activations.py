"""Massive activations (Sun et al. 2024, "Massive Activations in Large Language Models") on a real
model: per layer, the largest |hidden state| of the residual stream after that layer, the token and
dimension where it occurs, and its ratio to the median |hidden state| -- measured by hooks on the
model's layers during one plain forward, with no hidden state kept beyond its layer.

    massive_activations(text, model) -> pandas.DataFrame (one row per layer)
    activations_table(model, input_ids) -> the same for token ids (one window: the CLI, the app)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from attnlab import sinks
from attnlab.hf.load.loading import LoadedModel, model_on
from attnlab.normalizers.checks import scalar

__all__ = ["massive_activations", "activations_table", "recording_activations", "COLUMNS"]

# one row per layer (Sun et al. 2024): where the largest |h| is and how far above the median it stands
COLUMNS = ("layer", "max_abs", "token_index", "token", "dim", "median_abs", "ratio")


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's transformer layers in order (transformers' GradientCheckpointingLayer subclasses:
    every text architecture's block), outermost only."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    found = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    inner = {id(c) for m in found for c in m.modules() if c is not m}
    return [m for m in found if id(m) not in inner]


@contextlib.contextmanager
def recording_activations(model: torch.nn.Module) -> Iterator[list[dict]]:
    """Within the context every forward of ``model`` appends, per layer, ``sinks.massive_activations``
    of its output hidden states (batch item 0) to the yielded list; the hooks are always removed."""
    found: list[dict] = []
    layers = _layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no transformer layers that attnlab can find "
                         "(transformers' GradientCheckpointingLayer blocks)")

    def hook(_module, _inputs, output):
        h = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(h, torch.Tensor) and h.dim() == 3:
            found.append({k: t[0] for k, t in sinks.massive_activations(h[:1].float()).items()})

    handles = [layer.register_forward_hook(hook) for layer in layers]
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()


def massive_activations(text: str, model: LoadedModel | str | None = None, *, max_tokens: int | None = None):
    """One row per layer: ``layer``, ``max_abs``, ``token_index``, ``token``, ``dim``, ``median_abs``,
    ``ratio`` (= max_abs / median_abs) of the residual stream after each layer, for ``text`` (its first
    ``max_tokens`` tokens, default the model's maximum length) in one plain forward."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("text must be a non-empty str")
    loaded = model_on(model)
    # numpy and 0-d tensor numbers as Python ones
    limit = loaded.info.max_length if max_tokens is None else scalar(max_tokens)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= loaded.info.max_length:
        raise ValueError(f"max_tokens must be an integer in [1, {loaded.info.max_length}], "
                         f"got {max_tokens!r}")
    enc = loaded.tokenizer(text, truncation=True, max_length=limit, return_tensors="pt")
    return activations_table(loaded, enc["input_ids"])


def activations_table(model: LoadedModel | str | None, input_ids):
    """:data:`COLUMNS` per layer (one row each) of one plain forward of ``model`` on ``input_ids``
    ((N,) or (1, N) token ids, special tokens included): the residual stream after each layer."""
    import pandas as pd

    loaded = model_on(model)
    given = torch.as_tensor(input_ids)
    if given.dim() not in (1, 2) or (given.dim() == 2 and given.shape[0] != 1) or given.numel() == 0 \
            or given.is_floating_point() or given.dtype == torch.bool:
        raise ValueError(f"input_ids must be integer token ids of shape (N,) or (1, N), N >= 1, got "
                         f"{given.dtype} {tuple(given.shape)}")
    ids = given.reshape(1, -1).to(loaded.device)
    with loaded.lock, torch.no_grad(), recording_activations(loaded.model) as rows:
        loaded.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    tokens = loaded.tokenizer.convert_ids_to_tokens(ids[0].tolist())
    return pd.DataFrame([{"layer": i, "max_abs": float(r["max_abs"]), "token_index": int(r["token"]),
                          "token": tokens[int(r["token"])], "dim": int(r["dim"]),
                          "median_abs": float(r["median_abs"]), "ratio": float(r["ratio"])}
                         for i, r in enumerate(rows)], columns=list(COLUMNS))
