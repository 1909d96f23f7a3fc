"""Where each layer's values come from and where its attention output goes, found by tracing one forward.

The generic path of :mod:`attnlab.hf.capture.values` (the naming schemes there are the fast path): one
forward of a few random tokens with ``attnlab_capture`` in place of the model's attention
(:func:`attnlab.hf.capture.interface.capture_qk`) and a forward hook on every linear projection
(``nn.Linear``, transformers' ``Conv1D``). In each layer

- the *value projection* is the projection run before the layer's attention call whose output holds,
  column for column, the ``value`` tensor the attention function receives (B, H_kv, N, Dh): fused
  q/k/v projections (GPT-NeoX's ``query_key_value`` with heads interleaved, Phi-3's ``qkv_proj``,
  CodeGen's ``qkv_proj`` split in q, v, k order, ModernBERT's ``Wqkv``) give a column index per
  (value head, dim), whatever the layout;
- the *output projection* is the first projection after the call whose input is the attention output,
  heads concatenated: the attention call returns a random marker (B, M, H, Dh) during the trace, and
  the projection fed exactly that marker, reshaped to (B, M, H * Dh), is W_O. Whatever the model does
  between the two (a gate, a norm) breaks the match, and the layer is refused with the reason.

Shapes: values (B, H_kv, N, Dh) as the attention function receives them (grouped key/value heads not
repeated); a projection's output (B, N, W); ``columns`` (H_kv * Dh,) indexes W, ordered (value head, dim).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnlab.hf.capture.interface import UnsupportedModelError, capture_qk

__all__ = ["TracedLayer", "trace_value_paths", "is_projection"]

TRACE_TOKENS = 8  # tokens of the trace forward: 8 samples per column tell random columns apart
_MATCH_TOL = 1e-5  # relative: the values are the projection's output itself (a copy at most)
_BLOCK = 512  # value columns compared at a time (a (512, W) distance block)


@dataclass(frozen=True)
class TracedLayer:
    """One self-attention layer's value and output projections, by qualified module name."""

    value_name: str  # module whose output holds the values, e.g. "layers.0.attention.query_key_value"
    columns: tuple[int, ...]  # (H_kv * Dh,) columns of that output, ordered (value head, dim)
    out_name: str  # module whose input is the attention output (heads concatenated), e.g. "...dense"
    n_kv_heads: int  # H_kv
    head_dim: int  # Dh of the values


def is_projection(module) -> bool:
    """nn.Linear, or transformers' Conv1D (GPT-2 family: weight stored (in, out))."""
    if isinstance(module, torch.nn.Linear):
        return True
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _trace_ids(model, n: int) -> torch.Tensor:
    """(1, n) token ids, seeded, on the model's device."""
    emb = model.get_input_embeddings()
    vocab = getattr(emb, "num_embeddings", None) or getattr(model.config, "vocab_size", None) or 2
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    return torch.randint(min(3, vocab - 1), vocab, (1, n), generator=g).to(device)


def _value_columns(output: torch.Tensor, values: torch.Tensor) -> list[int] | None:
    """Columns of ``output`` (B, N, W) equal to each (head, dim) of ``values`` (B, H_kv, N, Dh), or None."""
    if output.shape[:-1] != values.shape[:1] + values.shape[2:3]:
        return None
    O = output.detach().float().reshape(-1, output.shape[-1]).t()  # (W, B * N)
    V = values.detach().float().permute(1, 3, 0, 2).reshape(-1, O.shape[1])  # (H_kv * Dh, B * N)
    scale = float(V.abs().max()) + 1e-12
    cols = []
    for i0 in range(0, V.shape[0], _BLOCK):
        d = torch.cdist(V[i0 : i0 + _BLOCK], O, compute_mode="donot_use_mm_for_euclid_dist")  # (block, W)
        best, idx = d.min(-1)
        if float(best.max()) > _MATCH_TOL * scale * O.shape[1] ** 0.5:
            return None
        cols += idx.tolist()
    return cols


