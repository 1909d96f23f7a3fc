"""The analysis every text page shares: cached per-window weights of the chosen variants.

The controls (text, model, variants, window) are in ``appkit.controls``; their old names here still
resolve (module ``__getattr__`` below). Results are cached per input (``st.cache_resource``: no
copy of the (L, H, N, N) arrays per rerun), shared by every session, a few entries at most.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import streamlit as st
import torch

import attnlab
from appkit import state
from appkit.sources import (
    Source,
    is_native,
    load,
)
from attnlab import hf
from attnlab.hf.compute.head_maps import HeadMaps
from attnlab.hf.compute.lazy_weights import LazyWeights

_MOVED = {  # names that moved to appkit.controls with the controls
    "SAMPLE",
    "MAX_TEXT_CHARS",
    "TEXT_TYPES",
    "LOCAL_DIR",
    "UPLOAD",
    "_decode_upload",
    "text_input",
    "model_input",
    "settings_input",
    "window_view",
    "inputs",
    "_session_folder",
}


def __getattr__(name: str):
    if name in _MOVED:
        from appkit import controls

        return getattr(controls, name)
    raise AttributeError(f"module 'appkit.analysis' has no attribute {name!r}")


@dataclass(frozen=True)
class Settings:
    """Everything that decides the weights, besides the text."""

    source: Source
    variants: tuple[str, ...] = attnlab.VARIANTS
    mode: str = "recompute"
    u: float = 0.5
    iters: int = 3
    extra: tuple = ()  # (name, value) of every other registered variant parameter (e.g. tol), sorted


# ----------------------------------------------------------------------------------------------
# Cached analysis
# ----------------------------------------------------------------------------------------------


@dataclass
class WindowView:
    """Weights of every chosen variant for one window of the text, plus what produced them."""

    settings: Settings
    info: hf.ModelInfo
    tokens: list[str]
    input_ids: list[int]  # (N,) model input of this window, special tokens included
    special: np.ndarray  # (N,) bool
    weights: Mapping[str, np.ndarray]  # variant -> (L, H, N, N) float32, computed when first read
    u: float | np.ndarray  # HNAS weight used: float, or (L, H) learned by a native checkpoint
    iters: int  # Sinkhorn iterations used
    window: int
    windowing: dict
    text_sha256: str
    characters: int
    notes: list[str] = field(default_factory=list)
    # variant -> {map: (L, H, N, N)}: a GAM checkpoint's phi, theta and brains (hf WindowResult.components)
    components: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    _nan: list = field(default_factory=list, init=False, repr=False, compare=False)  # [note], once known
    # a streamed window's statistics (eps_relative -> tidy table) without its weights (None: from them)
    streamed_table: object = field(default=None, repr=False, compare=False)
    # a long context's {variant: (L, H, N)} column masses, taken by the capture forward as its layers
    # ran (None: not taken; readers compute them)
    column_masses: Mapping | None = field(default=None, repr=False, compare=False)
    # (L, N) queries that may attend each key, from the layers' masks of the capture forward (a causal
    # model's streamed window; None: not known)
    key_counts: torch.Tensor | None = field(default=None, repr=False, compare=False)
    # an encoder-decoder's kind shown ("encoder", "decoder", "cross"; appkit/seq2seq.py), else None;
    # cross-attention's (M,) target tokens, the rows of its (L, H, M, N) weights (None: ``tokens``)
    kind: str | None = None
    query_tokens: list[str] | None = None

    @property
    def key(self) -> str:
        """Identifies the inputs of this analysis (cache keys of figures built from it)."""
        s = self.settings
        variants = ",".join(s.variants)
        extra = ",".join(f"{k}={v}" for k, v in s.extra)
        kind = f"|{self.kind}" if self.kind else ""  # an encoder-decoder's (text_sha256 covers the target)
        return (
            f"{s.source.key}|{self.text_sha256}|{variants}|{s.mode}|{s.u:g}|{s.iters}|{extra}|{self.window}"
            + kind
        )

    @property
    def n_windows(self) -> int:
        return self.windowing["n_windows"]

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.info.n_layers, self.info.n_heads, len(self.tokens)  # (no weights computed)

    def nan_note(self) -> str | None:
        """"NaN from layer l on: ..." when the attention of this window holds NaN (a model whose
        weights or hidden states hold NaN), else None; reads every variant's weights (a probe of a few
        rows: attnlab.stats.nan_notes), once per view."""
        if not self._nan:
            from attnlab import stats

            if any(isinstance(w, HeadMaps) for w in self.weights.values()):  # streamed: no map computed
                self._nan.append(_streamed_nan_note(self.weights))
            else:
                self._nan.append(stats.weights_nan_note(self.weights))
        return self._nan[0]

    def statistics_csv(self, eps_relative: float = 0.1) -> str:
        """Every statistic of ``attnlab.stats.tidy_table`` for this window, as CSV."""
        from attnlab import stats

        if self.streamed_table is not None:  # a streamed window: no weights computed
            return self.streamed_table(eps_relative).to_csv(index=False)
        u = self.u if isinstance(self.u, float) else torch.from_numpy(np.asarray(self.u))
        table = stats.tidy_table(
            {v: torch.from_numpy(w) for v, w in self.weights.items()},
            special=torch.from_numpy(np.asarray(self.special, dtype=bool)),
            u=u,
            eps_relative=eps_relative,
            window=self.window,
        )
        return table.to_csv(index=False)

    def source_manifest(self) -> dict:
        """This analysis as a manifest source (``attnlab.figures.app_views.manifest``)."""
        u = self.u if isinstance(self.u, float) else np.asarray(self.u).tolist()
        return {
            "label": self.settings.source.label,
            "model": self.info.as_dict(),
            "settings": {
                "variants": list(self.weights),
                "mode": self.settings.mode,
                "u": u,
                "iters": self.iters,
                "params": dict(self.settings.extra),
                "window": self.windowing["window"],
            },
        }


def _streamed_nan_note(weights: Mapping) -> str | None:
    """The NaN note of a streamed window (HeadMaps) from its streamed column masses (L, H, N): NaN in
    a layer's maps reaches its column masses; no map is computed."""
    from attnlab.figures._data import column_masses

    first = {}
    for v, w in weights.items():
        bad = np.isnan(column_masses(w)[0]).any(axis=(1, 2))  # (L,)
        if bad.any():
            first[v] = int(np.argmax(bad))
    if not first:
        return None
    named = ", ".join(f"{v} from layer {layer}" for v, layer in first.items())
    return f"NaN in the attention weights ({named}): the model's weights or hidden states hold NaN."


