"""Results of a text's analysis: per window (:class:`WindowResult`) and for the whole text
(:class:`AnalysisResult`), with their tidy statistics; the HNAS u of a trained checkpoint.

Shapes: ``weights[variant]`` is (L, H, N, N) per window (layers, heads, queries, keys).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field, replace

import torch

from attnlab import stats
from attnlab.hf.analysis import contribution_view
from attnlab.hf.capture.interface import DEFAULT_U
from attnlab.hf.capture.windows import Window, Windowing
from attnlab.hf.compute import lazy_weights
from attnlab.hf.load.loading import ModelInfo

__all__ = ["WindowResult", "AnalysisResult", "hnas_u_from_checkpoint"]

# ----------------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------------


@dataclass
class WindowResult:
    """Weights of every variant for one window of the text."""

    window: Window  # tokens, word ids, special/punctuation flags, character spans
    # variant -> (L, H, N, N); rows sum to 1. From the fused analysis a LazyWeights (a dict whose
    # variants are computed on first access, attnlab/hf/compute/lazy_weights.py); a plain dict otherwise
    weights: dict[str, torch.Tensor]
    u: float | torch.Tensor = DEFAULT_U  # HNAS weight used (for the u/N bound)
    # variant -> {map: (L, H, N, N)}: the parts of a GAM checkpoint's weights (attnlab.hf.load.native):
    # "phi" (content brains mixed, Eq. 14), "theta" (relative-position branch, Eq. 22), "brain_<b>",
    # "position_brain_<b>" (each brain normalized); NaN in layers without that map. Empty otherwise.
    components: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    # Row sums for the statistics, computed together with the weights (attnlab.hf.compute.weights): (sums,
    # special-key masks they cover, the weights' (id, version) when computed). Used by ``table``
    # while the weights are those very tensors, unchanged.
    _sums: tuple | None = field(default=None, repr=False, compare=False)
    # variant -> value norms and Gram matrices (hf.capture.values.ValueSummary), with contributions=True
    values: dict | None = field(default=None, repr=False, compare=False)
    causal: bool = False  # the window's attention is causal (query i sees keys j <= i)

    @property
    def value_norms(self) -> torch.Tensor:
        """(L, H, N) ||f_h(x_j)|| (Kobayashi et al. 2020); analyse with ``contributions=True``."""
        return contribution_view.value_norms(self)

    @property
    def contribution_mass(self) -> dict[str, torch.Tensor]:
        """variant -> (L, H, N) c_j = sum_i pi_ij ||f_h(x_j)|| (``attnlab.contributions``)."""
        return contribution_view.contribution_mass(self)

    def layer_contribution_norms(self, variant: str, layer: int) -> torch.Tensor:
        """(N, N) ||sum_h pi^h_ij f_h(x_j)|| of one layer, computed in blocks of rows."""
        return contribution_view.layer_norms(self, variant, layer)

    def sinks(self, which: str = "first+special", eps: float = 0.01, eps_relative: float = 0.1):
        """Tidy sink statistics (``attnlab.sinks.SINK_STATISTICS``): sink mass per layer and head and
        the column-mass statistics with the sink keys excluded (rows renormalized)."""
        from attnlab import sinks

        return sinks.sink_table(self.weights, self.special, which=which, eps=eps, eps_relative=eps_relative,
                                window=self.index)

    @property
    def index(self) -> int:
        return self.window.index

    @property
    def tokens(self) -> list[str]:
        return self.window.tokens

    @property
    def special(self) -> torch.Tensor:
        """(N,) bool: special tokens ([CLS], [SEP], <s>, ...)."""
        return torch.from_numpy(self.window.special)

    @property
    def punctuation(self) -> torch.Tensor:
        """(N,) bool: tokens made only of punctuation or symbols."""
        return torch.from_numpy(self.window.punctuation)

    def table(self, *, punctuation: bool = True, include_punctuation: bool | None = None, **kwargs):
        """Tidy statistics of this window (``attnlab.stats.tidy_table``) with a ``window`` column.

        ``special_mass`` is the mass on special tokens alone and, with ``punctuation``,
        ``punctuation_mass`` that on punctuation tokens (docs/STATISTICS.md). Other keyword arguments
        (eps, eps_relative, reference) go to ``tidy_table``. NaN values come with a note in
        ``table.attrs["notes"]`` naming the first layer (``attnlab.stats.nan_notes``).
        ``include_punctuation`` is the old name of ``punctuation`` (special_mass never counts punctuation).
        """
        if include_punctuation is not None:
            warnings.warn("table(include_punctuation=...) is now table(punctuation=...): special_mass counts "
                          "special tokens only, punctuation_mass the punctuation", DeprecationWarning,
                          stacklevel=2)
            punctuation = bool(include_punctuation)
        special, punct = self.special, (self.punctuation & ~self.special) if punctuation else None
        kwargs.setdefault("u", _u_for_stats(self.u))
        cached = None
        if set(kwargs) <= {"u", "eps", "eps_relative", "reference"}:
            cached = self._cached_key_sums(special, punct, kwargs.get("reference", "unas"))
        if cached is not None:
            sums, index, punct_index = cached
            table = stats.table_from_row_sums(
                sums, special_index=index, punctuation_index=punct_index, u=kwargs["u"],
                eps=kwargs.get("eps", 0.01), eps_relative=kwargs.get("eps_relative", 0.1),
                reference=kwargs.get("reference", "unas"), window=self.index,
            )
        else:
            table = stats.tidy_table(self.weights, special=special, punctuation=punct, window=self.index,
                                     **kwargs)
        return stats.with_nan_note(contribution_view.with_contributions(self, kwargs, table))

    def column_masses(self) -> dict[str, torch.Tensor]:
        """{variant: (L, H, N) column masses m_j = sum_i pi_ij}: from the analysis pass's row sums
        while they describe the current weights (no weights are computed), else from the weights."""
        if self._sums is not None:
            sums, _, fingerprint = self._sums
            if list(sums) == list(self.weights) and fingerprint == _fingerprint(self.weights):
                return {v: s.cols.reshape(s.shape[0], s.shape[1], -1) for v, s in sums.items()}
        window = self.streamed_window()
        if window is not None:  # streamed: one more pass over the tiles, no weights held
            return window.column_masses()
        return {v: w.sum(-2) for v, w in self.weights.items()}

    def streamed_window(self):
        """The StreamedWindow behind every variant's weights (attnlab/hf/compute/streamed.py: a long causal
        window's layers, masks and row sums, e.g. ``.counts()`` (L, N), the queries that may attend each
        key), or None when the weights are held whole. Computes no lazy variant."""
        held = list(lazy_weights.stored(self.weights))  # (computing no lazy variant)
        found = {id(getattr(w, "window", None)) for w in held
                 if getattr(w, "streamed_window", False)}
        if len(found) != 1 or len(self.weights) == 0:
            return None
        w = held[0]
        return w.window if getattr(w, "streamed_window", False) else None

    def sink_importance(self, masses: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """{variant: (L, H, N)} the causal-corrected importance of every key (Gu et al. 2024,
        ``attnlab.sinks.sink_importance``): column mass / queries that may attend the key (from the
        layers' masks on a streamed window; N - j queries on another causal window, every query on a
        bidirectional one). ``masses``: this window's :meth:`column_masses`, when the caller has them."""
        from attnlab.sinks import importance_from_masses, queries_per_key

        masses = self.column_masses() if masses is None else masses  # given: the caller's, already taken
        window = self.streamed_window()
        first = next(iter(masses.values()))
        L, H, N = first.shape
        if window is not None:  # the layers' own masks and windows
            counts = window.counts()  # (L, N)
        else:  # causal: N - j queries (M queries at the end of the keys); else all M
            M = next(iter(self.weights.values())).shape[-2]
            counts = queries_per_key(M, N, self.causal).expand(L, N)
        return {v: importance_from_masses(m, counts[:, None, :]) for v, m in masses.items()}

    def sink_rate(self, eps: float = 0.3, position: int = 0) -> dict[str, torch.Tensor]:
        """{variant: (L,)} per layer the share of heads whose importance of key ``position`` exceeds
        ``eps`` (Gu et al. 2024's sink rate; ``attnlab.sinks.sink_rate``)."""
        from attnlab import sinks

        eps, position = sinks.check_rate(eps, position, len(self.tokens))
        importance = self.sink_importance()
        return {v: sinks.rate_from_importance(imp[..., position], eps) for v, imp in importance.items()}

    def _cached_sums(self, special: torch.Tensor, reference):
        """(row sums, index of the key mask ``special`` among theirs) when they describe the current
        weights and the requested statistics; None otherwise."""
        cached = self._cached_key_sums(special, None, reference)
        return None if cached is None else cached[:2]

    def _cached_key_sums(self, special: torch.Tensor, punct: torch.Tensor | None, reference):
        """(row sums, index of ``special`` among their key masks, that of ``punct`` or None) when they
        describe the current weights and the requested statistics; None otherwise (tidy_table
        recomputes). The analysis sums the masks special | punctuation and special: the punctuation
        mass is their difference (an extra key mask of the sums)."""
        if self._sums is None or reference != "unas":
            return None
        sums, masks, fingerprint = self._sums
        if list(sums) != list(self.weights) or fingerprint != _fingerprint(self.weights):
            return None
        find = lambda key: next((i for i, m in enumerate(masks) if torch.equal(m, key)), None)  # noqa: E731
        index = find(special)
        if index is None or punct is None:
            return None if index is None else (sums, index, None)
        if (p := find(punct)) is not None:
            return sums, index, p
        if (both := find(special | punct)) is None:
            return None
        sums = {v: replace(s, special=torch.cat([s.special, (s.special[..., both] - s.special[..., index])
                                                 .clamp_min(0.0)[..., None]], -1)) for v, s in sums.items()}
        return sums, index, len(masks)


