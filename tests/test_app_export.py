"""The app's figure builders and exports (attnlab.figures.app_views), and the round trip
manifest -> `attnlab analyze` -> reproduce_figure -> the same figure data."""

from __future__ import annotations

import io
import json
import shlex
import struct
import zlib

import numpy as np
import pytest
import torch

from attnlab.figures import app_views as av
from attnlab.figures import export


def softmax_weights(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(*shape, generator=g) * 2, -1).numpy()


TOKENS = ["[CLS]", "the", "cat", "the", "mat", "[SEP]"]
W = {"unas": softmax_weights(2, 3, 6, 6), "dnas": softmax_weights(2, 3, 6, 6, seed=1)}


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) of a PNG, checking the signature and the IHDR chunk's CRC."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    assert struct.unpack(">I", data[29:33])[0] == zlib.crc32(data[12:29])
    return struct.unpack(">II", data[16:24])


def test_grid_bundle_is_one_trace_with_gutters():
    b = av.build("grid", W, TOKENS, {"variant": "unas"})  # attnlab.figures.attention_grid
    fig = b.figure
    assert len(fig.data) == 1
    z = np.asarray(fig.data[0].z, dtype=float)
    assert z.shape == (2 * 7 - 1, 3 * 7 - 1)
    np.testing.assert_array_equal(z[:6, 7:13], W["unas"][0, 1])  # layer 0, head 1
    assert np.isnan(z[6]).all() and np.isnan(z[:, 6]).all()  # gutters
    assert len(set(fig.data[0].x)) == len(fig.data[0].x)  # unique hover labels
    assert [a.text for a in fig.layout.annotations] == ["head 0", "head 1", "head 2", "layer 0", "layer 1"]
    assert len(b.table) == 2 * 3 * 6 * 6 and list(b.table.columns[:2]) == ["layer", "head"]
    np.testing.assert_array_equal(b.arrays["unas"], W["unas"])
    big = av.build(
        "grid", {"unas": softmax_weights(1, 2, 300, 300)}, ["t"] * 300, {"variant": "unas", "max_tokens": 64}
    )
    assert np.asarray(big.figure.data[0].z).shape == (60, 121)
    assert "5x5 token blocks" in big.figure.layout.title.text
    assert len(big.table) == 2 * 60 * 60  # the CSV holds the block means the figure draws


def test_builders_of_every_kind():
    for kind, params in [
        ("grid", {"variant": "unas"}),
        ("heatmap", {"variant": "dnas", "layer": 1, "head": 2}),
        ("head_view", {"variant": "unas", "layer": 0, "head": 0, "min_weight": 0.0}),
        ("token_mass", {"variant": "unas", "layer": 1, "head": None}),
        ("column_mass", {"variants": ["unas", "dnas"], "layer": None}),
        ("explained_away", {"eps": 0.5}),
    ]:
        b = av.build(kind, W, TOKENS, params, u=0.5)
        assert b.figure.data and len(b.table) > 0, kind
    b = av.build("token_mass", W, TOKENS, {"variant": "unas", "layer": 1, "head": None})
    np.testing.assert_allclose(b.table["column_mass"], W["unas"][1].sum(-2).mean(0), rtol=1e-6)
    hv = av.build("head_view", W, TOKENS, {"variant": "unas", "layer": 0, "head": 0, "min_weight": 0.0})
    drawn = sum(
        np.isfinite(np.asarray(t.x, dtype=float)).sum() // 2 for t in hv.figure.data if t.mode == "lines"
    )
    assert drawn == 36  # every (query, key) pair is one segment
    d = av.build("difference", [W, W], TOKENS, {"variants": ["unas", "dnas"], "layer": 0, "head": 1})
    np.testing.assert_allclose(d.arrays["difference"], W["unas"][0, 1] - W["dnas"][0, 1])
    js = av.build("js_distance", [W, W], TOKENS, {"variants": ["unas", "unas"]})
    np.testing.assert_allclose(js.arrays["js_distance"], 0.0, atol=2e-3)
    over = av.build(
        "column_mass", [W, W], TOKENS, {"variants": ["unas", "dnas"], "layer": 0}, labels=["A", "B"]
    )
    assert [t.name for t in over.figure.data][:2] == ["A · unas", "B · dnas"]
    with pytest.raises(ValueError, match="kind must be one of"):
        av.build("pie", W, TOKENS, {})


