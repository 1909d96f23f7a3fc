"""attnlab's own checkpoints (``attnlab train``, ``checkpoints/enc-*``) in the analysis pipeline.

``hf.load_model(dir)`` hands a directory whose ``config.json`` declares ``attnlab-checkpoint/1`` (a run
with ``latest.json`` or a step directory; :func:`attnlab.checkpoint_io.is_checkpoint`) to
:func:`load_native`, and ``hf.analyze`` / ``hf.stream_analysis`` / ``hf.batch_weights`` /
``attnlab analyze --model`` call :func:`native_weights` for it: the same windows, results, statistics
and figures as for a Hugging Face model.

    loaded = hf.load_model("checkpoints/enc-hnas")      # NativeModel (a LoadedModel)
    with capture_attention_inputs(loaded.model) as captured:
        loaded.model(input_ids)                        # captured[l]: what layer l's attention saw
    weights, components = native_weights(loaded, input_ids, None, ("unas", "hnas"), "recompute", {"iters": 3})

Capture: a forward pre-hook on every block's attention module records its input x (B, T, C) (after
the block's LayerNorm), mask, causal flag and positions; the context manager removes its hooks even on
error. Each variant's weights then come from that layer's own score function:

- standard layers: s = q k^T / sqrt(D) with q, k from the layer's ``qkv`` projection of x;
- GAM layers: the brains' scores eps_b (Eq. 16) and, with the relative-position branch, delta_b
  (Eq. 24); each brain is normalized by the variant (Psi_b), mixed with the brain weights W^P into
  Phi (Eq. 14) and Theta (Eq. 22), and combined with c1 (Eq. 20) or geometrically (Eq. 25). Phi, Theta
  and every brain's map come back as ``components`` beside the combined weights.

Modes: ``recompute`` runs the checkpoint as trained once and computes every variant from the captured
inputs; ``swap`` runs, per variant, the same weights with that variant in every layer (later layers
see different inputs). HNAS uses the u per layer and head the checkpoint learned (no ``u`` given) or
the given u. Shapes: weights and components (L, B, H, N, N).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from attnlab.hf.capture.interface import DEFAULT_U
from attnlab.hf.load.model_info import LoadedModel, ModelInfo, ModelLoadError, resolve_device
from attnlab.hf.load.native_tokenizer import NativeTokenizer
from attnlab.normalizers import attention_weights, check_params, variant_spec

__all__ = [
    "NativeModel",
    "NativeTokenizer",
    "AttentionInputs",
    "capture_attention_inputs",
    "load_native",
    "learned_u",
    "native_weights",
]


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NativeModel(LoadedModel):
    """A native attnlab checkpoint loaded for analysis. ``model`` is an ``attnlab.models.TransformerLM``
    in eval mode, ``tokenizer`` a :class:`NativeTokenizer`; ``step_dir`` the checkpoint read."""

    step_dir: str = ""
    # copies of the weights with one variant in every layer (swap mode), by (variant, iters, u)
    _swapped: dict = field(default_factory=dict, repr=False, compare=False)


_CACHE: dict[tuple[str, str], NativeModel] = {}  # by (step directory, device): a new step loads anew
_CACHE_LOCK = threading.Lock()


def load_native(path: str | os.PathLike, *, device="cpu") -> NativeModel:
    """Load (once per checkpoint step and device) a native attnlab checkpoint for analysis.

    ``path`` is a run directory (its ``latest.json`` names the step) or a step directory. Reads JSON
    and safetensors only. :class:`~attnlab.hf.load.loading.ModelLoadError` (a ValueError) when it does not
    load; ValueError naming ``device`` for an unavailable device.
    """
    from attnlab.checkpoint_io import resolve_checkpoint

    dev = resolve_device(device)
    directory = Path(path).expanduser()
    try:
        step_dir = resolve_checkpoint(directory).resolve()
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"the attnlab checkpoint in {directory} does not load: {e}") from None
    key = (str(step_dir), str(dev))
    with _CACHE_LOCK:
        if key not in _CACHE:
            _CACHE[key] = _load(directory, step_dir, dev)
        return _CACHE[key]


def clear_native_cache() -> None:
    with _CACHE_LOCK:
        _CACHE.clear()


def _load(directory: Path, step_dir: Path, device: torch.device) -> NativeModel:
    from attnlab.data import load_tokenizer
    from attnlab.models import load

    try:
        model = load(step_dir)
        tokenizer = load_tokenizer(step_dir)
    except (OSError, ValueError, KeyError, RuntimeError, TypeError) as e:
        raise ModelLoadError(f"the attnlab checkpoint in {directory} does not load: {e}") from None
    if device.type != "cpu":
        try:
            model.to(device)
        except RuntimeError as e:  # out of device memory, ...
            raise ModelLoadError(f"cannot move the checkpoint in {directory} to {device}: {e}") from None
    cfg = model.config
    kinds = sorted(set(cfg.layer_variants())) + (["GAM"] if any(cfg.layer_gam()) else [])
    info = ModelInfo(
        path=str(directory.resolve()),
        name=f"{directory.resolve().name} ({'/'.join(kinds)})",
        model_type=f"attnlab-{cfg.kind}",
        architecture=type(model).__name__ + (" (GAM)" if any(cfg.layer_gam()) else ""),
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_heads,
        max_length=cfg.max_len,
        causal=cfg.kind == "decoder",
        embedded=False,
    )
    vocab = step_dir / "vocab.txt" if tokenizer.kind == "wordpiece" else step_dir / "config.json"
    return NativeModel(model=model, tokenizer=NativeTokenizer(tokenizer, info.causal, str(vocab)), info=info,
                       step_dir=str(step_dir))


def learned_u(loaded: NativeModel) -> torch.Tensor | None:
    """(L, H) u = sigmoid(theta) the checkpoint learned in its HNAS layers, 0.5 (the default) in its
    other layers; None when it has no HNAS layer."""
    rows, any_learned = [], False
    for block in loaded.model.blocks:
        u = block.attn.hybrid_weight()  # (H,) or None
        any_learned |= u is not None
        rows.append(torch.full((loaded.info.n_heads,), DEFAULT_U) if u is None else u.detach().float().cpu())
    return torch.stack(rows) if any_learned else None


def _u_table(u, n_layers: int, n_heads: int) -> float | torch.Tensor:
    """u as a float or an (L, H) float tensor; ValueError naming ``u`` when it does not broadcast."""
    if not isinstance(u, torch.Tensor) or u.numel() == 1:
        return float(u)
    try:
        return torch.broadcast_to(u.detach().float().cpu().reshape(u.shape if u.dim() == 2 else (1, -1)),
                                  (n_layers, n_heads)).clone()
    except RuntimeError:
        raise ValueError(
            f"u must be broadcastable to (L, H) = ({n_layers}, {n_heads}), got shape {tuple(u.shape)}"
        ) from None


# ----------------------------------------------------------------------------------------------
# Capture
# ----------------------------------------------------------------------------------------------


@dataclass
class AttentionInputs:
    """What one layer's attention module received in a forward pass."""

    module: torch.nn.Module  # attnlab.modules.MultiHeadAttention or GAMAttention
    x: torch.Tensor  # (B, T, C) the attention's input (after the block's LayerNorm)
    mask: torch.Tensor | None  # bool broadcastable to (B, H, T, T); True = may attend
    causal: bool  # j <= i
    positions: torch.Tensor | None  # (B, T) or (T,) corpus positions (GAM); None = arange(T)

    def query_key(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, k), each (B, H, T, D), of a standard attention layer, from its own ``qkv`` projection of
        x; ValueError for a GAM layer (its scores are per brain: ``module.brain_scores(x)``)."""
        from attnlab.modules import GAMAttention

        m = self.module
        if isinstance(m, GAMAttention):
            raise ValueError("a GAM layer has no single query and key; use module.brain_scores(x)")
        B, T, C = self.x.shape
        q, k, _ = m.qkv(self.x).split(C, dim=-1)
        return tuple(t.view(B, T, m.n_heads, m.head_dim).transpose(1, 2) for t in (q, k))


@contextlib.contextmanager
def capture_attention_inputs(model) -> Iterator[list[AttentionInputs]]:
    """Record, per layer in order, what each block's attention module receives during forwards inside
    the context (``attnlab.models.TransformerLM``). The hooks are removed on exit, even on error."""
    captured: list[AttentionInputs] = []

    def hook(module, args, kwargs):
        x = args[0] if args else kwargs["x"]
        captured.append(AttentionInputs(module, x.detach(), kwargs.get("mask"), bool(kwargs.get("causal")),
                                        kwargs.get("positions")))

    handles = [block.attn.register_forward_pre_hook(hook, with_kwargs=True) for block in model.blocks]
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


# ----------------------------------------------------------------------------------------------
# Weights of every variant from captured inputs
# ----------------------------------------------------------------------------------------------


def _normalize(scores, variant: str, c: AttentionInputs, params: dict, repeat: int = 1):
    """attention_weights of (B, H * repeat, T, T) scores with the layer's mask and ``params``; a
    per-head parameter (H,) is repeated for GAM's brains (head-major, as GAMAttention does)."""
    kw = {k: v.to(scores).repeat_interleave(repeat).view(1, -1, 1, 1) if isinstance(v, torch.Tensor) else v
          for k, v in params.items()}
    return attention_weights(scores, variant, mask=c.mask, causal=c.causal, **kw)


