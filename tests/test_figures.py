"""attnlab.figures: builders return the expected traces holding the input data; export works."""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest
import torch

import attnlab
from attnlab import figures, stats
from attnlab.figures import export
from attnlab.figures._data import ZERO_WIDTH, block_mean

needs_chromium = pytest.mark.skipif(
    not export.chromium_available(),
    reason="Chromium not found (apt-get install chromium, or set BROWSER_PATH): static export untestable",
)


def softmax_weights(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(*shape, generator=g) * 2, -1)


def strip(labels):
    return [str(s).replace(ZERO_WIDTH, "") for s in labels]


# ----------------------------------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------------------------------


def grid_maps(z, L, H, m, n):
    """The (L, H, m, n) maps tiled into an attention_grid's z, and its gutter rows / columns."""
    z = np.asarray(z, dtype=np.float64)
    assert z.shape == (L * (m + 1) - 1, H * (n + 1) - 1)
    padded = np.pad(z, ((0, 1), (0, 1)), constant_values=np.nan).reshape(L, m + 1, H, n + 1)
    return padded[:, :m, :, :n].transpose(0, 2, 1, 3), padded[:, m], padded[:, :, :, n]


def test_attention_grid_is_one_trace_holding_every_map():
    L, H, N = 2, 3, 5
    w = softmax_weights(L, H, N, N)
    tokens = ["[CLS]", "a", "b", "a", "[SEP]"]
    fig = figures.attention_grid(w, tokens, title="grid")
    assert isinstance(fig, go.Figure) and len(fig.data) == 1
    trace = fig.data[0]
    assert isinstance(trace, go.Heatmap) and trace.text is None and trace.customdata is None
    maps, gutter_rows, gutter_cols = grid_maps(trace.z, L, H, N, N)
    np.testing.assert_array_equal(maps, w.numpy())  # every map, unchanged (float32), in its tile
    assert np.isnan(gutter_rows[:-1]).all() and np.isnan(gutter_cols[..., :-1]).all()
    # one unique label per row / column: layer / head, position and token (repeats kept apart)
    assert len(set(trace.x)) == len(trace.x) and len(set(trace.y)) == len(trace.y)
    assert trace.x[N + 1 + 3] == "head 1 · key 3 'a'" and trace.x[1] == "head 0 · key 1 'a'"
    assert trace.y[N + 1] == "layer 1 · query 0 '[CLS]'"
    assert trace.x[N].strip() == "" and trace.y[N].strip() == ""  # gutters: blank labels
    for word in ("%{y}", "%{x}", "weight %{z"):
        assert word in trace.hovertemplate
    assert trace.hoverongaps is False and trace.zmin == 0 and trace.zmax == pytest.approx(float(w.max()))
    titles = {a.text: (a.x, a.y) for a in fig.layout.annotations}
    assert list(titles) == ["head 0", "head 1", "head 2", "layer 0", "layer 1"]
    assert titles["head 2"][0].startswith("head 2 · ") and titles["layer 1"][1].startswith("layer 1 · ")
    assert fig.layout.xaxis.type == fig.layout.yaxis.type == "category"
    assert fig.layout.yaxis.autorange == "reversed"  # layer 0, query 0 at the top
    assert fig.layout.title.text == "grid"
    assert (fig.layout.width, fig.layout.height) == (80 * H + 200, 80 * L + 130)


def test_attention_grid_cross_attention_and_no_tokens():
    w = softmax_weights(1, 2, 3, 4)  # M = 3 queries, N = 4 keys
    fig = figures.attention_grid(w, ["k0", "k1", "k2", "k3"], zmax=1.0)
    maps, _, _ = grid_maps(fig.data[0].z, 1, 2, 3, 4)
    np.testing.assert_array_equal(maps, w.numpy())
    assert fig.data[0].y[2] == "layer 0 · query 2" and fig.data[0].x[4 + 1] == "head 1 · key 0 'k0'"
    assert fig.data[0].zmax == 1.0
    assert figures.attention_grid(w).data[0].x[0] == "head 0 · key 0"


