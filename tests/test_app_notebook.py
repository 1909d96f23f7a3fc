"""examples/explore.ipynb, executed top to bottom with nbclient (offline, embedded MiniLM), so the
notebook of docs/NOTEBOOK.md cannot rot: no cell may fail, and every figure cell shows a figure."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "examples" / "explore.ipynb"
PLOTLY = "application/vnd.plotly.v1+json"


@pytest.mark.slow
def test_explore_notebook_runs_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit it without outputs"
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError naming the failing cell
    figures = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for out in cell.outputs:
            if PLOTLY in out.get("data", {}):
                figures.append(out["data"][PLOTLY])
    titles = [json.loads(json.dumps(f))["layout"].get("title", {}).get("text", "") for f in figures]
    assert len(figures) == 7, titles  # heatmap, head view, model view, grid, ECDF, explained away, u
    assert titles[0] == "UNAS, layer 2, head 0" and "focus: 3: sat" in titles[2]
    heat = figures[0]
    assert len(heat["layout"]["shapes"]) == 2 and heat["data"][0]["x"][3] == "3: sat"
    curves = figures[-1]
    assert any(t.get("name", "").startswith("layer") for t in curves["data"])
