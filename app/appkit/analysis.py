"""The analysis every text page shares: text and model controls, cached per-window weights.

Controls keep their values across pages: each page renders its own widgets (keys prefixed with the
page name), seeded from and saved to ``st.session_state["attnlab_shared"]``.
Results are cached per input (``st.cache_resource``: no copy of the (L, H, N, N) arrays per rerun),
shared by every session, a few entries at most.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import streamlit as st
import torch

import attnlab
from appkit.sources import (
    EMBEDDED,
    UPLOAD_LIMIT_MB,
    SessionFolder,
    Source,
    checkpoint_sources,
    load,
    save_upload,
)
from attnlab import hf

SAMPLE = (
    "The cat sat on the mat because it was warm, and the dog watched it from the door. "
    "Attention lets every word look at every other word; a word that no one looks at is explained away."
)
MAX_TEXT_CHARS = 1_000_000  # ~250k tokens; longer texts belong to `attnlab analyze`
TEXT_UPLOAD_MB = 5
TEXT_TYPES = ("txt", "md")
LOCAL_DIR = "Local Hugging Face directory…"
UPLOAD = "Upload a checkpoint…"
SHARED = "attnlab_shared"


def remembered(prefix: str, name: str, widget: Callable, default, *args, valid=None, **kwargs):
    """Render ``widget(*args, key=prefix_name, **kwargs)`` seeded with the value this control had on
    any page (or ``default``), and remember its new value. ``valid(value)`` drops stale values."""
    key = f"{prefix}_{name}"
    shared = st.session_state.setdefault(SHARED, {})
    if key not in st.session_state:
        value = shared.get(name, default)
        st.session_state[key] = value if valid is None or valid(value) else default
    value = widget(*args, key=key, **kwargs)
    shared[name] = value
    return value


# ----------------------------------------------------------------------------------------------
# Controls
# ----------------------------------------------------------------------------------------------


def _decode_upload(name: str, data: bytes) -> str:
    if not name.lower().endswith(tuple(f".{t}" for t in TEXT_TYPES)):
        raise ValueError(f"{name} is not a text file: upload a .txt or .md file")
    if len(data) > TEXT_UPLOAD_MB * 1_000_000:
        raise ValueError(
            f"{name} is {len(data) / 1e6:.1f} MB; the limit is {TEXT_UPLOAD_MB} MB "
            "(use `attnlab analyze FILE.txt` for long texts)"
        )
    if b"\x00" in data:
        raise ValueError(f"{name} looks binary (it contains NUL bytes); expected UTF-8 text")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{name} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})"
        ) from None


def text_input(prefix: str) -> str:
    """Text area + .txt/.md upload; shows a message and stops the page when there is no usable text."""
    text = remembered(
        prefix,
        "text",
        st.text_area,
        SAMPLE,
        "Text",
        height=130,
        max_chars=MAX_TEXT_CHARS,
        help="Paste any text; long texts are cut into overlapping windows of the model's length.",
    )
    upload = st.file_uploader(  # no type=: the app, not the browser, says what is wrong with a file
        "…or upload a text file",
        key=f"{prefix}_upload",
        max_upload_size=TEXT_UPLOAD_MB,
        help=f".txt or .md, UTF-8, up to {TEXT_UPLOAD_MB} MB",
    )
    if upload is not None:
        try:
            text = _decode_upload(upload.name, upload.getvalue())
        except ValueError as e:
            st.error(str(e))
            st.stop()
        st.caption(f"Using the uploaded file **{upload.name}** ({len(text):,} characters).")
    if len(text) > MAX_TEXT_CHARS:
        st.error(
            f"The text has {len(text):,} characters; the app takes up to {MAX_TEXT_CHARS:,} "
            "(use `attnlab analyze FILE.txt` for longer texts)."
        )
        st.stop()
    if not text.strip():
        st.info("Type or paste a text (or upload a .txt file) to see its attention.")
        st.stop()
    return text


def model_input(prefix: str, container=None) -> Source:
    """Model picker: embedded MiniLM, shipped/trained checkpoints, a local directory or an upload."""
    box = container or st.sidebar
    sources = {s.label: s for s in [EMBEDDED, *checkpoint_sources()]}
    options = [*sources, LOCAL_DIR, UPLOAD]
    with box:
        choice = remembered(
            prefix, "model", st.selectbox, options[0], "Model", options, valid=lambda v: v in options
        )
        if choice == LOCAL_DIR:
            path = remembered(
                prefix,
                "model_dir",
                st.text_input,
                "",
                "Model directory",
                placeholder="/path/to/save_pretrained/folder",
            )
            if not path.strip():
                st.info("Enter the path of a folder written by save_pretrained (or an attnlab run).")
                st.stop()
            return Source("hf", path.strip(), path.strip())
        if choice == UPLOAD:
            files = st.file_uploader(
                "Checkpoint files",
                accept_multiple_files=True,
                key=f"{prefix}_ckpt",
                max_upload_size=UPLOAD_LIMIT_MB,
                help="model.safetensors + config.json + tokenizer files",
            )
            if not files:
                st.info("Upload model.safetensors, config.json and the tokenizer files.")
                st.stop()
            try:
                return save_upload([(f.name, f.getvalue()) for f in files], _session_folder())
            except ValueError as e:
                st.error(str(e))
                st.stop()
    return sources[choice]


def _session_folder() -> SessionFolder:
    """This session's upload folder (removed when the session ends and its state is dropped)."""
    if "attnlab_uploads" not in st.session_state:
        from streamlit.runtime.scriptrunner import get_script_run_ctx

        ctx = get_script_run_ctx()
        name = ctx.session_id if ctx is not None else "no-session"
        st.session_state["attnlab_uploads"] = SessionFolder(re.sub(r"[^A-Za-z0-9_-]", "_", name)[:64])
    return st.session_state["attnlab_uploads"]


