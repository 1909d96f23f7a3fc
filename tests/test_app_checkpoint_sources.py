"""appkit.sources.checkpoint_sources: the model picker offers attnlab's own checkpoints as native
models, a shipped Hugging Face recipe run (s2s-hnas-s*) through its model/ directory, and leaves out a
run with neither (a retrofit's θ alone), in checkpoints/ and in the runs directory."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "app"))

from appkit import sources  # noqa: E402


def _run(path: Path, kind: str | None, model: bool = False) -> Path:
    path.mkdir(parents=True)
    (path / "latest.json").write_text(json.dumps({"step": 1}))
    recipe = {"name": path.name, **({"kind": kind} if kind else {"model": {"kind": "encoder"}})}
    (path / "recipe.json").write_text(json.dumps(recipe))
    if model:
        (path / "model").mkdir()
        (path / "model" / "config.json").write_text("{}")
    return path


def test_native_checkpoints_hf_recipe_models_and_no_theta_only_runs(tmp_path, monkeypatch):
    ship, runs = tmp_path / "checkpoints", tmp_path / "runs"
    _run(ship / "enc-unas", None)
    _run(ship / "s2s-hnas-s0", "s2s-hnas", model=True)
    _run(ship / "retro-s0", "retrofit-hnas")  # θ only: not a model to analyse
    (ship / "stray").mkdir()  # no latest.json: not a run
    _run(runs / "mine", None)
    _run(runs / "summ", "s2s-hnas", model=True)
    monkeypatch.setattr(sources, "CHECKPOINTS", ship)
    monkeypatch.setenv("ATTNLAB_RUNS_DIR", str(runs))
    got = {s.label: (s.kind, s.path) for s in sources.checkpoint_sources()}
    assert got == {
        "enc-unas (shipped)": ("native", str(ship / "enc-unas")),
        "s2s-hnas-s0 (shipped)": ("hf", str(ship / "s2s-hnas-s0" / "model")),
        "mine (run)": ("native", str(runs / "mine")),
        "summ (run)": ("hf", str(runs / "summ" / "model")),
    }
