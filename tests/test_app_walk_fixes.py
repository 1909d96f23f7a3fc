"""What issue 30's screenshot walk (scripts/screenshots.py, every page at 1600x1000 and 1280x800) found
still wrong, each with a test that would have caught it: figure-level checks on the plotly figures'
layout and data (label geometry at the widths the app draws them, formats, shared colour ranges,
legend titles) and AppTest checks of page behaviour. Offline: the embedded MiniLM, a tiny random BART.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("streamlit.testing.v1")
import streamlit  # noqa: E402
import test_app_issue30 as base  # noqa: E402
from conftest import build_tiny_model  # noqa: E402

app_env = base.app_env
messages, run_page = base.messages, base.run_page

# The app's main column (Streamlit, wide layout, sidebar open) in the walk's two windows: what a figure
# drawn at the container's width ("stretch") gets
MAIN_COLUMN_PX = {1280: 820, 1600: 1140}
CHAR_PX = 0.6  # a character's width in font sizes (plotly's sans-serif, generous)


def _charts(at) -> dict[str, dict]:
    return {c.key: json.loads(c.proto.spec) for c in at.get("plotly_chart")}


@pytest.fixture
def chart_widths(monkeypatch) -> dict:
    """key -> the ``width`` each ``st.plotly_chart`` of a page run was given ("content", "stretch")."""
    widths, draw = {}, streamlit.plotly_chart

    def record(figure, *args, **kwargs):
        widths[kwargs.get("key")] = kwargs.get("width", "stretch")
        return draw(figure, *args, **kwargs)

    monkeypatch.setattr(streamlit, "plotly_chart", record)
    return widths


# ----------------------------------------------------------------------------------------------
# 1. Side-by-side panels (GAM's Φ, Θ and combined map on Inspect; Compare): labels clear of each other
# ----------------------------------------------------------------------------------------------


def _panel_geometry(fig, width: int) -> list[dict]:
    """Each panel's left and right edge (px) when the figure is drawn ``width`` px wide: the plot area
    is what the query labels and axis title (left) and the colour bar(s) (right) leave."""
    lay = fig.layout
    query_labels = [str(v) for v in lay.yaxis.tickvals]
    font = lay.yaxis.tickfont.size
    left = max(len(t) for t in query_labels) * CHAR_PX * font + 6 + 1.3 * 14 + 6  # labels, title
    right = 30 + 60  # the shared colour bar with its tick labels (per-panel bars sit between panels)
    plot = width - left - right
    out = []
    for k in range(len(fig.data)):
        axis = lay[f"xaxis{k + 1 if k else ''}"]
        out.append({"x0": left + axis.domain[0] * plot, "x1": left + axis.domain[1] * plot, "axis": axis})
    return out


def _check_panels(fig, n_keys: int) -> None:
    titles = [a for a in fig.layout.annotations if a.text]
    size = titles[0].font.size if titles else 13
    for window, width in MAIN_COLUMN_PX.items():
        panels = _panel_geometry(fig, width)
        for p in panels:  # key labels (rotated): one label height apart at least
            ticks = list(p["axis"].tickvals)
            step = n_keys / max(len(ticks), 1)
            spacing = (p["x1"] - p["x0"]) / n_keys * max(1, round(step))
            assert spacing >= p["axis"].tickfont.size + 1, (window, spacing, len(ticks))
        spans = []
        for a, p in zip(titles, panels, strict=False):  # each title within its panel and its gaps
            wide = max(len(line) for line in a.text.split("<br>")) * CHAR_PX * size
            centre = (p["x0"] + p["x1"]) / 2
            spans.append((centre - wide / 2, centre + wide / 2))
        for (_, right), (left, _) in zip(spans, spans[1:], strict=False):
            assert right + 4 <= left, (window, [a.text for a in titles], spans)
    lines = max([a.text.count("<br>") + 1 for a in titles] + [0])
    title_bottom = fig.layout.margin.t / 2 + 0.65 * 17  # plotly centres the title in the top margin
    assert title_bottom <= fig.layout.margin.t - lines * 1.3 * size - 2, "figure title over panel titles"


@pytest.mark.parametrize(
    "titles, n_keys, shared",
    [
        (["Φ: content brains", "Θ: relative position", "combined weights"], 52, True),  # GAM on Inspect
        (["unas", "dnas", "hnas"], 43, True),  # Compare, one model
        (["MiniLM-L6 (embedded) · unas", "enc-hnas (shipped) · hnas", "enc-gam (shipped) · unas"], 43, True),
        ([f"MiniLM-L6 (embedded) · {v}" for v in ("unas", "dnas", "hnas", "sinkhorn", "softmax1", "ssmax")],
         43, True),  # Compare's six panels
        (["unas minus dnas", "unas minus hnas"], 43, True),  # Compare's differences
        (["unas", "dnas", "hnas"], 43, False),  # a colour scale per panel
    ],
)
def test_side_by_side_panels_labels_do_not_collide(titles, n_keys, shared):
    """Seen at 1280x800: the panels of GAM's figure and Compare's, drawn at the main column's width,
    had their key labels run together (sized for 420 px panels; a third of 820 px is ~190 px), and
    long panel titles ("model · variant") ran into each other."""
    from attnlab.figures.views import panel_heatmaps

    rng = np.random.default_rng(0)
    maps = [rng.dirichlet(np.ones(n_keys), size=n_keys).astype(np.float32) for _ in titles]
    tokens = [f"tok{i}" for i in range(n_keys)]
    fig = panel_heatmaps(maps, tokens, titles, shared_scale=shared, title="layer 2, head 0", focus=3)
    _check_panels(fig, n_keys)
    names = [a.text.replace("<br>", " ") for a in fig.layout.annotations if a.text]
    assert [re.sub(r"\s+", " ", n) for n in names] == [t.replace(" · ", " ") for t in titles]


def test_gam_figure_panels_do_not_collide():
    """GAM's three panels as appkit.gam draws them (its titles)."""
    import sys

    sys.path.insert(0, str(base.REPO / "app"))
    from appkit.gam import PARTS

    from attnlab.figures.views import panel_heatmaps

    rng = np.random.default_rng(1)
    maps = [rng.dirichlet(np.ones(52), size=52) for _ in PARTS]
    fig = panel_heatmaps(maps, [f"t{i}" for i in range(52)], list(PARTS.values()), title="GAM")
    _check_panels(fig, 52)