def test_attention_grid_downsamples_large_maps():
    w = softmax_weights(2, 2, 300, 300)
    fig = figures.attention_grid(w, max_tokens=128)  # f = ceil(300 / 128) = 3: 100 x 100 blocks
    maps, _, _ = grid_maps(fig.data[0].z, 2, 2, 100, 100)
    blocks = w.numpy().reshape(2, 2, 100, 3, 100, 3).mean((3, 5))
    np.testing.assert_allclose(maps, blocks, rtol=1e-5)
    assert "means over 3x3 token blocks" in fig.layout.title.text
    assert fig.data[0].x[:2] == ("head 0 · keys 0-2", "head 0 · keys 3-5")
    edge = figures.attention_grid(softmax_weights(1, 1, 5, 5), max_tokens=2)  # f = 3, a partial block
    m = grid_maps(edge.data[0].z, 1, 1, 2, 2)[0][0, 0]
    w5 = softmax_weights(1, 1, 5, 5)[0, 0].numpy()
    assert m[0, 0] == pytest.approx(w5[:3, :3].mean()) and m[1, 1] == pytest.approx(w5[3:, 3:].mean())
    assert edge.data[0].x[1] == "head 0 · keys 3-4"


def test_block_mean_partial_edges():
    a = np.arange(25, dtype=np.float32).reshape(5, 5)
    pooled, f = block_mean(a, 3)  # f = 2: blocks of 2, the last one partial
    assert f == 2 and pooled.shape == (3, 3)
    assert pooled[0, 0] == pytest.approx(a[:2, :2].mean())
    assert pooled[2, 2] == pytest.approx(a[4, 4])
    assert pooled[0, 2] == pytest.approx(a[:2, 4].mean())


def test_attention_grid_rejects_bad_input():
    with pytest.raises(ValueError, match="4-D"):
        figures.attention_grid(np.zeros((3, 3)))
    with pytest.raises(ValueError, match="5 positions, while tokens has 4"):
        figures.attention_grid(softmax_weights(1, 1, 5, 5), ["a"] * 4)


def test_attention_heatmap_labels_hover_and_data():
    w = softmax_weights(4, 4)
    tokens = ["the", "cat", "the", "mat"]
    fig = figures.attention_heatmap(w, tokens, title="one head")
    assert len(fig.data) == 1
    trace = fig.data[0]
    np.testing.assert_array_equal(np.asarray(trace.z), w.numpy())
    # positions in the categories: repeated tokens stay apart and the hover names both positions
    assert list(trace.x) == ["0: the", "1: cat", "2: the", "3: mat"] and list(trace.y) == list(trace.x)
    for word in ("query %{y}", "key %{x}", "weight"):
        assert word in trace.hovertemplate
    # every token is labelled (plotly's automatic ticks skip every other label on a crowded axis)
    assert list(fig.layout.xaxis.tickvals) == list(trace.x)
    assert list(fig.layout.yaxis.tickvals) == list(trace.y)
    assert fig.layout.xaxis.type == "category" and list(fig.layout.yaxis.range) == [3.5, -0.5]  # top down
    with pytest.raises(ValueError, match="while tokens has 3"):
        figures.attention_heatmap(w, tokens[:3])


def test_attention_heatmap_cross_attention_query_tokens():
    w = softmax_weights(2, 3)
    fig = figures.attention_heatmap(w, ["k1", "k2", "k3"], query_tokens=["q1", "q2"])
    assert list(fig.data[0].y) == ["0: q1", "1: q2"]


def test_attention_heatmap_labels_every_token_of_a_bert_window():
    """Seen: a 64-token map labelled every other token ([SEP] had none)."""
    n = 64
    tokens = ["[CLS]", *(["the", "cat"] * 31), "[SEP]"]
    fig = figures.attention_heatmap(softmax_weights(n, n), tokens)
    assert len(fig.layout.xaxis.tickvals) == n and fig.layout.yaxis.tickvals[-1] == "63: [SEP]"
    # each label has room: the plot side over the labels, at the label font size + 2 px
    assert (fig.layout.height - 170) / n >= fig.layout.yaxis.tickfont.size + 2
    long = figures.attention_heatmap(softmax_weights(400, 400), ["t"] * 400)
    step = 400 // len(long.layout.xaxis.tickvals)
    assert 1 < step and long.layout.xaxis.tickvals[1] == f"{step}: t"  # thinned evenly, positions kept


def test_attention_heatmap_focus_outlines_row_and_column():
    fig = figures.attention_heatmap(softmax_weights(5, 5), list("abcde"), focus=2)
    rects = [(s.x0, s.x1, s.y0, s.y1) for s in fig.layout.shapes]
    assert rects == [(-0.5, 4.5, 1.5, 2.5), (1.5, 2.5, -0.5, 4.5)]  # row 2 (sent), column 2 (received)
    with pytest.raises(ValueError, match=r"focus must be a token position in \[0, 5\), got 5"):
        figures.attention_heatmap(softmax_weights(5, 5), list("abcde"), focus=5)


