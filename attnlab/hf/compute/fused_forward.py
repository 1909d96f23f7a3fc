"""The fused analysis of one window inside the capture forward (CPU, attnlab's kernel): each layer's heads go
through the analysis kernel as the layer runs, and the kernel's unas output softmax(s) v, from the same
exponentials, takes the place of the model's own (SDPA) attention, which would compute them again.

:class:`LayerwiseAnalysis` is the ``layer_hook`` of :func:`attnlab.hf.capture.interface.capture_qk`.
attnlab/hf/compute/weights.py sets it up for every recompute-mode forward of one unpadded window of a
bidirectional model
on the CPU with the kernel built, whatever the variants and whether statistics are asked for, so that
the captured q and k (and every weight computed from them) do not depend on either. With row sums
wanted it fills those of :func:`attnlab.hf.compute.fused_sums.variants_with_sums` layer by layer (the same
kernel call on the same q and k, a layer's maps at a time), so that after the forward only
``_assemble_sums`` is left; without, the kernel computes the attention output alone (its score pass).
A layer it cannot take (a mask, causal, not float32, a softcap or sliding window, dropout in training)
runs the model's own attention, and the hook stays off for the rest of the forward: the caller then
computes the sums from the captured q, k as without it. The unas output equals SDPA's to float
rounding (~1e-6 relative), so later layers' q and k differ from a plain forward's by about that much.
"""

from __future__ import annotations

import torch

from attnlab.hf.capture.mask_bias import KWARG
from attnlab.hf.compute.fused_sums import _assemble_sums, _FusedBuffers, flags_for, run_kernel

__all__ = ["LayerwiseAnalysis"]

# attention keyword arguments that change the attention beyond q, k and the scale: such layers are not taken
_CHANGING = ("softcap", "sliding_window", "s_aux", "sinks", KWARG)  # (KWARG: a position bias in the mask)


class LayerwiseAnalysis:
    """Row sums of every variant of one window (B = 1), computed layer by layer in the capture forward.

    slots: the fused analysis' variant slots (``variants_with_sums``' variants); u: float or (L, 1, H, 1,
    1); specials: list of S bool (N,) key masks, or None: no row sums, the attention outputs alone
    (slots, u, iters unused); kernel: ``attnlab.kernels.analysis_ops()``; workers: torch threads of the
    kernel.
    """

    def __init__(self, n_layers: int, n_heads: int, n_tokens: int, slots, u, iters: int, specials, kernel,
                 workers: int):
        L, H, N = n_layers, n_heads, n_tokens
        self.L, self.H, self.N = L, H, N
        self.slots, self.iters, self.kernel, self.workers = tuple(slots), iters, kernel, workers
        self.ref = "unas" if "unas" in self.slots else None
        spec = torch.stack([m.float() for m in specials], -1) if specials else torch.zeros(N, 0)  # (N, S)
        self.S = spec.shape[-1]
        self.spec_t = spec.t().contiguous()  # (S, N)
        self.u_maps = (torch.full((L * H,), u) if isinstance(u, float)
                       else u.float().reshape(L, H).reshape(L * H))
        self.with_sums = specials is not None
        # every map's rows with the sums; without, one layer's, as the kernel's scratch
        self.buf = _FusedBuffers.new(L * H if self.with_sums else H, N, self.S, torch.zeros(()),
                                     softmax1=self.with_sums and "softmax1" in self.slots,
                                     sparsemax=self.with_sums and "sparsemax" in self.slots)
        self.flags = flags_for(self.slots, (), True)
        self.done = 0  # layers analysed, in order
        self.active = True  # False once a layer ran the model's own attention

    def takes(self, query, key, value, mask, dropout: float, training: bool, causal: bool, kwargs) -> bool:
        """Whether the kernel can stand in for this layer's attention (and analyse it)."""
        if not self.active or causal or (training and dropout > 0):
            return False
        if any(kwargs.get(name) is not None for name in _CHANGING):
            return False
        if query.dtype != torch.float32 or key.dtype != torch.float32 or value.dtype != torch.float32:
            return False
        if query.device.type != "cpu" or query.shape[0] != 1 or tuple(query.shape[1:3]) != (self.H, self.N):
            return False
        if key.shape[2] != self.N or value.shape[2] != self.N:
            return False
        return mask is None or bool(mask.all())  # only a mask that masks nothing

    def __call__(self, layer: int, query, key, value, mask, scaling: float, dropout: float, training: bool,
                 causal: bool, last: bool, kwargs) -> torch.Tensor | None:
        """Analyse layer ``layer`` (query (1, H, N, D); key, value (1, H, N, D|Dv), grouped-query heads
        already repeated; mask: the layer's bool mask, True = may attend, or None) and return its
        attention output (1, N, H, Dv) for the model, or None when the model's own attention has to run
        (``last``: no output is needed)."""
        if layer != self.done or not self.takes(query, key, value, mask, dropout, training, causal, kwargs):
            self.active = False
            return None
        H, N = self.H, self.N
        self.done += 1
        if last and not self.with_sums:
            return None  # neither an output nor sums are needed
        rows = slice(layer * H, (layer + 1) * H) if self.with_sums else slice(0, H)
        q, k = query[0], key[0]  # (H, N, D) views
        out = None if last else torch.empty(1, N, H, value.shape[-1])
        run_kernel(self.kernel, q, k, [scaling] * H, self.u_maps[rows], self.spec_t, self.iters, [None] * 4,
                   tuple(t[rows] for t in (self.buf.alpha, self.buf.beta, self.buf.cols, self.buf.dn_rows,
                                           self.buf.sk_rows, self.buf.rows)),
                   self.flags, self.workers, None if last else value[0],
                   None if last else out[0].transpose(0, 1), analyse=self.with_sums,
                   softmax1=None if self.buf.s1 is None else self.buf.s1[rows],
                   sparsemax=None if self.buf.sm is None else self.buf.sm[rows])
        return out

    def sums(self) -> dict | None:
        """The row sums of ``variants_with_sums`` (``row_sums_dict`` layout over L*H maps), or None when
        some layer was not analysed here (or no sums were asked for)."""
        if not self.with_sums or not self.active or self.done != self.L:
            return None
        return _assemble_sums(self.buf, self.slots, self.ref, self.u_maps, self.iters, self.S)