# ----------------------------------------------------------------------------------------------
# 2. Explaining away's sink views (attnlab.figures.sinks)
# ----------------------------------------------------------------------------------------------


def _activations() -> pd.DataFrame:
    rng = np.random.default_rng(2)
    L = 6
    max_abs = rng.uniform(3, 40, L)
    max_abs[2:] *= 30  # a massive activation from layer 2 on
    median = rng.uniform(0.2, 0.6, L)
    return pd.DataFrame({"layer": np.arange(L), "max_abs": max_abs, "token_index": 0, "token": "[CLS]",
                         "dim": rng.integers(0, 384, L), "median_abs": median, "ratio": max_abs / median})


def test_massive_activations_axis_ticks_and_markers_read():
    """Seen: the y axis titled "|h|" (rotated: a glyph), minor log labels ("2", "5") between the
    decades, the median drawn as hairlines."""
    from attnlab.figures.sinks import massive_activations_by_layer

    table = _activations()
    fig = massive_activations_by_layer(table).figure
    y = fig.layout.yaxis
    assert y.type == "log" and "hidden state" in y.title.text and len(y.title.text) > 5
    logs = np.log10(np.asarray(y.tickvals, dtype=np.float64))
    np.testing.assert_allclose(logs, np.round(logs))  # decades only: no minor labels
    assert len(y.ticktext) == len(y.tickvals) and y.tickmode in (None, "array")
    lo, hi = np.log10(table[["max_abs", "median_abs"]].to_numpy()).min(), np.log10(table["max_abs"]).max()
    assert y.range[0] <= lo and y.range[1] >= hi  # every value (and the bars' labels) inside
    median = next(t for t in fig.data if t.name.startswith("median"))
    assert median.marker.line.width >= 2 and median.marker.size >= 16  # visible, not a hairline
    assert not any(t.name and "|h|" in t.name for t in fig.data)


