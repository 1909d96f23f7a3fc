"""What a normalizer costs a pretrained model: its language-model loss with a variant swapped in.

Loss definitions (nats per scored token, natural log; docs/SWAP_EVAL.md):

- causal LMs (``AutoModelForCausalLM`` heads): next-token loss. A window of N tokens x_0..x_{N-1}
  (special tokens included, e.g. LLaMA's BOS) scores the N - 1 tokens x_t, t >= 1:
  -ln p(x_t | x_<t); its *position* is t. This is transformers' ``model(ids, labels=ids).loss``.
- encoders with a masked-LM head (``AutoModelForMaskedLM``): masked-token loss, BERT's rule with a
  seeded mask. Of the window's non-special tokens each is chosen with probability ``mask_rate``
  (0.15; at least one per window), and of the chosen 80 % become [MASK], 10 % a uniformly random token
  id of the vocabulary, 10 % stay; the loss is -ln p(original token) at each chosen position, whose
  *position* is its index in the window. The draws come from numpy's PCG64 seeded with
  (seed, text index, window index), so every swap of a text sees the same mask.

Texts are tokenized once and cut into consecutive, non-overlapping windows of ``window`` tokens
(special tokens included, so each window is what the model saw in pretraining); every text token is
in exactly one window. The loss over several texts is token-weighted: total nats / scored tokens.

A swap (:class:`Swap`, installed by :func:`swapped_layers`; both in :mod:`attnlab.hf.beyond.layer_swap`,
re-exported here) replaces the attention of some layers (all when None) and, within them, of some
heads (all when None) by a variant, with the variant's parameters; everything is restored on exit,
also on error. Several swaps of one
window (:func:`window_losses`) share one unswapped forward: the transformer blocks below a swap's
first layer are not run again, they return their recorded outputs (as the interventions do,
:mod:`attnlab.hf.beyond.head_swaps`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from attnlab.hf.beyond.head_swaps import _replaced_forwards, blocks_of
from attnlab.hf.beyond.layer_swap import LAYER_SWAP, Swap, swapped_layers
from attnlab.hf.capture.variant_params import variant_kwargs
from attnlab.hf.capture.windows import MAX_DEFAULT_WINDOW, special_affixes, tokenize_text
from attnlab.hf.load.loading import LoadedModel, load_language_model
from attnlab.hf.load.model_info import ModelInfo
from attnlab.normalizers.checks import plain_number, scalar

__all__ = [
    "LAYER_SWAP",
    "MASK_RATE",
    "Swap",
    "TokenLosses",
    "check_swap",
    "text_windows",
    "mask_tokens",
    "lm_inputs",
    "token_losses",
    "window_losses",
    "swapped_layers",
    "as_language_model",
    "language_model_loss",
]

MASK_RATE = 0.15  # BERT's share of masked tokens


@dataclass(frozen=True)
class TokenLosses:
    """The scored tokens of one window."""

    positions: np.ndarray  # (T,) int64 position of each scored token in its window
    losses: np.ndarray  # (T,) float64 -ln p(token), nats


# ----------------------------------------------------------------------------------------------
# Windows, masks, losses (pure functions)
# ----------------------------------------------------------------------------------------------


def text_windows(tokenizer, text: str, window: int) -> list[tuple[list[int], np.ndarray]]:
    """``text`` -> [(input ids (N,), special (N,) bool)]: consecutive windows of at most ``window``
    tokens, the tokenizer's special tokens around each, every text token in exactly one window."""
    prefix, suffix = special_affixes(tokenizer)
    content = window - len(prefix) - len(suffix)
    if content < 1:
        raise ValueError(
            f"window must leave room for at least 1 text token besides the {len(prefix) + len(suffix)} "
            f"special tokens, got window={window}"
        )
    ids = tokenize_text(tokenizer, text).ids
    out = []
    for start in range(0, len(ids), content):
        piece = ids[start : start + content].tolist()
        special = np.zeros(len(prefix) + len(piece) + len(suffix), dtype=bool)
        special[: len(prefix)] = True
        special[len(prefix) + len(piece) :] = True
        out.append(([*prefix, *piece, *suffix], special))
    return out


