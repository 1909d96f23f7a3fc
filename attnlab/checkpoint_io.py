"""Checkpoint files: atomic writes, the directory layout, reading and writing safetensors + JSON.

    write_checkpoint(dir, tensors, config)   config.json + model.safetensors, each atomically
    read_checkpoint(dir) -> (config, state)  JSON and safetensors only (nothing is ever unpickled)
    resolve_checkpoint(dir)                  a step directory, or the one a run's latest.json names
    is_checkpoint(dir)                       True for an attnlab checkpoint (run or step directory)
    read_config(step_dir)                    config.json, validated (attnlab.schema) and bounded
    safetensors_shapes(path)                 {name: shape} from the header alone (nothing loaded)

A checkpoint directory holds ``config.json`` (``{"format": CHECKPOINT_FORMAT, "model": {...}, ...}``)
and ``model.safetensors``; a training run directory holds step directories and ``latest.json``
(``{"step": N, "dir": "step-0000000N"}``) naming the last complete one.

This module knows files, not models: ``attnlab.models.save`` / ``load`` turn a model into tensors and
back, ``attnlab.data`` saves tokenizers beside them, ``attnlab.train.checkpoint`` adds optimizer state.
Imports only :mod:`attnlab.schema` from attnlab, so every layer may use it (the data flow is one way).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from attnlab.schema import SchemaError, check_checkpoint_config, read_json

__all__ = [
    "CHECKPOINT_FORMAT",
    "WEIGHTS_FILE",
    "CONFIG_FILE",
    "LATEST_FILE",
    "fsync_dir",
    "atomic_write_bytes",
    "atomic_write_json",
    "checked_step_name",
    "resolve_checkpoint",
    "is_checkpoint",
    "load_config",
    "read_config",
    "safetensors_shapes",
    "check_weight_shapes",
    "write_checkpoint",
    "read_checkpoint",
]

CHECKPOINT_FORMAT = "attnlab-checkpoint/1"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
LATEST_FILE = "latest.json"


# ----------------------------------------------------------------------------------------------
# Atomic writes
# ----------------------------------------------------------------------------------------------


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so that renames inside it survive a crash (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_file(f, data: bytes) -> None:
    """The one place bytes reach a checkpoint file (tests patch it to simulate a full disk)."""
    f.write(data)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old file or the new one:
    temporary file in the same directory, fsync, ``os.replace``, fsync of the directory."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            _write_file(f, data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8"))


# ----------------------------------------------------------------------------------------------
# Layout
# ----------------------------------------------------------------------------------------------


def checked_step_name(name, source: str | os.PathLike = LATEST_FILE) -> str:
    """``name`` when it is a plain directory name (a ``latest.json`` pointer), else ValueError: a pointer
    such as ``../../etc`` must not lead a load outside the run directory."""
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name
            or "\0" in name):
        raise ValueError(f"{source} points at {name!r}, which is not a step directory name")
    return name


def resolve_checkpoint(directory: str | os.PathLike) -> Path:
    """The directory holding ``config.json`` + ``model.safetensors``: ``directory`` itself, or the step
    directory named by its ``latest.json`` (a training run)."""
    d = Path(directory)
    if (d / LATEST_FILE).is_file():
        latest = read_json(d / LATEST_FILE)
        return d / checked_step_name(latest.get("dir") if isinstance(latest, dict) else None, d / LATEST_FILE)
    if (d / WEIGHTS_FILE).is_file() and (d / CONFIG_FILE).is_file():
        return d
    if not d.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(d)!r} does not exist")
    raise FileNotFoundError(
        f"{str(d)!r} holds no checkpoint (expected {LATEST_FILE}, or {CONFIG_FILE} + {WEIGHTS_FILE})"
    )


def is_checkpoint(directory: str | os.PathLike) -> bool:
    """True for an attnlab checkpoint directory (a run with ``latest.json`` or a step directory) whose
    ``config.json`` declares ``CHECKPOINT_FORMAT``; False for anything else (a Hugging Face directory,
    a missing path, unreadable or malformed files). Reads only small JSON files."""
    try:
        config = read_json(resolve_checkpoint(directory) / CONFIG_FILE)
    except (OSError, ValueError, AttributeError, TypeError):
        return False
    return isinstance(config, dict) and config.get("format") == CHECKPOINT_FORMAT


def load_config(directory: str | os.PathLike) -> dict:
    """The full ``config.json`` of a checkpoint (model, data, train, tokenizer, step), validated."""
    return read_config(resolve_checkpoint(directory))


def read_config(step_dir: str | os.PathLike) -> dict:
    """``config.json`` of a step directory, validated by :func:`attnlab.schema.check_checkpoint_config`
    (types, ranges, required fields, depth) before anything is built from it; SchemaError (a
    ValueError) naming the file and the field otherwise."""
    path = Path(step_dir) / CONFIG_FILE
    config = read_json(path)
    if not isinstance(config, dict) or config.get("format") != CHECKPOINT_FORMAT:
        found = config.get("format") if isinstance(config, dict) else type(config).__name__
        raise SchemaError(f"{path} is not an attnlab checkpoint (format {found!r}, expected "
                          f"{CHECKPOINT_FORMAT!r})")
    return check_checkpoint_config(config, path)


def safetensors_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of a safetensors file, from its header alone (the safetensors library
    validates the header and the offsets against the file's size; no tensor is read). ValueError
    naming the file when it is not a valid safetensors file."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    except SafetensorError as e:  # truncated, random bytes, a pickle renamed
        raise ValueError(f"{path} is not a valid safetensors file ({e})") from None


def check_weight_shapes(path: str | os.PathLike, expected: dict[str, tuple[int, ...]],
                        config_path: str | os.PathLike) -> None:
    """The tensors of the safetensors file ``path`` (read from its header) are exactly ``expected``
    ({name: shape}, what the config in ``config_path`` builds); ValueError naming the first tensor
    that is missing, unexpected or of another shape."""
    got = safetensors_shapes(path)
    missing = [k for k in expected if k not in got]
    extra = [k for k in got if k not in expected]
    wrong = [k for k in expected if k in got and tuple(got[k]) != tuple(expected[k])]
    if missing or extra or wrong:
        if wrong:
            k = wrong[0]
            what = (f"tensor {k} has shape {tuple(got[k])} in the weights, the config builds "
                    f"{tuple(expected[k])}")
        elif missing:
            what = f"{len(missing)} tensors the config builds are missing (e.g. {missing[0]})"
        else:
            what = f"{len(extra)} tensors are not built by the config (e.g. {extra[0]})"
        raise SchemaError(f"{path} does not match {config_path}: {what}; expected the weights the "
                          "config describes (n_layers, d_model, d_ff, vocab_size, max_len ...)")


# ----------------------------------------------------------------------------------------------
# Reading and writing
# ----------------------------------------------------------------------------------------------


def write_checkpoint(directory: str | os.PathLike, tensors: dict[str, torch.Tensor], config: dict,
                     metadata: dict | None = None) -> Path:
    """Write ``config.json`` (``{"format": CHECKPOINT_FORMAT, **config}``) and ``model.safetensors``
    (``tensors`` on the CPU, ``metadata`` as strings) into ``directory`` (created), each atomically."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    meta = {k: str(v) for k, v in (metadata or {}).items()}
    atomic_write_bytes(d / WEIGHTS_FILE, st_save(tensors, metadata={"format": "pt", **meta}))
    atomic_write_json(d / CONFIG_FILE, {**config, "format": CHECKPOINT_FORMAT})
    return d


def read_checkpoint(directory: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor], Path]:
    """-> (config.json, tensors of model.safetensors, the step directory) of a run or step directory.

    FileNotFoundError when there is no checkpoint; ValueError when ``config.json`` is not an attnlab
    checkpoint's or the weights are not a valid safetensors file (truncated, another format).
    """
    step_dir = resolve_checkpoint(directory)
    config = read_config(step_dir)
    try:
        state = st_load((step_dir / WEIGHTS_FILE).read_bytes())
    except SafetensorError as e:  # truncated or not a safetensors file; a plain Exception subclass
        raise ValueError(f"{step_dir / WEIGHTS_FILE} is not a valid safetensors file ({e})") from None
    return config, state, step_dir
