"""Figure and data export: HTML (always), PNG / SVG / PDF through kaleido + Chromium, CSV / JSON / NPZ.

Static images need a Chrome or Chromium binary. kaleido >= 1 drives one through choreographer and
never ships it; ``chromium_path`` finds one the way choreographer does, without downloading anything:

1. the ``BROWSER_PATH`` environment variable (choreographer's override), if it names a file;
2. a browser previously fetched with ``kaleido_get_chrome`` / ``choreo_get_chrome``;
3. ``chrome``, ``google-chrome``, ``chromium``, ``chromium-browser``, ... on ``PATH``, then the usual
   install locations (``/usr/bin/chromium`` for Debian's ``apt-get install chromium``).

The browser is started once per process and kept (one kaleido session on a private event-loop
thread): the first static export takes a few seconds, later ones a fraction of a second.
``close_session()`` (also run at exit) stops it.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import shutil
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go

__all__ = [
    "STATIC_FORMATS",
    "FORMATS",
    "ExportError",
    "ExportReport",
    "chromium_available",
    "chromium_path",
    "close_session",
    "export_data",
    "export_figure",
    "export_figures",
]

STATIC_FORMATS = ("png", "svg", "pdf")
FORMATS = (*STATIC_FORMATS, "html", "json")
CHROMIUM_HINT = (
    "PNG/SVG/PDF export needs Chromium: apt-get install chromium "
    "(or set BROWSER_PATH to a Chrome/Chromium executable)"
)
DEFAULT_SIZE = (700, 500)  # plotly's default image size when the layout sets none
START_TIMEOUT_S = 60.0  # starting Chromium
RENDER_TIMEOUT_S = 60.0  # one image


class ExportError(RuntimeError):
    """A figure could not be exported (e.g. no Chromium for static formats); the message says why."""


def _is_exe(path: str | os.PathLike) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def chromium_path() -> str | None:
    """Path of the Chrome / Chromium that static export will use, or None (see the module doc)."""
    env = os.environ.get("BROWSER_PATH")
    if env:
        return env if _is_exe(env) else None
    try:
        from choreographer.browsers.chromium import Chromium

        found = Chromium.find_browser(skip_local=False)
    except Exception:  # noqa: BLE001  choreographer missing or its lookup failed: fall back to PATH
        found = None
    if found and _is_exe(found):
        return str(found)
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome"):
        if found := shutil.which(name):
            return found
    return None


def chromium_available() -> bool:
    """True when kaleido is installed and a Chrome / Chromium executable was found."""
    try:
        import kaleido  # noqa: F401
    except ImportError:
        return False
    return chromium_path() is not None


# ----------------------------------------------------------------------------------------------
# The kaleido session: one Chromium per process, driven from a private asyncio loop thread
# ----------------------------------------------------------------------------------------------


class _Session:
    """A started kaleido.Kaleido on its own event loop thread; ``render`` is blocking and thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._kaleido = None
        self._pid = None

    def _run(self, coro, timeout: float):
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except FutureTimeout:
            future.cancel()
            raise ExportError(f"kaleido did not answer within {timeout:g} s") from None

    def _start(self) -> None:
        import kaleido

        path = chromium_path()
        if path is None:
            raise ExportError(CHROMIUM_HINT)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="attnlab-kaleido", daemon=True)
        self._thread.start()
        self._pid = os.getpid()

        async def start():
            # mathjax=False: no CDN request (we run offline); plotly.js comes from the plotly package.
            k = kaleido.Kaleido(n=1, timeout=RENDER_TIMEOUT_S, mathjax=False, path=path)
            await k.open()
            return k

        try:
            self._kaleido = self._run(start(), START_TIMEOUT_S)
        except Exception as exc:
            self._stop_loop()
            raise ExportError(f"could not start Chromium at {path} for static export: {exc}") from exc

    def _stop_loop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=10)
            if not self._loop.is_running():
                self._loop.close()
        self._loop = self._thread = self._kaleido = None

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._kaleido is not None and self._pid == os.getpid():
            try:
                self._run(self._kaleido.close(), 20.0)
            except Exception:  # noqa: BLE001  closing a broken browser: nothing more to do
                pass
        if self._pid == os.getpid():
            self._stop_loop()
        self._loop = self._thread = self._kaleido = None

    def render(self, fig: dict, opts: dict) -> bytes:
        with self._lock:
            if self._kaleido is not None and self._pid != os.getpid():  # forked: the browser is not ours
                self._loop = self._thread = self._kaleido = None
            for attempt in (1, 2):
                if self._kaleido is None:
                    self._start()
                try:
                    return self._run(self._kaleido.calc_fig(fig, opts=opts), RENDER_TIMEOUT_S + 10)
                except Exception as exc:  # noqa: BLE001  a dead or stuck browser: restart it once
                    self._close()
                    if attempt == 2:
                        raise ExportError(f"static export ({opts.get('format')}) failed: {exc}") from exc
        raise AssertionError("unreachable")


_SESSION = _Session()
atexit.register(_SESSION.close)


def close_session() -> None:
    """Stop the Chromium kept for static export (the next static export starts a new one)."""
    _SESSION.close()


# ----------------------------------------------------------------------------------------------
# Figures
# ----------------------------------------------------------------------------------------------


def _target(path_or_format) -> tuple[Path | None, str]:
    if isinstance(path_or_format, str) and path_or_format.lower().lstrip(".") in FORMATS \
            and os.sep not in path_or_format:
        return None, path_or_format.lower().lstrip(".")
    path = Path(path_or_format)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise ValueError(f"path_or_format must be one of {FORMATS} or a file path ending in one of them, "
                         f"got {str(path_or_format)!r}")
    return path, fmt