def mask_tokens(
    ids: np.ndarray,
    special: np.ndarray,
    rng: np.random.Generator,
    mask_id: int,
    vocab_size: int,
    rate: float = MASK_RATE,
) -> tuple[np.ndarray, np.ndarray]:
    """BERT's masking: ids, special (N,) -> (inputs (N,), labels (N,) with -100 where not scored).

    Each non-special token is chosen with probability ``rate`` (the first draw picks one when none
    is chosen); of the chosen, 80 % -> ``mask_id``, 10 % -> a random id in [0, vocab_size), 10 % kept.
    """
    inputs, labels = ids.copy(), np.full_like(ids, -100)
    candidates = np.flatnonzero(~special)
    if not len(candidates):
        return inputs, labels
    chosen = rng.random(len(candidates)) < rate
    if not chosen.any():
        chosen[rng.integers(len(candidates))] = True
    picked = candidates[chosen]
    action = rng.random(len(picked))  # < 0.8: [MASK], < 0.9: random token, else kept
    random_ids = rng.integers(vocab_size, size=len(picked))
    labels[picked] = ids[picked]
    inputs[picked[action < 0.8]] = mask_id
    swap = (action >= 0.8) & (action < 0.9)
    inputs[picked[swap]] = random_ids[swap]
    return inputs, labels


