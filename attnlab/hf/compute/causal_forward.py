"""The causal analysis inside the capture forward (CPU, attnlab's kernel): each plain causal layer of one
window (grouped-query heads, a sliding window, a softcap) goes through ``attnlab_hf.causal_heads`` as
the layer runs; the kernel's unas output softmax(s) v, made from the same exponentials while a block
of rows is in L2, takes the place of the model's SDPA attention, which would compute the scores and
exponentials a second time. The row sums of unas, causal dnas and hnas (and one-round Sinkhorn, the
same weights) land in the window's accumulators; a layer the kernel does not take runs the model's
own attention and is streamed afterwards (attnlab/hf/compute/streamed.py).

:class:`CausalLayerwise` is the ``layer_hook`` of :func:`attnlab.hf.capture.interface.capture_qk`
(attnlab/hf/compute/weights.py sets it up). The output equals SDPA's to float32 rounding, so later
layers' q and k differ from a plain forward's by about that much (as the bidirectional fused forward).
"""

from __future__ import annotations

import torch

from attnlab.hf.capture.mask_bias import KWARG
from attnlab.hf.compute import causal_kernel, tiles

__all__ = ["CausalLayerwise"]

# attention keyword arguments beyond q, k, v, the scale, a softcap and a sliding window: not taken
_OTHER = ("s_aux", "sinks", "position_bias", KWARG)  # (KWARG: a position bias in the mask)


class CausalLayerwise:
    """Row sums of the kernel's variants, layer by layer in the capture forward of one window (B = 1).

    out: the accumulators of :func:`streamed.stream_sums` (``new_sums``); slots: variant -> kernel slot;
    params: checked parameters per variant; spec: (N, S) key masks or None; kernel: the op.
    """

    def __init__(self, n_heads: int, slots, params, spec, out, kernel):
        self.H, self.slots, self.params, self.spec = n_heads, slots, params, spec
        self.out, self.kernel = out, kernel
        self.done: set[int] = set()  # layers whose sums the kernel wrote

    def __call__(self, layer: int, query, key, value, mask, scaling: float, dropout: float, training: bool,
                 causal: bool, last: bool, kwargs) -> torch.Tensor | None:
        """query (1, H, N, D); key, value (1, H, N, D|Dv) (grouped heads repeated); -> the layer's attention
        output (1, N, H, Dv), or None: the model's own attention runs (and the layer streams later)."""
        if (not causal or (training and dropout > 0) or query.shape[0] != 1 or query.device.type != "cpu"
                or any(kwargs.get(name) is not None for name in _OTHER)
                or not all(t.dtype == torch.float32 for t in (query, key, value))):
            return None
        softcap, window = kwargs.get("softcap"), kwargs.get("sliding_window")
        inputs = tiles.LayerInputs(query=query[0], key=key[0], mask=None if mask is None else mask[0],
                                      causal=True, scale=float(scaling),
                                      softcap=None if softcap is None else float(softcap),
                                      sliding_window=None if window is None else int(window))
        H, N, Dv = query.shape[1], query.shape[2], value.shape[-1]
        out = None if last else torch.empty(1, N, H, Dv)
        v = None if last else value[0].contiguous()
        done = causal_kernel.kernel_layer(self.kernel, inputs, layer, self.slots, self.params, self.spec,
                                          self.out, self.H, v=v, out_attn=None if out is None else out[0])
        if not done:
            return None
        self.done.add(layer)
        return out