def _standard_layer(c: AttentionInputs, variant: str, params: dict) -> torch.Tensor:
    """(B, H, T, T) weights of a MultiHeadAttention layer: s = q k^T / sqrt(D) (Eq. 1's scores)."""
    q, k = (t.float() for t in c.query_key())  # (B, H, T, D)
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    return _normalize(scores, variant, c, params)


def _gam_branch(scores, variant, c, params, brain_w) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """scores (B, H, N_B, T, T) -> (mixed map (B, H, T, T), per-brain maps [(B, H, T, T)] * N_B)."""
    B, H, NB, T, _ = scores.shape
    psi = _normalize(scores.float().reshape(B, H * NB, T, T), variant, c, params, NB).view(B, H, NB, T, T)
    mixed = torch.einsum("bhntx,n->bhtx", psi, brain_w.float())  # sum_b W_b Psi_b (Eqs. 14, 22)
    return mixed, list(psi.unbind(2))


def _gam_layer(c: AttentionInputs, variant: str, params: dict) -> tuple[torch.Tensor, dict]:
    """(B, H, T, T) combined weights of a GAMAttention layer and its maps {phi, theta, brain_b,
    position_brain_b} (Eqs. 14-25 of the GAM paper)."""
    m, cfg = c.module, c.module.config
    phi, brains = _gam_branch(m.brain_scores(c.x), variant, c, params, m.brain_weights())
    parts = {"phi": phi, **{f"brain_{b}": p for b, p in enumerate(brains)}}
    if not cfg.relative_position:
        return phi, parts
    B, T, _ = c.x.shape
    positions = torch.arange(T, device=c.x.device) if c.positions is None else c.positions
    p = m.position_embedding(positions.expand(B, T))  # (B, T, M)
    theta, pos_brains = _gam_branch(m.brain_scores(p, positional=True), variant, c, params,
                                    m.brain_weights(m.position_brain_logits))
    parts.update(theta=theta, **{f"position_brain_{b}": t for b, t in enumerate(pos_brains)})
    if cfg.combine == "linear":  # Eq. (20): c1 Phi + (1 - c1) Theta
        combined = torch.lerp(theta, phi, m.c1().float())
    else:  # Eq. (25) on the weights: rows of sqrt(Phi o Theta), renormalized
        g = torch.sqrt(phi * theta + 1e-30)
        g = torch.where(phi * theta > 0, g, torch.zeros_like(g))
        combined = g / g.sum(-1, keepdim=True).clamp_min(1e-30)
    return combined, parts


