"""nn.Modules that own attention parameters; all math goes through ``attnlab.attend``.

    MultiHeadAttention   q/k/v/o projections + (for hnas) theta per head, u = sigmoid(theta)
    GAMAttention         GAM: bilinear B per head and brain, power/polynomial features, brain weights
                         W^P, relative-position branch (p, B^P, W^S) and the combination with c1

Both take x (B, T, d_model) and return (B, T, d_model) (or (out, weights (B, H, T, T))).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from attnlab.normalizers import attend, attention_weights, check_variant
from attnlab.normalizers.checks import scalar
from attnlab.scores import _relative_positions, polynomial_features, power_features

__all__ = [
    "HybridWeight",
    "AttentionConfig",
    "MultiHeadAttention",
    "GAMConfig",
    "GAMAttention",
]


def _check_variant(variant: str, name: str = "variant") -> None:
    check_variant(variant, name)  # one check, the registry's


def _check_input(x, d_model: int) -> tuple[int, int, int]:
    """x must be a floating (B, T, d_model) tensor; returns (B, T, d_model)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        seen = f"dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a floating-point tensor (B, T, d_model={d_model}), got {seen}")
    if x.dim() != 3 or x.shape[-1] != d_model:
        raise ValueError(f"x must have shape (B, T, d_model={d_model}), got {tuple(x.shape)}")
    return tuple(x.shape)


