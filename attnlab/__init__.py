"""attnlab: attention-analysis lab for UNAS, DNAS, HNAS, Sinkhorn and GAM attention.

Public surface (docs/DESIGN.md §6)::

    attnlab.VARIANTS                      # every registered variant ("unas", "dnas", "hnas", ...)
    attnlab.variant_specs()               # their declarations: parameters, guarantees, fast paths
    attnlab.register_variant(name, normalizer, **spec)
    attnlab.attention_weights(scores, variant, *, mask=None, causal=False, **params)
    attnlab.attend(q, k, v, variant, *, mask=None, causal=False, scale=None, return_weights=False,
                   **params)                # params: u (HNAS), iters and tol (Sinkhorn), ...
    attnlab.relative_positions(positions)
"""

from attnlab.normalizers import (
    DEFAULT_VARIANTS,
    VARIANTS,
    Param,
    VariantSpec,
    attend,
    attention_weights,
    check_params,
    column_logsumexp,
    register_variant,
    variant_spec,
    variant_specs,
)
from attnlab.scores import relative_positions

__all__ = ["VARIANTS", "DEFAULT_VARIANTS", "Param", "VariantSpec", "attend", "attention_weights",
           "check_params", "column_logsumexp", "register_variant", "relative_positions", "variant_spec",
           "variant_specs"]
__version__ = "0.1.0"

# Submodules with heavier imports (pandas, plotly, transformers) load on first use:
# ``attnlab.stats.column_mass(...)`` works after a plain ``import attnlab``.
_LAZY = {"stats", "figures", "hf", "modules", "models", "train", "data", "scores", "normalizers"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return importlib.import_module(f"attnlab.{name}")
    raise AttributeError(f"module 'attnlab' has no attribute {name!r}")