def _layer_weights(c: AttentionInputs, variant: str, params: dict) -> tuple[torch.Tensor, dict]:
    from attnlab.modules import GAMAttention

    if isinstance(c.module, GAMAttention):
        return _gam_layer(c, variant, params)
    return _standard_layer(c, variant, params), {}


def _swapped_model(loaded: NativeModel, variant: str, u, settings: Mapping[str, Any]):
    """The checkpoint's weights with ``variant`` in every layer, its parameters ``settings``
    (:func:`_swap_settings`; HNAS layers get theta = logit(u), clamped to u in [1e-6, 1 - 1e-6]); the
    checkpoint itself when it already is that variant with those parameters."""
    from attnlab.models import ModelConfig, TransformerLM

    base = loaded.model.config
    if base.layer_variants() == [variant] * base.n_layers and all(
            getattr(base, name) == value for name, value in settings.items()):
        own = learned_u(loaded)
        if variant != "hnas" or (isinstance(u, torch.Tensor) and own is not None and torch.equal(u, own)):
            return loaded.model
    u_key = None if u is None else (u if isinstance(u, float) else tuple(u.flatten().tolist()))
    key = (variant, tuple(sorted(settings.items())), u_key)
    with loaded.lock:
        if key not in loaded._swapped:
            if len(loaded._swapped) >= 8:
                loaded._swapped.pop(next(iter(loaded._swapped)))
            cfg = ModelConfig.from_dict({**base.to_dict(), "variant": variant, **settings})
            model = TransformerLM(cfg)
            got = model.load_state_dict(loaded.model.state_dict(), strict=False)
            odd = [k for k in (*got.missing_keys, *got.unexpected_keys) if not k.endswith("hybrid.theta")]
            if odd:
                raise ValueError(
                    f"cannot swap {variant!r} into {loaded.info.name}: weights {odd[:3]} do not fit"
                )
            if u is not None:
                for layer, block in enumerate(model.blocks):
                    if block.attn.hybrid is not None:
                        ul = torch.as_tensor(u if isinstance(u, float) else u[layer]).clamp(1e-6, 1 - 1e-6)
                        block.attn.hybrid.theta.data.copy_(torch.logit(ul).expand_as(block.attn.hybrid.theta))
            loaded._swapped[key] = model.to(loaded.device).eval()
        return loaded._swapped[key]


