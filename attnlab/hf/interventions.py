"""Per-head interventions (swap mode, one head at a time): "where does explaining away matter?"

For each (layer l, head h) the model runs with the model's own attention everywhere except head h of
layer l, whose weights are replaced by a variant's (computed from the same q and k by
:func:`attnlab.attend`), and the change of the output is measured against the unmodified model:

- encoders: the cosine distance 1 - cos(y_i, y'_i) of the final hidden states, mean over tokens
  (``hidden_cosine``), and of the mean-pooled sentence embedding (``pooled_cosine``);
- causal LMs loaded with their LM head (:func:`load_with_lm_head`): the change of the text's
  log-likelihood per token, mean_t ln p'(x_t | x_<t) - mean_t ln p(x_t | x_<t) (``loglik_change``, nats).

Batching: the interventions of one layer l run as one batch of H copies of the text; the layers below
l are the same as in the unmodified model, so they are not run again: their outputs, recorded once,
are returned by a stand-in forward. All L x H heads cost sum_l H (L - l) layer passes (252 for
MiniLM's 6 x 12) instead of L H full forwards. The attention function ``attnlab_intervene`` is
registered with transformers' ``AttentionInterface``; the model's implementation and the layers'
forwards are restored on exit, also on error.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from attnlab.hf.interface import UnsupportedModelError, to_bool_mask
from attnlab.hf.loading import LoadedModel, model_on
from attnlab.hf.variant_params import variant_kwargs
from attnlab.normalizers import VARIANTS, attend

__all__ = ["INTERVENE", "InterventionResult", "head_interventions", "load_with_lm_head", "has_lm_head"]

INTERVENE = "attnlab_intervene"
ENCODER_MEASURES = ("hidden_cosine", "pooled_cosine")
LM_MEASURES = ("loglik_change",)
_BLOCK = re.compile(r"^(.*\.\d+)\.")  # "encoder.layer.3.attention.self" -> "encoder.layer.3"


@dataclass
class _Plan:
    """State of one :func:`head_interventions` run, read by ``attnlab_intervene``."""

    variant: str
    params: dict
    layer_of: dict[int, int] = field(default_factory=dict)  # id(attention module) -> layer
    targets: list[tuple[int, int]] | None = None  # per batch element (layer, head); None = unmodified


_PLAN: contextvars.ContextVar[_Plan | None] = contextvars.ContextVar("attnlab_intervene", default=None)


def _intervene_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The model's SDPA attention; for each batch element b with a target (l, h) at this layer, head h
    is recomputed with the plan's variant. query (B, H, M, D); key, value (B, H_kv, N, D)."""
    kwargs.pop("output_attentions", None)
    out, _ = sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )  # (B, M, H, D)
    plan = _PLAN.get()
    if plan is None:
        return out, None
    layer = plan.layer_of.setdefault(id(module), len(plan.layer_of))  # first forward: call order
    if plan.targets is None:
        return out, None
    n_rep = getattr(module, "num_key_value_groups", 1)
    M, N = query.shape[-2], key.shape[-2]
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", False) if causal is None else causal) and M == N and M > 1
    mask = to_bool_mask(attention_mask, N)  # (B | 1, 1 | H, M, N) or None
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    extra = variant_kwargs(plan.variant, plan.params, causal=causal)
    for b, (lb, h) in enumerate(plan.targets):
        if lb != layer:
            continue
        kv = h // n_rep
        m = None if mask is None else mask[b if mask.shape[0] > 1 else 0, 0 if mask.shape[1] == 1 else h]
        head = attend(
            query[b, h][None, None],
            key[b, kv][None, None],
            value[b, kv][None, None],
            plan.variant,
            mask=None if m is None else m[None, None],
            causal=causal,
            scale=scale,
            **extra,
        )  # (1, 1, M, D)
        out[b, :, h] = head[0, 0].to(out.dtype)
    return out, None


