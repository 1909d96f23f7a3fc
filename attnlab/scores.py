"""Scores: what turns inputs into logits. Pure functions; the parameters live in attnlab.modules.

GAM ("Generalized Attention Mechanism and Relative Position for Transformer", Eqs. 11-18, 24-29):

    eps^{ab} = sum_rt f(y^a_r y^b_t) B_rt                                      (Eq. 16)
    power:      f(x) = x^{n1}                       -> eps = phi(Y) B phi(Y)^T   (Eq. 17)
    polynomial: f(x) = sum_l A_l x^l                -> eps = sum_l A_l Y^l B (Y^l)^T (Eq. 18)

with the sign-preserving power phi_n(x) = sign(x)|x|^n (x^n for integer n), so that
f(y_r y_t) = phi(y_r) phi(y_t) and the (n, n, M, M) tensor of Eq. 16 is never built.

Every GAM score is therefore a dot product of two feature maps, q_feat . k_feat with scale 1, and goes
through the same ``attend`` pipeline as standard attention.
"""

from __future__ import annotations

import torch

__all__ = [
    "relative_positions",
    "signed_power",
    "power_features",
    "polynomial_features",
    "gam_scores_reference",
]


def relative_positions(positions: torch.Tensor) -> torch.Tensor:
    """r^a_b = |pos_a - pos_b| + 1 (GAM Eqs. 28-29): 1 on the diagonal, 2 + n_e otherwise.

    Args:
        positions: (..., n) integer original corpus positions of the elements (may have gaps).
    Returns:
        (..., n, n) int64. Example: positions (0, 1, 3) for (My, name, Vikram) of "My name is Vikram"
        give r^1 = (1, 2, 4), r^3 = (4, 3, 1).
    """
    if not isinstance(positions, torch.Tensor):
        positions = torch.as_tensor(positions)
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise ValueError(f"positions must be an integer tensor (..., n), got dtype {positions.dtype}")
    if positions.dim() < 1:
        raise ValueError(f"positions must have at least 1 dim (..., n), got shape {tuple(positions.shape)}")
    pos = positions.to(torch.int64)
    return (pos[..., :, None] - pos[..., None, :]).abs() + 1


def signed_power(x: torch.Tensor, n: float) -> torch.Tensor:
    """phi_n(x): x^n for integer n (even or odd), sign(x)|x|^n otherwise (DESIGN.md §3)."""
    if float(n).is_integer():
        return x.pow(int(n))
    return torch.sign(x) * x.abs().pow(n)


def _rms(y: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Root mean square over the feature dim, (..., n, 1)."""
    return y.pow(2).mean(-1, keepdim=True).add(eps).sqrt()


def power_features(y: torch.Tensor, n1: float, rescale: bool = True) -> torch.Tensor:
    """phi_{n1}(y) (..., n, M), optionally times rms(y)^(1 - n1) per element (overflow guard).

    The rescaled features are computed as rms * phi(y / rms), so no intermediate exceeds the scale
    of y: without it y^l overflows float16 for l >= 4 and float32 for large l. Degree 1 is unchanged.
    """
    if not rescale or n1 == 1:
        return signed_power(y, n1)
    rms = _rms(y)
    return rms * signed_power(y / rms, n1)


def polynomial_features(y: torch.Tensor, degree: int, rescale: bool = True) -> list[torch.Tensor]:
    """[Y^{o1}, ..., Y^{oL}] each (..., n, M), degree l optionally rescaled by rms(y)^(1 - l)."""
    return [power_features(y, float(l), rescale) for l in range(1, degree + 1)]


def gam_scores_reference(
    y: torch.Tensor, bilinear: torch.Tensor, f, other: torch.Tensor | None = None
) -> torch.Tensor:
    """Literal Eq. (16), for tests on tiny inputs only: builds the (n, n, M, M) tensor.

    y (n, M), other (n', M) (default y), bilinear B (M, M), f elementwise -> eps (n, n').
    """
    other = y if other is None else other
    outer = y[:, None, :, None] * other[None, :, None, :]  # (n, n', M, M): y^a_r y^b_t
    return (f(outer) * bilinear).sum(dim=(-1, -2))
