"""Analysing a text with every attention variant on a real model: results, windows, streaming.

Data flow (docs/DESIGN.md §5): text -> tokens -> windows -> model forward (capturing q, k per layer) ->
weights per variant (:mod:`attnlab.hf.weights`, recompute or swap mode) -> statistics
(``attnlab.stats``).

Shapes: ``weights[variant]`` is (L, H, N, N) per window (layers, heads, queries, keys). The weights of
one (padded) batch come from :func:`attnlab.hf.weights.batch_weights`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice

import torch

from attnlab import stats
from attnlab.hf import contribution_view
from attnlab.hf.interface import DEFAULT_U
from attnlab.hf.loading import LoadedModel, ModelInfo, model_on
from attnlab.hf.native import NativeModel, learned_u, native_weights
from attnlab.hf.weights import check_arguments, window_weights_and_sums
from attnlab.hf.windows import (
    MAX_DEFAULT_WINDOW,
    TokenizedText,
    Window,
    Windowing,
    iter_windows,
    plan_windows,
    special_affixes,
    tokenize_text,
)
from attnlab.normalizers import DEFAULT_VARIANTS, check_params

__all__ = [
    "hnas_u_from_checkpoint",
    "WindowResult",
    "AnalysisResult",
    "AnalysisStream",
    "analyze",
    "stream_analysis",
]

# ----------------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------------


@dataclass
class WindowResult:
    """Weights of every variant for one window of the text."""

    window: Window  # tokens, word ids, special/punctuation flags, character spans
    weights: dict[str, torch.Tensor]  # variant -> (L, H, N, N); rows sum to 1
    u: float | torch.Tensor = DEFAULT_U  # HNAS weight used (for the u/N bound)
    # variant -> {map: (L, H, N, N)}: the parts of a GAM checkpoint's weights (attnlab.hf.native):
    # "phi" (content brains mixed, Eq. 14), "theta" (relative-position branch, Eq. 22), "brain_<b>",
    # "position_brain_<b>" (each brain normalized); NaN in layers without that map. Empty otherwise.
    components: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    # Row sums for the statistics, computed together with the weights (attnlab.hf.weights): (sums,
    # special-key masks they cover, the weights' (id, version) when computed). Used by ``table``
    # while the weights are those very tensors, unchanged.
    _sums: tuple | None = field(default=None, repr=False, compare=False)
    # variant -> value norms and Gram matrices (attnlab.hf.values.ValueSummary), with contributions=True
    values: dict | None = field(default=None, repr=False, compare=False)

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

    def table(self, *, include_punctuation: bool = True, **kwargs):
        """Tidy statistics of this window (``attnlab.stats.tidy_table``) with a ``window`` column.

        ``special_mass`` counts special tokens and, with ``include_punctuation``, punctuation tokens
        (docs/DESIGN.md §4). Other keyword arguments (eps, eps_relative, reference) go to ``tidy_table``.
        """
        from attnlab import stats

        special = self.special | self.punctuation if include_punctuation else self.special
        kwargs.setdefault("u", _u_for_stats(self.u))
        cached = None
        if set(kwargs) <= {"u", "eps", "eps_relative", "reference"}:
            cached = self._cached_sums(special, kwargs.get("reference", "unas"))
        if cached is not None:
            sums, index = cached
            return contribution_view.with_contributions(self, kwargs, stats.table_from_row_sums(
                sums, special_index=index, u=kwargs["u"], eps=kwargs.get("eps", 0.01),
                eps_relative=kwargs.get("eps_relative", 0.1), reference=kwargs.get("reference", "unas"),
                window=self.index,
            ))
        return contribution_view.with_contributions(
            self, kwargs, stats.tidy_table(self.weights, special=special, window=self.index, **kwargs))

    def _cached_sums(self, special: torch.Tensor, reference):
        """(row sums, index of ``special`` among their key masks) when they describe the current
        weights and the requested statistics; None otherwise (tidy_table recomputes)."""
        if self._sums is None or reference != "unas":
            return None
        sums, masks, fingerprint = self._sums
        if list(sums) != list(self.weights) or fingerprint != _fingerprint(self.weights):
            return None
        for i, m in enumerate(masks):
            if torch.equal(m, special):
                return sums, i
        return None


def _fingerprint(weights: dict[str, torch.Tensor]) -> tuple:
    """Which weight tensors (and versions) the row sums were computed with: a weight changed in place
    or replaced makes ``table`` recompute from the weights (tests/test_hf.py)."""
    return tuple((name, id(w), w._version, tuple(w.shape), w.dtype) for name, w in weights.items())


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

        return pd.concat([w.table(**kwargs) for w in self.windows], ignore_index=True)

    def summary(self, **kwargs):
        """Statistics averaged over windows (``attnlab.stats.aggregate_windows``): columns variant,
        layer, head, statistic, value (mean), std, n_windows."""
        from attnlab import stats

        return stats.aggregate_windows(w.table(**kwargs) for w in self.windows)


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

    Raises ValueError if the checkpoint cannot be read or has layers that are not UNAS/DNAS mixtures
    (Sinkhorn with iters > 1).
    """
    from attnlab import models

    try:
        u = models.load(directory).hybrid_weights()  # (L, H)
    except (OSError, KeyError, RuntimeError) as e:
        raise ValueError(f"cannot read HNAS weights from checkpoint {directory}: {e}") from None
    if not bool(torch.isfinite(u).all()):
        raise ValueError(f"checkpoint {directory} has layers without a hybrid weight (Sinkhorn, iters > 1)")
    return u