def native_weights(
    loaded: NativeModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    variants: Sequence[str],
    mode: str,
    params: Mapping[str, Any] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """Weights of every variant for a (padded) batch of a native checkpoint.

    input_ids, attention_mask: (B, N) (mask: 1 = real token; default all ones). ``params``: the variant
    parameters given (checked, e.g. by ``hf.compute.weights.check_arguments``; the specs' defaults fill the
    rest); a tensor is per layer and head, broadcastable to (L, H). Without ``u`` HNAS uses the u the
    checkpoint's HNAS layers learned (0.5 in its other layers).
    Returns ({variant: (L, B, H, N, N)}, {variant: {map: (L, B, H, N, N)}} for GAM layers: "phi",
    "theta", "brain_<b>", "position_brain_<b>"; NaN in layers without that map), float32 on the CPU.
    Rows and columns of padded tokens are zero.
    """
    info = loaded.info  # input_ids, attention_mask: checked by hf.batch_weights (or windows of a text)
    if input_ids.shape[1] > info.max_length:
        raise ValueError(
            f"input_ids has {input_ids.shape[1]} tokens; {info.name} takes at most {info.max_length}"
        )
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    params = dict(params or {})
    if params.get("u") is None:
        learned = learned_u(loaded)
        params.pop("u", None)
        if learned is not None:
            params["u"] = learned
    tables = {k: _u_table(v, info.n_layers, info.n_heads) for k, v in params.items()
              if isinstance(v, torch.Tensor)}  # (L, H) per layer and head
    dev = loaded.device
    ids, mask = input_ids.to(dev), mask.to(dev)
    weights: dict[str, list] = {v: [] for v in variants}
    parts: dict[str, list[dict]] = {v: [] for v in variants}
    with loaded.lock, torch.no_grad():
        if mode == "recompute":
            runs = [(loaded.model, tuple(variants))]
        else:
            u = tables.get("u", params.get("u", check_params("hnas", {})["u"]))
            runs = [(_swapped_model(loaded, v, u, _swap_settings(v, params, info.causal)), (v,))
                    for v in variants]
        for model, names in runs:
            with capture_attention_inputs(model) as captured:
                model(ids, attention_mask=mask)
            keep = mask.bool()[:, None, :, None]  # padded queries: rows of zeros
            for v in names:
                for layer, c in enumerate(captured):
                    p_l = {**params, **{k: t[layer].to(dev) for k, t in tables.items()}}
                    w, p = _layer_weights(c, v, p_l)
                    weights[v].append(w.float() * keep)
                    parts[v].append({name: t.float() * keep for name, t in p.items()})
    out = {v: torch.stack(ws).cpu() for v, ws in weights.items()}  # (L, B, H, N, N)
    return out, {v: _stack_parts(parts[v], out[v]) for v in variants}


def _swap_settings(variant: str, params: Mapping[str, Any], causal: bool) -> dict:
    """ModelConfig fields of the swapped-in model: every parameter the variant's spec declares, as
    given or its default (checked, the spec's causal rule applied), ``u`` apart (it sets theta).
    A native model's attention modules take a variant's parameters through their config
    (``attnlab.modules.AttentionConfig``); a parameter they have no field for runs at its default, so
    another value of it is refused (ValueError naming it) rather than silently ignored."""
    from dataclasses import fields

    from attnlab.models import ModelConfig

    spec = variant_spec(variant)
    declared = {p.name for p in spec.params}
    given = {name: value for name, value in params.items() if name in declared and value is not None}
    full = check_params(variant, given, causal=causal)
    settable = {f.name for f in fields(ModelConfig)}
    settings = {}
    for p in spec.params:
        if p.name == "u":
            continue
        value = full[p.name]
        if p.name in settable and not isinstance(value, torch.Tensor):
            settings[p.name] = value
        elif isinstance(value, torch.Tensor) or value != p.default:
            raise ValueError(
                f"{p.name} cannot be swapped into a native attnlab checkpoint: its attention modules take "
                f"{sorted(declared & settable)} of {variant}'s parameters (got {p.name}={value!r}; "
                f"use mode='recompute', or {p.name}={p.default!r})")
    return settings


def _stack_parts(per_layer: list[dict], like: torch.Tensor) -> dict[str, torch.Tensor]:
    """[{map: (B, H, N, N)}] per layer -> {map: (L, B, H, N, N)}, NaN where a layer lacks the map."""
    names = list(dict.fromkeys(n for p in per_layer for n in p))
    nan = torch.full(like.shape[1:], math.nan)
    return {n: torch.stack([p[n].cpu() if n in p else nan for p in per_layer]) for n in names}