def test_column_mass_distribution_ecdf():
    masses = {"unas": np.array([0.5, 0.1, 2.0, 1.4]), "dnas": torch.tensor([[1.0, 0.9], [1.2, 0.9]])}
    fig = figures.column_mass_distribution(masses, n_valid=4, u=0.5)
    assert [t.name for t in fig.data[:2]] == ["unas", "dnas"]
    assert len(fig.data) == 4  # two variants, the 1/N line, the u/N line
    np.testing.assert_allclose(fig.data[0].x, [0.1, 0.5, 1.4, 2.0])
    np.testing.assert_allclose(fig.data[0].y, [0.25, 0.5, 0.75, 1.0])
    np.testing.assert_allclose(fig.data[1].x, [0.9, 0.9, 1.0, 1.2])
    assert fig.data[2].name.startswith("1/N") and list(fig.data[2].x) == [0.25, 0.25]
    assert fig.data[3].name.startswith("u/N") and list(fig.data[3].x) == [0.125, 0.125]
    assert fig.layout.xaxis.type == "log"
    labels = [a.text for a in fig.layout.annotations]
    assert "1/N = 1/4" in labels and "u/N = 0.5/4" in labels
    assert len(figures.column_mass_distribution(masses, n_valid=4).data) == 3  # no u: no u/N line


def test_column_mass_distribution_histogram_and_zeros():
    masses = {"unas": np.array([0.0, 0.01, 0.5, 1.0, 2.49])}
    fig = figures.column_mass_distribution(masses, n_valid=5, kind="histogram", bins=10)
    counts = np.asarray(fig.data[0].y)[:-1]
    assert counts.sum() == pytest.approx(1.0)  # the zero is drawn at the floor, not dropped
    assert np.asarray(fig.data[0].x).min() > 0
    ecdf = figures.column_mass_distribution(masses, n_valid=5)
    assert np.asarray(ecdf.data[0].x).min() > 0
    with pytest.raises(ValueError, match="kind"):
        figures.column_mass_distribution(masses, 5, kind="violin")
    with pytest.raises(ValueError, match="n_valid"):
        figures.column_mass_distribution(masses, 0)


def test_column_mass_distribution_thins_long_ecdf():
    x = (np.random.default_rng(0).random(50_000) + 0.01).astype(np.float32)
    fig = figures.column_mass_distribution({"v": x}, n_valid=100, max_points=1000)
    xs, ys = np.asarray(fig.data[0].x), np.asarray(fig.data[0].y)
    assert len(xs) <= 1000 and xs[0] == x.min() and xs[-1] == x.max() and ys[-1] == 1.0
    assert np.all(np.diff(xs) >= 0)


def test_explained_away_heatmap_single_and_per_variant():
    f = np.array([[0.0, 0.5, 1.0], [0.25, 0.0, 0.1]])
    fig = figures.explained_away_heatmap(f, "ea")
    assert len(fig.data) == 1
    np.testing.assert_allclose(fig.data[0].z, f)
    assert fig.layout.coloraxis.cmin == 0 and fig.layout.coloraxis.cmax == 1
    scores = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(0)) * 3
    ws = {v: attnlab.attention_weights(scores, v) for v in ("unas", "dnas")}
    fr = {v: stats.explained_away_fraction(w, 0.5) for v, w in ws.items()}
    fig = figures.explained_away_heatmap(fr)
    assert len(fig.data) == 2 and all(t.coloraxis == "coloraxis" for t in fig.data)
    np.testing.assert_allclose(fig.data[0].z, fr["unas"].numpy())
    assert [a.text for a in fig.layout.annotations][:2] == ["unas", "dnas"]
    assert fig.data[0].texttemplate  # 3 heads: room for every value
    with pytest.raises(ValueError, match="one"):
        figures.explained_away_heatmap({"a": f, "b": f[:1]})


def test_explained_away_heatmap_values_never_run_together():
    """Seen: four variants x 12 heads printed '0.000.000.02...' in one row of the page."""
    fr = {v: np.random.default_rng(0).random((6, 12)) for v in ("unas", "dnas", "hnas", "sinkhorn")}
    fig = figures.explained_away_heatmap(fr)
    domains = [tuple(fig.layout[t.yaxis.replace("y", "yaxis")].domain) for t in fig.data]
    panels_per_row = domains.count(domains[0])
    assert len(fig.data) == 4 and panels_per_row == 2 and len(set(domains)) == 2  # wrapped in 2 rows
    per_cell = (fig.layout.width - 130) / panels_per_row / 12
    assert per_cell >= 36 and fig.data[0].texttemplate == "%{z:.2f}"  # "0.00" fits 36 px at 10 px
    crowded = figures.explained_away_heatmap(fr, cell_px=20)
    assert crowded.data[0].texttemplate is None  # too narrow for values: hover only


