"""State that follows the user: from page to page (this session) and across reloads and shared links
(the page URL's query parameters, ``st.query_params``).

A control made with :func:`remembered` is seeded, in this order, from the value it had on any page of
this session (``st.session_state["attnlab_shared"]``), from the URL, or from its default; its value is
written back to both. Values equal to their default are left out of the URL, so the default view has
a bare URL. Texts are too long for a URL: :func:`store_text` keeps each analysed text on this server
under its sha256 (``$ATTNLAB_TEXTS_DIR``, default ``$TMPDIR/attnlab-texts``) and the URL holds the
first 16 hex digits (``?text=...``), which :func:`load_text` reads back.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import streamlit as st

SHARED = "attnlab_shared"
MAX_STORED_TEXTS = 500  # the oldest stored texts beyond this are removed
_MISSING = object()


@dataclass(frozen=True)
class Codec:
    """How a control's value is written in the URL (``encode`` -> str) and read back (``decode``;
    a ValueError, KeyError or TypeError means the URL's value is unusable: the default is used)."""

    encode: Callable[[object], str]
    decode: Callable[[str], object]


TEXT = Codec(str, str)
INT = Codec(lambda v: str(int(v)), int)
FLOAT = Codec(lambda v: f"{float(v):g}", float)
BOOL = Codec(lambda v: "1" if v else "0", lambda s: {"1": True, "0": False}[s])
LIST = Codec(lambda v: ",".join(v), lambda s: [x for x in s.split(",") if x])


def shared() -> dict:
    """This session's values of every remembered control (by name, not by page)."""
    return st.session_state.setdefault(SHARED, {})


def url_value(name: str, codec: Codec, default=_MISSING):
    """The value of ``name`` in the page URL, decoded; ``default`` when absent or unusable."""
    raw = st.query_params.get(name)
    if raw is None:
        return default
    try:
        return codec.decode(raw)
    except (ValueError, KeyError, TypeError):
        return default


def set_url(name: str, value, codec: Codec, default=_MISSING) -> None:
    """Write ``name`` into the URL (removed when ``value`` is ``default`` or None); only changes are sent."""
    if value is None or (default is not _MISSING and value == default):
        if name in st.query_params:
            del st.query_params[name]
        return
    text = codec.encode(value)
    if st.query_params.get(name) != text:
        st.query_params[name] = text


SEED_ARG = {"multiselect": "default", "segmented_control": "default", "pills": "default"}
INDEX_WIDGETS = ("selectbox", "radio")


def _seed(widget: Callable, value, args: tuple, kwargs: dict) -> dict:
    """The keyword that makes ``value`` the widget's own default (``value=``, ``default=`` or
    ``index=``), so the browser shows it even for a widget that was not on the page a run ago."""
    kind = getattr(widget, "__name__", "")
    if kind in INDEX_WIDGETS:
        options = list(kwargs.get("options", args[1] if len(args) > 1 else []))
        return {"index": options.index(value) if value in options else 0}
    return {SEED_ARG.get(kind, "value"): value}


def remembered(
    prefix: str,
    name: str,
    widget: Callable,
    default,
    *args,
    valid: Callable | None = None,
    url: Codec | None = None,
    **kwargs,
):
    """Render ``widget(*args, key=prefix_name, **kwargs)`` showing the value this control has now,
    else had on any page, else the URL's (``url`` codec), else ``default``; remember its new value
    in both. ``valid(value)`` drops stale or out-of-range values (the default is used instead).

    The value is passed as the widget's own default (never assigned through ``st.session_state``):
    a widget that was not rendered in the previous run (the page stopped before it) comes back with
    the value, where a session-state assignment came back as the widget's bare default in the browser.
    """
    key = f"{prefix}_{name}"
    values = shared()
    value = st.session_state.get(key, _MISSING)
    if value is _MISSING or (valid is not None and not valid(value)):
        st.session_state.pop(key, None)
        value = values.get(name, _MISSING)
        if value is _MISSING and url is not None:
            value = url_value(name, url)
        if value is _MISSING or (valid is not None and not valid(value)):
            value = default
    value = widget(*args, key=key, **_seed(widget, value, args, kwargs), **kwargs)
    values[name] = value
    if url is not None:
        set_url(name, value, url, default)
    return value


# ----------------------------------------------------------------------------------------------
# Texts kept on the server, named by their hash
# ----------------------------------------------------------------------------------------------


def texts_dir() -> Path:
    return Path(os.environ.get("ATTNLAB_TEXTS_DIR", Path(tempfile.gettempdir()) / "attnlab-texts"))


def text_key(text: str) -> str:
    """The first 16 hex digits of the text's sha256 (its name in the URL and in the store)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def store_text(text: str) -> str:
    """Keep ``text`` on this server (once per content); -> its key. Old texts beyond
    ``MAX_STORED_TEXTS`` are removed."""
    key = text_key(text)
    root = texts_dir()
    path = root / f"{key}.txt"
    if not path.is_file():
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
        stored = sorted(root.glob("*.txt"), key=lambda p: p.stat().st_mtime)
        for old in stored[:-MAX_STORED_TEXTS]:
            old.unlink(missing_ok=True)
    return key


def load_text(key: str) -> str | None:
    """The stored text of ``key``, or None (unknown key, or stored on another server)."""
    if not re.fullmatch(r"[0-9a-f]{16}", key or ""):
        return None
    try:
        return (texts_dir() / f"{key}.txt").read_text(encoding="utf-8")
    except OSError:
        return None
