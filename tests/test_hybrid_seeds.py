"""Issue 29 item 4: the Hybrid weights page shows several seeds of one recipe together (mean over seeds of
each layer's u with a 95 % t-interval band), and lists command-line training runs (runs/GROUP/NAME)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from attnlab.figures.training import seed_band

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "app"))


def _records(seed: int, steps=(0, 10, 20), L=2, H=3):
    rng = np.random.default_rng(seed)
    return [{"step": s, "u": (0.5 + rng.normal(0, 0.05, (L, H))).tolist()} for s in steps]


def test_band_is_the_t_interval_over_seeds_of_the_head_means():
    per_seed = {f"r-s{k}": _records(k) for k in range(3)}
    last = per_seed["r-s2"][-1]
    per_seed["r-s2"] = per_seed["r-s2"][:-1] + [{"step": 25, "u": last["u"]}]  # step 20 not logged
    b = seed_band(per_seed)
    assert sorted(b.table.step.unique()) == [0, 10]  # only the steps every seed logged
    row = b.table[(b.table.step == 10) & (b.table.layer == 1)].iloc[0]
    x = np.array([np.mean(per_seed[n][1]["u"][1]) for n in per_seed])  # each seed's mean over heads
    half = stats.t.ppf(0.975, 2) * x.std(ddof=1) / np.sqrt(3)
    assert row["mean"] == pytest.approx(x.mean()) and row["n_seeds"] == 3
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((x.mean() - half, x.mean() + half))


def test_band_refuses_one_seed_and_mixed_shapes():
    with pytest.raises(ValueError, match="at least two runs"):
        seed_band({"a-s0": _records(0)})
    with pytest.raises(ValueError, match="runs of one model"):
        seed_band({"a-s0": _records(0), "a-s1": _records(1, L=3)})


def _write_run(root: Path, name: str, seed: int) -> Path:
    run = root / name
    run.mkdir(parents=True)
    (run / "recipe.json").write_text(json.dumps({"train": {"steps": 20}}))
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in _records(seed)) + "\n")
    return run


def test_siblings_are_the_other_seeds_of_the_recipe(tmp_path):
    from appkit import runs

    paths = {n: _write_run(tmp_path, n, k) for k, n in enumerate(("enc-s1", "enc-s0", "enc-x", "other-s0"))}
    sources = {f"{n} (run)": p for n, p in paths.items()}
    got = runs.seed_siblings("enc-s1 (run)", sources)
    assert list(got) == ["enc-s0 (run)", "enc-s1 (run)"]  # in seed order; other recipes left out
    assert runs.seed_siblings("enc-x (run)", sources) == {}


def test_page_draws_the_band_for_command_line_seeds(monkeypatch, tmp_path):
    pytest.importorskip("streamlit.testing.v1")
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("ATTNLAB_DEBUG", "1")
    monkeypatch.setenv("ATTNLAB_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("ATTNLAB_UPLOADS_DIR", str(tmp_path / "uploads"))
    for k in range(3):
        _write_run(tmp_path / "runs" / "scale", f"tiny-hnas-s{k}", k)  # (not a shipped name)
    at = AppTest.from_file(str(REPO / "app" / "streamlit_app.py"), default_timeout=240).run()
    at.switch_page("app_pages/hybrid_weights.py").run()
    label = next(o for o in at.selectbox(key="hybrid_source").options if o.startswith("scale/tiny-hnas-s1"))
    at.selectbox(key="hybrid_source").set_value(label).run()
    assert not at.exception, [e.message for e in at.exception]
    assert "command-line run" in label
    keys = {c.key for c in at.get("plotly_chart")}
    assert "hybrid_seed_band" in keys and "hybrid_u_curves" in keys
    at.multiselect(key="hybrid_seeds").set_value([at.multiselect(key="hybrid_seeds").options[0]]).run()
    assert "hybrid_seed_band" not in {c.key for c in at.get("plotly_chart")}
