"""Inspect's token views drawn in the browser (app/assets/token_views.js, a Streamlit v2 component):
one head's map, the head view, the token strip and the model view, with click to focus shared by the
views of a page at once, no round trip. The click then reaches Python (a trigger value), which keeps
the focus for the other pages and the URL (``appkit.show.focus``).

Each view gets the analysis it draws, float32 (the map and the strip's map, exact values in the
hover) or, for the model view's L x H maps, the pairs it draws (weight >= its minimum), one byte per
weight (at most 64 tokens).
Cross-attention (an encoder-decoder's target queries x source keys, ``view.query_tokens``): the head
view and the model view draw its rectangular (M, N) maps, the target tokens on the left, the source
tokens on the right; the focus is a source token (a key), as the page's focus bar, strip and URL
name it. Its map, grid and strip are the library's figures (``appkit.seq2seq.rectangular_view``).
The Export menu under each view builds the library's plotly figure of the same view
(``attnlab.figures.build``) when a file is asked for.
"""

from __future__ import annotations

import base64
import functools
from pathlib import Path

import numpy as np
import streamlit as st

from appkit import state
from appkit.analysis import WindowView
from appkit.export import export_menu
from appkit.long_context import span_block
from appkit.neuron import note_focus_click, wants_page_rerun
from appkit.show import FOCUS, bundle, current_focus, focus, manifest
from attnlab.figures._data import block_mean
from attnlab.figures.head_overlay import head_color
from attnlab.figures.head_view import MODEL_VIEW_MAX_TOKENS
from attnlab.figures.long_maps import head_map

ASSETS = Path(__file__).resolve().parents[1] / "assets"
KINDS = ("heatmap", "head_view", "token_mass", "model_view", "grid")  # + "focus_bar" (focus_bar below)
GRID_MAX_TOKENS = 48  # the grid's maps are means over token blocks beyond this side
GRID_CELL_PX = 72  # one map of the grid
STRIP_EXACT_MAX_TOKENS = 128  # beyond, the strip's rows travel as 16-bit fractions of their top
HEAD_VIEW_MIN_WEIGHT = 0.02  # lines below this weight are not drawn (as attnlab.figures.head_view)
MODEL_VIEW_MIN_WEIGHT = 0.05  # (as attnlab.figures.model_view)
SEQ = "token_views_seq"  # shared state: the sequence number of the last click handled
OVERLAY = "overlay"  # shared state and URL: the heads the head view shows besides the map's head
OVERLAY_SEQ = "overlay_seq"  # shared state: the sequence number of the last chip click handled


@functools.cache
def _sources() -> tuple[str, str]:
    """The component's module (token_views.js, then line_views.js: one module, shared helpers) and CSS."""
    js = (ASSETS / "token_views.js").read_text() + "\n" + (ASSETS / "line_views.js").read_text()
    return js, (ASSETS / "token_views.css").read_text()


def _component():
    """The component's mounting command. Registered on every call (the same definition again is a
    no-op): a registration belongs to one Streamlit runtime, and tests start many."""
    js, css = _sources()
    # plain DOM (no shadow root): the page's font, and the browser tests read the views
    return st.components.v2.component("attnlab.token_views", js=js, css=css, isolate_styles=False)


def _b64(a: np.ndarray, dtype) -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype=dtype).tobytes()).decode("ascii")


def shown_heads(head: int, n_heads: int, values: dict | None = None) -> list[int]:
    """The heads the head view overlays: the map's ``head`` and the ones added with the chips
    (this session's, else the URL's ``?overlay=``), sorted. ``values``: the session's shared state
    taken during a page run (a deferred export reads it in another thread)."""
    values = state.shared() if values is None else values
    if OVERLAY not in values:
        extra = state.url_value(OVERLAY, state.LIST, [])
        values[OVERLAY] = [int(h) for h in extra if h.isdigit()]
    return sorted({head, *(h for h in values[OVERLAY] if 0 <= h < n_heads)})