def test_massive_activations_table_columns_are_labelled():
    """Seen: the table showed raw column names (max_abs, median_abs) and 4 decimals. Its labels and
    formats are the figure module's, one per column of attnlab.hf.beyond.activations.COLUMNS."""
    from attnlab.figures.sinks import MASSIVE_ACTIVATIONS_COLUMNS
    from attnlab.hf.beyond.activations import COLUMNS

    assert list(MASSIVE_ACTIVATIONS_COLUMNS) == list(COLUMNS)
    for name, (label, fmt) in MASSIVE_ACTIVATIONS_COLUMNS.items():
        assert "_" not in label and label
        if fmt is not None:
            decimals = re.search(r"\.(\d)f", fmt)
            assert fmt.startswith("%") and (decimals is None or int(decimals.group(1)) <= 3), (name, fmt)


def test_sink_rate_lines_that_coincide_stay_visible():
    """Seen: DNAS hidden under Sinkhorn (both normalize columns: the same sink rates, drawn over)."""
    from attnlab.figures.sinks import sink_rate_by_layer

    same = np.array([0.0, 0.25, 0.5, 0.5])
    fig = sink_rate_by_layer({"unas": [1, 1, 0.75, 1], "dnas": same, "hnas": [0, 0.5, 0.5, 1],
                              "sinkhorn": same.copy()}, 0.3).figure
    styles = [(t.line.dash, t.marker.symbol) for t in fig.data]
    assert len(set(styles)) == len(styles)
    for i, a in enumerate(fig.data):
        for b in fig.data[i + 1:]:
            if np.array_equal(a.y, b.y):  # the later one is drawn inside the earlier
                assert b.line.width < a.line.width and b.marker.size < a.marker.size


# ----------------------------------------------------------------------------------------------
# 3-5. Compare: one range for the Jensen-Shannon maps, the overlay's legend, ECDFs at full width
# ----------------------------------------------------------------------------------------------


def test_column_mass_legend_names_what_the_curves_are():
    from attnlab.figures import app_views

    rng = np.random.default_rng(3)
    w = {v: rng.dirichlet(np.ones(6), size=(2, 2, 6)).astype(np.float32) for v in ("unas", "dnas")}
    tokens = list("abcdef")
    one = app_views.build("column_mass", w, tokens, {"variants": ["unas", "dnas"], "layer": None})
    assert one.figure.layout.legend.title.text == "variant"
    by_layer = app_views.build("column_mass", w, tokens,
                               {"variants": ["unas"], "layer": None, "group": "layer"})
    assert by_layer.figure.layout.legend.title.text == "variant · layer"
    overlaid = app_views.build("column_mass", [w, w], tokens, {"variants": ["unas", "dnas"], "layer": None},
                               labels=["A", "B"])
    assert overlaid.figure.layout.legend.title.text == "panel"
    js = app_views.build("js_distance", [w, w], tokens, {"variants": ["unas", "dnas"], "zmax": 0.5})
    assert js.figure.data[0].zmax == 0.5


def test_compare_js_maps_share_one_range_and_the_overlay_fills_the_column(app_env, chart_widths):
    """Seen: the two Jensen-Shannon maps (A vs B, A vs C) each on its own colour range; the overlaid
    ECDF's legend titled "variant" over panels, and drawn at a fixed 820 px."""
    at = run_page("compare")
    figs = _charts(at)
    js = [f["data"][0] for k, f in figs.items() if k.startswith("compare_js_")]
    assert len(js) == 2
    top = max(float(np.max(base_z(t))) for t in js)
    assert [t["zmax"] for t in js] == pytest.approx([top, top])
    assert any("share one colour range" in c.value for c in at.caption)
    overlay = figs["compare_overlay"]["layout"]
    assert overlay["legend"]["title"]["text"] == "panel"
    assert chart_widths["compare_overlay"] == "stretch"


def base_z(trace: dict) -> np.ndarray:
    z = trace["z"]
    if isinstance(z, dict):  # plotly's typed array
        import base64

        return np.frombuffer(base64.b64decode(z["bdata"]), dtype=z["dtype"])
    return np.asarray(z, dtype=np.float64)


def test_explaining_away_distribution_fills_the_column(app_env, chart_widths):
    """Seen at 1600 px: the ECDF at a fixed 820 px, the rest of the column empty."""
    at = run_page("explaining_away")
    assert not at.exception, [e.message for e in at.exception]
    assert chart_widths["away_column_mass"] == "stretch"


