"""Issue 32 items 4-5 in a real browser (Playwright + Debian's Chromium against app/serve.py, as
tests/test_browser.py): Inspect on a tiny causal LLaMA (2,048 positions, MiniLM's tokenizer) with a
text of ~1,650 tokens draws the block-downsampled map with its block size, the zoom at full
resolution, and a click in the windowed head view focuses the right absolute token (the span then
follows it); Explaining away draws the four sink views."""

from __future__ import annotations

import os
from urllib.parse import urlencode

import pytest

sync_api = pytest.importorskip("playwright.sync_api")
import test_browser as tb  # noqa: E402

pytestmark = [
    pytest.mark.slow,  # a Streamlit server and a browser
    pytest.mark.skipif(not os.path.exists(tb.CHROMIUM), reason="Debian's chromium is not installed"),
]
TEXT = " ".join(["The cat sat on the mat because it was tired and the dog barked at it."] * 100)


@pytest.fixture(scope="module")
def long_server(tmp_path_factory):
    """(url, model folder, the text's tokens as the model reads them) of a server whose model roots
    hold a tiny random LLaMA with 2,048 positions."""
    from test_app_long_context import build_long_llama

    from attnlab import hf

    root = tmp_path_factory.mktemp("long")
    folder = build_long_llama(root / "long-llama")
    tokens = hf.stream_analysis(TEXT, hf.load_model(str(folder)), ("unas",)).window(0).tokens
    before = os.environ.get("ATTNLAB_MODEL_ROOTS")
    os.environ["ATTNLAB_MODEL_ROOTS"] = str(root)
    try:
        with tb.serve(root / "server") as (url, _, _):
            yield url, folder, tokens
    finally:
        if before is None:
            os.environ.pop("ATTNLAB_MODEL_ROOTS", None)
        else:
            os.environ["ATTNLAB_MODEL_ROOTS"] = before


def _chart(page, key: str, test: str, arg=None, timeout_s: float = 240) -> None:
    """Wait until the plotly chart of widget ``key`` is drawn and ``test`` (JS over its div ``d``
    and ``arg``) holds; an error on the page ends the wait with its message."""
    page.wait_for_function(
        f"""arg => {{
            if (document.querySelector('[data-testid="stException"]')) return true;
            const d = document.querySelector('.st-key-{key} .js-plotly-plot');
            return !!(d && d._fullLayout && d.data && ({test}));
        }}""", arg=arg, timeout=timeout_s * 1000)
    error = page.query_selector('[data-testid="stException"]')
    assert error is None, error.inner_text()


def _main_text(page) -> str:
    return page.locator('[data-testid="stMain"]').inner_text()


def test_long_causal_text_in_the_browser(long_server):
    url, folder, tokens = long_server
    N = len(tokens)
    assert 1500 < N <= 2048
    with sync_api.sync_playwright() as p:
        browser = tb._browser(p)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        query = urlencode({"model": "Local Hugging Face directory…", "model_dir": str(folder)})
        page.goto(f"{url}/?{query}", wait_until="domcontentloaded")
        tb._idle(page, 240)
        tb._set_text(page, TEXT)
        # the whole map, downsampled: 4 x 4 token blocks, said in the title and on the page
        block = "each cell = 4 × 4 tokens (mean)"
        _chart(page, "inspect_heatmap_blocks", "d.layout.title.text.includes(arg)", block)
        tb._idle(page, 240)
        assert block in _main_text(page)
        size = page.evaluate("() => document.querySelector('.st-key-inspect_heatmap_blocks .js-plotly-plot')"
                             "._fullData[0].z.length")  # (plotly's decoded typed array)
        assert size == -(-N // 4)
        # the zoom: the first 128 tokens at full resolution, labelled with their positions
        _chart(page, "inspect_heatmap_zoom", "d.data[0].y.length === 128 && d.data[0].y[0] === arg",
               f"0: {tokens[0]}")
        assert f"tokens 0–128 of {N:,}" in _main_text(page)
        # a click on token 100 of the windowed head view (tokens 0-128) focuses token 100 of the text ...
        tb._click_in_sight(page, "inspect_head_view", 100)  # (the view is taller than the window)
        page.wait_for_function("() => window.location.search.includes('focus=100')", timeout=120_000)
        tb._idle(page, 240)
        assert f"tokens 36–164 of {N:,}" in _main_text(page)  # ... and the span follows it: 100 ± 64
        # a click on the 100th token of the new span (tokens 36-164) is token 136 of the text
        tb._wait_view(page, "inspect_head_view", "v.attnlab.tokens.length === 129")
        tb._click_in_sight(page, "inspect_head_view", 100)  # (the view is taller than the window)
        page.wait_for_function("() => window.location.search.includes('focus=136')", timeout=120_000)
        tb._idle(page, 240)
        assert f"Focus: token 136 “{tokens[136]}”" in _main_text(page)
        assert f"tokens 72–200 of {N:,}" in _main_text(page)
        # Explaining away: the four sink views, from the streamed sums
        page.goto(page.url.replace(f"{url}/?", f"{url}/explaining_away?"), wait_until="domcontentloaded")
        _chart(page, "away_sink_importance", "d.data[0].x[0] === arg", f"0: {tokens[0]}")
        for key in ("away_sink_rate", "away_first_token_mass", "away_massive_activations"):
            _chart(page, key, "d.data.length > 0")
        tb._idle(page, 240)
        assert "causal-corrected importance" in _main_text(page)
        browser.close()

