"""attnlab's causal analysis kernel (``torch.ops.attnlab_hf.causal_heads``, attnlab/csrc/analysis_causal.h)
for the streamed analysis: which layers and variants it takes, and the call that puts one layer's row
sums into the window's accumulators (and, in the capture forward, unas' attention output).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping

import torch

from attnlab.hf.compute.softmax1_sums import softmax1_sums
from attnlab.hf.compute.tiles import LayerInputs, _layer_u
from attnlab.normalizers import functions as fn
from attnlab.normalizers import variant_spec
from attnlab.stats._checks import LN2

__all__ = ["bound_allocator", "plain_causal", "causal_kernel", "kernel_slots", "kernel_layer"]

# From this many tokens on, ATTNLAB_BOUNDED_MALLOC=1 fixes glibc's mmap threshold (see bound_allocator).
MALLOC_FROM_TOKENS = 2048


_MALLOC = {"set": False}


def bound_allocator(n_tokens: int) -> None:
    """With ``ATTNLAB_BOUNDED_MALLOC=1``: keep a long forward's transient buffers from staying in the heap.
    glibc raises its mmap threshold each time a large buffer is freed (up to 32 MiB), after which the
    per-layer buffers of a long window (values, outputs, tiles: 25 MB each at 8,192 tokens) come from
    the heap and are not returned. Fixing the mmap and trim thresholds at 1 MiB (mallopt, once per
    process, Linux/glibc, windows from MALLOC_FROM_TOKENS tokens on) returns them: peak RSS growth 1.0
    instead of 1.7 GiB for the 12-layer MHA shape at 8,192 tokens -- but every large buffer is then
    mapped and zeroed anew, which made the plain forward ~1.5x slower at 2,048 tokens (docs/BENCHMARKS.md),
    hence off by default."""
    if _MALLOC["set"] or n_tokens < MALLOC_FROM_TOKENS or not sys.platform.startswith("linux"):
        return
    _MALLOC["set"] = True
    if os.environ.get("ATTNLAB_BOUNDED_MALLOC", "0") != "1":
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 20)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to fix
        pass


_PLAIN: dict = {}  # (id(mask), window) -> (mask, bool): masks checked to be plain causal (+ window)


def plain_causal(inputs: LayerInputs) -> bool:
    """Whether the layer's allowed keys are exactly j <= i (and i - j < sliding_window when it has one),
    with no other mask: what the causal analysis kernel computes. A mask tensor is compared once per
    object (transformers shares one between layers)."""
    if not inputs.causal or inputs.query.shape[1] != inputs.key.shape[1]:
        return False
    if inputs.mask is None:
        return True
    key = (id(inputs.mask), inputs.sliding_window)
    hit = _PLAIN.get(key)
    if hit is None or hit[0] is not inputs.mask:
        m = inputs.mask.reshape(-1, *inputs.mask.shape[-2:])
        n = inputs.key.shape[1]
        ok = m.shape[0] == 1 and tuple(m.shape[-2:]) == (n, n)
        if ok:
            i, j = torch.arange(n, device=m.device)[:, None], torch.arange(n, device=m.device)[None, :]
            want = j <= i
            if inputs.sliding_window:
                want &= i - j < inputs.sliding_window
            ok = bool(torch.equal(m[0], want))
        if len(_PLAIN) > 8:
            _PLAIN.clear()
        hit = _PLAIN[key] = (inputs.mask, ok)
    return hit[1]


def causal_kernel():
    """attnlab's causal analysis op (``torch.ops.attnlab_hf.causal_heads``), or None (kernels off or
    not built, no AVX-512, or ``_USE_KERNEL`` False)."""
    if not _USE_KERNEL:
        return None
    from attnlab import kernels

    ops = kernels.analysis_ops()
    return getattr(ops, "causal_heads", None) if ops is not None else None


_USE_KERNEL = True  # tests switch it off to compare with the PyTorch tiles


# The kernel's slots: unas, causal dnas (and one-round Sinkhorn, the same weights), hnas; softmax1 from its
# optional softmax1 output and unas' sums (attnlab/hf/compute/softmax1_sums.py).
SOFTMAX1 = "softmax1"
_SLOT = {fn.unas: 0, fn.dnas: 1, fn.sinkhorn: 1, fn.hnas: 2, fn.softmax1: SOFTMAX1}


def kernel_slots(variants, params, causal: bool) -> dict[str, int | str]:
    """variant -> its slot in the causal kernel (0-2, or SOFTMAX1), for the variants it computes (at most
    one HNAS)."""
    if not causal:
        return {}
    out, hnas = {}, 0
    for v in variants:
        normalizer = variant_spec(v).normalizer
        slot = _SLOT.get(normalizer)
        if slot == 2:
            hnas += 1
            if hnas > 1:
                continue
        if slot is not None:
            out[v] = slot
    return out


def kernel_layer(kernel, inputs: LayerInputs, layer: int, slots: Mapping[str, int], params, spec, out,
                 H: int, v: torch.Tensor | None = None, out_attn: torch.Tensor | None = None) -> bool:
    """One layer's row sums of the ``slots`` variants by the causal kernel, into ``out``; False when the
    layer is not one it computes (not a plain causal or sliding-window mask, not float32 on the CPU,
    more than 8 key masks) or some head needs the exact path (then nothing is written). With ``v``
    (H_kv, N, Dv), also unas' attention output into ``out_attn`` (N, H, Dv)."""
    q, k = inputs.query, inputs.key
    if (q.device.type != "cpu" or q.dtype != torch.float32 or k.dtype != torch.float32
            or not plain_causal(inputs) or (spec is not None and spec.shape[-1] > 8)):
        return False
    N = k.shape[1]
    S = 0 if spec is None else spec.shape[-1]
    mixed = [v for v, s in slots.items() if s == 2]
    u = _layer_u(params[mixed[0]]["u"], layer, H).reshape(H).float().contiguous() if mixed else torch.zeros(H)
    spec_t = torch.zeros(0, N) if spec is None else spec.t().float().contiguous()
    cols, rowsum, entropy, distance = (torch.zeros(3, H, N) for _ in range(4))
    special, js = torch.zeros(3, H, N, S), torch.zeros(2, H, N)
    s1 = torch.zeros(2, H, N) if SOFTMAX1 in slots.values() else None
    redo = kernel(q.contiguous(), k.contiguous(), float(inputs.scale), float(inputs.softcap or 0.0),
                  int(inputs.sliding_window or 0), u, spec_t, cols, rowsum, entropy, distance, special, js,
                  v, out_attn, s1)
    if bool(redo.any()):
        return False
    maps = slice(layer * H, (layer + 1) * H)
    for v, slot in slots.items():
        acc = out[v]
        if slot == SOFTMAX1:  # unas scaled per row: its sums in closed form from unas'
            unas = {"rowsum": rowsum[0], "entropy": entropy[0], "distance": distance[0],
                    "special": special[0] if S else None}
            fact, js2 = softmax1_sums(unas, s1[0], s1[1])
            for key in ("cols", "rowsum", "entropy", "distance"):
                acc[key][maps] = fact[key]
            if acc["special"] is not None:
                acc["special"][maps] = fact["special"]
            if acc["js"] is not None:
                acc["js"][maps] = js2.div(2.0 * LN2).clamp_(0.0, 1.0).sqrt_()
            continue
        acc["cols"][maps] = cols[slot]
        acc["rowsum"][maps], acc["entropy"][maps] = rowsum[slot], entropy[slot]
        acc["distance"][maps] = distance[slot]
        if acc["special"] is not None:
            acc["special"][maps] = special[slot]
        if acc["js"] is not None:
            if slot == 0:
                acc["js"][maps] = 0.0
            else:  # twice the JS divergence in nats -> the JS distance in bits, as row_sums_dict
                acc["js"][maps] = js[slot - 1].div(2.0 * LN2).clamp_(0.0, 1.0).sqrt_()
    return True