def _register() -> None:
    AttentionInterface.register(INTERVENE, _intervene_attention)
    AttentionMaskInterface.register(INTERVENE, sdpa_mask)


_register()


@contextlib.contextmanager
def _intervening(model, plan: _Plan) -> Iterator[None]:
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


@contextlib.contextmanager
def _skipping(blocks: list[torch.nn.Module], outputs: list, below: int, batch: int) -> Iterator[None]:
    """Blocks 0 .. below - 1 return their recorded (batch-1) outputs expanded to ``batch`` instead of
    running (the interventions of layer ``below`` leave them unchanged)."""

    def expand(x):
        if isinstance(x, torch.Tensor):
            return x.expand(batch, *x.shape[1:]) if x.dim() and x.shape[0] == 1 else x
        if isinstance(x, tuple):
            return tuple(expand(y) for y in x)
        return x

    try:
        for i in range(below):
            cached = expand(outputs[i])
            blocks[i].forward = lambda *a, _c=cached, **k: _c
        yield
    finally:
        for i in range(below):
            blocks[i].__dict__.pop("forward", None)


def _blocks(model, n_layers: int) -> list[torch.nn.Module]:
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


def has_lm_head(model) -> bool:
    """The model computes next-token logits (``get_output_embeddings()`` is a module)."""
    get = getattr(model, "get_output_embeddings", None)
    return callable(get) and get() is not None


def load_with_lm_head(path: str | os.PathLike, *, device="cpu") -> LoadedModel:
    """A local causal LM with its LM head (``AutoModelForCausalLM``, safetensors only, no remote code),
    for :func:`head_interventions`. The directory is first checked and probed by
    :func:`attnlab.hf.load_model` (its tokenizer and facts are reused). ValueError when the model is not
    causal or its weights have no LM head (and it is not tied to the input embeddings)."""
    from transformers import AutoModelForCausalLM

    from attnlab.hf.loading import ModelLoadError, _quiet_transformers, load_model

    base = load_model(path, device=device)
    if not base.info.causal:
        raise ValueError(
            f"load_with_lm_head: {base.info.name} is not a causal LM (it is a {base.info.model_type} "
            "encoder); encoders need no head, pass them to head_interventions as they are"
        )
    with _quiet_transformers():
        try:
            lm, info = AutoModelForCausalLM.from_pretrained(
                base.info.path,
                use_safetensors=True,
                dtype=torch.float32,
                output_loading_info=True,
                local_files_only=True,
                trust_remote_code=False,
            )
        except Exception as e:  # noqa: BLE001 -- many exception types from transformers
            raise ModelLoadError(
                f"cannot load {base.info.path} with its LM head: {e.__class__.__name__}: {e}"
            ) from None
    tied = bool(getattr(lm.config, "tie_word_embeddings", False))
    if any("lm_head" in k for k in info.get("missing_keys") or ()) and not tied:
        raise ModelLoadError(
            f"the weights in {base.info.path} have no LM head (lm_head.weight is missing and the "
            "config does not tie it to the input embeddings); save the model with its head"
        )
    lm.eval().to(base.device)
    return LoadedModel(model=lm, tokenizer=base.tokenizer, info=base.info)


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


