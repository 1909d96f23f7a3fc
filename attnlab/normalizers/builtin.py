"""The built-in variants, each declared once: its function, parameters, guarantees and fast paths.

Everything else in attnlab (checks, hf, statistics, figures, CLI, app, benchmark, docs) reads these
specs; a new variant is one function in functions.py (or anywhere) and one ``register_variant`` here
(or in a plugin package, entry-point group ``attnlab.variants``).
"""

from __future__ import annotations

from attnlab.normalizers import functions as fn
from attnlab.normalizers.fused import fused_dnas, fused_hnas, fused_sinkhorn, fused_unas
from attnlab.normalizers.specs import Param, register_variant

U = Param("u", float, 0.5, 0.0, 1.0, "HNAS hybrid weight: u * DNAS + (1 - u) * UNAS (sigmoid(theta_0 = 0))",
          per_head=True)
ITERS = Param("iters", int, 3, 1, 10_000, "Sinkhorn rounds (column, then row step); 1 = DNAS")
TOL = Param("tol", float, 0.0, 0.0, 1.0,
            "stop Sinkhorn early once every column's mass is within tol of M/N (0 = run every round)")


def triton_path(q, k, v, variant, mask, scale, ctx):
    """The CUDA fast path: attnlab.gpu's Triton kernels (None where they do not apply, e.g. triton
    not installed; attnlab.gpu imports triton only on first use)."""
    from attnlab import gpu  # noqa: PLC0415

    return gpu.fused_attend(q, k, v, variant, mask=mask, scale=scale, causal=ctx.causal, **ctx.params)


def _sinkhorn_causal(params: dict, given: frozenset) -> dict:
    """Causal Sinkhorn with more rounds degenerates toward the identity: only iters=1 (= causal DNAS);
    when iters is not given, causal use takes 1."""
    if "iters" not in given:
        return {**params, "iters": 1}
    if params["iters"] > 1:
        raise ValueError(
            f"iters must be 1 for causal sinkhorn (got iters={params['iters']}): with a causal mask the "
            "alternating normalizations degenerate toward the identity; use iters=1 (= causal dnas) or "
            "causal=False"
        )
    return params


register_variant(
    "unas", fn.unas, label="UNAS", builtin=True, default=True, fused=fused_unas, hf_kernel=True,
    summary="softmax over keys (standard attention)",
    reference='"Attention that does not Explain Away", Eq. 1',
)
register_variant(
    "dnas", fn.dnas, label="DNAS", builtin=True, default=True, fused=fused_dnas, hf_kernel=True,
    gpu=triton_path,
    summary="normalize over queries, then over keys: every key receives >= 1/N",
    reference='"Attention that does not Explain Away", Eq. 5',
    column_floor=lambda p: 1.0,
)
register_variant(
    "hnas", fn.hnas, label="HNAS", builtin=True, default=True, fused=fused_hnas, hf_kernel=True,
    gpu=triton_path,
    summary="u * DNAS + (1 - u) * UNAS, u learned per head: every key receives >= u/N",
    reference='"Attention that does not Explain Away", Eq. 12',
    params=(U,), column_floor=lambda p: p["u"],
)
register_variant(
    "sinkhorn", fn.sinkhorn, label="Sinkhorn", builtin=True, default=True, fused=fused_sinkhorn,
    gpu=triton_path,
    hf_kernel=lambda p: p["tol"] == 0,  # the analysis kernel runs every round (no tolerance)
    summary="iterated DNAS toward doubly stochastic (iters=1 is DNAS)",
    reference='"Attention that does not Explain Away", Eq. 10',
    params=(ITERS, TOL), column_floor=lambda p: 1.0, causal_rule=_sinkhorn_causal,
)
register_variant(
    "sparsemax", fn.sparsemax, label="sparsemax", builtin=True,
    hf_kernel=True,  # its statistics from each row's support, in the analysis kernel's row pass
    summary="Euclidean projection of each row onto the simplex: exact zeros",
    reference="Martins & Astudillo 2016, Eq. 2",
)
register_variant(
    "softmax1", fn.softmax1, label="softmax1", builtin=True, rows_sum_to_one=False,
    hf_kernel=True,  # unas scaled per row: the fused analysis computes it (attnlab/csrc/analysis_cpu.cpp)
    summary="off-by-one softmax, exp(s) / (1 + sum exp(s)): a built-in null key, rows sum to < 1",
    reference='Miller 2023, "Attention is off by one"',
)
