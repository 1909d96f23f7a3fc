"""softmax1's statistics in the fused analysis: closed forms from unas' row sums and ln t_i
(attnlab/hf/compute/softmax1_sums.py), against literal float64 sums of softmax1's weights, from rows
where the null key takes almost nothing (t ~ 1e-12) to rows where it takes almost everything."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.hf.compute.softmax1_sums import softmax1_sums
from attnlab.stats.engine import row_sums_dict


@pytest.mark.parametrize("shift", [-30.0, -3.0, 0.0, 4.0, 28.0])  # ln t ~ -shift - ln N
def test_closed_forms_equal_the_literal_sums(shift):
    gen = torch.Generator().manual_seed(int(shift) + 40)
    G, N = 3, 17
    s = torch.randn(G, N, N, generator=gen, dtype=torch.float64) * 2 + shift  # (G, M=N, N) scores
    q = torch.softmax(s, -1)  # unas
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.logaddexp(torch.zeros_like(lse), lse)[..., None])  # softmax1
    spec = (torch.arange(N) % 5 == 0).double()[:, None]  # (N, 1)
    dist = (torch.arange(N)[:, None] - torch.arange(N)[None, :]).abs().double()
    unas = row_sums_dict(q, spec, dist, None)
    want = row_sums_dict(p, spec, dist, None)
    got, js2 = softmax1_sums(unas, -lse, p.sum(-2))
    for key in ("rowsum", "entropy", "distance", "special", "cols"):
        torch.testing.assert_close(got[key], want[key], rtol=1e-12, atol=1e-14, msg=key)
    # twice the JS divergence to unas, literally, in a form that keeps its digits (the x log(x / m) terms
    # with log1p of the relative difference), against the closed form
    m = (p + q) / 2
    literal = (p * torch.log1p((p - m) / m) + q * torch.log1p((q - m) / m)).sum(-1)
    # (the literal sum's own rounding is ~1e-16: its first-order terms cancel)
    torch.testing.assert_close(js2, literal, rtol=1e-9, atol=1e-15)
    assert bool((js2 >= 0).all())


def test_a_tiny_null_key_share_keeps_its_digits():
    """t = 1e-12: 1 - r and the divergence (~ t^2 / 4) come from ln t, not from 1 - r in floating point."""
    lnt = torch.full((1, 2), math.log(1e-12))
    unas = {"rowsum": torch.ones(1, 2), "entropy": torch.zeros(1, 2), "distance": torch.zeros(1, 2),
            "special": None}
    got, js2 = softmax1_sums(unas, lnt, torch.zeros(1, 2))
    torch.testing.assert_close(js2, torch.full((1, 2), 0.25e-24), rtol=1e-4, atol=0)
    torch.testing.assert_close(got["entropy"], torch.full((1, 2), 1e-12), rtol=1e-4, atol=0)  # -r ln r


def test_a_null_key_that_takes_everything_gives_the_limit():
    """t = e^174 (a row whose scores all lie ~170 below the null key's 0): softmax1's weights are ~1e-76,
    so twice the divergence to unas is ln 2 (sum q ln 2q/q), as the materialized weights give; log1p(-d)
    with d rounded to 1 made it -inf and the JS distance 0."""
    lnt = torch.tensor([[174.0, 60.0]])
    unas = {"rowsum": torch.ones(1, 2), "entropy": torch.zeros(1, 2), "distance": torch.zeros(1, 2),
            "special": None}
    _, js2 = softmax1_sums(unas, lnt, torch.zeros(1, 2))
    torch.testing.assert_close(js2, torch.full((1, 2), math.log(2.0)), rtol=1e-6, atol=0)
