"""The app's views beyond weights (AppTest, no browser): the Interventions page, explained away by
contribution / without sinks, rollout and flow on Inspect."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("streamlit.testing.v1")
from streamlit.testing.v1 import AppTest  # noqa: E402

APP = str(Path(__file__).resolve().parents[1] / "app" / "streamlit_app.py")
TIMEOUT = 400
SHORT = "Giraffes rarely attend meetings, but they explain away."


@pytest.fixture
def app_env(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNLAB_DEBUG", "1")
    monkeypatch.setenv("ATTNLAB_UMAP", "off")
    monkeypatch.setenv("ATTNLAB_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("ATTNLAB_UPLOADS_DIR", str(tmp_path / "uploads"))
    return tmp_path


def _page(page: str, prefix: str) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    at.switch_page(f"app_pages/{page}.py").run()
    at.text_area(key=f"{prefix}_text").set_value(SHORT).run()
    assert not at.exception, [e.message for e in at.exception]
    return at


def _charts(at: AppTest) -> dict[str, dict]:
    return {c.key: json.loads(c.proto.spec) for c in at.get("plotly_chart")}


@pytest.mark.slow
def test_interventions_page_map_and_before_after(app_env):
    """Issue 30: before and after on one colour scale, their difference centred at 0, square-ish
    maps, measures named for people, and the Export menu of every other page."""
    at = _page("interventions", "interventions")
    figs = _charts(at)
    assert {"interventions_map", "interventions_before_after", "interventions_difference"} <= set(figs)
    the_map = figs["interventions_map"]["layout"]
    assert the_map["title"]["text"].endswith("becomes dnas")
    titles = [a["text"] for a in the_map["annotations"]]
    assert not any("_" in t for t in titles) and any("cosine distance" in t for t in titles)
    at.number_input(key="interventions_layer").set_value(3).run()
    at.number_input(key="interventions_head").set_value(5).run()
    assert not at.exception
    figs = _charts(at)
    pair, diff = figs["interventions_before_after"], figs["interventions_difference"]
    assert "layer 3, head 5" in pair["layout"]["title"]["text"]
    assert [t["coloraxis"] for t in pair["data"]] == ["coloraxis", "coloraxis"]  # one scale
    assert pair["layout"]["coloraxis"]["cmin"] == 0.0
    assert diff["layout"]["coloraxis"]["cmin"] == -diff["layout"]["coloraxis"]["cmax"]  # centred at 0
    assert "after (dnas) minus before (softmax)" in diff["layout"]["title"]["text"]
    for fig, panels in ((pair, 2), (diff, 1)):  # square-ish panels, not stretched to the page
        width, height = fig["layout"]["width"], fig["layout"]["height"]
        assert 0.6 < (width - 160) / panels / (height - 160) < 1.4
    table = next(d for d in at.dataframe if "measure" in d.value.columns)
    assert not table.value["measure"].str.contains("_").any()
    at.session_state["interventions_map_export"] = True  # the Export menu opened
    at.run()
    assert {"interventions_map_html", "interventions_map_csv"} <= {b.key for b in at.download_button}


@pytest.mark.slow
def test_explaining_away_by_contribution_and_without_sinks(app_env):
    at = _page("explaining_away", "away")
    assert "away_explained_away" in _charts(at)
    at.button_group(key="away_by").set_value("contribution").run()
    assert not at.exception, [e.message for e in at.exception]
    fig = _charts(at)["away_explained_away_beyond"]
    assert "by contribution" in fig["layout"]["title"]["text"]
    at.toggle(key="away_no_sinks").set_value(True).run()
    assert "sink keys excluded" in _charts(at)["away_explained_away_beyond"]["layout"]["title"]["text"]
    at.session_state["away_explained_away_beyond_export"] = True  # its Export menu opened
    at.run()
    assert "away_explained_away_beyond_html" in {b.key for b in at.download_button}


@pytest.mark.slow
def test_inspect_rollout_and_flow(app_env):
    at = _page("inspect", "inspect")
    at.toggle(key="inspect_rollout_show").set_value(True).run()
    assert "inspect_rollout_unas" in _charts(at)
    at.radio(key="inspect_rollout_kind").set_value("flow").run()
    assert not at.exception, [e.message for e in at.exception]
    assert "inspect_flow_unas" in _charts(at)