def test_joint_query_key_keeps_every_softmax():
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(7, 4, generator=g).numpy(), torch.randn(7, 4, generator=g).numpy() + 3.0
    q2, k2 = av.joint_query_key(q, k)
    np.testing.assert_allclose(
        torch.softmax(torch.from_numpy(q2 @ k2.T), -1),
        torch.softmax(torch.from_numpy(q @ k.T), -1),
        atol=1e-5,
    )
    np.testing.assert_allclose(q2.mean(0) * 0 + k2.mean(0), k2.mean(0))
    assert av.pca_2d(np.vstack([q2, k2])).shape == (14, 2)


def test_most_explained_away_ranks_starved_keys():
    w = np.full((1, 1, 4, 4), 0.25, dtype=np.float32)
    w[..., 3] = 0.0
    w[..., 0] = 0.5  # key 3 gets nothing, key 0 twice its share
    table = av.most_explained_away(w, ["a", "b", "c", "d"], eps=0.1)
    assert table.iloc[0]["token"] == "d" and table.iloc[0]["share_of_heads"] == 1.0


def test_data_bytes_and_html():
    b = av.build("heatmap", W, TOKENS, {"variant": "unas", "layer": 0, "head": 0})
    with np.load(io.BytesIO(av.data_bytes(b, "npz")), allow_pickle=False) as npz:
        np.testing.assert_array_equal(npz["unas"], W["unas"][0, 0])
        assert list(npz["tokens"]) == TOKENS
    csv = av.data_bytes(b, "csv").decode()
    assert csv.splitlines()[0] == "query,key,weight" and len(csv.splitlines()) == 37
    html = av.figure_bytes(b.figure, "html")
    assert b"<html>" in html[:100] and b"plotly" in html


@pytest.mark.slow
@pytest.mark.skipif(not export.chromium_available(), reason="Chromium not found: static export untestable")
def test_static_export_is_a_valid_image():
    b = av.build("grid", W, TOKENS, {"variant": "unas"})
    width, height = png_size(av.figure_bytes(b.figure, "png"))
    assert (width, height) == (b.figure.layout.width, b.figure.layout.height)
    assert av.figure_bytes(b.figure, "pdf").startswith(b"%PDF")
    assert b"<svg" in av.figure_bytes(b.figure, "svg")[:200]


def test_manifest_reproduces_the_figure_through_attnlab_analyze(tmp_path, monkeypatch):
    """The app's heatmap / grid / explained-away data == what the manifest's command + reproduce_figure
    give, on the embedded MiniLM (the same numbers, not just the same kind of figure)."""
    from attnlab import cli, hf

    text = "The quick brown fox jumps over the lazy dog, and the dog explains it away."
    settings = {"variants": ["unas", "dnas"], "mode": "recompute", "u": 0.5, "iters": 3}
    result = hf.analyze(text, None, variants=settings["variants"], iters=3)
    weights = {v: w.numpy() for v, w in result.weights.items()}
    source = {
        "label": "MiniLM",
        "model": result.model.as_dict(),
        "settings": {**settings, "window": result.windowing.window},
    }
    monkeypatch.chdir(tmp_path)
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    specs = [
        ("heatmap", {"variant": "dnas", "layer": 3, "head": 5}),
        ("grid", {"variant": "unas"}),
        ("explained_away", {"eps": 0.2, "variants": ["unas", "dnas"]}),
    ]
    manifests = [
        av.manifest(k, p, [source], text_sha256=result.text_sha256, characters=len(text), window=0)
        for k, p in specs
    ]
    command = shlex.split(manifests[0]["reproduce"]["commands"][0])
    assert command[:3] == ["attnlab", "analyze", "text.txt"] and "--model" not in command  # embedded
    assert cli.main(command[1:] + ["--quiet"]) == 0
    for (kind, params), m in zip(specs, manifests, strict=True):
        (tmp_path / "manifest.json").write_text(json.dumps(m))
        again = av.reproduce_figure("manifest.json", ["attnlab-out"])
        shown = av.build(kind, weights, result.tokens, params, u=0.5)
        for a, b in zip(shown.figure.data, again.figure.data, strict=True):
            np.testing.assert_allclose(np.asarray(a.z, dtype=float), np.asarray(b.z, dtype=float), atol=1e-5)
        assert shown.figure.layout.title.text == again.figure.layout.title.text
    m = json.loads((tmp_path / "manifest.json").read_text())
    m["input"]["sha256"] = "0" * 64
    with pytest.raises(ValueError, match="sha256"):
        av.reproduce_figure(m, ["attnlab-out"])


