"""The Export menu under every figure: PNG / SVG / PDF (kaleido + Chromium), interactive HTML, the data
(CSV / NPZ), and a JSON manifest (+ the text) from which ``attnlab analyze`` reproduces the figure.

Files are generated only when a button is clicked (deferred ``data`` callables), so an unexported
figure costs nothing; the clicks do not rerun the page. The menu's buttons exist only while it is open.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial

import streamlit as st

from attnlab.figures import app_views, chromium_available
from attnlab.figures.export import CHROMIUM_HINT

MIME = {
    "png": "image/png",
    "svg": "image/svg+xml",
    "pdf": "application/pdf",
    "html": "text/html",
    "csv": "text/csv",
    "npz": "application/octet-stream",
    "json": "application/json",
    "txt": "text/plain",
}


def _figure_bytes(bundle, fmt: str) -> bytes:
    return app_views.figure_bytes((bundle() if callable(bundle) else bundle).figure, fmt)


def _data_bytes(bundle, fmt: str) -> bytes:
    return app_views.data_bytes(bundle() if callable(bundle) else bundle, fmt)


@st.cache_resource(show_spinner=False)
def _static_ok() -> bool:
    return chromium_available()


def export_menu(
    prefix: str,
    name: str,
    bundle: app_views.FigureBundle | Callable[[], app_views.FigureBundle],
    manifest: dict | Callable[[], dict] | None = None,
    text: str | None = None,
) -> None:
    """A popover of download buttons for ``bundle`` (keys ``{prefix}_{name}_{format}``); a callable
    ``bundle`` is built only when a file is asked for (the views the browser draws itself), and a
    callable ``manifest`` is called again then (so it can name the focus of that moment).

    The popover's content is made only while it is open (opening it reruns the page): a page with
    six figures otherwise sent ~120 buttons and code blocks on every rerun, which the browser laid
    out each time (most of a text change's time in the browser)."""
    menu = st.popover("Export", icon=":material/download:", key=f"{prefix}_{name}_export", on_change="rerun")
    if not menu.open:
        return
    static = _static_ok()
    lazy = callable(bundle)
    make_manifest = manifest if callable(manifest) else (lambda: manifest)
    manifest = make_manifest()
    with menu:
        cols = st.columns(4)
        for col, fmt in zip(cols, ("png", "svg", "pdf", "html"), strict=True):
            col.download_button(
                fmt.upper(),
                data=partial(_figure_bytes, bundle, fmt),
                file_name=f"{name}.{fmt}",
                mime=MIME[fmt],
                key=f"{prefix}_{name}_{fmt}",
                on_click="ignore",
                disabled=fmt != "html" and not static,
                help=None if static or fmt == "html" else CHROMIUM_HINT,
            )
        cols = st.columns(4)
        for col, fmt in zip(cols[:2], ("csv", "npz"), strict=True):
            col.download_button(
                fmt.upper(),
                data=partial(_data_bytes, bundle, fmt),
                file_name=f"{name}.{fmt}",
                mime=MIME[fmt],
                key=f"{prefix}_{name}_{fmt}",
                on_click="ignore",
                disabled=fmt == "npz" and not lazy and not bundle.arrays,
            )
        if manifest is not None:
            cols[2].download_button(
                "Manifest",
                data=lambda: json.dumps(make_manifest(), indent=2),
                file_name=f"{name}.manifest.json",
                mime=MIME["json"],
                key=f"{prefix}_{name}_manifest",
                on_click="ignore",
                help="model, variants, settings and text hash; see reproduce.commands",
            )
        if text is not None:
            cols[3].download_button(
                "Text",
                data=partial(str, text),
                file_name="text.txt",
                mime=MIME["txt"],
                key=f"{prefix}_{name}_text",
                on_click="ignore",
                help="the analysed text",
            )
        if manifest is not None and manifest.get("reproduce", {}).get("commands"):
            cmds = [c for c in manifest["reproduce"]["commands"] if c]
            if cmds:
                st.caption("Reproduce (text saved as text.txt):")
                st.code(
                    "\n".join(cmds) + "\n" + manifest["reproduce"]["python"], language="bash", wrap_lines=True
                )
