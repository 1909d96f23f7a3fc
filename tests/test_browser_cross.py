"""Cross-attention's head view and model view in a real browser (Playwright + Debian's Chromium
against app/serve.py, as tests/test_browser.py): Inspect on a tiny random BART with a target draws
the target tokens on the left and the source tokens on the right; a click on a source token focuses
it in both views, the focus bar and the URL; a click on a target token leaves the focus as it is."""

from __future__ import annotations

import os
from urllib.parse import urlencode

import pytest
from conftest import build_tiny_model

sync_api = pytest.importorskip("playwright.sync_api")
import test_browser as tb  # noqa: E402

pytestmark = [
    pytest.mark.slow,  # a Streamlit server and a browser
    pytest.mark.skipif(not os.path.exists(tb.CHROMIUM), reason="Debian's chromium is not installed"),
]
SOURCE = "Attention lets every word look at every other word."
TARGET = "A key that no query wants."


@pytest.fixture(scope="module")
def bart_server(tmp_path_factory):
    """(url, model folder, (target tokens, source tokens)) of a server whose model roots hold a tiny BART."""
    from attnlab import hf

    root = tmp_path_factory.mktemp("cross")
    folder = build_tiny_model("bart", root / "bart", scale=0.3)
    tokens = hf.analyze(SOURCE, hf.load_model(str(folder)), ("unas",), target=TARGET).tokens("cross")
    with pytest.MonkeyPatch.context() as env:  # the server's model roots, restored after
        env.setenv("ATTNLAB_MODEL_ROOTS", str(root))
        with tb.serve(root / "server") as (url, _, _):
            yield url, folder, tokens


def test_cross_head_view_focuses_a_source_token(bart_server):
    url, folder, (queries, keys) = bart_server
    M, N = len(queries), len(keys)
    with sync_api.sync_playwright() as p:
        browser = tb._browser(p)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        query = urlencode({"model": "Local Hugging Face directory…", "model_dir": str(folder),
                           "target": TARGET, "kind": "cross"})
        page.goto(f"{url}/?{query}", wait_until="domcontentloaded")
        tb._idle(page, 240)
        tb._set_text(page, SOURCE)
        tb._wait_view(page, "inspect_head_view", "v.attnlab.m === arg[0] && v.attnlab.n === arg[1]", [M, N],
                      timeout_s=240)
        tb._idle(page, 240)
        shown = page.evaluate(f"() => [{tb.VIEW('inspect_head_view')}.attnlab.query_tokens, "
                              f"{tb.VIEW('inspect_head_view')}.attnlab.tokens]")
        assert shown == [queries, keys]
        tb._click_in_sight(page, "inspect_head_view", 3)  # a source token, on the right
        page.wait_for_function("() => window.location.search.includes('focus=3')", timeout=120_000)
        for key in ("inspect_head_view", "inspect_model_view"):
            assert tb._focus(page, key) == "3", key
        title = page.evaluate(f"() => {tb.VIEW('inspect_head_view')}.dataset.title")
        assert title.endswith(f"(focus: 3: {keys[3]})"), title
        _, y = page.evaluate(f"() => {tb.VIEW('inspect_head_view')}.pointOf(1)")  # source token 1 ...
        left = page.evaluate(f"() => {{ const c = {tb.VIEW('inspect_head_view')}.querySelector('canvas');"
                             "return c.getBoundingClientRect().left + 130; }")  # ... target token 1's label
        page.mouse.click(left, y)
        page.wait_for_timeout(500)
        assert tb._focus(page, "inspect_head_view") == "3", "a target token does not move the focus"
        tb._idle(page, 240)
        assert f"Focus: token 3 “{keys[3]}”" in page.locator('[data-testid="stMain"]').inner_text()
        browser.close()