def _temporary_sibling(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def _write_atomic(path: Path, data: bytes) -> None:
    """Write via a temporary file in the same folder, so a failure never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_sibling(path)
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def export_figure(
    fig: go.Figure,
    path_or_format,
    *,
    width: int | None = None,
    height: int | None = None,
    scale: float | None = None,
    include_plotlyjs: bool | str = True,
) -> Path | bytes | str:
    """Export a figure to a file, or return it in memory.

    Args:
        fig: a plotly Figure (or its dict).
        path_or_format: a file path ending in .png / .svg / .pdf / .html / .json (written atomically,
            folders created; returns the Path), or just the format name ("png", "svg", "pdf" return
            bytes; "html", "json" return str).
        width, height: image size in layout pixels (default: the figure's own, else 700 x 500).
        scale: pixel multiplier for PNG (e.g. 2 for high-DPI).
        include_plotlyjs: HTML only: True inlines plotly.js (works offline, ~4.5 MB), "cdn" links it.

    Raises:
        ExportError: static formats without a usable Chromium (message: how to install it), or a
            failed render. ValueError: an unknown format.
    """
    path, fmt = _target(path_or_format)
    fig = fig if isinstance(fig, go.Figure) else go.Figure(fig)
    if fmt == "html":
        text = fig.to_html(include_plotlyjs=include_plotlyjs, full_html=True)
        data = text.encode("utf-8")
    elif fmt == "json":
        text = fig.to_json()
        data = text.encode("utf-8")
    else:
        try:
            import kaleido  # noqa: F401
        except ImportError:
            raise ExportError(f"{CHROMIUM_HINT}; it also needs the Python package kaleido") from None
        if chromium_path() is None:
            raise ExportError(CHROMIUM_HINT)
        opts = {
            "format": fmt,
            "width": width or fig.layout.width or DEFAULT_SIZE[0],
            "height": height or fig.layout.height or DEFAULT_SIZE[1],
            "scale": scale or 1,
        }
        data = _SESSION.render(fig.to_dict(), opts)
        text = None
    if path is None:
        return text if fmt in ("html", "json") else data
    _write_atomic(path, data)
    return path


@dataclass
class ExportReport:
    """What ``export_figures`` wrote, and what it skipped with the reason."""

    written: list[Path] = field(default_factory=list)
    skipped: list[Path] = field(default_factory=list)
    note: str | None = None  # e.g. the Chromium hint when static formats were skipped


def export_figures(
    figures: Mapping[str, go.Figure], out_dir, formats: Iterable[str] = ("html", "png"), **kwargs
) -> ExportReport:
    """Write every figure as ``out_dir/<name>.<format>``; static formats are skipped (with a note)
    when Chromium is missing instead of failing, HTML is always written. kwargs: ``export_figure``'s.
    """
    formats = [f.lower().lstrip(".") for f in formats]
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise ValueError(f"formats must be among {FORMATS}, got {bad}")
    report = ExportReport()
    static_ok = chromium_available() if any(f in STATIC_FORMATS for f in formats) else True
    if not static_ok:
        report.note = CHROMIUM_HINT
    out_dir = Path(out_dir)
    for name, fig in figures.items():
        for fmt in formats:
            path = out_dir / f"{name}.{fmt}"
            if fmt in STATIC_FORMATS and not static_ok:
                report.skipped.append(path)
                continue
            report.written.append(export_figure(fig, path, **kwargs))
    return report


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------


def _to_numpy(value, name: str) -> np.ndarray:
    if hasattr(value, "detach"):  # torch.Tensor
        t = value.detach().cpu()
        if t.is_floating_point() and t.element_size() < 4:  # numpy has no bfloat16
            t = t.float()
        return t.numpy()
    a = np.asarray(value)
    if a.dtype == object:
        raise ValueError(f"data[{name!r}] must be an array, a tensor or a list of numbers / strings")
    return a


def _jsonable(value):
    if hasattr(value, "detach"):
        value = value.detach().cpu().tolist()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def export_data(data, path, *, compress: bool = False) -> Path:
    """Write data; the format follows the file suffix. Returns the Path (written atomically).

    - ``.csv``: a DataFrame (e.g. ``stats.tidy_table``), or a dict of equal-length 1-D columns.
    - ``.json``: a DataFrame as a list of records, or any dict of arrays / tensors / numbers / str.
    - ``.npz``: a dict {name: tensor or array} (e.g. {"unas": weights (L, H, N, N), ...,
      "tokens": [...]}); half precision is stored as float32, token lists as unicode arrays, so
      ``np.load(path)`` needs no pickle. ``compress=True`` uses ``np.savez_compressed``.
    """
    path = Path(path)
    fmt = path.suffix.lower()
    if fmt == ".csv":
        frame = data if isinstance(data, pd.DataFrame) else pd.DataFrame(
            {k: _to_numpy(v, k) for k, v in dict(data).items()}
        )
        payload = frame.to_csv(index=False).encode("utf-8")
    elif fmt == ".json":
        obj = data.to_dict(orient="records") if isinstance(data, pd.DataFrame) else _jsonable(data)
        payload = json.dumps(obj, allow_nan=False).encode("utf-8")
    elif fmt == ".npz":
        if not isinstance(data, Mapping):
            raise ValueError(f"NPZ export needs a dict {{name: array}}, got {type(data).__name__}")
        arrays = {str(k): _to_numpy(v, str(k)) for k, v in data.items()}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = _temporary_sibling(path)
        try:
            with tmp.open("wb") as f:  # a file object: numpy would append ".npz" to a name
                (np.savez_compressed if compress else np.savez)(f, **arrays)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return path
    else:
        raise ValueError(f"path must end in .csv, .json or .npz, got {str(path)!r}")
    _write_atomic(path, payload)
    return path
