"""softmax1's statistics from unas': softmax1 (the "off-by-one" softmax, a null key of score 0) is unas
scaled per row, so its row sums follow in closed form from unas' and one number per row (the fused
analysis, attnlab/hf/compute/fused_sums.py, and attnlab/csrc/analysis_cpu.cpp's softmax1 output).
"""

from __future__ import annotations

import math

import torch

__all__ = ["softmax1_sums"]


def softmax1_sums(unas: dict, lnt: torch.Tensor, cols: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """softmax1's row sums from unas' (``row_sums_dict`` layout over (G, N) rows), its ln t_i (G, N) and
    column masses (G, N), and twice its Jensen-Shannon divergence to unas per row (nats).

    softmax1 = r_i p_u,ij with r_i = 1 / (1 + t_i) (a null key of score 0 takes t_i / (1 + t_i)), so
    its row sum, distance and special masses are r_i times unas'; its entropy -sum p ln p = r_i H_u -
    r_i ln r_i sum_j p_u; and 2 JSD = sum_j [p ln (2p / (p + q)) + q ln (2q / (p + q))] with p = r q is
    (r log1p(-d) + log1p(d)) sum_j q, d = (1 - r) / (1 + r) = t / (2 + t). In float64 from ln t, so
    that 1 - r and d keep their digits when t is tiny (r close to 1), and ln(1 - d) its own when t is huge."""
    x = lnt.double()
    r, ln_r = torch.sigmoid(-x), -torch.nn.functional.softplus(x)  # r = 1 / (1 + e^x), ln r
    d = torch.sigmoid(x - math.log(2.0))  # t / (2 + t) = 1 / (1 + 2 e^-x)
    # ln(1 - d): log1p(-d) while t < 1 (its rounding cancels log1p(d)'s in the O(t^2) divergence of a
    # tiny t); -ln(1 + t / 2) beyond, where log1p(-d) would be log1p(-1) = -inf once d rounds to 1 (t past
    # ~1e17: a row whose scores all lie ~40 below 0) and r times it -inf, when the term r ln(1 - d) -> 0
    ln_1md = torch.where(x > 0, -torch.nn.functional.softplus(x - math.log(2.0)), torch.log1p(-d))
    total = unas["rowsum"].double()
    out = {
        "cols": cols,
        "rowsum": (r * total).to(cols.dtype),
        "entropy": (r * unas["entropy"].double() - r * ln_r * total).to(cols.dtype),
        "distance": (r * unas["distance"].double()).to(cols.dtype),
        "special": None if unas["special"] is None
        else (r[..., None] * unas["special"].double()).to(cols.dtype),
    }
    js2 = ((r * ln_1md + torch.log1p(d)) * total).to(cols.dtype)
    return out, js2