# ----------------------------------------------------------------------------------------------
# Round 2 (issue 14): readable figures, hover, focus, model view, shared scales
# ----------------------------------------------------------------------------------------------


def test_token_strip_says_where_its_scale_stops():
    """Seen: the strip's colour scale stopped at the 95th percentile without saying so."""
    mass = np.linspace(0.1, 1.0, 40)
    mass[0] = 9.0  # an attention sink
    fig = av.token_mass_strip([f"t{i}" for i in range(40)], mass, bound=1 / 40)
    bar = fig.data[0].colorbar.title.text
    assert fig.data[0].zmax == pytest.approx(np.quantile(mass, 0.95))
    assert "capped at the 95th" in bar and "max 9" in bar
    even = av.token_mass_strip(["a", "b"], np.array([1.0, 1.0]))
    assert "capped" not in even.data[0].colorbar.title.text  # nothing above the scale: nothing said
    hover = fig.data[1]  # one click/hover target per token, with its position
    assert list(hover.customdata) == list(range(40)) and hover.hovertext[3] == "3: t3"


def test_hover_names_positions():
    """Seen: "query: , / key: august" without positions; the grid said "querys"; no head-view hover."""
    heat = av.build("heatmap", W, TOKENS, {"variant": "unas", "layer": 0, "head": 0}).figure
    assert heat.data[0].x[3] == "3: the" and "query %{y}" in heat.data[0].hovertemplate
    from attnlab.figures import attention_grid

    grid = attention_grid(softmax_weights(1, 1, 300, 300), max_tokens=100)
    assert grid.data[0].y[0] == "layer 0 · queries 0-2" and grid.data[0].x[0] == "head 0 · keys 0-2"
    hv = av.head_view(W["unas"][0, 0], TOKENS)
    queries, keys = hv.data[-2], hv.data[-1]
    assert queries.hovertext[1].startswith("1: the → ") and "column mass" in keys.hovertext[2]
    assert list(queries.customdata) == list(range(6)) and "skip" not in (queries.hoverinfo or "")


def test_focus_in_the_head_view_and_model_view():
    hv = av.head_view(W["unas"][0, 0], TOKENS, min_weight=0.0, focus=2)
    lines = [t for t in hv.data if t.mode == "lines"]
    orange = [t for t in lines if t.line.color == "#ff7f0e"]
    ys = np.concatenate([np.asarray(t.y, dtype=float).reshape(-1, 3)[:, :2] for t in orange])
    assert len(ys) == 2 * 6 - 1 and ((ys[:, 0] == 2) | (ys[:, 1] == 2)).all()  # its row and column
    mv = av.model_view(W["unas"], TOKENS, min_weight=0.0, focus=2)
    marks = mv.data[-1]
    assert len(marks.x) == 2 * 3 * 6 and "focus: 2: cat" in mv.layout.title.text
    focused = np.asarray(marks.customdata)[:, 0] == 2  # token 2's markers, in every head, in orange
    assert (np.asarray(marks.marker.color) == focused).all() and focused.sum() == 2 * 3
    assert marks.marker.colorscale[-1][1] == "#ff7f0e" and (marks.marker.cmin, marks.marker.cmax) == (0, 1)
    assert [a.text for a in mv.layout.annotations] == ["head 0", "head 1", "head 2", "layer 0", "layer 1"]
    with pytest.raises(ValueError, match="up to 64 tokens, this window has 65"):
        av.model_view(softmax_weights(1, 1, 65, 65), ["t"] * 65)