def _u_for_stats(u):
    return float(u) if not isinstance(u, torch.Tensor) or u.numel() == 1 else u


# ----------------------------------------------------------------------------------------------
# Texts: windows streamed one at a time
# ----------------------------------------------------------------------------------------------


@dataclass
class AnalysisStream:
    """A planned analysis: ``windowing`` is known up front, iterating yields one
    :class:`WindowResult` per window, computed on demand (memory stays bounded for long texts)."""

    loaded: LoadedModel
    text: str
    variants: tuple[str, ...]
    mode: str
    params: dict  # the variant parameters given (checked; the specs' defaults fill the rest)
    windowing: Windowing
    tokenized: TokenizedText  # the whole text's tokens (compact arrays)
    text_sha256: str
    notes: list[str]
    contributions: bool = False  # also record value vectors (WindowResult.values)

    @property
    def u(self) -> float | torch.Tensor:
        """HNAS's hybrid weight in use (for the u/N bound)."""
        return self.params.get("u", DEFAULT_U)

    @property
    def iters(self) -> int:
        """Sinkhorn's rounds in use (causal models: 1 unless given)."""
        causal = self.model.causal
        return check_params("sinkhorn", {"iters": self.params.get("iters")}, causal=causal)["iters"]

    @property
    def model(self) -> ModelInfo:
        return self.loaded.info

    @property
    def device(self) -> torch.device:
        """Where the model runs; the windows' weights come back on the CPU."""
        return self.loaded.device

    def __len__(self) -> int:
        return self.windowing.n_windows

    def __iter__(self) -> Iterator[WindowResult]:
        for window in iter_windows(self.loaded.tokenizer, self.text, self.tokenized, self.windowing):
            yield self._result(window)

    def window(self, index: int) -> WindowResult:
        """The result of window ``index`` alone (the windows before it are not computed)."""
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self):
            raise ValueError(f"index must be an integer in [0, {len(self) - 1}], got {index!r}")
        windows = iter_windows(self.loaded.tokenizer, self.text, self.tokenized, self.windowing)
        return self._result(next(islice(windows, index, None)))

    def _result(self, window: Window) -> WindowResult:
        ids = torch.tensor([window.input_ids])  # (1, N)
        if isinstance(self.loaded, NativeModel):  # attnlab's own checkpoint: its own capture
            weights, parts = native_weights(self.loaded, ids, None, self.variants, self.mode, self.params)
            components = {v: {n: t[:, 0] for n, t in p.items()} for v, p in parts.items() if p}
            return WindowResult(window=window, weights={v: w[:, 0] for v, w in weights.items()}, u=self.u,
                                components=components)
        special = torch.from_numpy(window.special)
        masks = [special | torch.from_numpy(window.punctuation), special]  # table()'s two choices
        with contribution_view.recording(self) as record:
            weights, sums = window_weights_and_sums(
                self.loaded, ids, self.variants, self.mode, self.params, masks
            )
        weights = {v: w[:, 0] for v, w in weights.items()}
        cache = None
        if sums is not None:  # the statistics layer's public result type, one per variant
            shape = tuple(next(iter(weights.values())).shape)  # (L, H, N, N)
            sums = {v: stats.RowSums.from_dict(raw, shape) for v, raw in sums.items()}
            cache = (sums, masks, _fingerprint(weights))
        return WindowResult(window=window, weights=weights, u=self.u, _sums=cache, values=record.values())

    def collect(self, progress: bool = False) -> AnalysisResult:
        """Run every window and keep the results."""
        windows = list(_progress(self, progress))
        return AnalysisResult(
            model=self.model,
            variants=self.variants,
            mode=self.mode,
            u=self.u,
            iters=self.iters,
            windowing=self.windowing,
            windows=windows,
            text_sha256=self.text_sha256,
            notes=list(self.notes),
            device=str(self.device),
        )


def _progress(stream: AnalysisStream, enabled: bool):
    if not enabled:
        return iter(stream)
    from tqdm.auto import tqdm

    return tqdm(stream, total=len(stream), unit="window", desc="analysing", leave=False)