def _fingerprint(weights: dict[str, torch.Tensor]) -> tuple:
    """Which weight tensors (and versions) the row sums were computed with: a weight changed in place
    or replaced makes ``table`` recompute from the weights (tests/test_hf.py). Weights computed on
    first access (attnlab.hf.compute.lazy_weights) are not computed for it."""
    return lazy_weights.fingerprint(weights)


@dataclass
class AnalysisResult:
    """Everything :func:`analyze` found. Single-window texts read like one matrix per variant
    (``.tokens``, ``.weights``); long texts keep one :class:`WindowResult` per window."""

    model: ModelInfo
    variants: tuple[str, ...]
    mode: str
    u: float | torch.Tensor
    iters: int  # Sinkhorn iterations used (1 for causal models)
    windowing: Windowing
    windows: list[WindowResult]
    text_sha256: str
    notes: list[str] = field(default_factory=list)
    device: str = "cpu"  # where the model ran ("cpu", "cuda:0"); weights and tables are on the CPU

    @property
    def n_windows(self) -> int:
        return len(self.windows)

    def _single(self, what: str) -> WindowResult:
        if len(self.windows) != 1:
            raise ValueError(
                f"the text was split into {len(self.windows)} windows of {self.windowing.window} tokens; "
                f"use .windows[i].{what} (per window) instead of .{what}"
            )
        return self.windows[0]

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """variant -> (L, H, N, N) for a single-window text (raises for several windows)."""
        return self._single("weights").weights

    @property
    def tokens(self) -> list[str]:
        """Tokens aligned with ``.weights`` (special tokens included) for a single window; for several
        windows, the text's tokens without special tokens (each window has its own ``.tokens``)."""
        if len(self.windows) == 1:
            return self.windows[0].tokens
        return [t for w in self.windows for t in _text_tokens(w, self.windowing)]

    @property
    def word_ids(self) -> list[int | None]:
        """Word index per token of ``.tokens`` (None for special tokens)."""
        if len(self.windows) == 1:
            return self.windows[0].window.word_ids
        return [x for w in self.windows for x in _text_tokens(w, self.windowing, "word_ids")]

    @property
    def special(self) -> torch.Tensor:
        """(N,) bool special-token flags of the single window."""
        return self._single("special").special

    @property
    def components(self) -> dict[str, dict[str, torch.Tensor]]:
        """variant -> {map: (L, H, N, N)} of a GAM checkpoint, single window (see WindowResult)."""
        return self._single("components").components

    @property
    def value_norms(self) -> torch.Tensor:
        """(L, H, N) value norms of the single window (``contributions=True``)."""
        return self._single("value_norms").value_norms

    @property
    def contribution_mass(self) -> dict[str, torch.Tensor]:
        """variant -> (L, H, N) contribution masses of the single window (``contributions=True``)."""
        return self._single("contribution_mass").contribution_mass

    def table(self, **kwargs):
        """Tidy statistics, one row per window/variant/layer/head/statistic (see WindowResult.table)."""
        import pandas as pd

        return stats.with_nan_note(pd.concat([w.table(**kwargs) for w in self.windows], ignore_index=True))

    def summary(self, **kwargs):
        """Statistics averaged over windows (``attnlab.stats.aggregate_windows``): columns variant,
        layer, head, statistic, value (mean), std, n_windows."""

        return stats.with_nan_note(stats.aggregate_windows(w.table(**kwargs) for w in self.windows))


