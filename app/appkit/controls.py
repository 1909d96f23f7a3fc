"""The controls every text page shares: the text (box or upload), the model, the variants and their
parameters (sidebar, built from the variant registry's specs) and the window of a long text.

Every control follows the user from page to page and lives in the URL (``appkit.state``), so a
reload or a shared link on the same server reopens the same view. :func:`inputs` renders all of them
before it stops the page for a missing text or model: a control that is not rendered in a run loses
its state (the sidebar once came back empty after "Local Hugging Face directory…").
"""

from __future__ import annotations

import re
from contextlib import contextmanager

import streamlit as st

import attnlab
from appkit import state
from appkit.analysis import Settings, WindowView, _fail, _window, keeps_learned_u, n_windows
from appkit.params import param_widgets
from appkit.sources import (
    EMBEDDED,
    UPLOAD_LIMIT_MB,
    SessionFolder,
    Source,
    check_model_path,
    checkpoint_sources,
    save_upload,
)
from appkit.variants import settings_fields
from attnlab import hf

SAMPLE = (
    "The cat sat on the mat because it was warm, and the dog watched it from the door. "
    "Attention lets every word look at every other word; a word that no one looks at is explained away."
)
MAX_TEXT_CHARS = 1_000_000  # ~250k tokens; longer texts belong to `attnlab analyze`
MAX_TEXT_BYTES = 4 * MAX_TEXT_CHARS + 3  # UTF-8: at most 4 bytes a character, + a BOM
# The text uploader takes any file the server takes (server.maxUploadSize) and the app checks the
# text's characters: a byte limit on the widget refused a 5.2 MB file with only a red "!" on its
# chip (the page went on with the sample text) and was not the real limit. Its "… MB per file" line
# is hidden, as the label states the limit.
UPLOADER_CSS = """<style>
.st-key-{key} [data-testid="stFileUploaderDropzoneInstructions"] {{ display: none; }}
</style>"""
TEXT_TYPES = ("txt", "md")
LOCAL_DIR = "Local Hugging Face directory…"
UPLOAD = "Upload a checkpoint…"
UPLOADED = "upload"  # shared-state entry of the uploaded text: {"name", "text", "page"}
BUSY_CSS = """<style>
.st-key-attnlab_busy { position: fixed; bottom: 1.2rem; right: 1.5rem; z-index: 1000; width: auto;
  background: rgba(255, 255, 255, 0.95); border-radius: 0.5rem; padding: 0 0.8rem;
  box-shadow: 0 1px 6px rgba(0, 0, 0, 0.25); }
.st-key-attnlab_busy:empty { display: none; }
</style>"""


# ----------------------------------------------------------------------------------------------
# Text
# ----------------------------------------------------------------------------------------------


def _decode_upload(name: str, data: bytes) -> str:
    if not name.lower().endswith(tuple(f".{t}" for t in TEXT_TYPES)):
        raise ValueError(f"{name} is not a text file: upload a .txt or .md file")
    if len(data) > MAX_TEXT_BYTES:  # more bytes than any text of MAX_TEXT_CHARS characters has
        raise ValueError(
            f"{name} is {len(data) / 1e6:.1f} MB, more than a text of {MAX_TEXT_CHARS:,} characters (the "
            "app's limit) can be; use `attnlab analyze FILE.txt` for longer texts"
        )
    if b"\x00" in data:
        raise ValueError(f"{name} looks binary (it contains NUL bytes); expected UTF-8 text")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{name} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})"
        ) from None
    if len(text) > MAX_TEXT_CHARS:
        raise ValueError(
            f"{name} has {len(text):,} characters; the app takes up to {MAX_TEXT_CHARS:,} (use "
            "`attnlab analyze FILE.txt` for longer texts)"
        )
    if not text.strip():
        raise ValueError(
            f"{name} is empty ({len(data)} bytes, no text): upload a file with text, or remove it "
            "to use the text box"
        )
    return text


def _on_upload(prefix: str) -> None:
    """The uploader changed: a new file is the text from now on (on every page); removing it
    returns to the text box."""
    upload = st.session_state.get(f"{prefix}_upload")
    values = state.shared()
    values.pop(UPLOADED, None)
    values.pop("upload_error", None)
    if upload is None:
        return
    try:
        values[UPLOADED] = {"name": upload.name, "text": _decode_upload(upload.name, upload.getvalue())}
    except ValueError as e:
        values["upload_error"] = str(e)


def _restore_text_from_url(values: dict) -> None:
    """Once per session: the text of the link (``?text=KEY``, stored on this server)."""
    if values.get("text_from_url_done"):
        return
    values["text_from_url_done"] = True
    key = st.query_params.get("text")
    if not key or "text" in values:
        return
    text = state.load_text(key)
    if text is None:
        values["text_note"] = f"The link's text ({key}) is not stored on this server; showing the sample."
    elif st.query_params.get("upload"):
        values[UPLOADED] = {"name": st.query_params["upload"], "text": text, "restored": True}
    else:
        values["text"] = text