def _loglik(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """mean_t ln p(x_t | x_<t): logits (B, N, V), ids (1, N) -> (B,)."""
    logp = torch.log_softmax(logits[:, :-1].double(), -1)  # (B, N - 1, V)
    target = ids[:, 1:].expand(logits.shape[0], -1)[..., None]
    return logp.gather(-1, target)[..., 0].mean(-1)


def head_interventions(
    model: LoadedModel | str | os.PathLike | None,
    text: str | torch.Tensor,
    variant: str = "dnas",
    params: Mapping | None = None,
    *,
    batch_size: int | None = None,
    progress: bool = False,
    on_progress=None,
    device=None,
) -> InterventionResult:
    """Swap each head's normalizer for ``variant`` in turn and measure the change of the output.

    Args:
        model: a LoadedModel (causal LMs: from :func:`load_with_lm_head`), a model directory or None
            (the embedded MiniLM).
        text: the text (tokenized with special tokens, truncated to the model's max length) or
            input ids (1, N) / (N,).
        variant: any registered variant; params: its parameters (defaults filled in).
        batch_size: copies of the text per forward (default: the number of heads H).
        progress: a tqdm bar over the L x H heads; on_progress: called as on_progress(done, L * H)
            after each batch (e.g. a Streamlit progress bar).

    Returns:
        :class:`InterventionResult` with (L, H) ``measures``: ``hidden_cosine`` and ``pooled_cosine``
        for encoders, ``loglik_change`` for causal LMs.
    """
    loaded = model_on(model, device)
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {tuple(VARIANTS)}, got {variant!r}")
    info, net = loaded.info, loaded.model
    causal_lm = info.causal
    if causal_lm and not has_lm_head(net):
        raise ValueError(
            f"interventions on the causal model {info.name} measure the change of the text's log-likelihood, "
            "which needs the LM head, but the model was loaded without one; load it with "
            "attnlab.hf.interventions.load_with_lm_head(directory)"
        )
    if isinstance(text, str):
        if not text.strip():
            raise ValueError("text is empty (or only whitespace); there is nothing to intervene on")
        ids = loaded.tokenizer(text, truncation=True, max_length=info.max_length, return_tensors="pt")[
            "input_ids"
        ]
    elif isinstance(text, torch.Tensor) and text.dim() in (1, 2) and not text.is_floating_point():
        ids = text.reshape(1, -1).long()
    else:
        raise ValueError(f"text must be a str or integer input ids (N,) / (1, N), got {type(text).__name__}")
    N = ids.shape[1]
    if N == 0 or (causal_lm and N < 2):
        raise ValueError(
            f"text has {N} token(s); the log-likelihood change needs at least 2"
            if causal_lm
            else "text produced no tokens"
        )
    L, H = info.n_layers, info.n_heads
    if batch_size is None:
        batch_size = H
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    params = dict(params or {})
    variant_kwargs(variant, params, causal=causal_lm)  # validates the parameters now
    blocks = _blocks(net, L)
    ids = ids.to(loaded.device)
    plan = _Plan(variant=variant, params=params)
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

    recorded: list = []
    hooks = [b.register_forward_hook(lambda _m, _i, o: recorded.append(o)) for b in blocks]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=L * H, unit="head", desc=f"swapping heads to {variant}", leave=False)
    with loaded.lock, torch.no_grad(), _intervening(net, plan):
        try:
            base = forward(1)  # unmodified; assigns layer numbers, records each block's output
        finally:
            for hk in hooks:
                hk.remove()
        if len(plan.layer_of) != L:
            raise UnsupportedModelError(
                f"{type(net).__name__} made {len(plan.layer_of)} attention calls, expected {L}"
            )
        for layer in range(L):
            for h0 in range(0, H, batch_size):
                heads = list(range(h0, min(h0 + batch_size, H)))
                plan.targets = [(layer, h) for h in heads]
                with _skipping(blocks, recorded, layer, len(heads)):
                    y = forward(len(heads))
                plan.targets = None
                if causal_lm:
                    measures["loglik_change"][layer, heads] = (y - base).cpu()
                else:
                    measures["hidden_cosine"][layer, heads] = _cosine_distance(y, base).mean(-1).cpu()
                    measures["pooled_cosine"][layer, heads] = _cosine_distance(y.mean(1), base.mean(1)).cpu()
                if bar is not None:
                    bar.update(len(heads))
                if on_progress is not None:
                    on_progress(layer * H + heads[-1] + 1, L * H)
    if bar is not None:
        bar.close()
    tokens = loaded.tokenizer.convert_ids_to_tokens(ids[0].tolist())
    baseline = {"loglik_per_token": float(base[0])} if causal_lm else {}
    return InterventionResult(
        variant=variant, params=params, measures=measures, tokens=tokens, baseline=baseline
    )