@dataclass(frozen=True)
class Settings:
    """Everything that decides the weights, besides the text."""

    source: Source
    variants: tuple[str, ...] = attnlab.VARIANTS
    mode: str = "recompute"
    u: float = 0.5
    iters: int = 3


def settings_input(prefix: str, *, variants: bool = True) -> Settings:
    """Sidebar: model, variants, mode, HNAS u and Sinkhorn iterations."""
    source = model_input(prefix)
    with st.sidebar:
        chosen = attnlab.VARIANTS
        if variants:
            chosen = remembered(
                prefix,
                "variants",
                st.multiselect,
                list(attnlab.VARIANTS),
                "Variants",
                list(attnlab.VARIANTS),
                valid=lambda v: bool(v),
            )
            if not chosen:
                st.warning("Pick at least one variant.")
                st.stop()
        mode = remembered(
            prefix,
            "mode",
            st.radio,
            "recompute",
            "Mode",
            list(hf.MODES),
            horizontal=True,
            help="recompute: every variant from the model's own queries and keys; "
            "swap: the variant replaces the model's attention (later layers change too)",
        )
        u = remembered(
            prefix,
            "u",
            st.slider,
            0.5,
            "HNAS u",
            0.0,
            1.0,
            step=0.05,
            help="u·DNAS + (1-u)·UNAS; column mass >= u/N",
        )
        iters = remembered(prefix, "iters", st.slider, 3, "Sinkhorn iterations", 1, 20)
    return Settings(source, tuple(v for v in attnlab.VARIANTS if v in chosen), mode, float(u), int(iters))


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
    weights: dict[str, np.ndarray]  # variant -> (L, H, N, N) float32
    u: float | np.ndarray  # HNAS weight used: float, or (L, H) learned by a native checkpoint
    iters: int  # Sinkhorn iterations used
    window: int
    windowing: dict
    text_sha256: str
    characters: int
    notes: list[str] = field(default_factory=list)
    # variant -> {map: (L, H, N, N)}: a GAM checkpoint's phi, theta and brains (hf WindowResult.components)
    components: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)

    @property
    def key(self) -> str:
        """Identifies the inputs of this analysis (cache keys of figures built from it)."""
        s = self.settings
        variants = ",".join(s.variants)
        return f"{s.source.key}|{self.text_sha256}|{variants}|{s.mode}|{s.u:g}|{s.iters}|{self.window}"

    @property
    def n_windows(self) -> int:
        return self.windowing["n_windows"]

    @property
    def shape(self) -> tuple[int, int, int]:
        L, H, N, _ = next(iter(self.weights.values())).shape
        return L, H, N

    def statistics_csv(self, eps_relative: float = 0.1) -> str:
        """Every statistic of ``attnlab.stats.tidy_table`` for this window, as CSV."""
        from attnlab import stats

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
                "window": self.windowing["window"],
            },
        }


