"""Training runs started from the app: ``attnlab train`` in a background process per run.

A run is a directory under ``runs_dir()`` (runs/ by default) holding what ``attnlab train`` writes
(recipe.json, metrics.jsonl, latest.json, step-N/) plus the app's own files:

    app_config.json   the run configuration the app built (``attnlab train --config``)
    app_process.json  pid and command of the latest (re)start
    app_stop.json     written when the user stops the run
    exit_code         written by the process wrapper when ``attnlab train`` ends
    train.log         its stdout and stderr

The process runs in its own session (``start_new_session``), so it keeps going when the tab closes
or the server restarts; a page finds it again by scanning the runs directory. Stopping sends SIGTERM
to its process group: the trainer finishes its current step, writes a checkpoint of it and exits
(nothing is lost), and Resume continues from that checkpoint (``attnlab train --resume``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from appkit.sources import REPO, runs_dir

CONFIG = "app_config.json"
PROCESS = "app_process.json"
STOP = "app_stop.json"
EXIT = "exit_code"
LOG = "train.log"
RECENT_S = 60.0  # a shell-started run whose metrics changed this recently is running
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_CHILDREN: dict[int, subprocess.Popen] = {}  # started by this server process: polled to reap them


@dataclass
class Run:
    """A run directory and what it says about its process."""

    dir: Path
    status: str  # "running" | "finished" | "stopped" | "failed" | "starting"
    step: int  # last checkpointed step (0 before the first checkpoint)
    logged_step: int  # last step in metrics.jsonl
    steps: int  # train.steps of the configuration
    pid: int | None

    @property
    def name(self) -> str:
        return self.dir.name

    @property
    def active(self) -> bool:
        return self.status in ("running", "starting")

    def records(self) -> list[dict]:
        from attnlab.train import read_metrics

        return read_metrics(self.dir / "metrics.jsonl")

    def log_tail(self, lines: int = 20) -> str:
        p = self.dir / LOG
        return "\n".join(p.read_text(errors="replace").splitlines()[-lines:]) if p.is_file() else ""


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _alive(pid: int | None, run_dir: Path) -> bool:
    """True when ``pid`` is a live (not zombie) process training ``run_dir``."""
    if not pid:
        return False
    child = _CHILDREN.get(pid)
    if child is not None:  # started by this server: ask the process itself
        if child.poll() is None:
            # Alive. Its /proc cmdline may not name the run yet: between fork and exec it is still
            # the server's command line, so the check below called a just-started run dead, the
            # Train page drew it without polling and stayed at "starting — step 0" (issue 14).
            return True
        _CHILDREN.pop(pid, None)  # reaped: ended
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z" and str(run_dir) in cmdline


def inspect(run_dir: Path) -> Run:
    """The state of one run directory."""
    config = _read_json(run_dir / CONFIG) or _read_json(run_dir / "recipe.json")
    steps = int(config.get("train", {}).get("steps", 0) or 0)
    latest = _read_json(run_dir / "latest.json")
    step = int(latest.get("step", 0) or 0)
    from attnlab.train import read_metrics

    records = read_metrics(run_dir / "metrics.jsonl")
    logged = records[-1]["step"] if records else 0
    pid = _read_json(run_dir / PROCESS).get("pid")
    if _alive(pid, run_dir) or (pid is None and _writing(run_dir, logged, steps)):
        status = "running" if records else "starting"
    elif steps and step >= steps:
        status = "finished"
    elif (run_dir / STOP).is_file():
        status = "stopped"
    else:
        code = (run_dir / EXIT).read_text().strip() if (run_dir / EXIT).is_file() else ""
        status = "failed" if code not in ("", "0") or not (run_dir / "latest.json").is_file() else "stopped"
    return Run(run_dir, status, step, logged, steps, pid)


def _writing(run_dir: Path, logged: int, steps: int) -> bool:
    """A run started from a shell (no app process to ask) counts as running while it has not reached its
    steps and its metrics.jsonl changed in the last RECENT_S seconds."""
    try:
        return logged < steps and time.time() - (run_dir / "metrics.jsonl").stat().st_mtime < RECENT_S
    except OSError:
        return False


def recipe_runs() -> tuple[list[Run], list[Run]]:
    """(retrofit runs, command-line runs) of ``attnlab train --out <runs dir>/NAME`` or
    ``<runs dir>/GROUP/NAME``, each newest first, from one scan of the runs folder for recipe.json:

    - retrofits (``--recipe retrofit-hnas``, ``s2s-hnas``: their recipe.json's kind), whose u the Hybrid
      weights page shows;
    - runs started from a shell (a recipe.json and metrics.jsonl, no app config; retrofits excepted),
      e.g. scripts/hnas_scale.sh's runs/hnas-scale/enc8-hnas-s0, shown there while they train."""
    from attnlab.train.retrofit import is_retrofit_run

    root = runs_dir()
    found = [*root.glob("*/recipe.json"), *root.glob("*/*/recipe.json")] if root.is_dir() else []
    dirs = sorted((p.parent for p in found), key=lambda p: p.stat().st_mtime, reverse=True)
    retrofit = [p for p in dirs if is_retrofit_run(p)]
    cli = [p for p in dirs
           if p not in retrofit and not (p / CONFIG).is_file() and (p / "metrics.jsonl").is_file()]
    return [inspect(p) for p in retrofit], [inspect(p) for p in cli]


def list_runs() -> list[Run]:
    """Runs started from the app, newest first."""
    root = runs_dir()
    dirs = [p for p in root.glob("*") if (p / CONFIG).is_file()] if root.is_dir() else []
    return [inspect(p) for p in sorted(dirs, key=lambda p: p.stat().st_mtime, reverse=True)]


def _launch(run_dir: Path, resume: bool) -> None:
    cmd = [
        sys.executable,
        "-m",
        "attnlab.cli",
        "train",
        "--config",
        str(run_dir / CONFIG),
        "--out",
        str(run_dir),
        "--no-progress",
    ] + (["--resume"] if resume else [])
    spawn(run_dir, cmd, {"resume": resume})


def spawn(run_dir: Path, cmd: list[str], extra: dict | None = None, log: str = LOG) -> None:
    """Start ``cmd`` (an ``attnlab`` command naming ``run_dir``) in the background for ``run_dir``:
    its own session, output to ``log``, exit status to ``exit_code``, pid to ``app_process.json``."""
    # A shell wrapper records the exit status, so a later server still knows how the run ended. It
    # ignores Stop's SIGTERM (trap) and waits: the run counts as alive until the trainer has written
    # its checkpoint and exited, so Resume cannot start a second trainer on the same directory.
    script = f"trap : TERM INT; {shlex.join(cmd)}; echo $? > {shlex.quote(str(run_dir / EXIT))}"
    (run_dir / EXIT).unlink(missing_ok=True)
    (run_dir / STOP).unlink(missing_ok=True)
    env = {
        **os.environ,
        "OMP_WAIT_POLICY": "PASSIVE",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    with open(run_dir / log, "ab") as fh:
        proc = subprocess.Popen(
            ["/bin/sh", "-c", script],
            cwd=REPO,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
    _CHILDREN[proc.pid] = proc
    (run_dir / PROCESS).write_text(
        json.dumps({"pid": proc.pid, "command": cmd, **(extra or {}), "started": time.time()})
    )


def make_config(
    name: str,
    *,
    kind: str,
    variant: str | list[str],
    n_layers: int,
    n_heads: int,
    d_model: int,
    steps: int,
    batch_size: int,
    seq_len: int,
    threads: int,
    tokenizer: str,
) -> dict:
    """A run configuration (the format of attnlab/recipes/*.json) from the Train form; logging,
    evaluation and checkpoint intervals scale with the number of steps (checkpoints every <= 50 steps;
    Stop also writes one)."""
    steps = int(steps)
    return {
        "name": name,
        "description": "started from the attnlab app",
        "model": {
            "kind": kind,
            "d_model": int(d_model),
            "n_layers": int(n_layers),
            "n_heads": int(n_heads),
            "d_ff": 2 * int(d_model),
            "variant": variant,
        },
        "data": {"corpus": "kjv", "tokenizer": tokenizer, "seq_len": int(seq_len)},
        "train": {
            "steps": steps,
            "batch_size": int(batch_size),
            "warmup": min(100, steps // 10),
            "eval_every": max(1, min(100, steps // 10)),
            "log_every": max(1, min(10, steps // 50)),
            "save_every": max(1, min(50, steps // 10)),
            "threads": int(threads),
        },
    }


def start(name: str, config: dict, corpus: tuple[str, bytes] | None = None) -> Run:
    """Create ``runs/<name>`` with ``config`` (validated by attnlab.train.RunConfig) and start training.

    ``corpus`` = (file name, bytes) of an uploaded .txt corpus, checked and stored in the run directory.
    Raises ValueError with a message for people (bad name, existing run, bad config, bad corpus).
    """
    from attnlab.data import decode_text
    from attnlab.train import RunConfig

    if not NAME.match(name):
        raise ValueError(f"run name {name!r}: use letters, digits, '-', '_' or '.', at most 64 characters")
    run_dir = runs_dir() / name
    if run_dir.exists():
        raise ValueError(f"a run named {name!r} already exists in {runs_dir()}; pick another name")
    config = json.loads(json.dumps(config))  # a private copy
    if corpus is not None:
        file_name, data = corpus
        if not file_name.lower().endswith(".txt"):
            raise ValueError(f"{file_name} is not a .txt file; upload a plain-text corpus")
        decode_text(data, file_name)  # ValueError for binary / empty / tiny files
        config.setdefault("data", {})["corpus"] = str(run_dir / "corpus.txt")
    RunConfig.from_dict(config)  # ValueError naming the field
    run_dir.mkdir(parents=True)
    if corpus is not None:
        (run_dir / "corpus.txt").write_bytes(corpus[1])
    (run_dir / CONFIG).write_text(json.dumps(config, indent=2))
    _launch(run_dir, resume=False)
    return inspect(run_dir)


def stop(run: Run) -> None:
    """SIGTERM to the run's process group; the run keeps its last checkpoint."""
    (run.dir / STOP).write_text(json.dumps({"stopped": time.time(), "step": run.logged_step}))
    if _alive(run.pid, run.dir):
        try:
            os.killpg(run.pid, signal.SIGTERM)  # the wrapper leads its own session: pgid == pid
        except ProcessLookupError:
            pass


def resume(run: Run) -> None:
    """Continue a stopped (or failed) run from its last checkpoint."""
    if run.active:
        raise ValueError(f"run {run.name} is still running")
    if not (run.dir / "latest.json").is_file():
        raise ValueError(f"run {run.name} has no checkpoint to resume from; start a new run")
    _launch(run.dir, resume=True)


_SEED = re.compile(r"^(?P<recipe>.+)-s(?P<seed>\d+)$")


def seed_siblings(choice: str, sources: dict) -> dict:
    """{label: directory with metrics.jsonl} of the seeds of the chosen source's recipe: the sources whose
    directory name is the chosen one's with another ``-s<k>`` suffix (itself included); {} when the
    chosen one has no such suffix. ``sources``: the Hybrid weights page's {label: directory}."""
    chosen = sources.get(choice)
    match = _SEED.match(chosen.name) if chosen is not None else None
    if match is None:
        return {}
    out = {}
    for label, path in sources.items():
        m = _SEED.match(Path(path).name)
        if m and m["recipe"] == match["recipe"] and (Path(path) / "metrics.jsonl").is_file():
            out[label] = Path(path)
    return dict(sorted(out.items(), key=lambda kv: int(_SEED.match(kv[1].name)["seed"])))
