"""Showing a figure built from analyses: cached bundle, chart, Export menu with its manifest; and the
focused token (click to focus: appkit.token_views), shared by the views of a page and the pages of a
session, and kept in the URL (``?focus=``)."""

from __future__ import annotations

import json

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


def current_focus(view: WindowView, values: dict | None = None) -> int | None:
    """The focused token of this analysis as this session has it now (no URL write): what a
    deferred export reads when it is clicked, after focus clicks that reran only the focus bar.

    ``values``: the session's shared state (``state.shared()``), taken during a page run. A deferred
    export runs in a server thread without the session, where ``st.session_state`` is an empty
    stand-in: read there, the focus was always None (Inspect's exports lost it)."""
    f = (state.shared() if values is None else values).get(FOCUS) or {}
    return f.get("position") if f.get("view") == view.key else None


def set_focus(view: WindowView, position: int | None) -> None:
    state.shared()[FOCUS] = {"view": view.key, "position": position}


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
    return app_views.build(kind, weights, first.tokens, params, u=u, labels=list(labels) if labels else None,
                           query_tokens=first.query_tokens if len(_views) == 1 else None)


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
) -> app_views.FigureBundle:
    """Chart (key ``{prefix}_{name}``) + Export menu. Build errors become a message on the page.
    (Inspect's clickable views are drawn in the browser: appkit.token_views.)"""
    try:
        b = bundle(kind, views, params, labels)
    except ValueError as e:
        st.warning(f"{name}: {e}")
        return None
    st.plotly_chart(b.figure, key=f"{prefix}_{name}", width=width, theme=None, config=CHART_CONFIG)
    export_menu(prefix, name, b, manifest(kind, views, params, labels, f"{name}.manifest.json"), text)
    return b


def table_columns(columns: dict[str, tuple[str, str | None]], shares: tuple[str, ...] = ()) -> dict:
    """``st.dataframe``'s column_config from a builder's own {column: (label, format)} (e.g.
    ``stat_views.MOST_EXPLAINED_AWAY_COLUMNS``), so headers and formats follow its column names;
    ``shares`` (fractions in [0, 1]) are drawn as bars."""
    config = {}
    for name, (label, fmt) in columns.items():
        if name in shares:
            config[name] = st.column_config.ProgressColumn(label, min_value=0.0, max_value=1.0, format=fmt)
        elif fmt is None:
            config[name] = st.column_config.TextColumn(label)
        else:
            config[name] = st.column_config.NumberColumn(label, format=fmt)
    return config


def show_bundle(
    prefix: str, name: str, b: app_views.FigureBundle, manifest: dict | None = None, *, width="content"
) -> None:
    """A figure not built from an analysis (training curves, embeddings) + its Export menu."""
    st.plotly_chart(b.figure, key=f"{prefix}_{name}", width=width, theme=None, config=CHART_CONFIG)
    export_menu(prefix, name, b, manifest)
