"""scripts/train_queue.sh, the scheduler of the long training runs (scripts/hnas_scale.sh,
scripts/s2s_hnas.sh, scripts/causal_retrofit.sh): runs start in order, a run that names another run's
directory waits for it, finished runs are skipped (also when only their shipped copy exists, as in a
fresh checkout), ship copies the final step without its optimizer state, status reads both."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CORPUS = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; "
          "and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the "
          "waters. And God said, Let there be light: and there was light. ") * 40

pytestmark = pytest.mark.slow  # trains two tiny models in subprocesses (~20 s)


def _queue(tmp: Path) -> Path:
    """A queue of two runs of the enc-unas recipe on a small corpus, 2 and 3 steps (each its own
    --steps); b names a's directory."""
    root, ship = tmp / "root", tmp / "ship"
    root.mkdir()
    (root / "corpus.txt").write_text(CORPUS)
    script = tmp / "testq.sh"
    # b's corpus path goes through a's directory (root/a/../corpus.txt): it names a, so b waits for a
    script.write_text(f"""#!/usr/bin/env bash
set -euo pipefail
SELF="{script}"
cd "{REPO}"
source scripts/env.sh
QUEUE=testq
ROOT="{root}"
JOBS=2
SHIP="{ship}"
RUNS=("a enc-unas 0 --corpus {root}/corpus.txt --steps 2"
      "b enc-unas 1 --corpus {root}/a/../corpus.txt --steps 3")
REPORT="echo report:"
source scripts/train_queue.sh
queue_main "$@"; exit $?
""")
    return script


def _run(script: Path, *verb: str) -> str:
    done = subprocess.run(["bash", str(script), *verb], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _wait_for_scheduler(root: Path, timeout: float = 240.0) -> None:
    pid = root / ".state" / "scheduler.pid"
    t0 = time.monotonic()
    while pid.exists():
        assert time.monotonic() - t0 < timeout, (root / "logs" / "scheduler.log").read_text()
        time.sleep(0.5)


def test_queue_runs_in_order_ships_and_skips_what_is_done(tmp_path):
    script = _queue(tmp_path)
    root, ship = tmp_path / "root", tmp_path / "ship"
    assert "scheduler started" in _run(script, "start")
    _wait_for_scheduler(root)
    log = (root / "logs" / "scheduler.log").read_text()
    # b named a's directory: it started only after a's trainer ended, although JOBS = 2
    assert log.index("a: trainer exited with status 0") < log.index("b: start at step -1")
    for name, steps in (("a", 2), ("b", 3)):  # each run's own --steps is its target
        assert json.loads((root / name / "latest.json").read_text())["step"] == steps
    status = _run(script, "status")
    assert status.count("finished") == 2 and "/3 (checkpoint 3)" in status
    assert "scheduler: not running" in status

    shipped = _run(script, "ship")
    assert "a: shipped step 2" in shipped and "b: shipped step 3" in shipped
    final = ship / "a" / "step-00000002"
    assert (ship / "a" / "metrics.jsonl").is_file() and (ship / "a" / "recipe.json").is_file()
    assert any(final.iterdir()) and not list(final.glob("optimizer.*"))

    # a fresh checkout: runs/ is gone, the shipped copies remain -> both count as finished
    for name in ("a", "b"):
        subprocess.run(["rm", "-rf", str(root / name)], check=True)
    assert _run(script, "status").count("finished, shipped") == 2
    assert "already shipped" in _run(script, "ship")
    _run(script, "start")
    _wait_for_scheduler(root)
    log = (root / "logs" / "scheduler.log").read_text()
    assert "a: finished (step 2); skipped" in log and "b: finished (step 3); skipped" in log
    assert not (root / "a").exists()
    assert _run(script, "report").startswith("report: ")


def test_unknown_verb_is_refused_with_the_usage(tmp_path):
    done = subprocess.run(["bash", str(_queue(tmp_path)), "restart"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "usage: bash" in done.stderr
    assert "start|status|stop|ship|report" in done.stderr