@st.cache_resource(max_entries=4, ttl=1800, show_spinner=False)
def _plan(kind: str, path: str | None, text: str, variants: tuple, mode: str, u: float, iters: int):
    """The planned analysis (``hf.stream_analysis``) of any model: Hugging Face or native checkpoint.
    A native HNAS checkpoint keeps the u it learned (the slider's u applies to other models)."""
    model = load(Source(kind, path, ""))
    if isinstance(model, hf.NativeModel) and hf.native.learned_u(model) is not None:
        u = None
    return hf.stream_analysis(text, model, variants, mode, u, iters)


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
) -> WindowView:
    s = Settings(Source(kind, path, label), variants, mode, u, iters)
    model = load(s.source)
    plan = _plan(kind, path, text, variants, mode, u, iters)
    result = plan.window(window)
    used = plan.u if isinstance(plan.u, float) else plan.u.numpy()
    return WindowView(
        s,
        model.info,
        tokens=result.tokens,
        input_ids=list(result.window.input_ids),
        special=result.window.special,
        u=used,
        iters=plan.iters,
        window=window,
        weights={v: w.numpy() for v, w in result.weights.items()},  # (L, H, N, N)
        components={v: {n: t.numpy() for n, t in maps.items()} for v, maps in result.components.items()},
        windowing=plan.windowing.as_dict(),
        text_sha256=plan.text_sha256,
        characters=len(text),
        notes=list(plan.notes),
    )


def _fail(e: Exception) -> None:
    st.error(str(e).strip() or e.__class__.__name__)
    st.stop()


def n_windows(s: Settings, text: str) -> int:
    """How many windows the text spans for this model (loads the model, tokenizes once)."""
    try:
        plan = _plan(s.source.kind, s.source.path, text, s.variants, s.mode, s.u, s.iters)
    except (ValueError, OSError) as e:  # ModelLoadError is a ValueError
        _fail(e)
    return plan.windowing.n_windows


def window_view(prefix: str, s: Settings, text: str) -> WindowView:
    """The analysis of the window the user picked (a picker appears for multi-window texts).

    Bad input (a model that does not load, a text without tokens) -> a message, and the page stops.
    """
    count = n_windows(s, text)
    window = 0
    if count > 1:
        window = st.slider(
            f"Window (the text spans {count} windows)", 0, count - 1, 0, key=f"{prefix}_window"
        )
    try:
        with st.spinner("Computing attention…"):
            return _window(
                s.source.kind, s.source.path, s.source.label, text, s.variants, s.mode, s.u, s.iters, window
            )
    except (ValueError, OSError) as e:
        _fail(e)


def view_for(source: Source, like: Settings, text: str, window: int = 0) -> WindowView:
    """Another model's analysis of the same text with the same settings (Compare page)."""
    s = Settings(source, like.variants, like.mode, like.u, like.iters)
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
        )
    except (ValueError, OSError) as e:
        _fail(e)
