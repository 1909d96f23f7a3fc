"""Small pickers the analysis pages share (variant, layer, head), remembered across pages and in
the URL, and the focus line (which token is focused, and a button to clear it)."""

from __future__ import annotations

import streamlit as st

from appkit import state
from appkit.analysis import WindowView
from appkit.show import focus, set_focus


def layer_head(prefix: str, L: int, H: int, columns=None) -> tuple[int, int]:
    """Layer and head sliders (default layer 2, head 0; out-of-range values fall back)."""
    a, b = columns or st.columns(2)
    with a:
        layer = state.remembered(
            prefix,
            "layer",
            st.slider,
            min(2, L - 1),
            "Layer",
            0,
            L - 1,
            valid=lambda v: isinstance(v, int) and 0 <= v < L,
            url=state.INT,
        )
    with b:
        head = state.remembered(
            prefix,
            "head",
            st.slider,
            0,
            "Head",
            0,
            H - 1,
            valid=lambda v: isinstance(v, int) and 0 <= v < H,
            url=state.INT,
        )
    return layer, head


def variant(prefix: str, view: WindowView, container=None) -> str:
    """One of the analysed variants (segmented control)."""
    options = list(view.weights)
    with container or st.container():
        chosen = state.remembered(
            prefix,
            "variant",
            st.segmented_control,
            options[0],
            "Variant",
            options,
            required=True,
            valid=options.__contains__,
            url=state.TEXT,
        )
    return chosen if chosen in options else options[0]


def focus_line(prefix: str, view: WindowView) -> int | None:
    """The focused token (None: none) and a line saying how to focus (on Inspect; Inspect draws its
    own focus bar, appkit.token_views), or which token is focused."""
    f = focus(view)
    if f is None:
        st.caption("Focus a token by clicking it on Inspect: its row and column are outlined here too.")
        return None
    a, b = st.columns([5, 1])
    a.markdown(
        f"**Focus: token {f} “{view.tokens[f]}”** — the row it sends and the column it receives are "
        "outlined in orange; click it again or clear."
    )
    if b.button("Clear focus", key=f"{prefix}_clear_focus"):
        set_focus(view, None)
        st.rerun()
    return f