def _check_mask(mask, B: int, H: int, T: int) -> torch.Tensor | None:
    """mask: None or bool broadcastable to (B, H, T, T) -> a 4-D view (leading 1s added)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        seen = f"dtype {mask.dtype}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"mask must be a boolean tensor broadcastable to (B, H, T, T) = ({B}, {H}, {T}, "
                         f"{T}), got {seen}")
    try:
        ok = mask.dim() <= 4 and torch.broadcast_shapes(mask.shape, (B, H, T, T)) == (B, H, T, T)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"mask must broadcast to (B, H, T, T) = ({B}, {H}, {T}, {T}), got shape "
                         f"{tuple(mask.shape)}")
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def _check_flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


class HybridWeight(nn.Module):
    """HNAS hybrid weight u = sigmoid(theta) per head, theta_0 = 0 (u_0 = 0.5). Eq. (12)."""

    def __init__(self, n_heads: int, init_u: float = 0.5):
        super().__init__()
        if not 0.0 < init_u < 1.0:
            raise ValueError(f"init_u must lie in (0, 1), got {init_u!r}")
        self.theta = nn.Parameter(torch.full((n_heads,), math.log(init_u / (1.0 - init_u))))

    def forward(self) -> torch.Tensor:
        """u as (1, H, 1, 1), ready to broadcast against (B, H, M, N)."""
        return torch.sigmoid(self.theta).view(1, -1, 1, 1)


@dataclass
class AttentionConfig:
    d_model: int = 128  # model width; split evenly over heads
    n_heads: int = 4  # number of heads H
    variant: str = "unas"  # unas | dnas | hnas | sinkhorn
    iters: int = 1  # sinkhorn iterations
    u: float = 0.5  # initial hybrid weight for hnas (theta_0 = logit(u))
    learn_u: bool = True  # hnas: learn theta; False keeps u fixed
    bias: bool = True  # biases in the q/k/v/o projections
    dropout: float = 0.0  # dropout on the output projection

    def __post_init__(self):
        _check_variant(self.variant)
        for name in ("d_model", "n_heads"):
            value = scalar(getattr(self, name))  # numpy and 0-d tensor integers as Python ints
            object.__setattr__(self, name, value)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"AttentionConfig.{name} must be an integer >= 1, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model must be divisible by n_heads, got {self.d_model} and {self.n_heads}")


class MultiHeadAttention(nn.Module):
    """Standard multi-head attention whose normalizer is any registered variant."""

    def __init__(self, config: AttentionConfig):
        super().__init__()
        self.config = config
        self.n_heads = config.n_heads
        self.head_dim = config.d_model // config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.out = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        self.hybrid = None
        if config.variant == "hnas":
            self.hybrid = HybridWeight(config.n_heads, config.u)
            self.hybrid.theta.requires_grad_(config.learn_u)

    def hybrid_weight(self) -> torch.Tensor | None:
        """u per head (H,) for hnas, None otherwise."""
        return None if self.hybrid is None else self.hybrid().flatten()

    def forward(self, x, mask=None, causal=False, return_weights=False):
        """x (B, T, C); mask bool broadcastable to (B, H, T, T), e.g. key padding (B, 1, 1, T)."""
        B, T, C = _check_input(x, self.config.d_model)
        mask = _check_mask(mask, B, self.n_heads, T)
        _check_flag("causal", causal), _check_flag("return_weights", return_weights)
        q, k, v = self.qkv(x).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        # q, k, v: (B, H, T, D)
        res = attend(
            q, k, v, self.config.variant, mask=mask, causal=causal,
            u=None if self.hybrid is None else self.hybrid(), iters=self.config.iters,
            return_weights=return_weights,
        )
        out, weights = res if return_weights else (res, None)
        out = self.dropout(self.out(out.transpose(1, 2).reshape(B, T, C)))  # (B, T, C)
        return (out, weights) if return_weights else out


@dataclass
class GAMConfig:
    d_model: int = 128  # M, the width of y
    n_heads: int = 4  # heads a = 1..h
    n_brains: int = 1  # N_B bilinear matrices per head (Eq. 14)
    rank: int | None = None  # None: full-rank B (M x M); int d: B = W_Q W_K^T of rank d
    f: str = "power"  # "power" (Eq. 17) or "poly" (Eq. 18)
    power: float = 1.0  # n1 of the power law
    degree: int = 2  # L of the polynomial
    rescale: bool = False  # opt-in overflow guard: degree-l features times rms(y)^(1-l) per token (not
    # Eqs. 16-18 for n1 != 1 or the polynomial; no-op for l = 1). Checkpoints without the key were
    # trained with it on and load with it (attnlab.models.model_config_from_checkpoint).
    brain_weights: str = "uniform"  # "uniform" (1/N_B) or "learned" (softmax of logits, Eq. 19)
    variant: str = "unas"  # normalizer of each brain (paper: softmax = unas)
    iters: int = 1  # sinkhorn iterations when variant == "sinkhorn"
    u: float = 0.5  # hnas hybrid weight (initial, learned per head)
    relative_position: bool = False  # add the relative-position branch (Eqs. 20-24)
    max_len: int = 512  # r^a is padded to this length before the map to p^a
    combine: str = "linear"  # "linear" (Eq. 20) or "geometric" (Eq. 25, applied to the weights)
    c1: float | None = 0.5  # linear mix c1 in (0, 1); None learns it as sigmoid(scalar)
    scale: float | None = None  # score scale; None = 1/sqrt(d) low rank, 1/sqrt(M) full rank
    bias: bool = True  # biases in the value/output projections
    dropout: float = 0.0  # dropout on the output projection

    def __post_init__(self):
        _check_variant(self.variant)
        checks = [
            ("f", self.f in ("power", "poly"), "'power' or 'poly'"),
            ("brain_weights", self.brain_weights in ("uniform", "learned"), "'uniform' or 'learned'"),
            ("combine", self.combine in ("linear", "geometric"), "'linear' or 'geometric'"),
            ("n_brains", self.n_brains >= 1, ">= 1"),
            ("power", isinstance(self.power, (int, float)) and not isinstance(self.power, bool)
             and math.isfinite(self.power) and self.power > 0, "a finite number > 0"),
            ("degree", isinstance(self.degree, int) and not isinstance(self.degree, bool)
             and self.degree >= 1, "an integer >= 1"),
            ("rescale", isinstance(self.rescale, bool), "True or False"),
            ("max_len", isinstance(self.max_len, int) and self.max_len >= 1, "an integer >= 1"),
            ("rank", self.rank is None or self.rank >= 1, "None or >= 1"),
            ("c1", self.c1 is None or 0.0 < self.c1 < 1.0, "None (learned) or in (0, 1)"),
            ("d_model", isinstance(self.n_heads, int) and self.n_heads >= 1
             and self.d_model % self.n_heads == 0, f"divisible by n_heads={self.n_heads} (an integer >= 1)"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"GAMConfig.{name} must be {expected}, got {getattr(self, name)!r}")


class _Bilinear(nn.Module):
    """B per (head, brain): full rank (H, N_B, M, M) or low rank W_Q, W_K (H, N_B, M, d)."""

    def __init__(self, m: int, n_heads: int, n_brains: int, rank: int | None):
        super().__init__()
        self.rank = rank
        if rank is None:
            self.B = nn.Parameter(torch.randn(n_heads, n_brains, m, m) / m)
        else:
            self.W_Q = nn.Parameter(torch.randn(n_heads, n_brains, m, rank) / math.sqrt(m))
            self.W_K = nn.Parameter(torch.randn(n_heads, n_brains, m, rank) / math.sqrt(m))

    def matrix(self) -> torch.Tensor:
        """B itself, (H, N_B, M, M) (for tests and inspection)."""
        return self.B if self.rank is None else self.W_Q @ self.W_K.transpose(-1, -2)

    def features(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """feats (Bt, T, M) -> (q, k) with q . k = feats B feats^T: (Bt, H, N_B, T, r) each."""
        x = feats[:, None, None]  # (Bt, 1, 1, T, M)
        if self.rank is None:
            B = self.B.to(x.dtype)
            return x @ B, x.expand(-1, *B.shape[:2], -1, -1)
        return x @ self.W_Q.to(x.dtype), x @ self.W_K.to(x.dtype)


class GAMAttention(nn.Module):
    """Generalized attention (GAM): Eqs. 13-19, with the relative-position branch of Eqs. 20-25.

    Per head a and brain b: eps_b = f(Y)[B_b] (factorized, see attnlab.scores), Psi_b = normalize(eps_b)
    with any registered variant, Phi = sum_b W^P_b Psi_b, z = Phi Y W_V. Each brain is one call of
    ``attend`` with scale 1 (the scale is folded into the features), so no (T, T) matrix is held
    unless weights are requested or the geometric combination needs them.
    """

    def __init__(self, config: GAMConfig):
        super().__init__()
        self.config = config
        c, M = config, config.d_model
        self.n_heads, self.head_dim = c.n_heads, M // c.n_heads
        n_feat = 1 if c.f == "power" else c.degree
        self.scores = _Bilinear(M, c.n_heads, c.n_brains, c.rank)
        self.value = nn.Linear(M, M, bias=c.bias)  # W_V of every head, (M, h * M/h)
        self.out = nn.Linear(M, M, bias=c.bias)
        self.dropout = nn.Dropout(c.dropout)
        self.poly = nn.Parameter(torch.ones(n_feat)) if c.f == "poly" else None  # A_l
        self.brain_logits = nn.Parameter(torch.zeros(c.n_brains)) if c.brain_weights == "learned" else None
        self.hybrid = HybridWeight(c.n_heads, c.u) if c.variant == "hnas" else None
        if c.relative_position:
            self.position_map = nn.Linear(c.max_len, M)  # r^a (padded) -> p^a in R^M
            self.position_scores = _Bilinear(M, c.n_heads, c.n_brains, c.rank)
            self.position_brain_logits = (
                nn.Parameter(torch.zeros(c.n_brains)) if c.brain_weights == "learned" else None
            )
            self.c1_logit = nn.Parameter(torch.zeros(())) if c.c1 is None else None
        self._scale = c.scale if c.scale is not None else 1.0 / math.sqrt(c.rank or M)

    # -- parameters seen as the paper's quantities --------------------------------------------

    def brain_weights(self, logits: torch.Tensor | None = None) -> torch.Tensor:
        """W^P (N_B,), sum 1: uniform 1/N_B or softmax of learned logits (Eq. 19)."""
        logits = self.brain_logits if logits is None else logits
        if logits is None:
            w, n = self.value.weight, self.config.n_brains
            return torch.full((n,), 1.0 / n, dtype=w.dtype, device=w.device)
        return torch.softmax(logits, dim=0)

    def c1(self) -> torch.Tensor:
        """Linear mixing weight c1 in (0, 1) (Eq. 20): fixed, or sigmoid of a learned scalar."""
        if self.config.c1 is not None:
            w = self.value.weight
            return torch.tensor(self.config.c1, dtype=w.dtype, device=w.device)
        return torch.sigmoid(self.c1_logit)

    def hybrid_weight(self) -> torch.Tensor | None:
        return None if self.hybrid is None else self.hybrid().flatten()

    def position_embedding(self, positions: torch.Tensor, check: bool = True) -> torch.Tensor:
        """p^a (Bt, T, M) from r^a = relative_positions(positions) (Eqs. 26-29).

        The map sees 1/r (1 on the diagonal, decaying with corpus distance), zero-padded to max_len.
        ``check=False`` skips the distinct-positions check (positions known to be arange(T)).
        """
        r = _relative_positions(positions, check=check).to(self.position_map.weight.dtype)  # (Bt, T, T)
        T = r.shape[-1]
        if T > self.config.max_len:
            raise ValueError(f"sequence length {T} exceeds GAMConfig.max_len={self.config.max_len}")
        return self.position_map(F.pad(1.0 / r, (0, self.config.max_len - T)))

    # -- scores ---------------------------------------------------------------------------------

    def _features(self, y: torch.Tensor, bilinear: _Bilinear) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, k) of shape (Bt, H * N_B, T, r) with q . k = eps (Eq. 16, factorized)."""
        c = self.config
        if y.dtype in (torch.float16, torch.bfloat16):  # scores in float32: y^l B y^l overflows half
            y = y.float()
        if c.f == "power":
            qs, ks = bilinear.features(power_features(y, c.power, c.rescale))
        else:  # sum_l A_l Y^l B (Y^l)^T = [A_1 Y^1 B, ..., A_L Y^L B] . [Y^1, ..., Y^L]
            pairs = [bilinear.features(f) for f in polynomial_features(y, c.degree, c.rescale)]
            qs = torch.cat([a * p[0] for a, p in zip(self.poly.to(y.dtype), pairs, strict=True)], dim=-1)
            ks = torch.cat([p[1] for p in pairs], dim=-1)
        qs = qs * self._scale
        Bt, H, NB, T, R = qs.shape
        return qs.reshape(Bt, H * NB, T, R), ks.reshape(Bt, H * NB, T, -1)

    def brain_scores(self, y: torch.Tensor, positional: bool = False) -> torch.Tensor:
        """eps_b (Bt, H, N_B, T, T) of Eq. (16) (delta_b of Eq. (24) with ``positional``).

        y is x (B, T, M) for the content branch and p (B, T, M) for the position branch; the score
        scale multiplies B. Materializes (T, T): for inspection and tests.
        """
        q, k = self._features(y, self.position_scores if positional else self.scores)
        Bt, _, T, _ = q.shape
        return (q @ k.transpose(-1, -2)).view(Bt, self.n_heads, self.config.n_brains, T, T)

    def _brain_mix(self, per_brain: torch.Tensor, logits) -> torch.Tensor:
        """(Bt, H * N_B, T, X) -> sum_b W_b (...) as (Bt, H, T, X) (Eqs. 14, 22)."""
        Bt, _, T, X = per_brain.shape
        w = self.brain_weights(logits).to(per_brain)
        return torch.einsum("bhntx,n->bhtx", per_brain.view(Bt, self.n_heads, -1, T, X), w)

    def _branch(self, feats_src, bilinear, logits, values, mask, causal, want_weights):
        """One branch (content or position): per-brain attention, mixed over brains."""
        q, k = self._features(feats_src, bilinear)  # (Bt, H*N_B, T, r)
        nb = self.config.n_brains
        v = values.repeat_interleave(nb, dim=1)  # (Bt, H*N_B, T, Dh)
        m = mask if mask is None or mask.shape[1] == 1 else mask.repeat_interleave(nb, dim=1)
        u = None if self.hybrid is None else self.hybrid().repeat_interleave(nb, dim=1)
        kw = dict(mask=m, causal=causal, u=u, iters=self.config.iters)
        if want_weights:
            scores = q @ k.transpose(-1, -2)  # (Bt, H*N_B, T, T), scale already in q
            psi = attention_weights(scores, self.config.variant, **kw)
            return self._brain_mix(psi, logits)  # Phi (Bt, H, T, T)
        return self._brain_mix(attend(q, k, v, self.config.variant, scale=1.0, **kw), logits)

    def forward(self, x, mask=None, causal=False, positions=None, return_weights=False):
        """x (B, T, M); mask bool broadcastable to (B, H, T, T); positions (B, T) or (T,) corpus
        positions for the relative-position branch (default arange(T))."""
        c = self.config
        Bt, T, M = _check_input(x, c.d_model)
        mask = _check_mask(mask, Bt, self.n_heads, T)
        _check_flag("causal", causal), _check_flag("return_weights", return_weights)
        if positions is not None:
            if not isinstance(positions, torch.Tensor) or tuple(positions.shape) not in ((T,), (Bt, T)):
                seen = (tuple(positions.shape) if isinstance(positions, torch.Tensor)
                        else type(positions).__name__)
                raise ValueError(f"positions must be a tensor (T,) or (B, T) = ({Bt}, {T}), got {seen}")
        values = self.value(x).view(Bt, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, Dh)
        need_weights = return_weights or (c.relative_position and c.combine == "geometric")
        phi = self._branch(x, self.scores, self.brain_logits, values, mask, causal, need_weights)
        if c.relative_position:
            given = positions is not None
            if not given:
                positions = torch.arange(T, device=x.device)
            p = self.position_embedding(positions.expand(Bt, T), check=given)  # (B, T, M)
            theta = self._branch(p, self.position_scores, self.position_brain_logits, values,
                                 mask, causal, need_weights)
            if c.combine == "linear":  # Eq. (20): c1 z + (1 - c1) pi^pos
                phi = torch.lerp(theta, phi, self.c1().to(phi))
            else:  # Eq. (25) on the weights: rows of sqrt(Phi o Theta), renormalized
                g = torch.sqrt(phi * theta + 1e-30)
                g = torch.where(phi * theta > 0, g, torch.zeros_like(g))
                phi = g / g.sum(-1, keepdim=True).clamp_min(1e-30)
        weights = phi if need_weights else None
        z = (weights.to(values.dtype) @ values if need_weights else phi).to(x.dtype)  # (B, H, T, Dh)
        out = self.dropout(self.out(z.transpose(1, 2).reshape(Bt, T, M)))
        return (out, weights) if return_weights else out
