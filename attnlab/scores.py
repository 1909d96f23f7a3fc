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

import math
import numbers

import torch

__all__ = [
    "relative_positions",
    "signed_power",
    "power_features",
    "polynomial_features",
    "gam_scores_reference",
]


INT64_MAX = 2**63 - 1


def relative_positions(positions: torch.Tensor) -> torch.Tensor:
    """r^a_b = |pos_a - pos_b| + 1 (GAM Eqs. 28-29): 1 on the diagonal, 2 + n_e otherwise.

    Args:
        positions: (..., n) distinct integer original corpus positions of the elements (may have
            gaps; a list or numpy array is taken as a tensor). Eq. 29 gives r = 1 only on the
            diagonal, so a position repeated within one sequence is refused, and so are positions
            whose differences + 1 do not fit int64.
    Returns:
        (..., n, n) int64. Example: positions (0, 1, 3) for (My, name, Vikram) of "My name is Vikram"
        give r^1 = (1, 2, 4), r^3 = (4, 3, 1).
    """
    if not isinstance(positions, torch.Tensor):
        try:
            positions = torch.as_tensor(positions)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"positions must be an integer tensor (..., n) of int64 values, got "
                             f"{type(positions).__name__} ({e})") from None
        if positions.numel() == 0:  # an empty list: no dtype to infer
            positions = positions.to(torch.int64)
    return _relative_positions(positions, check=True)


def _relative_positions(positions: torch.Tensor, check: bool) -> torch.Tensor:
    """relative_positions; ``check=False`` skips the data checks (positions known distinct and small,
    e.g. arange(T): no host sync)."""
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise ValueError(f"positions must be an integer tensor (..., n), got dtype {positions.dtype}")
    if positions.dim() < 1:
        raise ValueError(f"positions must have at least 1 dim (..., n), got shape {tuple(positions.shape)}")
    if positions.dtype == torch.uint64 and check and positions.numel():
        if int(positions.max()) > INT64_MAX:
            raise ValueError(f"positions must fit int64, got {int(positions.max())}")
    pos = positions.to(torch.int64)
    if check and pos.shape[-1] > 1:
        srt = pos.sort(-1).values  # (..., n)
        dup = srt[..., 1:] == srt[..., :-1]
        if bool(dup.any()):
            value = srt[..., 1:][dup][0].item()
            raise ValueError(f"positions must be distinct within each sequence (Eq. 29: r = 1 only on "
                             f"the diagonal), got position {value} twice")
        span = max(b - a for a, b in zip(srt[..., 0].flatten().tolist(), srt[..., -1].flatten().tolist(),
                                         strict=True))
        if span + 1 > INT64_MAX:
            raise ValueError(f"positions must span less than 2**63 - 1 so that |pos_a - pos_b| + 1 fits "
                             f"int64, got a span of {span}")
    return (pos[..., :, None] - pos[..., None, :]).abs() + 1


def _check_exponent(n) -> float:
    if isinstance(n, bool) or not isinstance(n, numbers.Real) or not math.isfinite(n) or n <= 0:
        raise ValueError(f"n must be a finite number > 0 (the power n1 or degree l), got {n!r}")
    return float(n)


def _check_y(y, name: str = "y") -> torch.Tensor:
    if not isinstance(y, torch.Tensor) or not y.is_floating_point():
        seen = f"dtype {y.dtype}" if isinstance(y, torch.Tensor) else type(y).__name__
        raise ValueError(f"{name} must be a floating-point tensor (..., n, M), got {seen}")
    return y


def signed_power(x: torch.Tensor, n: float) -> torch.Tensor:
    """phi_n(x): x^n for integer n (even or odd), sign(x)|x|^n otherwise (docs/DESIGN.md §3); n > 0."""
    n = _check_exponent(n)
    x = _check_y(x, "x")
    if n.is_integer():
        return x.pow(int(n))
    return torch.sign(x) * x.abs().pow(n)


def _rms(y: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Root mean square over the feature dim, (..., n, 1)."""
    return y.pow(2).mean(-1, keepdim=True).add(eps).sqrt()


def power_features(y: torch.Tensor, n1: float, rescale: bool = False) -> torch.Tensor:
    """phi_{n1}(y) (..., n, M): the paper's features (Eq. 17). ``rescale=True`` (opt-in overflow
    guard, not the paper's function for n1 != 1) multiplies them by rms(y)^(1 - n1) per element.

    The rescaled features are computed as rms * phi(y / rms), so no intermediate exceeds the scale
    of y: without it y^l overflows float16 for l >= 4 and float32 for large l. Degree 1 is unchanged.
    """
    y = _check_y(y)
    n1 = _check_exponent(n1)
    if not rescale or n1 == 1:
        return signed_power(y, n1)
    rms = _rms(y)
    return rms * signed_power(y / rms, n1)


def polynomial_features(y: torch.Tensor, degree: int, rescale: bool = False) -> list[torch.Tensor]:
    """[Y^{o1}, ..., Y^{oL}] each (..., n, M) (Eq. 18); ``rescale=True`` (opt-in overflow guard)
    multiplies degree l by rms(y)^(1 - l)."""
    if isinstance(degree, bool) or not isinstance(degree, numbers.Integral) or degree < 1:
        raise ValueError(f"degree must be an integer >= 1, got {degree!r}")
    return [power_features(y, float(l), rescale) for l in range(1, degree + 1)]


def gam_scores_reference(
    y: torch.Tensor, bilinear: torch.Tensor, f, other: torch.Tensor | None = None
) -> torch.Tensor:
    """Literal Eq. (16), for tests on tiny inputs only: builds the (n, n, M, M) tensor.

    y (n, M), other (n', M) (default y), bilinear B (M, M), f elementwise -> eps (n, n').
    """
    other = y if other is None else other
    for name, t in (("y", y), ("other", other)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            seen = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 2-D tensor (n, M), got {seen}")
    M = y.shape[-1]
    if other.shape[-1] != M or not isinstance(bilinear, torch.Tensor) or tuple(bilinear.shape) != (M, M):
        seen = tuple(bilinear.shape) if isinstance(bilinear, torch.Tensor) else type(bilinear).__name__
        raise ValueError(f"bilinear must be (M, M) = ({M}, {M}) and other (n', {M}), got bilinear {seen} "
                         f"and other {tuple(other.shape)}")
    outer = y[:, None, :, None] * other[None, :, None, :]  # (n, n', M, M): y^a_r y^b_t
    return (f(outer) * bilinear).sum(dim=(-1, -2))
