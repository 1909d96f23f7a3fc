"""Models the app can analyse: the embedded MiniLM, shipped and trained attnlab checkpoints, a local
Hugging Face directory, or an uploaded checkpoint (safetensors + config).

A :class:`Source` is a small hashable description; :func:`load` turns it into a loaded model once per
server (``st.cache_resource``). Every model goes through ``attnlab.hf.load_model``: Hugging Face
directories as ``hf.LoadedModel``, native attnlab checkpoints as ``hf.NativeModel``.

Model paths come from the page URL (``?model_dir=``) and the text box, so they are untrusted: only
directories under the allowed roots load (:func:`model_roots`: the repository's ``checkpoints/``, the
runs directory, the uploads directory, and any listed in ``ATTNLAB_MODEL_ROOTS``; docs/APP.md).

Uploads go to a per-session :class:`SessionFolder`, removed when the session ends; the folders of a
server that was killed outright are removed by the next server's start-up sweep
(:func:`sweep_uploads_once`, :func:`sweep_stale_uploads`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import streamlit as st

from attnlab import hf
from attnlab.checkpoint_io import is_checkpoint

REPO = Path(__file__).resolve().parents[2]
CHECKPOINTS = REPO / "checkpoints"
UPLOAD_LIMIT_MB = 200  # one uploaded checkpoint file (also server.maxUploadSize)
# Files an uploaded checkpoint may contain; anything else (and any pickle) is refused.
UPLOAD_SUFFIXES = (".safetensors", ".json", ".txt", ".model")
OWNER_FILE = ".owner.json"  # in a session folder: the server process that made it (see sweep_stale_uploads)


def uploads_dir() -> Path:
    """Where uploaded checkpoints are unpacked (ATTNLAB_UPLOADS_DIR, default $TMPDIR/attnlab-uploads)."""
    return Path(os.environ.get("ATTNLAB_UPLOADS_DIR", Path(tempfile.gettempdir()) / "attnlab-uploads"))


def runs_dir() -> Path:
    """Where the Train page keeps runs (ATTNLAB_RUNS_DIR, default runs/ in the repository)."""
    return Path(os.environ.get("ATTNLAB_RUNS_DIR", REPO / "runs"))


MODEL_ROOTS_ENV = "ATTNLAB_MODEL_ROOTS"


def model_roots() -> list[Path]:
    """Folders the app may load models from: the shipped ``checkpoints/``, the runs directory, the
    uploads directory, and the folders listed in ``ATTNLAB_MODEL_ROOTS`` (separated by ``os.pathsep``,
    e.g. ``/models:/home/me/hf``). Anything else a URL or the text box names is refused."""
    extra = [Path(p).expanduser() for p in os.environ.get(MODEL_ROOTS_ENV, "").split(os.pathsep) if p.strip()]
    return [CHECKPOINTS, runs_dir(), uploads_dir(), *extra]


def check_model_path(path: str) -> Path:
    """``path`` resolved (symlinks followed) when it lies under one of :func:`model_roots`; else a
    ValueError naming it, the allowed roots and the setting that adds one."""
    try:
        target = Path(path).expanduser().resolve()
    except (OSError, RuntimeError, ValueError) as e:  # a loop of links, a NUL byte
        raise ValueError(f"model directory {path!r} cannot be resolved ({e.__class__.__name__})") from None
    roots = model_roots()
    for root in roots:
        try:
            target.relative_to(root.expanduser().resolve())
            return target
        except (ValueError, OSError):
            continue
    shown = ", ".join(str(r) for r in roots)
    raise ValueError(
        f"model directory {path!r} is outside the folders this app loads models from ({shown}); "
        f"expected a folder under one of them (the server's {MODEL_ROOTS_ENV} adds folders)"
    )


@dataclass(frozen=True)
class Source:
    """What to load: kind "hf" (path None = embedded MiniLM) or "native" (attnlab checkpoint)."""

    kind: str
    path: str | None
    label: str

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.path or 'embedded'}"


EMBEDDED = Source("hf", None, "MiniLM-L6 (embedded)")


def is_native(path: str | Path) -> bool:
    """True for an attnlab checkpoint directory (a run with latest.json, or a step directory)."""
    return is_checkpoint(path)


def _run_source(run: Path, label: str) -> Source | None:
    """A run directory (latest.json) as a model: attnlab's own checkpoint, or the Hugging Face model a
    recipe on a Hugging Face model wrote to ``RUN/model`` (e.g. s2s-hnas's BART; recipe.json names its
    kind); None for a run with neither (a retrofit's θ alone)."""
    from attnlab.train.config import recipe_file_kind

    if recipe_file_kind(run / "recipe.json") is None:
        return Source("native", str(run), label)
    if (run / "model" / "config.json").is_file():
        return Source("hf", str(run / "model"), label)
    return None


def checkpoint_sources() -> list[Source]:
    """Shipped checkpoints (checkpoints/*) and runs trained from the app (runs/*), newest runs first:
    attnlab's own checkpoints, and the model/ of a shipped Hugging Face recipe run (s2s-hnas-s*)."""
    shipped = [_run_source(p, f"{p.name} (shipped)") for p in sorted(CHECKPOINTS.glob("*"))
               if (p / "latest.json").is_file()]
    runs = sorted(runs_dir().glob("*/latest.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    return [s for s in [*shipped, *(_run_source(p.parent, f"{p.parent.name} (run)") for p in runs)] if s]


# Native attnlab checkpoints load through the library like any model (attnlab.hf.load.native).
NativeModel = hf.NativeModel


def app_device() -> str:
    """Where the app runs Hugging Face models: ``ATTNLAB_DEVICE`` (``auto``, ``cpu``, ``cuda``,
    ``cuda:N``), default ``auto``: a GPU when torch sees one, else the CPU. Native attnlab
    checkpoints (small) stay on the CPU."""
    return os.environ.get("ATTNLAB_DEVICE", "auto")


@st.cache_resource(show_spinner="Loading the model…", max_entries=8)
def _load_cached(kind: str, path: str | None):
    try:  # native checkpoints (small) stay on the CPU
        return hf.load_model(path, device="cpu" if kind == "native" else app_device())
    except ValueError:  # ModelLoadError: already worded for people
        raise
    except Exception as e:  # e.g. safetensors' SafetensorError on a corrupt weights file
        raise hf.ModelLoadError(f"the model in {path} does not load ({e.__class__.__name__}: {e})") from None


def load(source: Source):
    """hf.LoadedModel (Hugging Face) or hf.NativeModel; ``hf.ModelLoadError`` (a ValueError) with a message
    for people when it does not load. Failures are not cached, so a fixed directory loads next time."""
    if source.path is not None:
        check_model_path(source.path)  # the URL and the text box are untrusted
    if source.kind == "hf" and source.path is not None and is_native(source.path):
        source = Source("native", source.path, source.label)
    return _load_cached(source.kind, source.path)


# ----------------------------------------------------------------------------------------------
# Uploaded checkpoints
# ----------------------------------------------------------------------------------------------


class SessionFolder:
    """One app session's upload folder, ``uploads_dir() / name``: removed with everything in it when
    this object is garbage collected, which happens when the session (whose ``st.session_state``
    holds it) ends. :meth:`create` also writes ``.owner.json`` (this server's pid, its start time and
    PID namespace), from which :func:`sweep_stale_uploads` tells the folders of dead servers."""

    def __init__(self, name: str):
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise ValueError(f"session folder name must be 1-64 letters, digits, '-' or '_', got {name!r}")
        self.name = name
        self.path = uploads_dir() / name
        weakref.finalize(self, shutil.rmtree, str(self.path), True)

    def create(self) -> Path:
        """Make the folder, marked as this server process's; -> its path."""
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / OWNER_FILE).write_text(json.dumps(_this_process()))
        return self.path


def _process_stat(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks after boot) of a process from /proc/PID/stat; None when there
    is no such process or no /proc (not Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], fields[19]  # fields 3 and 22 of proc(5)


def _pid_namespace() -> str:
    """Where a pid means something: this host and PID namespace (containers number processes anew)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")  # e.g. "pid:[4026531836]"
    except OSError:
        namespace = ""
    return f"{socket.gethostname()} {namespace}"


def _this_process() -> dict:
    stat = _process_stat(os.getpid())
    return {"pid": os.getpid(), "start": stat and stat[1], "pid_namespace": _pid_namespace()}


def _owner_is_dead(owner: dict) -> bool:
    """True only when it is certain that the process that wrote ``owner`` has ended: same host and PID
    namespace, and the pid is gone, a zombie, or now a different process (another start time)."""
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0 or owner.get("pid_namespace") != _pid_namespace():
        return False  # unreadable, or from another machine / container: its pid says nothing here
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # exists, owned by another user
    stat = _process_stat(pid)
    if stat is None:
        return False  # no /proc: it exists, which is all we know
    state, start = stat
    return state == "Z" or (owner.get("start") is not None and start != owner["start"])


def sweep_stale_uploads(root: str | os.PathLike | None = None) -> list[Path]:
    """Remove the session folders under ``root`` (default :func:`uploads_dir`) whose server process has
    ended (killed outright, so its sessions never ran their clean-up); -> the folders removed.

    Only folders with a readable ``.owner.json`` naming a dead process of this host and PID namespace
    go (see :func:`_owner_is_dead`): a live server's folder, a folder being created, one from another
    container sharing the directory, symlinks and anything else are left alone.
    """
    root = uploads_dir() if root is None else Path(root)
    removed = []
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        if folder.is_symlink() or not folder.is_dir():
            continue
        try:
            owner = json.loads((folder / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(owner, dict) and _owner_is_dead(owner):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


@st.cache_resource(show_spinner=False)
def _sweep_once(root: str) -> tuple[str, ...]:
    try:
        removed = sweep_stale_uploads(root)
    except OSError as e:  # an unreadable uploads directory must not stop the app
        logging.getLogger("attnlab.app").warning("could not sweep the upload folders in %s: %s", root, e)
        return ()
    if removed:
        logging.getLogger("attnlab.app").info(
            "removed %d upload folder(s) left by ended servers in %s", len(removed), root
        )
    return tuple(p.name for p in removed)


def sweep_uploads_once() -> tuple[str, ...]:
    """:func:`sweep_stale_uploads` of the current uploads directory, once per server process (the entry
    point calls it on every run; ``st.cache_resource`` makes the later calls free); -> names removed."""
    return _sweep_once(str(uploads_dir()))


def save_upload(files: list[tuple[str, bytes]], session: SessionFolder | None = None) -> Source:
    """Write uploaded checkpoint files into a directory named by their hash (inside ``session``'s
    folder when given, so that it goes when the session ends); -> its Source.

    Expects ``config.json`` and ``model.safetensors`` (plus tokenizer files: ``vocab.txt`` for an
    attnlab checkpoint, tokenizer.json / tokenizer_config.json ... for a Hugging Face one).
    Raises ValueError naming what is missing or not allowed.
    """
    names = [Path(name).name for name, _ in files]
    bad = [n for n in names if not n.endswith(UPLOAD_SUFFIXES)]
    if bad:
        raise ValueError(
            f"not allowed in a checkpoint upload: {', '.join(bad)} (only safetensors weights, "
            "JSON configs and tokenizer files; pickles are never loaded)"
        )
    missing = [n for n in ("config.json", "model.safetensors") if n not in names]
    if missing:
        raise ValueError(f"the upload needs {' and '.join(missing)} (got {', '.join(names) or 'nothing'})")
    digest = hashlib.sha256()
    for name, data in sorted(zip(names, (d for _, d in files), strict=True)):
        digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    root = uploads_dir() if session is None else session.create()
    target = root / digest.hexdigest()[:16]
    if not target.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".upload-", dir=root))
        for name, (_, data) in zip(names, files, strict=True):
            (tmp / name).write_bytes(data)
        os.replace(tmp, target)
    kind = "native" if is_native(target) else "hf"
    return Source(kind, str(target), f"upload {target.name[:8]}")
