"""Models the app can analyse: the embedded MiniLM, shipped and trained attnlab checkpoints, a local
Hugging Face directory, or an uploaded checkpoint (safetensors + config).

A :class:`Source` is a small hashable description; :func:`load` turns it into a loaded model once per
server (``st.cache_resource``). Hugging Face models go through ``attnlab.hf.load_model``; native
attnlab checkpoints (``attnlab.models.load``) are wrapped in :class:`NativeModel`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import streamlit as st

from attnlab import hf
from attnlab.models import checked_step_name

REPO = Path(__file__).resolve().parents[2]
CHECKPOINTS = REPO / "checkpoints"
NATIVE_FORMAT = "attnlab-checkpoint/1"
UPLOAD_LIMIT_MB = 200  # one uploaded checkpoint file (also server.maxUploadSize)
# Files an uploaded checkpoint may contain; anything else (and any pickle) is refused.
UPLOAD_SUFFIXES = (".safetensors", ".json", ".txt", ".model")


def uploads_dir() -> Path:
    """Where uploaded checkpoints are unpacked (ATTNLAB_UPLOADS_DIR, default $TMPDIR/attnlab-uploads)."""
    return Path(os.environ.get("ATTNLAB_UPLOADS_DIR", Path(tempfile.gettempdir()) / "attnlab-uploads"))


def runs_dir() -> Path:
    """Where the Train page keeps runs (ATTNLAB_RUNS_DIR, default runs/ in the repository)."""
    return Path(os.environ.get("ATTNLAB_RUNS_DIR", REPO / "runs"))


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
    p = Path(path)
    config = p / "config.json"
    if (p / "latest.json").is_file():
        try:
            config = p / checked_step_name(json.loads((p / "latest.json").read_text())["dir"]) / "config.json"
        except (OSError, ValueError, KeyError, TypeError):
            return False
    try:
        return json.loads(config.read_text()).get("format") == NATIVE_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def checkpoint_sources() -> list[Source]:
    """Shipped checkpoints (checkpoints/*) and runs trained from the app (runs/*), newest runs first."""
    out = [
        Source("native", str(p), f"{p.name} (shipped)")
        for p in sorted(CHECKPOINTS.glob("*"))
        if (p / "latest.json").is_file()
    ]
    runs = sorted(runs_dir().glob("*/latest.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    out += [Source("native", str(p.parent), f"{p.parent.name} (run)") for p in runs]
    return out


# ----------------------------------------------------------------------------------------------
# Native attnlab checkpoints
# ----------------------------------------------------------------------------------------------


@dataclass
class NativeModel:
    """An attnlab checkpoint ready for analysis: the model, its tokenizer, and its variants swapped in."""

    model: object  # attnlab.models.TransformerLM, eval mode
    tokenizer: object  # attnlab.data tokenizer
    info: hf.ModelInfo
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    _swapped: dict = field(default_factory=dict, repr=False)

    def swapped(self, variant: str, u: float, iters: int):
        """The same weights with ``variant`` in every layer (HNAS keeps a learned theta when the
        checkpoint has one, else starts from ``u``). Cached per (variant, u, iters)."""
        from attnlab.models import ModelConfig, TransformerLM

        key = (variant, round(u, 4), iters)
        with self.lock:
            if key not in self._swapped:
                base = self.model.config.to_dict()
                if base["variant"] == variant or base["variant"] == [variant] * self.info.n_layers:
                    self._swapped[key] = self.model
                else:
                    cfg = ModelConfig.from_dict(
                        {
                            **base,
                            "variant": variant,
                            "u": min(max(u, 1e-4), 1 - 1e-4),
                            "iters": 1
                            if self.info.causal
                            else (iters if variant == "sinkhorn" else base["iters"]),
                        }
                    )
                    swapped = TransformerLM(cfg)
                    swapped.load_state_dict(self.model.state_dict(), strict=False)  # theta may be new
                    self._swapped[key] = swapped.eval()
            return self._swapped[key]


def _load_native(path: str) -> NativeModel:
    from attnlab.data import load_tokenizer
    from attnlab.models import load as load_checkpoint

    try:
        model = load_checkpoint(path)
        tokenizer = load_tokenizer(path)
    except (OSError, ValueError, KeyError, RuntimeError, TypeError) as e:
        raise hf.ModelLoadError(f"the attnlab checkpoint in {path} does not load: {e}") from None
    cfg = model.config
    variants = sorted(set(cfg.layer_variants()))
    info = hf.ModelInfo(
        path=str(Path(path).resolve()),
        name=f"{Path(path).name} ({'/'.join(variants)})",
        model_type=f"attnlab-{cfg.kind}",
        architecture=type(model).__name__,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_heads,
        max_length=cfg.max_len,
        causal=cfg.kind == "decoder",
        embedded=False,
    )
    return NativeModel(model=model, tokenizer=tokenizer, info=info)


@st.cache_resource(show_spinner="Loading the model…", max_entries=8)
def _load_cached(kind: str, path: str | None):
    if kind == "native":
        return _load_native(path)
    try:
        return hf.load_model(path)
    except ValueError:  # ModelLoadError: already worded for people
        raise
    except Exception as e:  # e.g. safetensors' SafetensorError on a corrupt weights file
        raise hf.ModelLoadError(f"the model in {path} does not load ({e.__class__.__name__}: {e})") from None


def load(source: Source):
    """LoadedModel (Hugging Face) or NativeModel; ``hf.ModelLoadError`` (a ValueError) with a message
    for people when it does not load. Failures are not cached, so a fixed directory loads next time."""
    if source.kind == "hf" and source.path is not None and is_native(source.path):
        source = Source("native", source.path, source.label)
    return _load_cached(source.kind, source.path)


# ----------------------------------------------------------------------------------------------
# Uploaded checkpoints
# ----------------------------------------------------------------------------------------------


class SessionFolder:
    """One app session's upload folder, ``uploads_dir() / name``: removed with everything in it when
    this object is garbage collected, which happens when the session (whose ``st.session_state``
    holds it) ends."""

    def __init__(self, name: str):
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise ValueError(f"session folder name must be 1-64 letters, digits, '-' or '_', got {name!r}")
        self.name = name
        self.path = uploads_dir() / name
        weakref.finalize(self, shutil.rmtree, str(self.path), True)


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
    root = uploads_dir() if session is None else session.path
    target = root / digest.hexdigest()[:16]
    if not target.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".upload-", dir=root))
        for name, (_, data) in zip(names, files, strict=True):
            (tmp / name).write_bytes(data)
        os.replace(tmp, target)
    kind = "native" if is_native(target) else "hf"
    return Source(kind, str(target), f"upload {target.name[:8]}")