def keeps_learned_u(source: Source) -> bool:
    """True for a native HNAS checkpoint: its analysis uses the u it learned, whatever the u slider
    says (so the slider is disabled there). A model that does not load: False (the page says why)."""
    if source.path is None or not (source.kind == "native" or is_native(source.path)):
        return False
    try:
        model = load(source)
    except (ValueError, OSError):
        return False
    return isinstance(model, hf.NativeModel) and hf.load.native.learned_u(model) is not None


@st.cache_resource(max_entries=4, ttl=1800, show_spinner=False)
def _plan(
    kind: str,
    path: str | None,
    text: str,
    variants: tuple,
    mode: str,
    u: float,
    iters: int,
    extra: tuple = (),
):
    """The planned analysis (``hf.stream_analysis``) of any model: Hugging Face or native checkpoint.
    A native HNAS checkpoint keeps the u it learned (the slider's u applies to other models)."""
    model = load(Source(kind, path, ""))
    u, iters = _given(model, u, iters)
    # statistics=False: the pages take their statistics from the weights they read, and a variant's
    # weights are computed when first read (Inspect, showing one variant, computes one)
    # the library's windowing: a causal model's whole text up to its maximum positions (Inspect draws
    # a window longer than LONG_CONTEXT tokens downsampled: appkit/long_context.py)
    plan = hf.stream_analysis(text, model, variants, mode, u, iters, statistics=False, **dict(extra))
    limit = max_text_tokens()
    if plan.windowing.n_tokens > limit:  # bounded work per session: one text, at most this many tokens
        raise ValueError(f"the text has {plan.windowing.n_tokens:,} tokens for this model; the app analyses "
                         f"up to {limit:,} per text (ATTNLAB_APP_MAX_TOKENS; use `attnlab analyze FILE.txt` "
                         "for longer texts)")
    return plan


