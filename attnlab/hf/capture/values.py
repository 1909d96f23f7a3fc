"""Each layer's value vectors and output projection per head, read from a Hugging Face model.

Kobayashi et al. (2020), "Attention is Not Only a Weight", Eq. (6): a layer's attention output is
y_i = sum_h sum_j pi^h_ij f_h(x_j) (+ the output bias), with f_h(x_j) = (x_j W_V,h + b_V,h) W_O,h the
value vector of token j in head h carried through that head's slice of the output projection. This
module finds W_V (as the output of the value projection, recorded by a forward hook) and W_O per
layer. The architectures in ``VALUE_PATHS`` are read by name (the fast path):

    arch family              value projection            output projection
    BERT, RoBERTa, ELECTRA   self.value (Linear)         parent attention's output.dense (Linear)
    DistilBERT               v_lin (Linear)              out_lin (Linear)
    GPT-2                    c_attn (Conv1D, last third) c_proj (Conv1D)
    LLaMA, Mistral, Qwen2    v_proj (Linear, H_kv heads) o_proj (Linear)

Grouped-query attention: value head g serves query heads g * H / H_kv ... (g + 1) * H / H_kv - 1
(transformers' ``repeat_kv``). Every other model (ALBERT, ModernBERT, GPT-NeoX, GPT-J, OPT, CodeGen,
Phi, Phi-3, ...: fused or differently named projections, layers sharing their weights) is traced once
(:mod:`attnlab.hf.capture.value_trace`): the value projection is the one whose output holds the
attention function's ``value`` argument, the output projection the one fed its output. A model whose
values or output cannot be located so raises :class:`UnsupportedModelError` naming it and the reason.

Shapes: values (B, N, H_kv, Dh) as recorded; W_O per head (H, Dh, D); f (B, H, N, D).
Hooks are forward hooks on the value projections: they observe every forward (recompute, swap and
intervention runs alike) and are always removed on exit from :func:`record_values`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from attnlab.hf.capture.interface import UnsupportedModelError
from attnlab.hf.capture.score_adapters import adapter_for, attention_modules, output_projection
from attnlab.hf.capture.value_trace import is_projection, trace_value_paths

__all__ = ["VALUE_PATHS", "ValuePath", "value_paths", "record_values", "head_outputs"]

# family -> (attribute of the value projection, how the output projection is reached); documentation of
# what ``value_paths`` understands (the order it tries them in)
VALUE_PATHS = {
    "llama-family": ("v_proj", "o_proj"),
    "distilbert": ("v_lin", "out_lin"),
    "gpt2": ("c_attn", "c_proj"),
    "bert-family": ("value", "<parent>.output.dense"),
}


@dataclass(frozen=True)
class ValuePath:
    """Where one layer's values come from and go to."""

    layer: int
    name: str  # qualified name of the attention module, e.g. "encoder.layer.0.attention.self"
    value_module: torch.nn.Module  # hooked: its output holds the values (B, N, width)
    value_slice: slice | torch.Tensor  # the values' columns of that output (GPT-2: the last third of
    # c_attn; traced: a (H_kv * Dh,) index tensor ordered (value head, dim), fused or interleaved layouts)
    w_out: torch.Tensor  # (H * Dh, D): attention output (concatenated heads) @ w_out = projection
    n_heads: int  # H
    n_kv_heads: int  # H_kv (values shared by H / H_kv query heads)
    head_dim: int  # Dh
    out_gram: torch.Tensor  # (H, Dh, Dh) W_O,h W_O,h^T per head: ||v W_O,h||^2 = v^T out_gram[h] v

    def per_head(self) -> torch.Tensor:
        """W_O split per query head: (H, Dh, D) (a view of the weight)."""
        return self.w_out.unflatten(0, (self.n_heads, self.head_dim))


def _linear_w(module) -> torch.Tensor | None:
    """Weight as (in, out) for nn.Linear ((out, in) stored) and transformers' Conv1D ((in, out))."""
    if isinstance(module, torch.nn.Linear):
        return module.weight.detach().t()
    if is_projection(module):  # Conv1D
        return module.weight.detach()
    return None


def _heads(model) -> tuple[int, int]:
    cfg = model.config
    H = (
        getattr(cfg, "num_attention_heads", None)
        or getattr(cfg, "n_head", None)
        or getattr(cfg, "n_heads", None)
    )
    if not isinstance(H, int) or H < 1:
        raise UnsupportedModelError(
            f"{type(model).__name__}: the config does not say how many attention heads"
        )
    kv = getattr(cfg, "num_key_value_heads", None) or H
    return H, kv