def test_sink_views_fill_the_column_and_label_the_table(app_env, chart_widths):
    """Seen: the sink views at fixed widths, the massive-activations table with raw column names."""
    from attnlab.figures.sinks import MASSIVE_ACTIVATIONS_COLUMNS

    at = run_page("explaining_away")
    for name in ("sink_importance", "sink_rate", "first_token_mass", "massive_activations"):
        assert chart_widths[f"away_{name}"] == "stretch", name
    table = next(d for d in at.dataframe if "max_abs" in d.value.columns)
    config = json.loads(table.proto.columns)
    for name, (label, _) in MASSIVE_ACTIVATIONS_COLUMNS.items():
        assert config[name]["label"] == label


# ----------------------------------------------------------------------------------------------
# 6. Interventions: one number format per quantity
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("measures", [("hidden_cosine", "pooled_cosine"), ("loglik_change",)])
def test_intervention_output_change_has_one_format(measures):
    """Seen: the map's hover wrote %{z:.3g} (0.00000412), the table %.4g (4.123e-06): two formats of
    one number. Hover, colour bar and table now write each measure one way."""
    from attnlab.figures import beyond as figs

    rng = np.random.default_rng(4)
    fig = figs.intervention_heatmap({m: rng.random((2, 3)) * 1e-3 for m in measures}, "dnas").figure
    (fmt,) = {figs.MEASURE_FORMATS[m] for m in measures}
    for trace in fig.data:
        used = set(re.findall(r"%\{z:([^}]+)\}", trace.hovertemplate))
        assert used == {fmt} and trace.colorbar.tickformat == fmt
    columns = figs.intervention_columns(measures)
    assert columns["value"] == ("output change", "%" + fmt)


# ----------------------------------------------------------------------------------------------
# 7. Corpus and Swap cost: the variant chips fit
# ----------------------------------------------------------------------------------------------


def _column_share(at, key: str) -> float:
    """The share of the width of the narrowest column holding widget ``key`` (1.0: no column)."""
    from streamlit.testing.v1.element_tree import Block, Column

    def walk(node, share):
        if getattr(node, "key", None) == key and not isinstance(node, Block):
            return share
        if isinstance(node, Block):
            children = list(node.children.values())
            weights = [c.weight for c in children if isinstance(c, Column)]
            for child in children:
                s = share * (child.weight / sum(weights)) if isinstance(child, Column) else share
                found = walk(child, s)
                if found is not None:
                    return found
        return None

    found = walk(at._tree, 1.0)
    assert found is not None, f"no widget {key}"
    return found


def _in_order(node):
    """Every element under ``node``, in the page's order."""
    from streamlit.testing.v1.element_tree import Block

    if isinstance(node, Block):
        for child in node.children.values():
            yield from _in_order(child)
    else:
        yield node


@pytest.mark.parametrize("page, key", [("corpus", "corpus_variants"), ("swap_cost", "swap_variants")])
def test_variant_chips_have_room(app_env, page, key):
    """Seen at 1280x800: the variants' chips clipped in a fifth of the form (~150 px)."""
    at = run_page(page)
    chosen = at.multiselect(key=key).value
    assert len(chosen) >= 3
    width = _column_share(at, key) * MAIN_COLUMN_PX[1280]
    chips = sum(len(v) * 7 + 40 for v in chosen)  # a chip: its name (14 px font) and its ×
    assert width >= min(chips, 600), (page, width)


# ----------------------------------------------------------------------------------------------
# 8. Interventions on an encoder-decoder: the refusal first, no control that cannot apply
# ----------------------------------------------------------------------------------------------


def test_interventions_on_an_encoder_decoder_refuses_first(app_env):
    """Seen: the target box and the attention-kind selector above the refusal."""
    bart = build_tiny_model("bart", app_env / "bart", scale=0.3)
    at = run_page("interventions", model="Local Hugging Face directory…", model_dir=str(bart))
    assert not at.exception, [e.message for e in at.exception]
    assert "per-head interventions do not support encoder-decoders: " in at.warning[0].value
    seen = [(n.type, getattr(n, "key", None)) for n in _in_order(at.main)]
    assert seen[:3] == [("title", None), ("caption", None), ("warning", None)], seen  # the refusal first
    keys = {w.key for kind in ("text_area", "radio", "selectbox") for w in getattr(at, kind)}
    assert not keys & {"interventions_target", "interventions_kind", "interventions_variant"}
    assert not at.get("plotly_chart")
