"""Attention flow (Abnar & Zuidema 2020, "Quantifying Attention Flow in Transformers", Sec. 3).

The layers form a directed graph: node (l, i) is position i after layer l (l = 0: the input tokens,
l = L: the outputs); layer l adds an edge (l + 1, i) -> (l, j) of capacity A_l[i, j], with
A_l = rownorm(0.5 W_l + 0.5 I) the head-averaged, residual-mixed weights of ``attention_rollout``.
The flow from output i to input j is the value of a maximum flow from node (L, i) to node (0, j).
Rollout multiplies the same matrices (every path counts); flow only counts what fits through the
narrowest layer, so it is bounded by each layer's capacities.

Implementation: ``scipy.sparse.csgraph.maximum_flow`` (Dinic's algorithm) on integer capacities
round(A * CAPACITY_SCALE); flows are divided back, so each value is exact up to one rounding of each
edge of a minimum cut (|error| <= N * 0.5 / CAPACITY_SCALE ~ 2.4e-4 at N = 512, far less in practice).

Cost: one max flow per (output, input) pair on a graph of L * N^2 edges, i.e. about
n_outputs * N * L * N^2 edge visits (times a few Dinic phases). ``MAX_FLOW_WORK`` caps that product;
larger requests raise ValueError and say how many output positions would fit (pass ``outputs=``).
Measured in docs/BENCHMARKS.md.

NaN (docs/DESIGN.md §4): a NaN (or +inf) weight makes every flow NaN -- a maximum flow is a global
quantity of the graph, so no flow is computed around it (a finite all-zero flow would be a wrong value).
Empty weights (no layer, head or token) and negative weights are refused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from attnlab.normalizers.checks import plain_number
from attnlab.stats import check_weights
from attnlab.stats._checks import is_lazy_maps, layer_head_means

__all__ = ["CAPACITY_SCALE", "MAX_FLOW_WORK", "flow_work", "flow_capacities", "attention_flow"]

CAPACITY_SCALE = 1 << 20  # integer capacities: round(A_l[i, j] * 2^20); a row sums to 2^20
# n_outputs * N * L * N^2 at most (~2e7 per second on one shared CPU core, i.e. <= ~1 minute): every
# output of 6 layers x 96 tokens (5.1e8) fits, or one output of a 6-layer 512-token window (8.1e8).
MAX_FLOW_WORK = 1e9


def flow_work(n_layers: int, n_tokens: int, n_outputs: int) -> float:
    """The work measure ``MAX_FLOW_WORK`` bounds: n_outputs * N * (L * N^2)."""
    return float(n_outputs) * n_tokens * n_layers * n_tokens**2


def flow_capacities(weights: torch.Tensor, add_residual: bool = True) -> torch.Tensor:
    """A_l (L, N, N) float64: heads averaged (weights (L, H, N, N); (L, N, N) is taken as averaged),
    0.5 W + 0.5 I with ``add_residual``, rows renormalized to 1 (empty rows stay 0). A causal window's
    lazy (L, H, N, N) (attnlab.hf.compute.head_maps.HeadMaps) is read one layer at a time."""
    lazy = is_lazy_maps(weights)  # a causal window's HeadMaps: head-averaged one layer at a time
    w = weights if lazy else check_weights("weights", weights, min_dim=3)
    if len(w.shape) not in (3, 4) or w.shape[-1] != w.shape[-2]:
        raise ValueError(f"weights must be (L, H, N, N) or (L, N, N), got shape {tuple(w.shape)}")
    if not w.shape.numel():
        raise ValueError(f"weights must hold at least one layer, head and token (L, H, N >= 1), got shape "
                         f"{tuple(w.shape)}")
    lows = []  # one pass, on the host copy flow needs anyway

    def low_of(x: torch.Tensor) -> None:
        lows.append(float(torch.nan_to_num(x, nan=0.0).min()))

    if lazy:
        a = layer_head_means(w, torch.float64, each=low_of)  # (L, N, N)
    else:
        a = w.double().cpu()
        low_of(a)
    low = min(lows)
    if low < 0:
        raise ValueError(f"weights must be >= 0 (attention weights), got a minimum of {low:.4g}")
    if a.dim() == 4:
        a = a.mean(1)
    if add_residual:
        a = 0.5 * a + 0.5 * torch.eye(a.shape[-1], dtype=a.dtype)
    rows = a.sum(-1, keepdim=True)
    return a / torch.where(rows > 0, rows, 1.0)


def _graph(caps: np.ndarray, source_row: int):
    """CSR graph for the flows out of output ``source_row``: nodes (l, i) -> l * N + i for l < L, the
    source is node L * N (only its own row of the top layer is needed)."""
    from scipy.sparse import csr_matrix

    L, N, _ = caps.shape
    rows, cols, vals = [], [], []
    for layer in range(L):  # edges from (layer + 1, i) to (layer, j)
        c = caps[layer]
        if layer == L - 1:
            i = np.zeros(N, dtype=np.int64) + source_row
            j = np.arange(N)
            v = c[source_row]
            src = np.full(N, L * N)
        else:
            i, j = np.nonzero(c)
            v = c[i, j]
            src = (layer + 1) * N + i
        keep = v > 0
        rows.append(src[keep])
        cols.append(layer * N + j[keep])
        vals.append(v[keep])
    n = L * N + 1
    return csr_matrix(
        (np.concatenate(vals).astype(np.int32), (np.concatenate(rows), np.concatenate(cols))), shape=(n, n)
    )


def _check_max_work(max_work) -> float:
    """The work limit: a finite number > 0 (NaN or inf would switch the limit off)."""
    value = plain_number(max_work)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        raise ValueError(f"max_work must be a finite number > 0 (edge visits), got {max_work!r}")
    return float(value)


def attention_flow(
    weights: torch.Tensor,
    outputs: Sequence[int] | None = None,
    *,
    add_residual: bool = True,
    max_work: float = MAX_FLOW_WORK,
) -> torch.Tensor:
    """Max-flow value from each output position to each input token.

    Args:
        weights: (L, H, N, N) (heads averaged) or (L, N, N) attention weights of one window.
        outputs: output positions i (default: all N); each row of the result is one of them.
        add_residual: mix the identity in as rollout does (0.5 W + 0.5 I).
        max_work: refuse when n_outputs * N * L * N^2 exceeds it (see the module docstring); a finite
            number > 0.

    Returns:
        (len(outputs), N) float64: flow[o, j] from output ``outputs[o]`` to input token j; each lies in
        [0, 1] and a row's flows to all inputs together need not sum to 1. All NaN when a weight is
        NaN or +inf.
    """
    from scipy.sparse.csgraph import maximum_flow

    max_work = _check_max_work(max_work)
    caps = flow_capacities(weights, add_residual)
    L, N, _ = caps.shape
    if outputs is None:
        outputs = list(range(N))
    else:
        bad = [
            o
            for o in outputs
            if isinstance(o, bool) or not isinstance(o, (int, np.integer)) or not 0 <= o < N
        ]
        if bad or not len(outputs):
            raise ValueError(
                f"outputs must be a non-empty list of positions in [0, {N - 1}], got {list(outputs)!r}"
            )
        outputs = [int(o) for o in outputs]
    work = flow_work(L, N, len(outputs))
    if work > max_work:
        fit = int(max_work // flow_work(L, N, 1))
        hint = (
            f"pass outputs= with at most {fit} positions"
            if fit >= 1
            else "no output position fits; use a shorter window (or rollout)"
        )
        raise ValueError(
            f"attention flow for {len(outputs)} output position(s) of {L} layers x {N} tokens needs "
            f"~{work:.2g} edge visits, over the limit max_work={max_work:.2g}: {hint}"
        )
    if bool(torch.isnan(caps).any()):  # NaN / +inf weights (rows renormalized by inf are NaN)
        return torch.full((len(outputs), N), math.nan, dtype=torch.float64)
    icaps = np.rint(caps.numpy() * CAPACITY_SCALE).astype(np.int64)
    out = np.zeros((len(outputs), N))
    for o, i in enumerate(outputs):
        graph = _graph(icaps, i)
        for j in range(N):
            out[o, j] = maximum_flow(graph, L * N, j, method="dinic").flow_value
    return torch.from_numpy(out / CAPACITY_SCALE)