def _find(name: str, module, modules: dict) -> tuple[torch.nn.Module, slice, torch.Tensor] | None:
    """(value module, slice of its output, W_O (H*Dh, D)) of one attention module, or None."""
    for v_attr, o_attr in (("v_proj", "o_proj"), ("v_lin", "out_lin")):
        v, o = getattr(module, v_attr, None), getattr(module, o_attr, None)
        if isinstance(v, torch.nn.Linear) and _linear_w(o) is not None:
            return v, slice(0, v.out_features), _linear_w(o)
    c_attn, c_proj = getattr(module, "c_attn", None), getattr(module, "c_proj", None)
    if c_attn is not None and _linear_w(c_attn) is not None and _linear_w(c_proj) is not None:
        if getattr(module, "is_cross_attention", False):
            return None
        width = _linear_w(c_attn).shape[1] // 3
        return c_attn, slice(2 * width, 3 * width), _linear_w(c_proj)
    value = getattr(module, "value", None)
    if isinstance(value, torch.nn.Linear) and "." in name:
        parent = modules.get(name.rsplit(".", 1)[0])
        dense = getattr(getattr(parent, "output", None), "dense", None)
        if _linear_w(dense) is not None:
            return value, slice(0, value.out_features), _linear_w(dense)
    return None


def _path(model, layer: int, name: str, v_module, cols, w_out, H: int, H_kv: int) -> ValuePath:
    """A checked :class:`ValuePath` (widths split into heads; W_O's per-head Gram matrices)."""
    width = cols.stop - cols.start if isinstance(cols, slice) else cols.numel()
    if width % H_kv or w_out.shape[0] % H:
        raise UnsupportedModelError(
            f"{type(model).__name__} layer {name}: value width {width} does not split into {H_kv} "
            f"value heads, or the output projection's {w_out.shape[0]} inputs into {H} heads"
        )
    Dh = width // H_kv
    if w_out.shape[0] != H * Dh:
        raise UnsupportedModelError(
            f"{type(model).__name__} layer {name}: output projection takes {w_out.shape[0]} inputs, "
            f"expected {H} heads x {Dh} = {H * Dh}"
        )
    per_head = w_out.unflatten(0, (H, Dh))  # (H, Dh, D)
    out_gram = torch.matmul(per_head, per_head.transpose(-1, -2)).float()  # (H, Dh, Dh)
    return ValuePath(layer, name, v_module, cols, w_out, H, H_kv, Dh, out_gram)


def _named_paths(model, H: int, H_kv: int) -> list[ValuePath]:
    """The fast path: attention modules whose projections ``VALUE_PATHS`` names."""
    modules = dict(model.named_modules())
    paths = []
    for name, module in modules.items():
        if not (hasattr(module, "is_causal") or "attention" in type(module).__name__.lower()):
            continue
        if "Attention" not in type(module).__name__ or getattr(module, "is_cross_attention", False):
            continue
        found = _find(name, module, modules)
        if found is not None:
            paths.append(_path(model, len(paths), name, *found, H, H_kv))
    return paths


# model -> its traced layers (module names and columns: the tensors are read afresh, so a model moved to
# another device after the trace still gets its own weights)
_TRACED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _traced_paths(model, H: int, H_kv: int) -> list[ValuePath]:
    """The generic path: the layers found by one traced forward (cached per model)."""
    traced = _TRACED.get(model)
    if traced is None:
        traced = _TRACED[model] = trace_value_paths(model, H, H_kv)
    modules = dict(model.named_modules())
    paths = []
    for layer, t in enumerate(traced):
        cols = torch.tensor(t.columns)
        if bool((cols == torch.arange(cols[0], cols[0] + len(cols))).all()):
            cols = slice(int(cols[0]), int(cols[0]) + len(cols))  # contiguous: a view, no gather
        w_out = _linear_w(modules[t.out_name])
        paths.append(_path(model, layer, t.value_name.rsplit(".", 1)[0], modules[t.value_name], cols, w_out,
                           H, t.n_kv_heads))
    return paths