def _given(model, u: float, iters: int) -> tuple:
    """(u, iters) as the analysis takes them: None where the model decides (a native HNAS checkpoint's
    learned u; a causal model's one Sinkhorn round while the slider is at its default)."""
    if isinstance(model, hf.NativeModel) and hf.load.native.learned_u(model) is not None:
        u = None
    if model.info.causal and iters == attnlab.variant_spec("sinkhorn").param("iters").default:
        iters = None  # the slider left at its default: the causal rule's 1 (more rounds are refused)
    return u, iters


def _streamed_table(s: Settings, text: str, window: int, result=None):
    """eps_relative -> the window's tidy statistics of a long context's CSV: from the row sums its
    capture forward took (``result``, a WindowResult of a ``statistics=True`` plan: no weights held, no
    second forward), else by a second capture forward that takes them as it runs."""

    def table(eps_relative: float):
        if result is not None:
            return result.table(eps_relative=eps_relative)
        model = load(s.source)
        u, iters = _given(model, s.u, s.iters)
        plan = hf.stream_analysis(text, model, s.variants, s.mode, u, iters, **dict(s.extra))
        return plan.window(window).table(eps_relative=eps_relative)

    return table


# Beyond this many tokens a window is a long context: Inspect draws one head's map downsampled with
# a zoom, the head view and the token strip around the focus (appkit/long_context.py).
LONG_CONTEXT = 512


def max_text_tokens() -> int:
    """Tokens the app analyses per text: ``ATTNLAB_APP_MAX_TOKENS`` (default 200,000)."""
    try:
        return max(1, int(os.environ.get("ATTNLAB_APP_MAX_TOKENS", "200000")))
    except ValueError:
        return 200_000


@st.cache_resource(max_entries=3, ttl=1800, show_spinner=False)
def _window(
    kind: str,
    path: str | None,
    label: str,
    text: str,
    variants: tuple,
    mode: str,
    u: float,
    iters: int,
    window: int,
    extra: tuple = (),
) -> WindowView:
    s = Settings(Source(kind, path, label), variants, mode, u, iters, extra)
    model = load(s.source)
    plan = _plan(kind, path, text, variants, mode, u, iters, extra)
    sums = _sums_come_free(plan, window)
    if sums:  # the capture forward's kernel takes every variant's row sums anyway: keep them
        plan = dataclasses.replace(plan, statistics=True)
    result = plan.window(window)
    used = plan.u if isinstance(plan.u, float) else plan.u.numpy()
    long = len(result.tokens) > LONG_CONTEXT  # a long context's streamed weights stay per head on access
    streamed = long and any(isinstance(w, HeadMaps) for w in dict.values(result.weights))
    behind = result.streamed_window()  # its layers' masks: the sink views' counts, no second forward
    counts = behind.counts() if model.info.causal and behind is not None else None
    # the capture forward's row sums (the streamed window holds the same: no second pass over the tiles)
    masses = result.column_masses() if sums and streamed else None
    return WindowView(
        s,
        model.info,
        tokens=result.tokens,
        input_ids=list(result.window.input_ids),
        special=result.window.special,
        u=used,
        iters=plan.iters,
        window=window,
        weights=_numpy_weights(result.weights, long),  # (L, H, N, N)
        components={v: {n: t.numpy() for n, t in maps.items()} for v, maps in result.components.items()},
        windowing=plan.windowing.as_dict(),
        text_sha256=plan.text_sha256,
        characters=len(text),
        notes=list(plan.notes),
        streamed_table=_streamed_table(s, text, window, result if masses is not None else None)
        if streamed else None,
        column_masses=masses,
        key_counts=counts,
    )


