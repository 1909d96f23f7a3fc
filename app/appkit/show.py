"""Showing a figure built from analyses: cached bundle, chart, Export menu with its manifest; and the
focused token (click to focus), shared by the views of a page and kept in the URL (``?focus=``)."""

from __future__ import annotations

import json
from functools import partial

import streamlit as st

from appkit import state
from appkit.analysis import WindowView
from appkit.export import export_menu
from attnlab.figures import app_views

CHART_CONFIG = {"displaylogo": False}
FOCUS = "focus"  # shared-state entry: {"view": WindowView.key, "position": int}


def focus(view: WindowView) -> int | None:
    """The focused token of this analysis (None: nothing focused, or it belongs to another text,
    window or model). A link's ``?focus=`` is used once, for the view it opens on."""
    values = state.shared()
    if FOCUS not in values:
        values[FOCUS] = {"view": view.key, "position": state.url_value(FOCUS, state.INT, None)}
    f = values[FOCUS]
    if f["view"] != view.key or f["position"] is None or not 0 <= f["position"] < view.shape[2]:
        f.update(view=view.key, position=None)
    state.set_url(FOCUS, f["position"], state.INT)
    return f["position"]


def current_focus(view: WindowView) -> int | None:
    """The focused token of this analysis as this session has it now (no URL write): what a
    deferred export reads when it is clicked, after focus clicks that reran only the focus bar."""
    f = state.shared().get(FOCUS) or {}
    return f.get("position") if f.get("view") == view.key else None


def set_focus(view: WindowView, position: int | None) -> None:
    state.shared()[FOCUS] = {"view": view.key, "position": position}


def _generation(prefix: str) -> int:
    """How many clicks the page's clickable charts have handled: part of their keys, so that after a
    click every one of them is a new chart with no selection (plotly keeps a clicked point selected
    across the rerun, and a second click on it was no change of the selection: no event, so "click
    it again" never cleared the focus; neither did a click on a token another chart had selected)."""
    return st.session_state.setdefault(f"{prefix}_click_generation", 0)


def _on_select(prefix: str, chart_key: str, view_key: str) -> None:
    """A click on a chart: its point's token position becomes the focus; a click on the focused
    token clears it. Every clickable chart of the page then starts with no selection."""
    points = st.session_state[chart_key]["selection"]["points"]
    position = clicked_position(points[0].get("customdata")) if points else None
    current = state.shared().get(FOCUS, {})
    if position is not None and current.get("view") == view_key and current.get("position") == position:
        position = None  # the focused token clicked again
    state.shared()[FOCUS] = {"view": view_key, "position": position}
    st.session_state[f"{prefix}_click_generation"] = _generation(prefix) + 1


def clicked_position(data) -> int | None:
    """The token position in a clicked point's ``customdata``: a number (head view, strip), or the
    first entry of a row (heatmap cell: [query, key, weight]; model view: [position, layer, head]).
    A row of a 2-D numpy ``customdata`` reaches Python as a list, or, sent by plotly as a typed array,
    as {"0": query, "1": key, ...}. None when the point carries no position."""
    if isinstance(data, dict):
        data = data.get("0")
    elif isinstance(data, (list, tuple)):
        data = data[0] if data else None
    try:
        return None if data is None else int(data)
    except (TypeError, ValueError):
        return None


def _as_list(views: WindowView | list[WindowView]) -> list[WindowView]:
    return views if isinstance(views, list) else [views]


@st.cache_resource(max_entries=12, ttl=1800, show_spinner=False)
def _bundle(
    keys: tuple[str, ...],
    kind: str,
    params_json: str,
    labels: tuple[str, ...] | None,
    _views: list[WindowView],
) -> app_views.FigureBundle:
    params = json.loads(params_json)
    first = _views[0]
    weights = first.weights if len(_views) == 1 else [v.weights for v in _views]
    u = first.u if isinstance(first.u, float) else None
    return app_views.build(kind, weights, first.tokens, params, u=u, labels=list(labels) if labels else None)


def bundle(
    kind: str, views: WindowView | list[WindowView], params: dict, labels: list[str] | None = None
) -> app_views.FigureBundle:
    """The figure of ``kind`` for these analyses (cached per inputs; arrays are not hashed)."""
    views = _as_list(views)
    return _bundle(
        tuple(v.key for v in views),
        kind,
        json.dumps(params, sort_keys=True),
        tuple(labels) if labels else None,
        views,
    )


def manifest(
    kind: str,
    views: WindowView | list[WindowView],
    params: dict,
    labels: list[str] | None = None,
    file_name: str = "manifest.json",
) -> dict:
    views = _as_list(views)
    first = views[0]
    return app_views.manifest(
        kind,
        params,
        [v.source_manifest() for v in views],
        text_sha256=first.text_sha256,
        characters=first.characters,
        window=first.window,
        labels=labels,
        file_name=file_name,
    )


def show(
    prefix: str,
    name: str,
    kind: str,
    views: WindowView | list[WindowView],
    params: dict,
    *,
    labels: list[str] | None = None,
    text: str | None = None,
    width="content",
    clickable: bool = False,
) -> app_views.FigureBundle:
    """Chart (key ``{prefix}_{name}``) + Export menu. Build errors become a message on the page.
    ``clickable``: a click on a token (a point with its position in ``customdata``) focuses it."""
    try:
        b = bundle(kind, views, params, labels)
    except ValueError as e:
        st.warning(f"{name}: {e}")
        return None
    key = f"{prefix}_{name}"
    if clickable:  # in a container keyed {prefix}_{name}; the chart's key changes with every click
        chart_key = f"{key}_click{_generation(prefix)}"
        select = partial(_on_select, prefix, chart_key, _as_list(views)[0].key)
        with st.container(key=key):
            st.plotly_chart(
                b.figure,
                key=chart_key,
                width=width,
                theme=None,
                config=CHART_CONFIG,
                on_select=select,
                selection_mode="points",
            )
    else:
        st.plotly_chart(b.figure, key=key, width=width, theme=None, config=CHART_CONFIG)
    export_menu(prefix, name, b, manifest(kind, views, params, labels, f"{name}.manifest.json"), text)
    return b


def show_bundle(
    prefix: str, name: str, b: app_views.FigureBundle, manifest: dict | None = None, *, width="content"
) -> None:
    """A figure not built from an analysis (training curves, embeddings) + its Export menu."""
    st.plotly_chart(b.figure, key=f"{prefix}_{name}", width=width, theme=None, config=CHART_CONFIG)
    export_menu(prefix, name, b, manifest)
