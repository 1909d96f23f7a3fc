"""Per-head interventions (swap mode, one head at a time): "where does explaining away matter?"

For each (layer l, head h) the model runs with the model's own attention everywhere except head h of
layer l, whose weights are replaced by a variant's (computed from the same q and k by
:func:`attnlab.attend`), and the change of the output is measured against the unmodified model:

- encoders: the cosine distance 1 - cos(y_i, y'_i) of the final hidden states, mean over tokens
  (``hidden_cosine``), and of the mean-pooled sentence embedding (``pooled_cosine``);
- causal LMs loaded with their LM head (:func:`load_with_lm_head`): the change of the text's
  log-likelihood per token, mean_t ln p'(x_t | x_<t) - mean_t ln p(x_t | x_<t) (``loglik_change``, nats).

Batching (:mod:`attnlab.hf.beyond.head_swaps`): the swaps of one layer l run as one batch (one copy of the
text per swapped head); the layers below l are not run again, and at layer l only what follows the
attention runs per copy. All L x H heads of MiniLM (6 x 12) cost ~37 forward-equivalents instead of
72 forwards. A long text is cut into windows as :func:`attnlab.hf.analyze` cuts it; ``window_index``
picks the one described.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from attnlab.hf.beyond.head_swaps import INTERVENE, SwapPlan, default_batch_size, swap_runner
from attnlab.hf.capture.variant_params import variant_kwargs
from attnlab.hf.load.loading import LoadedModel, model_on
from attnlab.normalizers import VARIANTS
from attnlab.normalizers.checks import scalar

__all__ = ["INTERVENE", "InterventionResult", "head_interventions", "load_with_lm_head", "has_lm_head"]

ENCODER_MEASURES = ("hidden_cosine", "pooled_cosine")
LM_MEASURES = ("loglik_change",)


def has_lm_head(model) -> bool:
    """The model computes next-token logits (``get_output_embeddings()`` is a module)."""
    get = getattr(model, "get_output_embeddings", None)
    return callable(get) and get() is not None


def load_with_lm_head(path: str | os.PathLike, *, device="cpu") -> LoadedModel:
    """A local causal LM with its LM head (``AutoModelForCausalLM``, safetensors only, no remote code),
    for :func:`head_interventions`. The directory is first checked and probed by
    :func:`attnlab.hf.load_model` (its tokenizer and facts are reused). ValueError when the model is not
    causal or its weights have no LM head (and it is not tied to the input embeddings)."""
    from attnlab.hf.load.loading import load_language_model, load_model

    base = load_model(path, device=device)
    if not base.info.causal:
        raise ValueError(
            f"load_with_lm_head: {base.info.name} is not a causal LM (it is a {base.info.model_type} "
            "encoder); encoders need no head, pass them to head_interventions as they are"
        )
    return load_language_model(path, device=device)


@dataclass
class InterventionResult:
    """The L x H maps of :func:`head_interventions`."""

    variant: str
    params: dict  # the variant's parameters used
    measures: dict[str, torch.Tensor]  # name -> (L, H) change of the output when that head is swapped
    tokens: list[str]
    baseline: dict[str, float] = field(default_factory=dict)  # e.g. loglik_per_token of the unmodified model

    def table(self):
        """Tidy rows: layer, head, measure, value."""
        import numpy as np
        import pandas as pd

        frames = []
        for name, m in self.measures.items():
            L, H = m.shape
            frames.append(
                pd.DataFrame(
                    {
                        "variant": self.variant,
                        "layer": np.repeat(np.arange(L), H),
                        "head": np.tile(np.arange(H), L),
                        "measure": name,
                        "value": m.reshape(-1).double().numpy(),
                    }
                )
            )
        return pd.concat(frames, ignore_index=True)


def _cosine_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return 1.0 - torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


def _changes(y: torch.Tensor, base: torch.Tensor, causal_lm: bool) -> dict[str, torch.Tensor]:
    """measure -> (B,): y, base are log-likelihoods (B,), (1,) or final hidden states (B | 1, N, D)."""
    if causal_lm:
        return {"loglik_change": y - base}
    return {
        "hidden_cosine": _cosine_distance(y, base).mean(-1),
        "pooled_cosine": _cosine_distance(y.mean(1), base.mean(1)),
    }


def _loglik(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """mean_t ln p(x_t | x_<t): logits (B, N, V), ids (1, N) -> (B,), one copy at a time in float64
    (so that only one (N - 1, V) float64 array exists at once)."""
    target = ids[0, 1:, None]  # (N - 1, 1)
    rows = [torch.log_softmax(x[:-1].double(), -1).gather(-1, target)[:, 0].mean() for x in logits]
    return torch.stack(rows)


def _input_ids(loaded: LoadedModel, text, window_index: int, window, overlap) -> torch.Tensor:
    """(1, N) input ids: a Window's, given ids, or window ``window_index`` of a text (analyze's windows)."""
    from attnlab.hf.analysis.one_window import text_window
    from attnlab.hf.capture.windows import Window

    if isinstance(text, Window):
        return torch.tensor([text.input_ids])
    if isinstance(text, str):
        if not text.strip():
            raise ValueError("text is empty (or only whitespace); there is nothing to intervene on")
        win = text_window(loaded, text, window_index, window=window, overlap=overlap)
        return torch.tensor([win.input_ids])
    if isinstance(text, torch.Tensor) and text.dim() in (1, 2) and not text.is_floating_point():
        return text.reshape(1, -1).long()
    raise ValueError(
        "text must be a str, an attnlab.hf.Window or integer input ids (N,) / (1, N), "
        f"got {type(text).__name__}"
    )


def encoder_decoder_message(info) -> str:
    """Why per-head interventions refuse an encoder-decoder, and what it supports instead."""
    return (
        f"per-head interventions do not support encoder-decoders: {info.name} is a {info.model_type} "
        "encoder-decoder, whose encoder self-attention, decoder self-attention and cross-attention read "
        "two texts (a source and a target), and swapping one of their heads has no one output measure "
        "here (hidden states for encoders, log-likelihood for causal LMs). Supported on it: the maps of "
        "the three kinds under every variant, hf.analyze(source, model, target=...) (recompute mode; "
        "swap mode runs a variant in every head at once, BART family); not supported: one head "
        "swapped at a time, in any of the three kinds"
    )


def head_interventions(
    model: LoadedModel | str | os.PathLike | None,
    text,
    variant: str = "dnas",
    params: Mapping | None = None,
    *,
    window_index: int = 0,
    window: int | None = None,
    overlap: int | None = None,
    batch_size: int | None = None,
    progress: bool = False,
    on_progress=None,
    device=None,
) -> InterventionResult:
    """Swap each head's normalizer for ``variant`` in turn and measure the change of the output.

    Args:
        model: a LoadedModel (causal LMs: from :func:`load_with_lm_head`), a model directory or None
            (the embedded MiniLM).
        text: a text, an :class:`attnlab.hf.Window` of an analysis, or input ids (1, N) / (N,).
        variant: any registered variant; params: its parameters (numbers; defaults filled in).
        window_index: for a text, which of its windows (0-based; cut as :func:`attnlab.hf.analyze` cuts
            them, ``window`` tokens each, ``overlap`` shared); ValueError for one the text lacks.
        batch_size: swapped heads per forward (default: a layer's H heads, fewer when a batch's
            activations would pass ``attnlab.hf.beyond.head_swaps.BATCH_BYTES``).
        progress: a tqdm bar over the L x H heads; on_progress: called as on_progress(done, L * H)
            after each batch (e.g. a Streamlit progress bar).

    Returns:
        :class:`InterventionResult` with (L, H) ``measures``: ``hidden_cosine`` and ``pooled_cosine``
        for encoders, ``loglik_change`` for causal LMs.
    """
    loaded = model_on(model, device)
    if loaded.info.encoder_decoder:
        raise ValueError(encoder_decoder_message(loaded.info))
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {tuple(VARIANTS)}, got {variant!r}")
    info, net = loaded.info, loaded.model
    causal_lm = info.causal
    if causal_lm and not has_lm_head(net):
        raise ValueError(
            f"interventions on the causal model {info.name} measure the change of the text's log-likelihood, "
            "which needs the LM head, but the model was loaded without one; load it with "
            "attnlab.hf.beyond.interventions.load_with_lm_head(directory)"
        )
    ids = _input_ids(loaded, text, window_index, window, overlap)
    N = ids.shape[1]
    if N == 0 or (causal_lm and N < 2):
        raise ValueError(
            f"text has {N} token(s); the log-likelihood change needs at least 2"
            if causal_lm
            else "text produced no tokens"
        )
    L, H = info.n_layers, info.n_heads
    if batch_size is None:
        batch_size = default_batch_size(net.config, N, H, causal_lm)
    batch_size = scalar(batch_size)  # numpy and 0-d tensor numbers as Python ones
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    params = dict(params or {})
    plan = SwapPlan(variant=variant, params=variant_kwargs(variant, params, causal=causal_lm))
    ids = ids.to(loaded.device)
    measures = {
        k: torch.zeros(L, H, dtype=torch.float64) for k in (LM_MEASURES if causal_lm else ENCODER_MEASURES)
    }

    def forward(batch: int):
        out = net(
            input_ids=ids.expand(batch, -1),
            use_cache=False,
            **({} if causal_lm else {"output_hidden_states": True}),
        )
        if causal_lm:
            return _loglik(out.logits, ids)  # (B,)
        return out.hidden_states[-1]  # (B, N, D)

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=L * H, unit="head", desc=f"swapping heads to {variant}", leave=False)
    try:
        with loaded.lock, torch.no_grad(), swap_runner(net, plan, L) as runner:
            base = runner.unmodified(forward)
            for layer in range(L):
                for h0 in range(0, H, batch_size):
                    heads = list(range(h0, min(h0 + batch_size, H)))
                    y = runner.swapped(forward, layer, heads)
                    for name, value in _changes(y, base, causal_lm).items():
                        measures[name][layer, heads] = value.cpu()
                    if bar is not None:
                        bar.update(len(heads))
                    if on_progress is not None:
                        on_progress(layer * H + heads[-1] + 1, L * H)
    finally:
        if bar is not None:
            bar.close()
    tokens = loaded.tokenizer.convert_ids_to_tokens(ids[0].tolist())
    baseline = {"loglik_per_token": float(base[0])} if causal_lm else {}
    return InterventionResult(
        variant=variant, params=params, measures=measures, tokens=tokens, baseline=baseline
    )