def _sums_come_free(plan, index: int) -> bool:
    """Whether window ``index`` is a causal model's long context whose capture forward runs attnlab's
    causal kernel for every chosen variant (recompute mode, CPU): the kernel sums their rows as the
    layers run, kept or not (attnlab/hf/compute/causal_forward.py), so keeping them
    (``statistics=True``) costs two key masks more. Other variants (sparsemax, plugins) would stream
    their sums after the forward."""
    from attnlab.hf.compute import causal_kernel

    w, loaded = plan.windowing, plan.loaded
    n = min(w.content, w.n_tokens - w.starts[index]) + (w.window - w.content)  # special tokens included
    if (not plan.model.causal or plan.mode != "recompute" or isinstance(loaded, hf.NativeModel)
            or loaded.device.type != "cpu" or n <= LONG_CONTEXT):
        return False
    slots = causal_kernel.kernel_slots(plan.variants, {}, True)
    return causal_kernel.causal_kernel() is not None and set(slots) == set(plan.variants)


class _NumpyWeights(Mapping):
    """{variant: (L, H, N, N) numpy} over lazy analysis weights (hf.compute.lazy_weights): a variant is
    computed when first read, so a page that shows one variant computes that one (at 512 tokens each
    is ~75 MB and ~0.2 s); ``values()`` / ``items()`` compute every variant."""

    def __init__(self, weights: LazyWeights):
        self._weights = weights

    def __getitem__(self, name: str) -> np.ndarray:
        return self._weights[name].numpy()  # (a view, no copy)

    def __iter__(self):
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)


def _numpy_weights(weights, long: bool = False) -> Mapping:
    if isinstance(weights, LazyWeights):
        return _NumpyWeights(weights)
    # a long context's HeadMaps (a streamed window) stay as they are: a head computed when read
    # (w.head(layer, head)), the whole (L, H, N, N) only where a page asks for it (np.asarray); a
    # shorter window's are numpy, as every page reads them
    return {v: w if long and isinstance(w, HeadMaps) else w.numpy() for v, w in weights.items()}


def _fail(e: Exception) -> None:
    st.error(str(e).strip() or e.__class__.__name__)
    st.stop()


def n_windows(s: Settings, text: str) -> int:
    """How many windows the text spans for this model (loads the model, tokenizes once)."""
    try:
        plan = _plan(s.source.kind, s.source.path, text, s.variants, s.mode, s.u, s.iters, s.extra)
    except (ValueError, OSError) as e:  # ModelLoadError is a ValueError
        _fail(e)
    return plan.windowing.n_windows


def view_for(source: Source, like: Settings, text: str, window: int = 0) -> WindowView:
    """Another model's analysis of the same text with the same settings (Compare page); an
    encoder-decoder's with the target and kind chosen (appkit/seq2seq.py)."""
    s = Settings(source, like.variants, like.mode, like.u, like.iters, like.extra)
    from appkit import seq2seq

    if seq2seq.is_encoder_decoder(source):
        values = state.shared()
        return seq2seq.kind_view(s, text, values.get(seq2seq.TARGET, "").strip() or None,
                                 values.get("kind", "cross"))
    count = n_windows(s, text)
    try:
        return _window(
            source.kind,
            source.path,
            source.label,
            text,
            s.variants,
            s.mode,
            s.u,
            s.iters,
            min(window, count - 1),
            s.extra,
        )
    except (ValueError, OSError) as e:
        _fail(e)
