"""Normalizers: turn attention scores into attention weights, and the fused ``attend`` path.

Notation (docs/DESIGN.md §1): queries i = 1..M, keys j = 1..N.

    q         (B, H, M, D)      k (B, H, N, D)      v (B, H, N, Dv)
    scores    (B, H, M, N)      s_ij = scale * q_i . k_j
    weights   (B, H, M, N)      pi_ij; rows sum to 1 (softmax1: to < 1), or are all zero without a valid key
    mask      bool, broadcastable to (B, H, M, N); True = "query i may attend to key j"

Variants ("Attention that does not Explain Away", Eqs. 1, 5, 10, 12, and two for comparison):

    unas      pi = softmax_j(s)                                       (Eq. 1)
    dnas      pi = softmax_j(s_ij - c_j), c_j = logsumexp_i s_ij      (Eq. 5, in log space)
    hnas      pi = u * pi_dnas + (1 - u) * pi_unas                    (Eq. 12)
    sinkhorn  ``iters`` alternating (column, row) normalizations      (Eq. 10)
    sparsemax Euclidean projection of each row onto the simplex       (Martins & Astudillo 2016)
    softmax1  exp(s_ij) / (1 + sum_j exp(s_ij))                       (off-by-one softmax)

The package, one concern per module (each imports only those above it):

    functions.py     the variants as pure functions (logits, ctx) -> weights; NormalizerContext
    checks.py        argument checks, one per kind of argument (shared by every entry point)
    specs.py         VariantSpec / Param, the registry, register_variant, entry points, VARIANTS
    contract.py      what a registered variant's normalizer must return, checked at its first use
    kernel_paths.py  attnlab's CPU kernels as the fast paths need them
    lse.py           column / row log-sum-exp without the (M, N) matrix; Sinkhorn potentials
    fused.py         fused attend paths (no (M, N) matrix) of unas, dnas, hnas, sinkhorn
    builtin.py       the built-in specs (one declaration per variant)
    api.py           attention_weights, attend
"""

from attnlab.normalizers import builtin as _builtin  # noqa: F401  (registers the built-in variants)
from attnlab.normalizers.api import attend, attention_weights
from attnlab.normalizers.functions import (
    NormalizerContext,
    dnas,
    hnas,
    sinkhorn,
    softmax1,
    sparsemax,
    unas,
)
from attnlab.normalizers.lse import column_logsumexp, row_logsumexp, sinkhorn_potentials
from attnlab.normalizers.specs import (
    DEFAULT_VARIANTS,
    ENTRY_POINT_GROUP,
    VARIANTS,
    Param,
    VariantSpec,
    check_param,
    check_params,
    check_variant,
    parameter_names,
    register_variant,
    unregister_variant,
    variant_spec,
    variant_specs,
)

__all__ = [
    "VARIANTS",
    "DEFAULT_VARIANTS",
    "ENTRY_POINT_GROUP",
    "NormalizerContext",
    "Param",
    "VariantSpec",
    "attention_weights",
    "attend",
    "check_param",
    "check_params",
    "check_variant",
    "column_logsumexp",
    "parameter_names",
    "register_variant",
    "unregister_variant",
    "row_logsumexp",
    "sinkhorn_potentials",
    "variant_spec",
    "variant_specs",
    "unas",
    "dnas",
    "hnas",
    "sinkhorn",
    "sparsemax",
    "softmax1",
]