# ----------------------------------------------------------------------------------------------
# Export: HTML / JSON always, data files, and the missing-Chromium path
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def small_fig():
    return figures.explained_away_heatmap(np.array([[0.0, 0.5], [0.25, 1.0]]), "tiny")


def test_export_html_inline_and_in_memory(tmp_path, small_fig):
    path = export.export_figure(small_fig, tmp_path / "sub" / "fig.html")
    text = path.read_text(encoding="utf-8")
    assert text.lstrip().lower().startswith(("<html", "<!doctype html")) and "Plotly.newPlot" in text
    assert not re.search(r"<script[^>]*src=", text)  # plotly.js inline: works offline
    assert len(text) > 1_000_000
    cdn = export.export_figure(small_fig, "html", include_plotlyjs="cdn")
    assert isinstance(cdn, str) and re.search(r'<script[^>]*src="https://cdn.plot.ly', cdn)
    assert len(cdn) < 100_000
    as_json = json.loads(export.export_figure(small_fig, "json"))
    assert as_json["data"][0]["type"] == "heatmap"
    assert not list(tmp_path.glob("sub/.*"))  # no temporary files left behind


def test_export_unknown_format(small_fig, tmp_path):
    with pytest.raises(ValueError, match="path_or_format"):
        export.export_figure(small_fig, tmp_path / "fig.gif")


def test_static_export_without_chromium_is_a_clear_error(monkeypatch, tmp_path, small_fig):
    monkeypatch.setenv("BROWSER_PATH", str(tmp_path / "no-such-browser"))
    assert export.chromium_path() is None and not export.chromium_available()
    with pytest.raises(export.ExportError, match="apt-get install chromium"):
        export.export_figure(small_fig, tmp_path / "fig.png")
    assert not (tmp_path / "fig.png").exists()
    report = export.export_figures({"ea": small_fig}, tmp_path / "out", formats=("html", "png", "pdf"))
    assert [p.name for p in report.written] == ["ea.html"]
    assert [p.name for p in report.skipped] == ["ea.png", "ea.pdf"]
    assert "apt-get install chromium" in report.note


def test_export_data_csv_json_npz(tmp_path):
    w = softmax_weights(2, 3, 5, 5)
    df = stats.tidy_table({"unas": w, "dnas": w.flip(-1)})
    back = pd.read_csv(export.export_data(df, tmp_path / "stats.csv"))
    pd.testing.assert_frame_equal(back, df, check_exact=False, rtol=1e-12)
    records = json.loads(export.export_data(df, tmp_path / "stats.json").read_text())
    assert len(records) == len(df) and records[0]["variant"] == "unas"
    tokens = ["[CLS]", "a", "b", "c", "[SEP]"]
    path = export.export_data({"unas": w, "half": w.half(), "tokens": tokens}, tmp_path / "w.npz")
    with np.load(path) as z:  # allow_pickle=False by default
        np.testing.assert_array_equal(z["unas"], w.numpy())
        assert z["half"].dtype == np.float16 or z["half"].dtype == np.float32
        assert list(z["tokens"]) == tokens
    meta = json.loads(export.export_data({"n": np.int64(3), "u": torch.tensor([0.5])}, tmp_path / "m.json")
                      .read_text())
    assert meta == {"n": 3, "u": [0.5]}
    with pytest.raises(ValueError, match="csv"):
        export.export_data(df, tmp_path / "stats.xlsx")


# ----------------------------------------------------------------------------------------------
# Static export through kaleido + Chromium (skipped, with the reason, only without Chromium)
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
@needs_chromium
def test_static_export_file_signatures(tmp_path):
    w = softmax_weights(2, 2, 6, 6)
    fig = figures.attention_grid(w, title="export")
    png = export.export_figure(fig, tmp_path / "grid.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = export.export_figure(fig, tmp_path / "grid.svg")
    assert b"<svg" in svg.read_bytes()[:2000]
    pdf = export.export_figure(fig, tmp_path / "grid.pdf")
    assert pdf.read_bytes()[:4] == b"%PDF"
    in_memory = export.export_figure(fig, "png", width=300, height=200, scale=2)
    assert isinstance(in_memory, bytes) and in_memory[:4] == b"\x89PNG"
    width = int.from_bytes(in_memory[16:20], "big")  # IHDR width in pixels
    assert width == 600
    report = export.export_figures(
        {"cm": figures.column_mass_distribution({"unas": stats.column_mass(w)}, 6, u=0.5)},
        tmp_path / "out",
        formats=("html", "png"),
    )
    assert report.note is None and [p.name for p in report.written] == ["cm.html", "cm.png"]
    assert (tmp_path / "out" / "cm.png").read_bytes()[:4] == b"\x89PNG"