def _text(prefix: str) -> tuple[str | None, str | None]:
    """Render the text box and the uploader; -> (text, None) or (None, message)."""
    values = state.shared()
    _restore_text_from_url(values)
    if note := values.pop("text_note", None):
        st.warning(note)
    uploaded = values.get(UPLOADED)
    area = state.remembered(
        prefix,
        "text",
        st.text_area,
        SAMPLE,
        "Text" if uploaded is None else "Text (not used while a file is uploaded)",
        height=130,
        max_chars=MAX_TEXT_CHARS,
        disabled=uploaded is not None,
        help="Paste any text; long texts are cut into overlapping windows of the model's length.",
    )
    st.html(UPLOADER_CSS.format(key=f"{prefix}_upload"))
    st.file_uploader(  # no type= and no size limit: the app, not the browser, says what is wrong
        f"…or upload a text file (.txt or .md, up to {MAX_TEXT_CHARS:,} characters)",
        key=f"{prefix}_upload",
        help="UTF-8 text; it replaces the text box until removed",
        on_change=_on_upload,
        args=(prefix,),
    )
    if error := values.get("upload_error"):
        return None, error
    text = area
    if uploaded is not None:
        text = uploaded["text"]
        how = "restored from the link" if uploaded.get("restored") else "uploaded"
        a, b = st.columns([4, 1])
        a.caption(
            f"Using the {how} file **{uploaded['name']}** ({len(text):,} characters); the text box is "
            "not used while it is."
        )
        if b.button("Use the text box", key=f"{prefix}_drop_upload"):
            values.pop(UPLOADED, None)
            st.rerun()
    if len(text) > MAX_TEXT_CHARS:
        return None, (
            f"The text has {len(text):,} characters; the app takes up to {MAX_TEXT_CHARS:,} "
            "(use `attnlab analyze FILE.txt` for longer texts)."
        )
    if not text.strip():
        return None, "Type or paste a text (or upload a .txt file) to see its attention."
    state.set_url("text", None if text == SAMPLE else state.store_text(text), state.TEXT)
    state.set_url("upload", uploaded["name"] if uploaded else None, state.TEXT)
    return text, None


# ----------------------------------------------------------------------------------------------
# Model, variants, parameters
# ----------------------------------------------------------------------------------------------


def _session_folder() -> SessionFolder:
    """This session's upload folder (removed when the session ends and its state is dropped)."""
    if "attnlab_uploads" not in st.session_state:
        from streamlit.runtime.scriptrunner import get_script_run_ctx

        ctx = get_script_run_ctx()
        name = ctx.session_id if ctx is not None else "no-session"
        st.session_state["attnlab_uploads"] = SessionFolder(re.sub(r"[^A-Za-z0-9_-]", "_", name)[:64])
    return st.session_state["attnlab_uploads"]


def _model(prefix: str) -> tuple[Source | None, str | None]:
    """Model picker (in the sidebar): embedded MiniLM, shipped/trained checkpoints, a local
    directory or an upload; -> (source, None) or (None, message)."""
    sources = {s.label: s for s in [EMBEDDED, *checkpoint_sources()]}
    options = [*sources, LOCAL_DIR, UPLOAD]
    choice = state.remembered(
        prefix,
        "model",
        st.selectbox,
        options[0],
        "Model",
        options,
        valid=options.__contains__,
        url=state.TEXT,
    )
    if choice == LOCAL_DIR:
        path = state.remembered(
            prefix,
            "model_dir",
            st.text_input,
            "",
            "Model directory",
            placeholder="/path/to/save_pretrained/folder",
            url=state.TEXT,
        ).strip()
        if not path:
            return None, "Enter the path of a folder written by save_pretrained (or an attnlab run)."
        try:
            check_model_path(path)  # from the URL (?model_dir=) or the box: untrusted
        except ValueError as e:
            return None, str(e)
        return Source("hf", path, path), None
    if choice == UPLOAD:
        files = st.file_uploader(
            "Checkpoint files",
            accept_multiple_files=True,
            key=f"{prefix}_ckpt",
            max_upload_size=UPLOAD_LIMIT_MB,
            help="model.safetensors + config.json + tokenizer files (not kept in the URL)",
        )
        if not files:
            return None, "Upload model.safetensors, config.json and the tokenizer files."
        try:
            return save_upload([(f.name, f.getvalue()) for f in files], _session_folder()), None
        except ValueError as e:
            return None, str(e)
    return sources[choice], None