def _on_heads(key: str) -> None:
    """A click on a head chip of the head view (trigger "heads" = {heads, head, seq}): the heads
    shown besides the map's head go into the session and the URL (``?overlay=``)."""
    value = st.session_state[key].get("heads") if st.session_state.get(key) else None
    if not value:
        return
    head = int(value.get("head", -1))
    extra = sorted({int(h) for h in value.get("heads", []) if int(h) != head})
    seq = max(int(value.get("seq", 0)), state.shared().get(OVERLAY_SEQ, 0))
    state.shared().update({OVERLAY: extra, OVERLAY_SEQ: seq})
    state.set_url(OVERLAY, [str(h) for h in extra] or None, state.LIST)


@st.cache_resource(max_entries=4, ttl=1800, show_spinner=False)
def _layer_span(key: str, variant: str, layer: int, lo: int, hi: int, _view: WindowView):
    """(blocks (H, n, n) of the layer's heads over tokens [lo, hi), column masses (H, N) over every
    query). With the column masses the capture forward took (``WindowView.column_masses``), each
    head's block alone is computed (``long_context.span_block``: the tiles of its rows, not its whole
    map); without them each head's (N, N) is computed in turn (``weights.head``), summed and dropped."""
    maps = _view.weights[variant]
    H = _view.shape[1]
    if _view.column_masses is not None:
        blocks = [span_block(maps, layer, h, lo, hi) for h in range(H)]
        return np.stack(blocks), _view.column_masses[variant][layer].numpy()  # (H, n, n), (H, N)
    blocks, mass = [], []
    for h in range(H):
        m = head_map(maps, layer, h)  # (N, N)
        blocks.append(m[lo:hi, lo:hi].copy())
        mass.append(m.sum(0))
    return np.stack(blocks), np.stack(mass)


def _span_weights(view: WindowView, variant: str, layer: int, span: tuple[int, int]):
    """(weights (L, H, n, n) whose layer ``layer`` is the window's blocks (every layer reads the same
    memory: only ``layer`` is meant), column masses (H, N) of the whole text)."""
    blocks, mass = _layer_span(view.key, variant, layer, *span, view)
    return np.broadcast_to(blocks, (view.shape[0], *blocks.shape)), mass


