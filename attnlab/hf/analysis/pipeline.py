"""Analysing a text with every attention variant on a real model: planning, windows, streaming
(the results themselves: attnlab/hf/analysis/results.py).

Data flow (docs/DESIGN.md §5): text -> tokens -> windows -> model forward (capturing q, k per layer) ->
weights per variant (:mod:`attnlab.hf.compute.weights`, recompute or swap mode) -> statistics
(``attnlab.stats``).

Shapes: ``weights[variant]`` is (L, H, N, N) per window (layers, heads, queries, keys). The weights of
one (padded) batch come from :func:`attnlab.hf.compute.weights.batch_weights`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice

import torch

from attnlab import stats
from attnlab.hf.analysis import contribution_view
from attnlab.hf.analysis.results import (  # noqa: F401  (re-exported: their old home)
    AnalysisResult,
    WindowResult,
    _fingerprint,
    _u_for_stats,
    hnas_u_from_checkpoint,
)
from attnlab.hf.capture.interface import DEFAULT_U
from attnlab.hf.capture.windows import (
    MAX_DEFAULT_WINDOW,
    TokenizedText,
    Window,
    Windowing,
    check_token_ids,
    iter_windows,
    plan_windows,
    special_affixes,
    tokenize_text,
)
from attnlab.hf.compute.lazy_weights import batch_item
from attnlab.hf.compute.weights import check_arguments, window_weights_and_sums
from attnlab.hf.load.loading import LoadedModel, ModelInfo, model_on
from attnlab.hf.load.native import NativeModel, learned_u, native_weights
from attnlab.normalizers import DEFAULT_VARIANTS, check_params, variant_spec
from attnlab.normalizers.checks import scalar

__all__ = [
    "hnas_u_from_checkpoint",
    "WindowResult",
    "AnalysisResult",
    "AnalysisStream",
    "analyze",
    "stream_analysis",
]


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
    statistics: bool = True  # row sums for WindowResult.table() in the analysis pass (False: later)

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
        index = scalar(index)  # numpy and 0-d tensor numbers as Python ones
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
                                components=components, causal=self.model.causal)
        special = torch.from_numpy(window.special)
        masks = [special | torch.from_numpy(window.punctuation), special]  # table()'s two choices
        with contribution_view.recording(self) as record:
            weights, sums = window_weights_and_sums(
                self.loaded, ids, self.variants, self.mode, self.params, masks if self.statistics else None
            )
        weights = batch_item(weights, 0)  # (L, H, N, N) each; computed on first access when lazy
        cache = None
        if sums is not None:  # the statistics layer's public result type, one per variant
            N = ids.shape[1]
            shape = (self.model.n_layers, self.model.n_heads, N, N)  # (L, H, N, N): no weight computed
            sums = {v: stats.RowSums.from_dict(raw, shape) for v, raw in sums.items()}
            cache = (sums, masks, _fingerprint(weights))
        return WindowResult(window=window, weights=weights, u=self.u, _sums=cache, values=record.values(),
                            causal=self.model.causal)

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


def _causal_notes(model_name: str, variants: Sequence[str], given: dict) -> list[str]:
    """One note per variant whose causal rule (its spec's ``causal_rule``) changes its parameters
    on this causal model, e.g. sinkhorn's iters 3 -> 1; the rule's docstring says why."""
    notes = []
    for name in variants:
        rule = variant_spec(name).causal_rule
        if rule is None:
            continue
        free, causal = check_params(name, given), check_params(name, given, causal=True)
        changed = [f"{k}={causal[k]!r}" for k in causal if not _same(causal[k], free.get(k))]
        if changed:
            why = " ".join((rule.__doc__ or "").split())
            note = f"{model_name} is causal: {name} uses {', '.join(changed)}"
            notes.append(f"{note} ({why})" if why else note)
    return notes


def _check_swap_size(info: ModelInfo, variants, windowing) -> None:
    """Swap mode returns every variant's whole (L, H, N, N) weights of a window (the swapped forward
    computes them; nothing streams): refused before any forward beyond the limit a streamed window's
    weights materialize up to (``head_maps.MATERIALIZE_LIMIT``), instead of running out of memory."""
    from attnlab.hf.compute import head_maps

    n = min(windowing.content, windowing.n_tokens) + windowing.window - windowing.content  # longest window
    need = 4 * len(variants) * info.n_layers * info.n_heads * n * n
    if need > head_maps.MATERIALIZE_LIMIT:
        raise ValueError(
            f"mode='swap' keeps every variant's whole weights of a window: {len(variants)} x (L, H, N, N) = "
            f"({info.n_layers}, {info.n_heads}, {n:,}, {n:,}) float32, {head_maps.size_text(need)}, over the "
            f"{head_maps.size_text(head_maps.MATERIALIZE_LIMIT)} limit (ATTNLAB_MATERIALIZE_LIMIT_MB); use "
            "mode='recompute' (the model's own q and k, streamed in bounded memory), fewer variants or a "
            "smaller window")


def _windowing_note(info: ModelInfo, windowing: Windowing, given: int | None) -> str:
    """Which windowing a causal model's analysis uses, in words (the CLI prints it, the app shows it)."""
    n = windowing.n_tokens
    if windowing.n_windows == 1:
        how = "the window given" if given is not None else "the whole context, as the model reads it"
        return f"{info.name} is causal: the text's {n:,} tokens are analysed in one window ({how})"
    why = (f"the window given ({windowing.window:,} tokens)" if given is not None
           else f"longer than the model's {info.max_length:,} positions")
    return (f"{info.name} is causal: the text's {n:,} tokens are analysed in {windowing.n_windows} windows "
            f"of {windowing.window:,} tokens overlapping by {windowing.overlap:,} ({why}); attention at a "
            "position sees only its own window's earlier tokens")


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


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
    statistics: bool = True,
    **params,
) -> AnalysisStream:
    """Plan the analysis of ``text`` (tokenize, cut into windows) without running the model yet.

    See :func:`analyze` for the arguments; iterate the result to get the windows one by one.
    ``statistics=False``: the analysis pass takes no row sums for ``WindowResult.table()`` (which then
    computes them from the weights, with the same values): for callers that read weights only (the
    app's views), the weights of each variant then cost only when read (CPU, recompute mode).
    """
    if not isinstance(statistics, bool):
        raise ValueError(f"statistics must be True or False, got {statistics!r}")
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    if not text.strip():
        raise ValueError("text is empty (or only whitespace); there is nothing to analyse")
    loaded = model_on(model, device)
    info = loaded.info
    if info.encoder_decoder:  # three kinds of attention over two texts: analyze(text, model, target=...)
        raise ValueError(f"model {info.name} is an encoder-decoder ({info.model_type}): expected "
                         "hf.analyze(text, model, target=...) (source and target texts, three kinds of "
                         "attention), got stream_analysis, which analyses one text in windows")
    variants, given = check_arguments(variants, mode, {"u": u, "iters": iters, **params}, info)
    notes = list(loaded.notes)  # what loading adjusted (e.g. the tokenizer class it loaded)
    if "u" not in given and isinstance(loaded, NativeModel):  # a native HNAS checkpoint's learned u
        learned = learned_u(loaded)
        if learned is not None:
            given = {**given, "u": learned}
            notes.append(f"hnas uses the u per layer and head learned by {info.name}")
    if info.causal:
        notes += _causal_notes(info.name, variants, given)
    window = given_window = scalar(window)  # numpy and 0-d tensor numbers as Python ones
    overlap = scalar(overlap)
    if window is None:  # causal: the whole context (attention at i depends on every token before it)
        window = info.max_length if info.causal else min(info.max_length, MAX_DEFAULT_WINDOW)
    elif isinstance(window, bool) or not isinstance(window, int) or not 0 < window <= info.max_length:
        raise ValueError(
            f"window must be an integer in [1, {info.max_length}] for {info.name}, got {window!r}"
        )
    prefix, suffix = special_affixes(loaded.tokenizer)
    tokenized = tokenize_text(loaded.tokenizer, text)
    if len(tokenized) == 0:
        raise ValueError("the text produced no tokens for this tokenizer; there is nothing to analyse")
    check_token_ids(tokenized, prefix + suffix, loaded.model.get_input_embeddings().num_embeddings,
                    loaded.tokenizer)  # ids the embedding has no row for: a worded error, not IndexError
    windowing = plan_windows(len(tokenized), window, len(prefix) + len(suffix), overlap)
    if mode == "swap":
        _check_swap_size(info, variants, windowing)
    if info.causal:
        notes.append(_windowing_note(info, windowing, given_window))
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
        statistics=statistics,
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
    target: str | None = None,
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
        window: tokens per window, special tokens included; default: a causal model's whole context
            (its maximum positions: windows only beyond that, with a note), otherwise min(model max
            length, 512).
        overlap: text tokens shared by consecutive windows; default a quarter of a window.
        progress: show a tqdm bar over windows.
        device: where the model runs: None (the loaded model's device; the CPU when ``model`` is None
            or a directory), ``"cpu"``, ``"cuda"``, ``"cuda:<index>"``, a ``torch.device`` or
            ``"auto"`` (CUDA when available). A model on another device is loaded there once (cached).
            ValueError naming ``device`` when CUDA is asked for but unavailable. Weights and
            statistics come back on the CPU either way; ``.device`` says where the model ran.
        contributions: also record each layer's value vectors (``attnlab.hf.capture.values``): the windows get
            ``value_norms``, ``contribution_mass`` and contribution statistics in ``table()``.
        target: an encoder-decoder's (T5, BART, mBART, Pegasus, Marian) target text, which the decoder
            reads after its start token while ``text`` is the encoder's source; None: the start token
            alone. ValueError naming ``target`` for any other model (attnlab/hf/analysis/seq2seq.py).

    Returns:
        :class:`AnalysisResult`; ``.weights[variant]`` is (L, H, N, N) for a single-window text; for
        a GAM checkpoint ``.components[variant]`` holds its maps Phi, Theta and each brain's. An
        encoder-decoder gives a :class:`~attnlab.hf.analysis.seq2seq_result.Seq2SeqResult`:
        ``.weights[kind][variant]`` for the kinds encoder, decoder and cross, ``.table()`` with a
        ``kind`` column, ``.view(kind)`` one kind as an AnalysisResult.
    """
    loaded = model_on(model, device)
    if loaded.info.encoder_decoder or target is not None:
        from attnlab.hf.analysis.seq2seq import analyze_seq2seq, check_target

        check_target(target, loaded.info)  # a target for another kind of model: named
        unused = {"window": window, "overlap": overlap, "contributions": contributions or None}
        for name, value in unused.items():
            if value is not None:
                raise ValueError(f"{name}: an encoder-decoder's source and target are analysed whole, each "
                                 f"in one window, without contributions; expected the default, got {value!r}")
        return analyze_seq2seq(text, loaded, target, variants, mode, u, iters, **params)
    stream = stream_analysis(text, loaded, variants, mode, u, iters, window=window, overlap=overlap,
                             contributions=contributions, **params)
    return stream.collect(progress=progress)