def _adapter_paths(model, adapter, H: int) -> list[ValuePath]:
    """The layers of a family declared in attnlab/hf/capture/score_adapters.py (attention outside the
    AttentionInterface): its value projection's columns and its output projection, per module."""
    modules = dict(model.named_modules())
    paths = []
    for name, module in attention_modules(model, adapter):
        v, o = getattr(module, adapter.value, None), _linear_w(output_projection(modules, name, adapter))
        if _linear_w(v) is None or o is None or o.shape[0] % H:
            raise UnsupportedModelError(
                f"{type(model).__name__} layer {name}: no value projection {adapter.value!r} or output "
                f"projection {adapter.output!r} of {H} heads, as attnlab declares for {adapter.family}"
            )
        cols, H_kv = adapter.value_columns(module, H, o.shape[0] // H)
        paths.append(_path(model, len(paths), name, v, cols, o, H, H_kv))
    return paths


def value_paths(model) -> list[ValuePath]:
    """One :class:`ValuePath` per self-attention layer, in layer order.

    The naming schemes of ``VALUE_PATHS`` when they find every layer; otherwise one traced forward
    (:func:`attnlab.hf.capture.value_trace.trace_value_paths`, with attnlab's capture in place of the
    model's attention: callers serialize it with other forwards, e.g. under ``LoadedModel.lock``).
    Raises :class:`UnsupportedModelError` (a ValueError) naming the model when its value path cannot
    be read (values that are not a projection's output, an attention output that reaches no
    projection unchanged, widths that do not fit, attention outside transformers' AttentionInterface).
    """
    H, H_kv = _heads(model)
    adapter = adapter_for(model)
    if adapter is not None:  # attention outside the AttentionInterface: the family's declared projections
        return _adapter_paths(model, adapter, H)
    cfg = model.config
    n_layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None)
    named = _named_paths(model, H, H_kv)
    transformers_model = hasattr(type(model), "_can_set_attn_implementation")
    if named and (not transformers_model or not isinstance(n_layers, int) or len(named) == n_layers):
        return named
    if not transformers_model:  # no AttentionInterface to trace through
        raise UnsupportedModelError(
            f"{type(model).__name__} has no attention module attnlab can read values from (known: "
            + "; ".join(f"{k}: {v} -> {o}" for k, (v, o) in VALUE_PATHS.items())
            + "); contribution norms need each layer's value and output projections"
        )
    try:
        return _traced_paths(model, H, H_kv)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(
            f"contribution norms need each layer's value and output projections: {e}"
        ) from None


@contextlib.contextmanager
def record_values(model, paths: list[ValuePath] | None = None) -> Iterator[list[list[torch.Tensor]]]:
    """Record every layer's values (B, N, H_kv, Dh) during the forwards inside the block.

    Yields ``forwards``: a list that grows by one list per forward of the model, holding the values of
    each layer that ran (in layer order; a forward stopped early has fewer). The hooks are removed on
    exit, also on error.
    """
    paths = value_paths(model) if paths is None else paths
    forwards: list[list[torch.Tensor]] = []

    def start(_module, _args):
        forwards.append([])

    def hook_for(path: ValuePath):
        cols = path.value_slice

        def hook(_module, _inputs, output):
            v = output[..., cols if isinstance(cols, slice) else cols.to(output.device)]  # (B, N, H_kv * Dh)
            forwards[-1].append(v.detach().reshape(*v.shape[:-1], path.n_kv_heads, path.head_dim))

        return hook

    handles = [model.register_forward_pre_hook(start)]
    shared = {id(p.value_module): p for p in reversed(paths)}  # layers sharing weights (ALBERT): one hook
    try:
        handles += [p.value_module.register_forward_hook(hook_for(p)) for p in shared.values()]
        yield forwards
    finally:
        for h in handles:
            h.remove()


def head_outputs(values: torch.Tensor, path: ValuePath) -> torch.Tensor:
    """f_h(x_j) = v_{j, g(h)} W_O,h for every head: values (B, N, H_kv, Dh) -> (B, H, N, D).

    Kobayashi et al. (2020), Eq. (6); g(h) = h // (H / H_kv) is the value head of query head h.
    """
    rep = path.n_heads // path.n_kv_heads
    v = values.float().repeat_interleave(rep, dim=2)  # (B, N, H, Dh)
    w = path.per_head().to(v.device, v.dtype)  # (H, Dh, D)
    return torch.einsum("bnhd,hdm->bhnm", v, w)  # (B, H, N, D)