def _text_tokens(w: WindowResult, windowing: Windowing, attr: str = "tokens") -> list:
    """The part of a window's tokens not already covered by the previous window (no specials)."""
    values = getattr(w.window, attr)
    text_values = [v for v, s in zip(values, w.window.special, strict=True) if not s]
    skip = 0
    if w.index > 0:
        prev_stop = windowing.starts[w.index - 1] + windowing.content
        skip = max(0, prev_stop - w.window.start)
    return text_values[skip:]


def hnas_u_from_checkpoint(directory: str | os.PathLike) -> torch.Tensor:
    """u = sigmoid(theta) per layer and head, (L, H), of a trained attnlab checkpoint (a run or step
    directory written by ``attnlab train``), for ``analyze(..., u=...)`` on a model with the same L, H.

    Raises ValueError if the checkpoint cannot be read, learned no u (no HNAS layer: a UNAS or DNAS
    checkpoint would silently give u = 0 or 1) or has layers that are not UNAS/DNAS mixtures
    (Sinkhorn with iters > 1).
    """
    from attnlab import models

    try:
        model = models.load(directory)
        u = model.hybrid_weights()  # (L, H)
    except (OSError, KeyError, RuntimeError) as e:
        raise ValueError(f"cannot read HNAS weights from checkpoint {directory}: {e}") from None
    if all(block.attn.hybrid_weight() is None for block in model.blocks):
        raise ValueError(f"checkpoint {directory} must have learned HNAS weights u (a layer with variant "
                         f"'hnas'), got layer variants {model.config.layer_variants()}: it has no u to use")
    if not bool(torch.isfinite(u).all()):
        raise ValueError(f"checkpoint {directory} has layers without a hybrid weight (Sinkhorn, iters > 1)")
    return u


def _u_for_stats(u):
    return float(u) if not isinstance(u, torch.Tensor) or u.numel() == 1 else u