def _settings(prefix: str, variants: bool = True) -> tuple[Settings | None, str | None]:
    """The sidebar, rendered in full whatever is missing; -> (settings, None) or (None, message)."""
    with st.sidebar:
        source, problem = _model(prefix)
        names = list(attnlab.VARIANTS)
        chosen = list(attnlab.DEFAULT_VARIANTS)
        if variants:
            chosen = state.remembered(
                prefix,
                "variants",
                st.multiselect,
                list(attnlab.DEFAULT_VARIANTS),
                "Variants",
                names,
                valid=lambda v: bool(v) and set(v) <= set(names),
                url=state.LIST,
            )
        mode = state.remembered(
            prefix,
            "mode",
            st.radio,
            "recompute",
            "Mode",
            list(hf.MODES),
            horizontal=True,
            valid=list(hf.MODES).__contains__,
            url=state.TEXT,
            help="recompute: every variant from the model's own queries and keys; "
            "swap: the variant replaces the model's attention (later layers change too)",
        )
        learned = source is not None and "hnas" in chosen and keeps_learned_u(source)
        params, bad_param = param_widgets(prefix, chosen, learned_u=learned)
    if problem is None and not chosen:
        problem = "Pick at least one variant."
    problem = problem or bad_param
    if problem is not None:
        return None, problem
    ordered = tuple(v for v in attnlab.VARIANTS if v in chosen)
    return Settings(source, ordered, mode, **settings_fields(params)), None


def inputs(prefix: str, *, variants: bool = True) -> tuple[str, Settings]:
    """The text and the sidebar of a text page; a message and the page stops when either is unusable
    (after every control is rendered)."""
    text, text_problem = _text(prefix)
    settings, problem = _settings(prefix, variants)
    if text_problem is not None or problem is not None:
        for message in (text_problem, problem):
            if message:
                (st.info if message.startswith(("Type", "Enter", "Upload", "Pick")) else st.error)(message)
        st.stop()
    return text, settings


def text_input(prefix: str) -> str:
    """The text box + upload alone (a page without the sidebar); stops the page without a text."""
    text, problem = _text(prefix)
    if problem is not None:
        (st.info if problem.startswith("Type") else st.error)(problem)
        st.stop()
    return text


def settings_input(prefix: str, *, variants: bool = True) -> Settings:
    """The sidebar alone; stops the page when the model is missing or no variant is chosen."""
    settings, problem = _settings(prefix, variants)
    if problem is not None:
        st.info(problem) if problem.startswith(("Enter", "Upload", "Pick")) else st.error(problem)
        st.stop()
    return settings


# ----------------------------------------------------------------------------------------------
# Windows and the analysis of the chosen one
# ----------------------------------------------------------------------------------------------


@contextmanager
def busy(message: str = "Computing attention…"):
    """A spinner pinned to the bottom right of the window, in sight however far the page is scrolled."""
    st.html(BUSY_CSS)
    with st.container(key="attnlab_busy"), st.spinner(message):
        yield


def window_caption(view: WindowView) -> str:
    """'window 2 of 4: text tokens 385-893 of 2,000 (overlap 128 with the previous)'."""
    w = view.windowing
    count, k = w["n_windows"], view.window
    start = w["starts"][k]
    stop = min(start + w["content"], w["n_tokens"])
    text = f"window {k + 1} of {count}: text tokens {start + 1:,}–{stop:,} of {w['n_tokens']:,}"
    if count > 1:
        text += f", overlapping the neighbouring windows by {w['overlap']} tokens"
    return text


def window_view(prefix: str, s: Settings, text: str) -> WindowView:
    """The analysis of the window the user picked (a 1-based picker appears for multi-window
    texts; the choice follows the user between pages and lives in the URL).

    Bad input (a model that does not load, a text without tokens) -> a message, and the page stops.
    An encoder-decoder: the target box and the kind of attention shown instead (appkit/seq2seq.py).
    """
    from appkit import seq2seq

    if seq2seq.is_encoder_decoder(s.source):
        return seq2seq.seq2seq_view(prefix, s, text, busy)
    count = n_windows(s, text)
    window = 1
    if count > 1:
        window = state.remembered(
            prefix,
            "window",
            st.slider,
            1,
            f"Window (the text spans {count} windows of the model's length)",
            1,
            count,
            valid=lambda v: isinstance(v, int) and 1 <= v <= count,
            url=state.INT,
        )
    else:
        state.set_url("window", None, state.INT)
    try:
        with busy():
            view = _window(
                s.source.kind,
                s.source.path,
                s.source.label,
                text,
                s.variants,
                s.mode,
                s.u,
                s.iters,
                window - 1,
                s.extra,
            )
    except (ValueError, OSError) as e:
        _fail(e)
    if count > 1:
        st.caption(window_caption(view).capitalize() + ".")
    return view
