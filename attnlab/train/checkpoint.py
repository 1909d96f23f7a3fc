"""Crash-safe training checkpoints (safetensors + JSON only; nothing is unpickled).

A run directory holds::

    recipe.json           the run configuration (written once)
    metrics.jsonl         one JSON object per logged step
    latest.json           {"step": N, "dir": "step-00000N"}: the last complete checkpoint
    step-00000N/          config.json, model.safetensors, optimizer.safetensors (optional),
                          trainer_state.json, vocab.txt (wordpiece tokenizer)

A checkpoint is written into a hidden temporary directory, every file fsynced, the directory renamed
to ``step-N`` and only then ``latest.json`` replaced atomically (temp file, fsync, rename, fsync of the
directory). A kill at any instant therefore leaves ``latest.json`` pointing at a complete checkpoint;
older step directories are pruned only after the pointer moved.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from attnlab.checkpoint_io import (
    LATEST_FILE,
    atomic_write_bytes,
    atomic_write_json,
    checked_step_name,
    fsync_dir,
)
from attnlab.models import save
from attnlab.schema import Field, SchemaError, check_fields, check_trainer_state, loads, read_json

__all__ = ["save_checkpoint", "write_step", "read_latest", "load_optimizer_state", "load_trainer_state",
           "optimizer_tensors", "clean_temporary", "CheckpointError"]

OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "trainer_state.json"
TMP_PREFIX = ".tmp-step-"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says which and what is intact."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """AdamW state as flat tensors ``state.<param index>.<key>`` plus JSON-able param groups."""
    sd = optimizer.state_dict()
    tensors = {}
    for idx, st in sd["state"].items():
        for key, value in st.items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            tensors[f"state.{idx}.{key}"] = t.detach().cpu().contiguous()
    return tensors, {"param_groups": sd["param_groups"]}


def load_optimizer_state(optimizer: torch.optim.Optimizer, step_dir: Path) -> None:
    path = Path(step_dir) / OPTIMIZER_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{path} is missing: this checkpoint was saved without optimizer state (train.keep_optimizer="
            "false) and cannot be resumed exactly"
        )
    from safetensors import SafetensorError, safe_open  # metadata only

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = loads((f.metadata() or {}).get("optimizer", "null"), f"{path} (metadata 'optimizer')")
        groups = meta.get("param_groups") if isinstance(meta, dict) else None
        if not isinstance(groups, list) or len(groups) != len(optimizer.param_groups):
            raise SchemaError(f"{path}: metadata 'optimizer' must hold param_groups, one per parameter group "
                              f"({len(optimizer.param_groups)}), got {type(groups).__name__}")
        tensors = st_load(path.read_bytes())
        state: dict[int, dict] = {}
        n_params = sum(len(g["params"]) for g in optimizer.param_groups)
        for name, t in tensors.items():
            parts = name.split(".", 2)
            if len(parts) != 3 or parts[0] != "state" or not parts[1].isdigit() or int(parts[1]) >= n_params:
                raise SchemaError(f"{path}: tensor names must be state.<parameter index < {n_params}>.<key>, "
                                  f"got {name[:60]!r}")
            state.setdefault(int(parts[1]), {})[parts[2]] = t
        device = optimizer.param_groups[0]["params"][0].device
        for st in state.values():
            for key, t in st.items():
                st[key] = t if key == "step" else t.to(device)
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except SafetensorError as e:
        raise CheckpointError(f"{path} is not a valid safetensors file ({e}); the run cannot be resumed "
                              "exactly") from None
    except (SchemaError, KeyError, TypeError, ValueError) as e:  # torch's checks of a crafted state
        brief = " ".join(str(e).split())[:200]
        raise CheckpointError(f"{path} does not fit this run's optimizer ({e.__class__.__name__}: {brief}); "
                              "the run cannot be resumed exactly") from None


def load_trainer_state(step_dir: Path, step: int | None = None) -> dict:
    """``trainer_state.json`` of a checkpoint, validated (:func:`attnlab.schema.check_trainer_state`:
    step >= 0 and equal to ``step`` when given, data position, counts); CheckpointError otherwise."""
    path = Path(step_dir) / STATE_FILE
    try:
        return check_trainer_state(read_json(path), path, step)
    except SchemaError as e:
        raise CheckpointError(f"{e}; the run cannot be resumed from this checkpoint") from None


def read_latest(run_dir: Path) -> dict | None:
    """``latest.json`` of a run directory, or None when it has no checkpoint yet."""
    p = Path(run_dir) / LATEST_FILE
    if not p.is_file():
        return None
    try:
        latest = check_fields(read_json(p), {"step": Field("int", low=0), "dir": Field("str")}, p)
        checked_step_name(latest["dir"], p)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    if not (Path(run_dir) / latest["dir"]).is_dir():
        raise CheckpointError(f"{p} points at {latest['dir']}, which is missing")
    return latest


def clean_temporary(run_dir: Path) -> None:
    """Remove half-written checkpoint directories left by a kill."""
    for p in Path(run_dir).glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(p, ignore_errors=True)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def save_checkpoint(run_dir: Path, step: int, model, optimizer, trainer_state: dict, extra_config: dict,
                    tokenizer, keep: int, with_optimizer: bool = True) -> Path:
    """Write checkpoint ``step`` of ``model`` (unwrapped) and ``optimizer``; move latest.json to it.

    On any failure (full disk, ...) the temporary directory is removed, latest.json is untouched and a
    ``CheckpointError`` names the step that is still the last good one.
    """

    def write(tmp: Path) -> None:
        tok_entry = tokenizer.save(tmp)
        save(model, tmp, extra_config={**extra_config, "tokenizer": tok_entry, "step": step},
             metadata={"step": step})

    return write_step(run_dir, step, write, optimizer if with_optimizer else None, trainer_state, keep)


def write_step(run_dir: Path, step: int, write: Callable[[Path], None], optimizer, trainer_state: dict,
               keep: int) -> Path:
    """The crash-safe step directory of any trainer: ``write(tmp)`` puts its weights into the temporary
    directory, then the optimizer state (unless None) and ``trainer_state.json`` follow, every file is
    fsynced, the directory renamed to ``step-N`` and latest.json moved to it; old steps pruned to
    ``keep``. CheckpointError (naming the last good step) when any of it fails."""
    run_dir = Path(run_dir)
    final = run_dir / step_dir_name(step)
    tmp = run_dir / f"{TMP_PREFIX}{step:08d}-{os.getpid()}"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        write(tmp)
        if optimizer is not None:
            tensors, meta = optimizer_tensors(optimizer)
            atomic_write_bytes(tmp / OPTIMIZER_FILE,
                               st_save(tensors, metadata={"optimizer": json.dumps(meta), "step": str(step)}))
        atomic_write_json(tmp / STATE_FILE, {**trainer_state, "step": step})
        for p in tmp.iterdir():
            _fsync_file(p)
        fsync_dir(tmp)
        if final.exists():  # an orphan from a run killed between this rename and the pointer update
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(run_dir)
        atomic_write_json(run_dir / LATEST_FILE, {"step": step, "dir": final.name})
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        latest = None
        try:
            latest = read_latest(run_dir)
        except (OSError, ValueError, CheckpointError):
            pass
        kept = (f"the last good checkpoint (step {latest['step']}) is intact" if latest
                else "no earlier checkpoint")
        raise CheckpointError(
            f"could not save the checkpoint of step {step} in {run_dir}: {e}; {kept}"
        ) from e
    _prune(run_dir, keep, final.name)
    return final


def _prune(run_dir: Path, keep: int, latest_name: str) -> None:
    steps = sorted(p for p in run_dir.glob("step-*") if p.is_dir())
    for p in steps[:-keep] if keep > 0 else steps:
        if p.name != latest_name:
            shutil.rmtree(p, ignore_errors=True)