def trace_value_paths(model, n_heads: int, n_kv_heads: int, arch: str | None = None) -> list[TracedLayer]:
    """One :class:`TracedLayer` per self-attention call of one forward, in layer order.

    Raises :class:`UnsupportedModelError` naming ``arch`` (default: the model's class) when a layer's
    values are not columns of a projection's output, or its attention output reaches no projection
    unchanged.
    """
    arch = arch or type(model).__name__
    names = {m: n for n, m in model.named_modules() if is_projection(m)}
    events: list[tuple] = []  # ("proj", name, input, output) | ("attn", values (B, H_kv, N, Dh), marker)
    g = torch.Generator().manual_seed(1)

    def proj_hook(module, inputs, output):
        events.append(("proj", names[module], inputs[0].detach(), output.detach()))

    def layer_hook(layer, query, key, value, *_):
        # value (B, H, N, Dh) with grouped heads repeated (or (B, H_kv, N, Dh) where the module keeps them)
        if value.shape[1] != n_kv_heads:
            if value.shape[1] != n_heads or n_heads % n_kv_heads:
                raise UnsupportedModelError(
                    f"{arch}: layer {layer} hands the attention function {value.shape[1]} value heads, "
                    f"the config says {n_heads} query and {n_kv_heads} key/value heads"
                )
            value = value[:, :: n_heads // n_kv_heads]  # (B, H_kv, N, Dh): repeat_kv's copies dropped
        B, M = query.shape[0], query.shape[2]
        marker = torch.randn(B, M, query.shape[1], value.shape[-1], generator=g).to(query.device, query.dtype)
        events.append(("attn", value.detach(), marker))
        return marker  # (B, M, H, Dh): the layer's "attention output" during the trace

    ids = _trace_ids(model, TRACE_TOKENS)
    handles = [m.register_forward_hook(proj_hook) for m in names]
    try:
        with torch.no_grad(), capture_qk(model, layer_hook=layer_hook):
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    except UnsupportedModelError:
        raise
    except Exception as e:  # the model's own code on the trace: worded, never a crash deep inside
        raise UnsupportedModelError(
            f"{arch} failed on the forward that locates its value projections ({type(e).__name__}: {e})"
        ) from None
    finally:
        for h in handles:
            h.remove()
    return _match(events, arch)


def _match(events: list[tuple], arch: str) -> list[TracedLayer]:
    """TracedLayers from the trace's events (projections and attention calls, in call order)."""
    calls = [i for i, e in enumerate(events) if e[0] == "attn"]
    layers = []
    for layer, at in enumerate(calls):
        _, values, marker = events[at]
        start = calls[layer - 1] + 1 if layer else 0
        value = None
        for e in reversed(events[start:at]):  # the nearest projection before the call first
            cols = _value_columns(e[3], values) if e[0] == "proj" else None
            if cols is not None:
                value = (e[1], tuple(cols))
                break
        if value is None:
            raise UnsupportedModelError(
                f"{arch}: the values of attention layer {layer} are not the output of a linear projection "
                "(a norm or scaling after it?), so contribution norms cannot split them per head"
            )
        B, M, H, Dh = marker.shape
        flat = marker.reshape(B, M, H * Dh)
        end = calls[layer + 1] if layer + 1 < len(calls) else len(events)
        out = next((e[1] for e in events[at + 1 : end] if e[0] == "proj" and e[2].shape == flat.shape
                    and torch.equal(e[2], flat)), None)
        if out is None:
            raise UnsupportedModelError(
                f"{arch}: the output of attention layer {layer} reaches no linear projection unchanged "
                "(the heads are gated or normalized first?), so its output projection W_O is unknown"
            )
        layers.append(TracedLayer(value[0], value[1], out, values.shape[1], values.shape[-1]))
    if not layers:
        raise UnsupportedModelError(f"{arch} never called its attention function during a forward")
    return layers
