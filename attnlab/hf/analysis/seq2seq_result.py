"""The result of an encoder-decoder's analysis (attnlab/hf/analysis/seq2seq.py): the weights of the
three kinds of attention, their statistics with a ``kind`` column, the column mass of each key (the
source tokens, for cross-attention) beside the variants' floors, and one kind as an
:class:`AnalysisResult` for code written for one matrix per variant (figures, the app's pages).

Shapes, per variant: ``weights["encoder"]`` (L_enc, H, N, N), ``weights["decoder"]`` (L_dec, H, M, M),
``weights["cross"]`` (L_dec, H, M, N); N source tokens, M target tokens (decoder start token first).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from attnlab import stats
from attnlab.hf.analysis.results import AnalysisResult, WindowResult, _u_for_stats
from attnlab.hf.capture.seq2seq import KINDS
from attnlab.hf.capture.windows import Window, Windowing
from attnlab.hf.load.model_info import ModelInfo
from attnlab.normalizers import check_params, variant_spec

__all__ = ["Seq2SeqResult", "check_kind"]


def check_kind(kind) -> str:
    """ValueError naming ``kind`` unless it is one of ``KINDS``."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return kind


@dataclass
class Seq2SeqResult:
    """Everything :func:`attnlab.hf.analyze` found on an encoder-decoder."""

    model: ModelInfo
    variants: tuple[str, ...]
    mode: str
    u: float | torch.Tensor
    iters: int  # Sinkhorn rounds of the encoder and cross-attention (the decoder's: its causal rule)
    source: Window  # the encoder's tokens (N)
    target: Window  # the decoder's tokens (M): its start token, then the target's
    weights: dict[str, dict[str, torch.Tensor]]  # kind -> variant -> (L, H, M, N), see the module
    text_sha256: str  # of source and target
    notes: list[str] = field(default_factory=list)
    device: str = "cpu"  # where the model ran; weights are on the CPU
    kinds: tuple[str, ...] = KINDS

    def windows_of(self, kind: str) -> tuple[Window, Window]:
        """(the queries' window, the keys' window) of ``kind``."""
        check_kind(kind)
        return {"encoder": (self.source, self.source), "decoder": (self.target, self.target),
                "cross": (self.target, self.source)}[kind]

    def tokens(self, kind: str) -> tuple[list[str], list[str]]:
        """(query tokens (M), key tokens (N)) of ``kind``."""
        queries, keys = self.windows_of(kind)
        return queries.tokens, keys.tokens

    def table(self, *, punctuation: bool = True, **kwargs):
        """Tidy statistics of every kind (``attnlab.stats.tidy_table`` per kind, the keys' special and
        punctuation tokens) with a ``kind`` column first; ``eps``, ``eps_relative``, ``reference`` as
        there. For cross-attention the column statistics describe the source tokens: m_j = Σ_i π_ij over
        the M target queries, with the floors 1/N (DNAS) and u/N (HNAS) of docs/ANALYSIS.md."""
        import pandas as pd

        kwargs.setdefault("u", _u_for_stats(self.u))
        parts = []
        for kind in self.kinds:
            _, keys = self.windows_of(kind)
            special = torch.from_numpy(keys.special)
            punct = torch.from_numpy(keys.punctuation & ~keys.special) if punctuation else None
            part = stats.tidy_table(self.weights[kind], special=special, punctuation=punct, **kwargs)
            part.insert(0, "kind", kind)
            parts.append(part)
        return stats.with_nan_note(pd.concat(parts, ignore_index=True))

    def column_masses(self, kind: str = "cross") -> dict[str, torch.Tensor]:
        """{variant: (L, H, N)} m_j = Σ_i π_ij: the attention each key receives (cross: each source token
        from the M target queries; mean M/N for row-stochastic variants)."""
        check_kind(kind)
        return {v: w.sum(-2) for v, w in self.weights[kind].items()}

    def column_mass_table(self, kind: str = "cross"):
        """One row per (variant, layer, head, key): ``kind, variant, layer, head, key, token,
        column_mass`` (m_j), ``relative_column_mass`` (m_j · N / M) and ``floor``, the variant's bound
        on m_j (``column_floor`` / N: 1/N for DNAS and Sinkhorn, u/N for HNAS, 0 for the others; it
        holds for any number M of queries, docs/ANALYSIS.md)."""
        import pandas as pd

        queries, keys = self.windows_of(kind)
        M, N = len(queries.tokens), len(keys.tokens)
        frames = []
        for v, m in self.column_masses(kind).items():  # (L, H, N)
            L, H, _ = m.shape
            layer, head, key = (g.reshape(-1) for g in torch.meshgrid(
                torch.arange(L), torch.arange(H), torch.arange(N), indexing="ij"))  # (L * H * N,) each
            frames.append(pd.DataFrame({
                "kind": kind, "variant": v, "layer": layer.numpy(), "head": head.numpy(), "key": key.numpy(),
                "token": [keys.tokens[j] for j in key.tolist()],
                "column_mass": m.reshape(-1).double().numpy(),
                "relative_column_mass": (m.reshape(-1).double() * N / M).numpy(),
                "floor": self._floor(v, kind, L, H).expand(L, H, N).reshape(-1).numpy() / N,
            }))
        return pd.concat(frames, ignore_index=True)

    def _floor(self, variant: str, kind: str, L: int, H: int) -> torch.Tensor:
        """(L, H, 1) the variant's ``column_floor`` (before dividing by N), 0 when it declares none."""
        spec = variant_spec(variant)
        if spec.column_floor is None:
            return torch.zeros(L, H, 1, dtype=torch.float64)
        given = {"u": self.u} if "u" in {p.name for p in spec.params} else {}
        floor = spec.column_floor(check_params(variant, given, causal=kind == "decoder"))
        return torch.broadcast_to(torch.as_tensor(floor, dtype=torch.float64), (L, H))[..., None]

    def view(self, kind: str) -> AnalysisResult:
        """``kind`` as an :class:`AnalysisResult` of one window: ``.weights`` (L, H, M, N), ``.tokens`` the
        keys' tokens (the query tokens: :meth:`tokens`), ``.model`` with that kind's layers and heads
        (``causal`` for the decoder)."""
        queries, keys = self.windows_of(kind)
        weights = self.weights[kind]
        L, H = next(iter(weights.values())).shape[:2]
        info = dataclasses.replace(self.model, n_layers=L, n_heads=H, n_kv_heads=H, causal=kind == "decoder")
        n = len(keys.tokens)
        windowing = Windowing(window=n, content=n, stride=n, overlap=0, n_tokens=n, n_windows=1, starts=(0,))
        window = WindowResult(window=keys, weights=dict(weights), u=self.u, causal=kind == "decoder")
        return AnalysisResult(model=info, variants=self.variants, mode=self.mode, u=self.u, iters=self.iters,
                              windowing=windowing, windows=[window], text_sha256=self.text_sha256,
                              notes=list(self.notes), device=self.device)
