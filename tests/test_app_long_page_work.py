"""Issue 32 item 5: the work a long-context page does on top of the analysis, counted, so that a removed
recomputation cannot come back unnoticed (scripts/profile_long_page.py measures it):

- a text change runs ONE capture forward (Inspect and Explaining away; the sink views' counts come from
  that forward's masks, a short sliding-window window included; the statistics CSV of a long context
  from its row sums);
- the long context's column masses come from the capture forward's row sums (no second pass over the
  tiles, no head's whole map for the token strip), with the values a second pass gives;
- Inspect computes ONE head's whole (N, N) map (the block map and the zoom); the head view's other
  heads compute only the tiles of their span's rows (``long_context.span_block``), equal bit for bit to
  the whole head's slice.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("streamlit.testing.v1")
import test_app_issue30 as base  # noqa: E402
import test_app_long_context as long  # noqa: E402

app_env, deferred, long_llama = base.app_env, base.deferred, long.long_llama
click, messages, run_page = base.click, base.messages, base.run_page
VARIANTS = ("unas", "dnas", "hnas", "sinkhorn", "sparsemax", "softmax1")


@pytest.fixture
def counted(monkeypatch) -> dict:
    """Counts of the expensive steps: capture forwards, stream passes over the tiles (row sums), whole
    heads computed (``head_weights``)."""
    from attnlab.hf.compute import streamed, tiles, weights

    n = {"forwards": 0, "stream_sums": 0, "heads": 0}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            n[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(weights, "_recompute_with_sums", counting("forwards", weights._recompute_with_sums))
    monkeypatch.setattr(streamed, "stream_sums", counting("stream_sums", streamed.stream_sums))
    monkeypatch.setattr(tiles, "head_weights", counting("heads", tiles.head_weights))
    monkeypatch.setattr(streamed, "head_weights", tiles.head_weights)  # (imported by name there)
    return n


# ----------------------------------------------------------------------------------------------
# span_block: the head view's rows alone, the whole head's values
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_span_block_equals_the_whole_heads_slice(app_env, tiny_model_dir, arch, monkeypatch):
    """Every variant (row-normalized, column-normalized, Sinkhorn, sparsemax, softmax1), spans at the
    start, across tile boundaries and at the end, a plain causal and a sliding-window model: the span's
    block equals ``head_map(...)[lo:hi, lo:hi]`` exactly. Tiles of 16 rows, so that a span covers many."""
    from appkit.long_context import span_block

    from attnlab import hf
    from attnlab.figures.long_maps import head_map
    from attnlab.hf.compute import tiles

    monkeypatch.setattr(tiles, "TILE_BYTES", 1 << 14)
    text = " ".join(["The cat sat on the mat because it was tired and the dog barked at it."] * 8)
    plan = hf.stream_analysis(text, hf.load_model(str(tiny_model_dir(arch))), VARIANTS, statistics=False)
    result = plan.window(0)
    N = len(result.tokens)
    assert N >= 60  # tiles of 16 rows: 4
    for v in VARIANTS:
        w = result.weights[v]
        for lo, hi in ((0, 10), (5, 40), (N // 2, N // 2 + 7), (N - 20, N)):
            for layer, head in ((0, 0), (1, 3)):
                got = span_block(w, layer, head, lo, hi)
                assert got.dtype == np.float32 and got.shape == (hi - lo, hi - lo)
                np.testing.assert_array_equal(got, head_map(w, layer, head)[lo:hi, lo:hi], err_msg=v)


def test_span_block_of_a_row_variant_computes_only_its_rows_tiles(long_llama, monkeypatch):
    """unas (rows normalized alone): a span in the middle of the text computes the logits of the tiles
    holding its rows, not those above or below; causal dnas computes the tiles down to the span's
    last, no further."""
    from appkit.long_context import span_block

    from attnlab import hf
    from attnlab.hf.compute import tiles

    monkeypatch.setattr(tiles, "TILE_BYTES", 1 << 14)
    result = hf.stream_analysis(long.TEXT, hf.load_model(str(long_llama)), ("unas", "dnas"),
                                statistics=False).window(0)
    inputs = result.weights["unas"].window.layers[0]
    rows = tiles._tile_rows(inputs, 1, tiles._LIVE + 1)
    N = len(result.tokens)
    assert N > 6 * rows
    seen = []
    logits = tiles.LayerInputs.logits

    def counting(self, heads, i0, i1, lo, hi):
        seen.append(i0)
        return logits(self, heads, i0, i1, lo, hi)

    monkeypatch.setattr(tiles.LayerInputs, "logits", counting)
    lo = 3 * rows + 1  # rows of tiles 3 and 4
    span_block(result.weights["unas"], 0, 1, lo, lo + rows)
    assert seen == [3 * rows, 4 * rows]
    seen.clear()
    span_block(result.weights["dnas"], 0, 1, lo, lo + rows)
    assert seen == [i * rows for i in range(5)]  # the prefix potential: tiles 0..4, not beyond


# ----------------------------------------------------------------------------------------------
# The pages: one capture forward, one whole head
# ----------------------------------------------------------------------------------------------


def test_inspect_on_a_long_text_runs_one_forward_and_one_whole_head(long_llama, monkeypatch, counted):
    """A long context on Inspect: one capture forward (which takes the column masses), no other pass
    over the tiles, one head's whole map (the block map and the zoom); the head view and the strip
    equal the whole maps' (the strip's column masses those of a second, streamed pass)."""
    import json

    from appkit.token_views import decoded

    at = long._page(long_llama, monkeypatch, variant="unas", layer="1", head="2", focus="900")
    assert not at.exception and not at.error, messages(at)
    assert counted == {"forwards": 1, "stream_sums": 1, "heads": 1}, counted  # stream_sums: the forward's
    views = {c.key.removesuffix("_view"): decoded(json.loads(c.proto.json)) for c in at.get("bidi_component")}
    hv, strip = views["inspect_head_view"], views["inspect_token_mass"]
    layer = long._layer(long_llama, 1)  # (H, N, N), by a fresh analysis
    np.testing.assert_array_equal(hv["heads_map"], layer[:, 836:965, 836:965])
    from attnlab import hf

    plan = hf.stream_analysis(long.TEXT, hf.load_model(str(long_llama)), ("unas",), statistics=False)
    masses = plan.window(0).weights["unas"].window.column_masses()["unas"][1]  # (H, N), a second pass
    np.testing.assert_array_equal(strip["strip_mass"], masses.mean(0).numpy()[836:965])
    np.testing.assert_allclose(strip["strip_mass"], layer.sum(1).mean(0)[836:965], rtol=1e-5)


def test_explaining_away_on_a_long_text_runs_one_forward(long_llama, monkeypatch, counted, deferred):
    """Explaining away on a long context: one capture forward, whose row sums give the column masses of
    every view (no second pass over the tiles) and the statistics CSV (no second forward); the sink
    views' counts from the layers' masks (no forward)."""
    import io

    import pandas as pd

    at = long._page(long_llama, monkeypatch, "explaining_away")
    assert not at.exception and not at.error, messages(at)
    # the app opens on Inspect first (its one head); Explaining away adds no forward, pass or head
    assert counted == {"forwards": 1, "stream_sums": 1, "heads": 1}, counted
    table = pd.read_csv(io.StringIO(click(at, deferred, "away_stats_csv")))
    assert counted["forwards"] == 1 and counted["stream_sums"] == 1, counted
    from attnlab import hf

    want = hf.stream_analysis(long.TEXT, hf.load_model(str(long_llama))).window(0).table(eps_relative=0.1)
    pd.testing.assert_frame_equal(table, pd.read_csv(io.StringIO(want.to_csv(index=False))))


def test_sink_views_of_a_short_sliding_window_take_the_forwards_masks(app_env, monkeypatch, english_text,
                                                                      counted):
    """A short causal window (Mistral, sliding window of 8): the sink views' counts are the masks' of the
    window's own capture forward, with no second capture forward (their values, min(N - j, 8) queries:
    tests/test_app_sinks.py)."""
    from appkit import state
    from conftest import build_tiny_model

    directory = build_tiny_model("mistral", app_env / "mistral")
    monkeypatch.setenv("ATTNLAB_TEXTS_DIR", str(app_env / "texts"))
    at = run_page("explaining_away", model="Local Hugging Face directory…", model_dir=str(directory),
                  text=state.store_text(english_text[:200]))
    assert not at.exception and not at.error, messages(at)
    assert counted["forwards"] == 1, counted  # (massive activations: a plain forward, not a capture)
