"""attnlab: attention-analysis lab for UNAS, DNAS, HNAS, Sinkhorn and GAM attention.

Public surface (DESIGN.md §6)::

    attnlab.VARIANTS                      # ("unas", "dnas", "hnas", "sinkhorn")
    attnlab.attention_weights(scores, variant, *, mask=None, causal=False, u=None, iters=None)
    attnlab.attend(q, k, v, variant, *, mask=None, causal=False, u=None, iters=None, scale=None,
                   return_weights=False)
    attnlab.relative_positions(positions)
"""

from attnlab.normalizers import VARIANTS, attend, attention_weights, column_logsumexp
from attnlab.scores import relative_positions

__all__ = ["VARIANTS", "attend", "attention_weights", "column_logsumexp", "relative_positions"]
__version__ = "0.1.0"

# Submodules with heavier imports (pandas, plotly, transformers) load on first use:
# ``attnlab.stats.column_mass(...)`` works after a plain ``import attnlab``.
_LAZY = {"stats", "figures", "hf", "modules", "models", "train", "data", "scores", "normalizers"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return importlib.import_module(f"attnlab.{name}")
    raise AttributeError(f"module 'attnlab' has no attribute {name!r}")