def test_panels_share_one_scale_and_differences_centre_at_zero():
    b = av.build(
        "panels", [W, W], TOKENS, {"variants": ["unas", "dnas"], "layer": 1, "head": 0}, labels=["A", "B"]
    )
    fig = b.figure
    top = max(float(W["unas"][1, 0].max()), float(W["dnas"][1, 0].max()))
    assert [t.coloraxis for t in fig.data] == ["coloraxis", "coloraxis"]
    assert (
        fig.layout.coloraxis.cmax == pytest.approx(top)
        and f"0–{top:.3g}" in fig.layout.coloraxis.colorbar.title.text
    )
    own = av.build(
        "panels", [W, W], TOKENS, {"variants": ["unas", "dnas"], "layer": 1, "head": 0, "shared_scale": False}
    )
    assert own.figure.layout.coloraxis2.cmax == pytest.approx(float(W["dnas"][1, 0].max()))
    d = av.build(
        "differences",
        [W, W, W],
        TOKENS,
        {"variants": ["unas", "dnas", "unas"], "layer": 0, "head": 0},
    )
    lim = float(np.abs(W["unas"][0, 0] - W["dnas"][0, 0]).max())
    axis = d.figure.layout.coloraxis
    assert (axis.cmin, axis.cmax) == (pytest.approx(-lim), pytest.approx(lim)) and axis.colorscale[0][
        1
    ] != axis.colorscale[-1][1]
    np.testing.assert_allclose(d.arrays["difference_1"], W["unas"][0, 0] - W["dnas"][0, 0])
    np.testing.assert_allclose(d.arrays["difference_2"], 0.0)
    # panels of one model are named by variant above each map (the full names ran into each other);
    # the figure's title names the model; panels of two models keep their full names
    names = ["MiniLM · unas", "MiniLM · dnas", "MiniLM · unas (2)"]
    params = {"variants": ["unas", "dnas", "unas"], "layer": 0, "head": 0}
    panels = av.build("panels", [W, W], TOKENS, {**params, "variants": ["unas", "dnas"]}, labels=names[:2])
    assert [a.text for a in panels.figure.layout.annotations][:2] == ["unas", "dnas"]
    assert panels.figure.layout.title.text.startswith("MiniLM: layer 0, head 0")
    d = av.build("differences", [W, W, W], TOKENS, params, labels=names)
    assert [a.text for a in d.figure.layout.annotations][:2] == ["unas minus dnas", "unas minus unas (2)"]
    assert d.figure.layout.title.text.startswith("Differences from MiniLM · unas")
    two = {**params, "variants": ["unas", "dnas"]}
    d = av.build("differences", [W, W], TOKENS, two, labels=["A · unas", "B · dnas"])
    assert d.figure.layout.annotations[0].text == "A · unas minus B · dnas"


def test_embedding_legend_clears_the_colour_bar():
    """Seen: the query/key legend overlapped the colour bar's title."""
    b = av.embedding_view(
        np.random.default_rng(0).random((12, 2)),
        np.zeros((12, 3)),
        TOKENS,
        list(np.linspace(0, 1, 12)),
        ["query"] * 6 + ["key"] * 6,
        color_label="mass",
        title="t",
    )
    legend = b.figure.layout.legend
    assert legend.orientation == "h" and legend.y >= 1.0 and legend.yanchor == "bottom"


def test_every_public_name_is_importable_from_attnlab_figures():
    import attnlab.figures as figures

    for name in av.__all__:
        assert getattr(figures, name) is getattr(av, name), name