def head_output_norms(values: torch.Tensor, paths: list[ValuePath]) -> torch.Tensor:
    """||f_h(x_j)|| of every layer without forming f: values (L, B, N, H_kv, Dh) -> (L, B, H, N).

    ||v W_O,h||^2 = v^T (W_O,h W_O,h^T) v, with one (Dh, Dh) matrix per head: N H Dh^2 work instead of
    N H Dh D for the vectors themselves (Kobayashi et al. 2020, Eq. (6)); one einsum for all layers.
    """
    rep = paths[0].n_heads // paths[0].n_kv_heads
    v = values.float()
    if rep > 1:  # grouped-query attention: value head g serves query heads g * rep ... (g + 1) * rep - 1
        v = v.repeat_interleave(rep, dim=3)  # (L, B, N, H, Dh)
    out_gram = torch.stack([p.out_gram for p in paths]).to(v.device, v.dtype)  # (L, H, Dh, Dh)
    sq = torch.einsum("lbnhd,lhde,lbnhe->lbhn", v, out_gram, v)
    return sq.clamp_min_(0.0).sqrt_()


@dataclass(frozen=True)
class ValueSummary:
    """What the contribution measures need of one forward's values (one window, B = 1)."""

    norms: torch.Tensor  # (L, H, N) ||f_h(x_j)||
    values: torch.Tensor  # (L, N, H_kv, Dh) the recorded values, for the layer-level norm
    paths: tuple = field(repr=False, compare=False, default=())  # ValuePath per layer

    def gram(self, layer: int) -> torch.Tensor:
        """(N, H, H) f_h(x_j) . f_k(x_j) of one layer (computed on demand from the values)."""
        from attnlab import contributions

        f = head_outputs(self.values[layer][None], self.paths[layer])[0]  # (H, N, D)
        return contributions.value_gram(f)


def summarize(values: list[torch.Tensor], paths: list[ValuePath]) -> ValueSummary:
    """Norms (and the values, on the CPU) from one forward's values, a (1, N, H_kv, Dh) tensor per layer."""
    if len(values) != len(paths):
        raise ValueError(f"values were recorded for {len(values)} layers, the model has {len(paths)}")
    stacked = torch.stack(values)  # (L, 1, N, H_kv, Dh)
    norms = head_output_norms(stacked, paths)[:, 0]  # (L, H, N)
    return ValueSummary(norms=norms.cpu(), values=stacked[:, 0].float().cpu(), paths=tuple(paths))


def window_summaries(
    forwards: list[list[torch.Tensor]], paths, variants, mode: str
) -> dict[str, ValueSummary]:
    """variant -> :class:`ValueSummary` from :func:`record_values`' list: recompute mode runs one forward
    (the model's own, shared by every variant), swap mode one forward per variant, in order."""
    if mode == "recompute":
        if len(forwards) != 1:
            raise ValueError(f"recompute mode runs one forward, {len(forwards)} were recorded")
        shared = summarize(forwards[0], paths)
        return dict.fromkeys(variants, shared)
    if len(forwards) != len(variants):
        raise ValueError(
            f"swap mode runs one forward per variant ({len(variants)}), {len(forwards)} were recorded"
        )
    return {v: summarize(f, paths) for v, f in zip(variants, forwards, strict=True)}


def window_value_summaries(
    loaded, input_ids: torch.Tensor, variants, mode: str = "recompute", params=None
) -> dict[str, ValueSummary]:
    """variant -> :class:`ValueSummary` for one window (input_ids (1, N)): recompute mode runs the
    model's own forward once (shared by every variant), swap mode one forward per variant with
    ``params`` (any variant's parameters, e.g. {"u": 0.5, "iters": 3}; each takes its own)."""
    from attnlab.hf.capture.interface import use_variant
    from attnlab.hf.capture.variant_params import variant_kwargs

    ids = input_ids.to(loaded.device)
    with loaded.lock, torch.no_grad():
        paths = value_paths(loaded.model)  # under the lock: a traced model's first call runs a forward
        with record_values(loaded.model, paths) as forwards:
            if mode == "recompute":
                loaded.model(input_ids=ids, use_cache=False)
            else:
                for v in variants:
                    with use_variant(loaded.model, v, **variant_kwargs(v, params, causal=loaded.info.causal)):
                        loaded.model(input_ids=ids, use_cache=False)
    return window_summaries(forwards, paths, tuple(variants), mode)