def view_data(
    kind: str, view: WindowView, variant: str, layer: int, head: int | None, heads: list[int] | None = None,
    span: tuple[int, int] | None = None,
) -> dict:
    """What the browser draws for ``kind`` (focus and sequence number added by :func:`token_view`).

    ``head`` None (token_mass only): the mean over the layer's heads; ``heads`` (head_view): the
    heads overlaid (default: ``head`` alone). Arrays are little-endian,
    row-major: ``map`` (N, N) float32 of (layer, head); ``heads_map`` (H, N, N) float32 of every head
    of the layer (head_view: a chip shows or hides one at once); ``strip`` (N, N) float32 of the strip's map
    (the head, or the mean over the layer's heads: its column sums are the mean column mass, its
    rows the mean rows sent); ``model`` (L, H, N, N) uint8 of weight / model_max * 255.

    Cross-attention (``view.query_tokens``; heatmap, head_view, model_view): ``map`` (M, N),
    ``heads_map`` (H, M, N), the model view's index i * N + j over (M, N); ``m`` = M and
    ``query_tokens`` the M target tokens, ``tokens`` / ``n`` the N source tokens (the keys).

    ``span`` (head_view, token_mass of a long context): the tokens [lo, hi) alone, N = hi - lo; the
    strip's column masses are still the whole text's; positions in the data are relative to lo, the
    views form a group of their own (their clicks carry lo: :func:`token_view`).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    mass = None  # (H, N): the whole text's column masses of a span's layer
    if span is not None:
        if kind not in ("head_view", "token_mass"):
            raise ValueError(f"only the head view and the token strip take a span, not {kind!r}")
        w, mass = _span_weights(view, variant, layer, span)  # (L, H, n, n)
        mass = mass[:, span[0]:span[1]]  # (H, n)
    else:
        w = np.asarray(view.weights[variant])  # (L, H, M, N); M == N but for cross-attention
    L, H, M, N = w.shape
    tokens = list(view.tokens) if span is None else list(view.tokens[span[0]:span[1]])
    group = view.key if span is None else f"{view.key}@{span[0]}-{span[1]}"
    d = {"kind": kind, "group": group, "variant": variant, "tokens": tokens, "n": N}
    queries = getattr(view, "query_tokens", None)  # cross-attention: target rows x source columns
    if queries is not None and span is None:
        d.update(m=M, query_tokens=list(queries))
    if kind in ("grid", "model_view"):  # the head the page shows, framed; a click on another drills down
        d.update(layer_shown=layer, head_shown=head)
    if kind == "heatmap":
        m = w[layer, head]
        top = float(np.nanmax(m)) if m.size and np.isfinite(m).any() else 1.0
        d.update(map=_b64(m, "<f4"), zmax=top, title=f"{variant}: layer {layer}, head {head}")
    elif kind == "head_view":
        heads = sorted({head, *(heads or [])})
        named = f"head {head}" if len(heads) == 1 else "heads " + ", ".join(map(str, heads))
        d.update(
            map=_b64(w[layer, head], "<f4"),
            heads_map=_b64(w[layer], "<f4"),  # (H, M, N)
            heads=H,
            heads_shown=heads,
            head_shown=head,
            heads_seq=state.shared().get(OVERLAY_SEQ, 0),
            colors=[head_color(h) for h in range(H)],
            min_weight=HEAD_VIEW_MIN_WEIGHT,
            title_base=f"{variant}: head view, layer {layer}",
            title=f"{variant}: head view, layer {layer}, {named}",
        )
    elif kind == "token_mass":
        where = f"layer {layer}, " + ("mean over heads" if head is None else f"head {head}")
        strip = w[layer].mean(0) if head is None else w[layer, head]  # (N, N)
        d.update(strip_where=where, strip_title=f"{variant}: attention each token receives ({where})")
        if N <= STRIP_EXACT_MAX_TOKENS and mass is None:
            d.update(strip=_b64(strip, "<f4"))
        else:  # exact column masses; the rows (shown when a token is focused) to 1 / 65534 of the top
            top = float(np.nanmax(strip)) if np.isfinite(strip).any() else 1.0
            q = np.where(np.isnan(strip), 65535.0, np.rint(np.clip(strip / (top or 1.0), 0, 1) * 65534.0))
            cols = strip.sum(0) if mass is None else mass.mean(0) if head is None else mass[head]
            d.update(strip_q=_b64(q, "<u2"), strip_max=top, strip_mass=_b64(cols, "<f4"))
    elif kind == "grid":
        pooled, f = block_mean(w, GRID_MAX_TOKENS)  # (L, H, m, n)
        top = float(np.nanmax(pooled)) if pooled.size and np.isfinite(pooled).any() else 1.0
        title = f"{variant}: attention by layer and head"
        d.update(
            grid=_b64(pooled, "<f4"),
            zmax=top,
            layers=L,
            heads=H,
            side_m=pooled.shape[-2],
            side_n=pooled.shape[-1],
            block=f,
            cell_px=GRID_CELL_PX,
            title=title if f == 1 else f"{title} (means over {f}x{f} token blocks)",
        )
    else:  # the model view draws the pairs >= its min weight only: those, sparse, per head
        if max(M, N) > MODEL_VIEW_MAX_TOKENS:
            raise ValueError(f"the model view draws up to {MODEL_VIEW_MAX_TOKENS} tokens, the window has "
                             f"{max(M, N)}")
        top = float(np.nanmax(w)) if w.size and np.isfinite(w).any() else 1.0
        flat = w.reshape(L * H, M * N)
        heads, where = np.nonzero(flat >= MODEL_VIEW_MIN_WEIGHT)  # row-major: grouped by head
        values = np.rint(np.clip(flat[heads, where] / (top or 1.0), 0.0, 1.0) * 255.0)
        offsets = np.searchsorted(heads, np.arange(L * H + 1))  # head h: entries [off[h], off[h + 1])
        d.update(
            model_idx=_b64(where, "<u2"),
            model_val=_b64(values, "u1"),
            model_off=_b64(offsets, "<u4"),
            model_max=top,
            layers=L,
            heads=H,
            min_weight=MODEL_VIEW_MIN_WEIGHT,
            title=f"{variant}: model view (every layer and head)",
        )
    return d


def decoded(data: dict) -> dict:
    """``data`` as the browser reads it, arrays as numpy (see :func:`view_data`; the tests read the
    views so)."""
    out = dict(data)
    N = data["n"]
    M = data.get("m", N)  # cross-attention's queries
    shapes = {
        "map": ("<f4", (M, N)),
        "strip": ("<f4", (N, N)),
        "strip_q": ("<u2", (N, N)),
        "strip_mass": ("<f4", (N,)),
        "model_idx": ("<u2", (-1,)),
        "model_val": ("u1", (-1,)),
        "model_off": ("<u4", (-1,)),
        "heads_map": ("<f4", (data.get("heads"), M, N)),
        "grid": ("<f4", (data.get("layers"), data.get("heads"), data.get("side_m"), data.get("side_n"))),
    }
    for name, (dtype, shape) in shapes.items():
        if data.get(name):
            out[name] = np.frombuffer(base64.b64decode(data[name]), dtype=dtype).reshape(shape)
    return out


def _take_focus(view_key: str, value: dict, offset: int = 0) -> None:
    """The focus a click set in the browser ({focus: position or -1, seq}) becomes the shared focus
    (``offset``: the first token of a span's views, whose positions are relative to it)."""
    position = value.get("focus")
    if position is not None and position < 0:
        position = None  # -1: the focus was cleared
    elif position is not None:
        position = int(position) + offset
    state.shared()[FOCUS] = {"view": view_key, "position": position}
    state.shared()[SEQ] = max(int(value.get("seq", 0)), state.shared().get(SEQ, 0))


def _on_click(view_key: str, key: str, offset: int = 0) -> None:
    """A click on a token in a view (trigger "focus"; a span's views: positions from ``offset``)."""
    value = st.session_state[key].get("focus") if st.session_state.get(key) else None
    if value:
        _take_focus(view_key, value, offset)
        note_focus_click()  # the neuron view, when shown, follows the focus: a whole-page rerun


def _on_head(prefix: str, view_key: str, key: str) -> None:
    """A click on a head of the grid or the model view (trigger "head": {layer, head, focus, seq}):
    that head becomes the page's layer and head (its sliders, the session, the URL); a model-view
    click's token becomes the focus."""
    value = st.session_state[key].get("head") if st.session_state.get(key) else None
    if not value:
        return
    layer, head = int(value["layer"]), int(value["head"])
    st.session_state[f"{prefix}_layer"], st.session_state[f"{prefix}_head"] = layer, head
    state.shared().update(layer=layer, head=head)
    if int(value.get("seq", 0)) > state.shared().get(SEQ, 0):  # the click also (un)focused a token
        _take_focus(view_key, value)


def token_view(
    prefix: str,
    kind: str,
    view: WindowView,
    variant: str,
    layer: int,
    head: int | None,
    *,
    text: str | None = None,
    span: tuple[int, int] | None = None,
) -> None:
    """One token view (key ``{prefix}_{kind}``) and its Export menu (the plotly figure, built when
    a file is asked for, with the focus of that moment). ``span`` (head_view, token_mass): the
    tokens [lo, hi) of a long context alone; a click there reruns the page (the span follows the focus)."""
    if view.query_tokens is not None and kind not in ("head_view", "model_view"):  # cross-attention's
        from appkit.seq2seq import rectangular_view  # map, grid, strip: the library's figures

        return rectangular_view(prefix, kind, view, variant, layer, head)
    heads = shown_heads(head, view.shape[1]) if kind == "head_view" else None
    if heads is not None:
        state.set_url(OVERLAY, [str(h) for h in heads if h != head] or None, state.LIST)
    data = view_data(kind, view, variant, layer, head, heads, span)
    lo, hi = span or (0, view.shape[2])
    f = focus(view)
    data.update(focus=f - lo if f is not None and lo <= f < hi else None, seq=state.shared().get(SEQ, 0))
    key = f"{prefix}_{kind}"
    with st.container(key=key):
        _component()(
            data=data,
            key=f"{key}_view",
            on_focus_change=lambda: _on_click(view.key, f"{key}_view", lo),
            on_head_change=lambda: _on_head(prefix, view.key, f"{key}_view"),
            on_heads_change=lambda: _on_heads(f"{key}_view"),
        )
    values = state.shared()  # this session's, read again when a file is asked for (another thread)

    def params() -> dict:  # the focus of the moment a file is asked for
        if kind == "grid":
            return {"variant": variant, "max_tokens": GRID_MAX_TOKENS, "focus": current_focus(view, values)}
        p = {"variant": variant, "layer": layer, "head": head, "focus": current_focus(view, values)}
        if kind == "head_view":  # the heads shown at that moment (chips rerun only the focus bar)
            p["heads"] = shown_heads(head, view.shape[1], values)
        if span is not None:  # the manifest names the tokens shown; the figure's positions are from lo
            p["span"] = [lo, hi]
        return p

    export_menu(
        prefix,
        kind,
        lambda: bundle(kind, view, params()) if span is None else span_bundle(kind, view, params()),
        lambda: manifest(kind, view, params(), file_name=f"{kind}.manifest.json"),
        text,
    )


def span_bundle(kind: str, view: WindowView, p: dict):
    """The Export figure of a span's head view or strip: the library's builder on the span's tokens
    (focus relative to the span; ``p["span"]`` = [lo, hi))."""
    from attnlab.figures import app_views

    lo, hi = p["span"]
    w, mass = _span_weights(view, p["variant"], p["layer"], (lo, hi))  # (L, H, n, n): layer p["layer"] meant
    f = p.get("focus")
    q = {**p, "focus": f - lo if f is not None and lo <= f < hi else None}
    tokens = list(view.tokens[lo:hi])
    b = app_views.build(kind, {p["variant"]: w}, tokens, q)
    if kind == "token_mass" and q["focus"] is None:  # the whole text's column masses, not the span's
        from attnlab.figures.views import token_mass_strip

        cols = (mass.mean(0) if p["head"] is None else mass[p["head"]])[lo:hi]  # (n,)
        where = f"layer {p['layer']}, " + ("mean over heads" if p["head"] is None else f"head {p['head']}")
        title = f"{p['variant']}: attention each token receives ({where}; tokens {lo}–{hi - 1})"
        b.figure = token_mass_strip(tokens, cols, title=title, bound=1.0 / view.shape[2], what="mass")
        b.table = b.table.assign(position=np.arange(lo, hi), column_mass=cols)
        b.arrays = {"column_mass": cols}
    return b


HINT = "Click a token (a map cell, the head view, the token strip, the model view) to focus its attention."


@st.fragment
def focus_bar(prefix: str, view: WindowView) -> None:
    """Which token is focused, and a button to clear it (drawn in the browser). The views' clicks
    reach Python through it: a click reruns only this fragment, which keeps the focus in the session
    (other pages, the views' next run, deferred exports) and in the URL (``?focus=``)."""
    data = {"kind": "focus_bar", "group": view.key, "tokens": list(view.tokens), "n": view.shape[2]}
    data.update(hint=HINT, focus=focus(view), seq=state.shared().get(SEQ, 0))
    key = f"{prefix}_focus_bar"
    with st.container(key=key):
        _component()(
            data=data,
            key=f"{key}_view",
            on_focus_change=lambda: _on_click(view.key, f"{key}_view"),
            on_heads_change=lambda: _on_heads(f"{key}_view"),  # the head view's chips, routed here
        )
    if wants_page_rerun():  # a focus click while the neuron view is shown: it follows the focus
        st.rerun()