def stream_analysis(
    text: str,
    model: LoadedModel | str | os.PathLike | None = None,
    variants: Sequence[str] = DEFAULT_VARIANTS,
    mode: str = "recompute",
    u: float | torch.Tensor | None = None,
    iters: int | None = None,
    *,
    window: int | None = None,
    overlap: int | None = None,
    device=None,
    contributions: bool = False,
    **params,
) -> AnalysisStream:
    """Plan the analysis of ``text`` (tokenize, cut into windows) without running the model yet.

    See :func:`analyze` for the arguments; iterate the result to get the windows one by one.
    """
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    if not text.strip():
        raise ValueError("text is empty (or only whitespace); there is nothing to analyse")
    loaded = model_on(model, device)
    info = loaded.info
    variants, given = check_arguments(variants, mode, {"u": u, "iters": iters, **params}, info)
    notes = []
    if "u" not in given and isinstance(loaded, NativeModel):  # a native HNAS checkpoint's learned u
        learned = learned_u(loaded)
        if learned is not None:
            given = {**given, "u": learned}
            notes.append(f"hnas uses the u per layer and head learned by {info.name}")
    if info.causal and "sinkhorn" in variants and "iters" not in given:
        notes.append(
            f"{info.name} is causal: sinkhorn uses iters=1 (= causal DNAS), since causal Sinkhorn with "
            "more iterations degenerates toward the identity"
        )
    if window is None:
        window = min(info.max_length, MAX_DEFAULT_WINDOW)
    elif isinstance(window, bool) or not isinstance(window, int) or not 0 < window <= info.max_length:
        raise ValueError(
            f"window must be an integer in [1, {info.max_length}] for {info.name}, got {window!r}"
        )
    prefix, suffix = special_affixes(loaded.tokenizer)
    tokenized = tokenize_text(loaded.tokenizer, text)
    if len(tokenized) == 0:
        raise ValueError("the text produced no tokens for this tokenizer; there is nothing to analyse")
    windowing = plan_windows(len(tokenized), window, len(prefix) + len(suffix), overlap)
    return AnalysisStream(
        loaded=loaded,
        text=text,
        variants=variants,
        mode=mode,
        params=given,
        windowing=windowing,
        tokenized=tokenized,
        text_sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
        notes=notes,
        contributions=contribution_view.check_flag(contributions, loaded),
    )


def analyze(
    text: str,
    model: LoadedModel | str | os.PathLike | None = None,
    variants: Sequence[str] = DEFAULT_VARIANTS,
    mode: str = "recompute",
    u: float | torch.Tensor | None = None,
    iters: int | None = None,
    *,
    window: int | None = None,
    overlap: int | None = None,
    progress: bool = False,
    device=None,
    contributions: bool = False,
    **params,
) -> AnalysisResult:
    """Attention weights of every variant on a real model, for every layer and head.

    Args:
        text: the text to analyse (non-empty).
        model: None (the embedded MiniLM), a local model directory (``save_pretrained``, or a native
            attnlab checkpoint: a run or step directory of ``attnlab train``, e.g.
            ``checkpoints/enc-hnas``), or a :class:`LoadedModel`.
        variants: any of ``attnlab.VARIANTS`` (default: ``attnlab.DEFAULT_VARIANTS``, the paper's four).
        mode: "recompute" (variants computed from the model's own q and k) or "swap" (the variant
            replaces the model's attention; later layers change too).
        u: HNAS hybrid weight in [0, 1], float or tensor broadcastable to (L, H); default: the u per
            layer and head a native HNAS checkpoint learned (with a note), else 0.5.
        iters: Sinkhorn rounds (default 3; a causal model uses 1 unless given, with a note in
            ``.notes``, and refuses iters > 1).
        **params: any other registered variant parameter (e.g. ``tol`` for Sinkhorn).
        window: tokens per window, special tokens included; default min(model max length, 512).
        overlap: text tokens shared by consecutive windows; default a quarter of a window.
        progress: show a tqdm bar over windows.
        device: where the model runs: None (the loaded model's device; the CPU when ``model`` is None
            or a directory), ``"cpu"``, ``"cuda"``, ``"cuda:<index>"``, a ``torch.device`` or
            ``"auto"`` (CUDA when available). A model on another device is loaded there once (cached).
            ValueError naming ``device`` when CUDA is asked for but unavailable. Weights and
            statistics come back on the CPU either way; ``.device`` says where the model ran.
        contributions: also record each layer's value vectors (``attnlab.hf.values``): the windows get
            ``value_norms``, ``contribution_mass`` and contribution statistics in ``table()``.

    Returns:
        :class:`AnalysisResult`; ``.weights[variant]`` is (L, H, N, N) for a single-window text; for
        a GAM checkpoint ``.components[variant]`` holds its maps Phi, Theta and each brain's.
    """
    stream = stream_analysis(text, model, variants, mode, u, iters, window=window, overlap=overlap,
                             device=device, contributions=contributions, **params)
    return stream.collect(progress=progress)