def lm_inputs(
    loaded: LoadedModel,
    ids: Sequence[int],
    special: np.ndarray,
    *,
    causal: bool,
    seed: int,
    text: int,
    window: int,
    rate: float = MASK_RATE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One window's (inputs (N,), labels (N,)) as transformers' LM heads take them: a causal LM's
    labels are its inputs (the head shifts them), an MLM's are :func:`mask_tokens`' with the mask drawn
    from PCG64 seeded with (seed, text, window)."""
    ids = np.asarray(ids, dtype=np.int64)
    if causal:
        return torch.from_numpy(ids), torch.from_numpy(ids.copy())
    mask_id = getattr(loaded.tokenizer, "mask_token_id", None)
    if mask_id is None:
        raise ValueError(
            f"model {loaded.info.name}: its tokenizer has no mask token, which the masked-LM "
            "loss needs; expected a tokenizer saved with its [MASK] token"
        )
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, text, window])))
    inputs, labels = mask_tokens(ids, special, rng, mask_id, loaded.model.config.vocab_size, rate)
    return torch.from_numpy(inputs), torch.from_numpy(labels)


def token_losses(logits: torch.Tensor, labels: torch.Tensor, causal: bool) -> TokenLosses:
    """logits (N, V), labels (N,) -> the scored tokens' -ln p in float32 (as transformers' losses),
    returned in float64. Causal: logits at t - 1 score labels[t]."""
    if causal:
        logits, labels, offset = logits[:-1], labels[1:], 1
    else:
        offset = 0
    scored = torch.nonzero(labels != -100)[:, 0]  # (T,)
    nll = torch.nn.functional.cross_entropy(logits[scored].float(), labels[scored], reduction="none")
    return TokenLosses(
        positions=(scored + offset).cpu().numpy().astype(np.int64), losses=nll.double().cpu().numpy()
    )


def window_losses(
    loaded: LoadedModel,
    ids: Sequence[int],
    special: np.ndarray,
    swaps: Sequence[Swap],
    *,
    seed: int = 0,
    text: int = 0,
    window: int = 0,
    mask_rate: float = MASK_RATE,
) -> list[TokenLosses]:
    """One window (ids, special (N,)) scored under each swap, in order; the same mask for every swap.

    After a :class:`Swap` with ``variant=None`` (the unswapped forward, whose block outputs are
    recorded), a swap whose first swapped layer is l does not run blocks 0 .. l-1 again.
    """
    net, info = loaded.model, loaded.info
    causal = info.causal
    inputs, labels = lm_inputs(
        loaded, ids, special, causal=causal, seed=seed, text=text, window=window, rate=mask_rate
    )
    inputs, labels = inputs[None].to(loaded.device), labels.to(loaded.device)  # (1, N), (N,)
    blocks = blocks_of(net, info.n_layers)
    recorded: dict[int, object] = {}  # id(block) -> its output in the unswapped forward
    out = []
    with loaded.lock, torch.no_grad():
        for swap in swaps:
            if swap.variant is None:
                hooks = [
                    b.register_forward_hook(lambda m, _i, o: recorded.__setitem__(id(m), o)) for b in blocks
                ]
                try:
                    logits = net(input_ids=inputs, use_cache=False).logits[0]  # (N, V)
                finally:
                    for h in hooks:
                        h.remove()
            else:
                first = 0 if swap.layers is None else min(swap.layers)
                below = [b for b in blocks[:first] if id(b) in recorded]

                def stand_in(m, _forward):
                    return lambda *_a, **_k: recorded[id(m)]

                with _replaced_forwards(below, stand_in), swapped_layers(net, blocks, swap):
                    logits = net(input_ids=inputs, use_cache=False).logits[0]
            out.append(token_losses(logits, labels, causal))
    return out


# ----------------------------------------------------------------------------------------------
# Checks and the public function
# ----------------------------------------------------------------------------------------------


def _check_indices(name: str, values, n: int, what: str) -> tuple[int, ...] | None:
    if values is None:
        return None
    items = (
        [values]
        if isinstance(values, int)
        else list(values)
        if isinstance(values, (list, tuple, range))
        else None
    )
    if not items or any(
        isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v < n for v in items
    ):
        raise ValueError(
            f"{name} must be None or {what} indices in [0, {n - 1}] (the model has {n}), got {values!r}"
        )
    return tuple(sorted({int(v) for v in items}))


def check_swap(
    info: ModelInfo, variant: str | None, layers=None, heads=None, params: Mapping | None = None
) -> Swap:
    """A :class:`Swap` for a model; ValueError naming ``variant``, ``layers``, ``heads`` or a parameter."""
    if variant is None:
        if params or layers is not None or heads is not None:
            raise ValueError(
                "layers, heads and variant parameters need a variant; got variant=None with "
                f"layers={layers!r}, heads={heads!r}, params={dict(params or {})!r}"
            )
        return Swap()
    kwargs = variant_kwargs(variant, params, causal=info.causal)
    return Swap(
        variant,
        _check_indices("layers", layers, info.n_layers, "layer"),
        _check_indices("heads", heads, info.n_heads, "head"),
        kwargs,
    )


def _language_model(model) -> LoadedModel:
    """A LoadedModel whose model has an LM head (a directory or None is loaded with it)."""
    if not isinstance(model, LoadedModel):
        if model is not None and not isinstance(model, (str, os.PathLike)):
            raise ValueError(
                "model must be a LoadedModel (attnlab.hf.load_language_model), a model directory "
                f"or None, got {type(model).__name__}"
            )
        return load_language_model(model)
    get = getattr(model.model, "get_output_embeddings", None)
    if not callable(get) or get() is None:
        raise ValueError(
            f"model {model.info.name} was loaded without an LM head ({type(model.model).__name__}); "
            "supported heads: causal (AutoModelForCausalLM), masked (AutoModelForMaskedLM); "
            "load it with attnlab.hf.load_language_model(directory)"
        )
    return model


as_language_model = _language_model  # public: the HNAS retrofit checks its model with it


def language_model_loss(
    texts: str | Sequence[str],
    model,
    variant: str | None = None,
    layers=None,
    heads=None,
    *,
    window: int | None = None,
    seed: int = 0,
    mask_rate: float = MASK_RATE,
    **params,
) -> float:
    """Mean loss in nats per scored token over ``texts`` (token-weighted; see the module docstring).

    Args:
        texts: a text or a sequence of texts (none empty).
        model: a LoadedModel with an LM head (:func:`attnlab.hf.load_language_model`), a model
            directory (loaded with its head) or None (the embedded MiniLM, which has none: ValueError).
        variant: None (the model's own attention) or a registered variant, swapped into ``layers``
            (indices, None = all) and ``heads`` (indices, None = all) with its ``**params``.
        window: tokens per window, special tokens included (default: the model's max length, at most
            512); seed, mask_rate: the masked-LM mask (ignored by causal LMs).
    """
    loaded = _language_model(model)
    swap = check_swap(loaded.info, variant, layers, heads, params)
    texts = [texts] if isinstance(texts, str) else texts
    if not isinstance(texts, Sequence) or not len(texts) or not all(isinstance(t, str) for t in texts):
        raise ValueError(f"texts must be a text or a non-empty sequence of texts, got {texts!r:.80}")
    window = min(loaded.info.max_length, MAX_DEFAULT_WINDOW) if window is None else scalar(window)
    mask_rate = plain_number(mask_rate)  # numpy and 0-d tensor numbers as Python ones
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= loaded.info.max_length:
        raise ValueError(f"window must be an integer in [1, {loaded.info.max_length}], got {window!r}")
    if isinstance(mask_rate, bool) or not isinstance(mask_rate, (int, float)) or not 0 < mask_rate <= 1:
        raise ValueError(f"mask_rate must be a number in (0, 1], got {mask_rate!r}")
    total, count = 0.0, 0
    for i, text in enumerate(texts):
        if not text.strip():
            raise ValueError(f"texts[{i}] is empty (or only whitespace); expected text to score")
        for w, (ids, special) in enumerate(text_windows(loaded.tokenizer, text, window)):
            (scored,) = window_losses(
                loaded, ids, special, [swap], seed=seed, text=i, window=w, mask_rate=mask_rate
            )
            total += float(scored.losses.sum())
            count += len(scored.losses)
    if count == 0:
        raise ValueError(
            f"texts gave no tokens to score ({len(texts)} text(s)); a causal LM needs windows of "
            "at least 2 tokens"
        )
    return total / count
