"""Attention with logit softcapping (Gemma 2), for the capture forward: PyTorch's SDPA refuses a
softcap, so ``attnlab_capture`` runs the model's eager math itself, in tiles of query rows so that
no (H, N, N) score matrix is held at long context.

    s_ij = softcap * tanh(scale * q_i . k_j / softcap);  pi = softmax_j over the allowed keys;  out = pi v
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import repeat_kv

__all__ = ["softcapped_attention"]

# Rows of one tile: (B, H, ROWS, N) float32 scores and weights.
ROWS = 256


def softcapped_attention(query, key, value, mask, scale: float, softcap: float, causal: bool,
                         sliding_window: int | None = None) -> torch.Tensor:
    """query (B, H, M, D); key, value (B, H_kv, N, D|Dv); mask bool broadcastable to (B, H, M, N), True =
    may attend, or None (then ``causal`` and ``sliding_window`` give the allowed keys). Returns the
    attention output (B, M, H, Dv) in the query's dtype: softmax in float32, cast back (as eager)."""
    B, H, M, _ = query.shape
    n_rep = H // key.shape[1]
    k, v = repeat_kv(key, n_rep), repeat_kv(value, n_rep)  # (B, H, N, D)
    N = k.shape[2]
    out = torch.empty(B, M, H, v.shape[-1], dtype=query.dtype, device=query.device)
    for i0 in range(0, M, ROWS):
        i1 = min(M, i0 + ROWS)
        s = torch.matmul(query[:, :, i0:i1], k.transpose(-1, -2)).float().mul_(scale)  # (B, H, T, N)
        s = s.div_(softcap).tanh_().mul_(softcap)
        if mask is not None:
            allowed = mask[..., i0:i1, :] if mask.shape[-2] > 1 else mask
        elif causal or sliding_window:
            i = torch.arange(i0, i1, device=s.device)[:, None] + (N - M)  # queries at the end of the keys
            j = torch.arange(N, device=s.device)[None, :]
            allowed = j <= i if causal else torch.ones_like(j, dtype=torch.bool)
            if sliding_window:
                allowed = allowed & (i - j < sliding_window)
        else:
            allowed = None
        if allowed is not None:
            s = s.masked_fill_(~allowed, float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num_(0.0).to(v.dtype)  # a row with no allowed key: zeros
        out[:, i0:i1] = torch.matmul(p, v).transpose(1, 2)
    return out
