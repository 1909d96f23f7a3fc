"""sparsemax in the fused analysis (Martins & Astudillo 2016, Eq. 2: p_j = max(s_j - tau, 0)): its row sums
come from each row's support, which lies among the keys within 1 of the row maximum (the analysis kernel's
row pass, attnlab/csrc/analysis_sparsemax.h, or :func:`sparsemax_head` on the PyTorch path), laid out as
``_FusedBuffers.sm`` (LH, 5 + S, N): [0] column masses, per row [1] sum p, [2] sum p ln p, [3] sum p |i - j|,
[4] twice the Jensen-Shannon divergence to unas (nats), [5:] special masses. Its weights are the
reference function's on the scores (:func:`sparsemax_weights`), the values of the generic path.
"""

from __future__ import annotations

import torch

from attnlab.normalizers import attention_weights
from attnlab.stats.divergence import js2_rowsum
from attnlab.stats.engine import row_sums_dict

__all__ = ["sparsemax_weights", "sparsemax_head", "sparsemax_sums"]


def sparsemax_weights(q, k, scale, out) -> None:
    """sparsemax's (L, 1, H, N, N) weights into ``out``, layer by layer: attention_weights on the scores."""
    for layer in range(q.shape[0]):
        s = torch.matmul(q[layer], k[layer].transpose(-1, -2)).mul_(scale[layer])  # (1, H, N, N)
        out[layer] = attention_weights(s, "sparsemax")


def sparsemax_head(s, e, alpha_u, views, sm, row: int, spec, dist) -> None:
    """One linear head's sparsemax on the PyTorch path: weights from s (N, N) = scores - row max (sparsemax
    is shift-invariant) into ``views["sparsemax"]`` when written, and ``sm[row]`` (or nothing when sm is
    None) as the kernel fills it; unas = diag(alpha_u) e; spec (N, S), dist (N, N)."""
    p = attention_weights(s, "sparsemax")  # (N, N)
    if "sparsemax" in views:
        views["sparsemax"].copy_(p)
    if sm is None:
        return
    sums = row_sums_dict(p[None], spec, dist, None)
    out = sm[row]  # (5 + S, N)
    out[0], out[1], out[3] = sums["cols"][0], sums["rowsum"][0], sums["distance"][0]
    out[2] = -sums["entropy"][0]  # sum p ln p
    out[5:] = sums["special"][0].t()
    js2_rowsum(p, e * alpha_u[:, None], torch.empty_like(p), torch.empty_like(p), out=out[4])


def sparsemax_sums(sm: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """(row sums in ``row_sums_dict``'s layout without js, twice the JS divergence to unas) from sm."""
    fact = {"cols": sm[:, 0], "rowsum": sm[:, 1], "entropy": -sm[:, 2], "distance": sm[:, 3],
            "special": sm[:, 5:].transpose(1, 2)}
    return fact, sm[:, 4]
