"""Corpus jobs started from the app, in a background process per run: ``attnlab corpus`` (the Corpus
page) and ``attnlab swap-eval`` (the Swap cost page), the two jobs over a corpus (:data:`KINDS`).

The mechanism is the Train page's (appkit.runs.spawn: own session, exit status recorded, found again
by scanning a directory; Stop = SIGTERM to the process group). A run lives in
``runs_dir()/corpus/NAME``:

    app_corpus.json   what the form asked for (source, variants, window, ...)
    app_process.json  pid and command of the latest (re)start; exit_code; corpus.log
    source/           an uploaded .jsonl/.csv/.parquet file, or the .txt/.md files of an uploaded zip
    result/           the run directory of the job (rows/, tables, manifest, progress.json)

A swap-eval run lives in ``runs_dir()/swap-eval/NAME`` the same way (its config also names the model).

Stopping loses nothing: shards are written atomically and Resume reruns the same command, which
skips the finished shards.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from appkit.runs import EXIT, NAME, PROCESS, STOP, _alive, _read_json, spawn
from appkit.sources import runs_dir

CONFIG = "app_corpus.json"
LOG = "corpus.log"
UPLOAD_SUFFIXES = (".jsonl", ".csv", ".parquet", ".zip")
ZIP_MEMBERS = (".txt", ".md")
MAX_ZIP_BYTES = 1 << 30  # uncompressed size accepted from an uploaded zip


def corpus_dir(kind: str = "corpus") -> Path:
    """Where runs of ``kind`` (a key of :data:`KINDS`) live."""
    return runs_dir() / KINDS[kind].folder


@dataclass
class CorpusRun:
    dir: Path
    status: str  # "starting" | "running" | "finished" | "stopped" | "failed"
    progress: dict  # progress.json of the job ({} before it starts)
    pid: int | None
    started: float = 0.0  # time.time() of the latest (re)start (app_process.json)
    kind: str = "corpus"  # a key of KINDS

    @property
    def name(self) -> str:
        return self.dir.name

    @property
    def result(self) -> Path:
        return self.dir / "result"

    @property
    def active(self) -> bool:
        return self.status in ("starting", "running")

    def log_tail(self, lines: int = 20) -> str:
        p = self.dir / LOG
        return "\n".join(p.read_text(errors="replace").splitlines()[-lines:]) if p.is_file() else ""


def inspect(run_dir: Path, kind: str = "corpus") -> CorpusRun:
    progress = _read_json(run_dir / "result" / "progress.json")
    process = _read_json(run_dir / PROCESS)
    pid = process.get("pid")
    if _alive(pid, run_dir):
        status = "running" if progress else "starting"
    elif (run_dir / "result" / KINDS[kind].finished).is_file() and progress.get("status") == "finished":
        status = "finished"
    elif (run_dir / STOP).is_file():
        status = "stopped"
    else:
        status = "failed"
    return CorpusRun(run_dir, status, progress, pid, float(process.get("started") or 0.0), kind)


def progress_line(run: CorpusRun) -> tuple[float, str]:
    """(fraction done, the progress bar's text). While the job has not yet finished a shard in this
    (re)start it says "starting…": the job writes 0 tokens/s until its first shard is done (~30 s
    on 2 cores), and after a Resume the progress it finds is the previous process's, whose rate and
    ETA no longer hold. Rate and ETA are shown only while they are this process's."""
    p = run.progress
    done, total = p.get("documents_done", 0), p.get("documents")
    of = f"{done} of {total} documents" if total else "reading the corpus"
    fraction = min(1.0, done / total) if total else 0.0
    fresh = p.get("updated", 0.0) >= run.started and p.get("tokens_per_s", 0) > 0
    if run.active and not fresh:
        before = f" ({done} of {total} documents done before)" if done and run.started else ""
        return fraction, f"**starting…** — loading the model, then the first shard{before}"
    if not run.active:
        return fraction, f"**{run.status}** — {of}"
    eta = f", ETA {p['eta_s']:.0f} s" if p.get("eta_s") else ""
    return fraction, f"**{run.status}** — {of}, {p['tokens_per_s']:,.0f} tokens/s{eta}"


def list_runs(kind: str = "corpus") -> list[CorpusRun]:
    root = corpus_dir(kind)
    dirs = [p for p in root.glob("*") if (p / CONFIG).is_file()] if root.is_dir() else []
    return [inspect(p, kind) for p in sorted(dirs, key=lambda p: p.stat().st_mtime, reverse=True)]


def _unzip(data: bytes, target: Path) -> None:
    """The .txt/.md members of a zip into ``target`` (no absolute paths, no '..', bounded size)."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile:
        raise ValueError("the uploaded .zip is not a zip archive") from None
    members = [m for m in archive.infolist() if not m.is_dir() and m.filename.lower().endswith(ZIP_MEMBERS)]
    if not members:
        raise ValueError("the uploaded .zip holds no .txt or .md files")
    if sum(m.file_size for m in members) > MAX_ZIP_BYTES:
        raise ValueError(f"the uploaded .zip expands to more than {MAX_ZIP_BYTES >> 20} MiB")
    for m in members:
        parts = Path(m.filename).parts
        if Path(m.filename).is_absolute() or ".." in parts:
            raise ValueError(f"the uploaded .zip has an unsafe member path {m.filename!r}")
        out = target.joinpath(*parts)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(archive.read(m))


def command(run_dir: Path, config: dict, source: str) -> list[str]:
    cmd = [sys.executable, "-m", "attnlab.cli", "corpus", source, "--out", str(run_dir / "result"),
           "--quiet", "--text-column", config.get("text_column") or "text"]
    if config.get("variants"):
        cmd += ["--variants", ",".join(config["variants"])]
    for key in ("window", "overlap", "max_docs", "id_column", "shard_docs"):
        if config.get(key) not in (None, ""):
            cmd += [f"--{key.replace('_', '-')}", str(config[key])]
    for name, value in (config.get("params") or {}).items():
        cmd += [f"--{name.replace('_', '-')}", str(value)]
    if config.get("index"):  # the token index Inspect's corpus search reads (appkit/corpus_search.py)
        cmd.append("--index")
    return cmd


def swap_command(run_dir: Path, config: dict, source: str) -> list[str]:
    """``attnlab swap-eval`` for a run of the Swap cost page (docs/SWAP_EVAL.md)."""
    cmd = [sys.executable, "-m", "attnlab.cli", "swap-eval", "--model", str(config["model"]),
           "--corpus", source, "--out", str(run_dir / "result"), "--quiet",
           "--text-column", config.get("text_column") or "text",
           "--variants", ",".join(config.get("variants") or ("dnas", "sinkhorn", "softmax1")),
           "--layers", config.get("layers") or "each"]
    for key in ("window", "max_docs", "shard_docs", "mask_rate", "seed", "bootstrap"):
        if config.get(key) not in (None, ""):
            cmd += [f"--{key.replace('_', '-')}", str(config[key])]
    for name, value in (config.get("params") or {}).items():
        cmd += [f"--{name.replace('_', '-')}", str(value)]
    return cmd


@dataclass(frozen=True)
class JobKind:
    """A corpus job the app runs in the background."""

    folder: str  # its runs' folder under runs_dir()
    finished: str  # the file of result/ a finished run has
    command: Callable[[Path, dict, str], list[str]]  # (run dir, config, source) -> the command line


KINDS = {"corpus": JobKind("corpus", "summary.parquet", command),
         "swap-eval": JobKind("swap-eval", "loss_delta.parquet", swap_command)}


def start(name: str, config: dict, upload: tuple[str, bytes] | None = None,
          path: str | None = None, kind: str = "corpus") -> CorpusRun:
    """Create ``corpus/NAME`` (``swap-eval/NAME``) and start ``attnlab corpus`` (``swap-eval``) on the
    shipped corpus (neither ``upload`` nor ``path``), an upload (file name, bytes) or a server-side
    ``path``. ValueError for people."""
    if not NAME.match(name):
        raise ValueError(f"run name {name!r}: use letters, digits, '-', '_' or '.', at most 64 characters")
    if kind == "swap-eval":
        model = Path(str(config.get("model") or ""))
        if not str(config.get("model") or "").strip() or not (model / "config.json").is_file():
            raise ValueError(f"model {str(config.get('model') or '')!r}: a local model directory with a "
                             "config.json and an LM head (causal or masked) was expected")
    run_dir = corpus_dir(kind) / name
    if run_dir.exists():
        raise ValueError(f"a {kind} run named {name!r} already exists; pick another name")
    if upload is not None:
        file_name = upload[0]
        if not file_name.lower().endswith(UPLOAD_SUFFIXES):
            raise ValueError(f"{file_name}: upload a .jsonl, .csv, .parquet file or a .zip of .txt files")
    elif path:
        if not Path(path).exists():
            raise ValueError(f"server path {path!r} does not exist")
    run_dir.mkdir(parents=True)
    try:
        source = "kjv"
        if upload is not None:
            (run_dir / "source").mkdir()
            if file_name.lower().endswith(".zip"):
                _unzip(upload[1], run_dir / "source")
                source = str(run_dir / "source")
            else:
                target = run_dir / "source" / ("corpus" + Path(file_name).suffix.lower())
                target.write_bytes(upload[1])
                source = str(target)
        elif path:
            source = str(Path(path).resolve())
    except ValueError:
        import shutil

        shutil.rmtree(run_dir)
        raise
    config = {**config, "source": source}
    (run_dir / CONFIG).write_text(json.dumps(config, indent=2))
    spawn(run_dir, KINDS[kind].command(run_dir, config, source), log=LOG)
    return inspect(run_dir, kind)


def stop(run: CorpusRun) -> None:
    """SIGTERM to the run's process group; finished shards stay."""
    (run.dir / STOP).write_text(json.dumps({"stopped": time.time()}))
    if _alive(run.pid, run.dir):
        try:
            os.killpg(run.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def resume(run: CorpusRun) -> None:
    """Run the same command again: finished shards are skipped."""
    if run.active:
        raise ValueError(f"run {run.name} is still running")
    cmd = _read_json(run.dir / PROCESS).get("command")
    if not cmd:
        config = _read_json(run.dir / CONFIG)
        cmd = KINDS[run.kind].command(run.dir, config, config["source"])
    spawn(run.dir, cmd, log=LOG)


__all__ = ["CorpusRun", "JobKind", "KINDS", "corpus_dir", "inspect", "list_runs", "progress_line", "start",
           "stop", "resume", "command", "swap_command", "EXIT"]
