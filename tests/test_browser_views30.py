"""Issue 30 items 11-13 in a real browser (Playwright + Debian's Chromium against app/serve.py, the
server and helpers of tests/test_browser.py): the head view's chips overlay heads at once and tell
Python (URL, reload); the neuron view follows a focus click; a click on a point of the Embeddings
scatter focuses its token on Inspect, whose focus is ringed in the scatter."""

from __future__ import annotations

import pytest

sync_api = pytest.importorskip("playwright.sync_api")
import test_browser as tb  # noqa: E402

pytestmark = tb.pytestmark
server_dir, server = tb.server_dir, tb.server  # one server for this module, as test_browser's


def _open(p, url: str, query: str = ""):
    """A 1600x1000 page on Inspect (``?query``), its run over and every view drawn."""
    browser = tb._browser(p)
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    page.goto(f"{url}/{query}", wait_until="domcontentloaded")
    tb._heatmap(page, "unas: layer 2, head 0")
    tb._idle(page)
    return browser, page


def _chip(page, head: int) -> None:
    page.locator(".st-key-inspect_head_view .attnlab-view").scroll_into_view_if_needed()
    page.mouse.click(*page.evaluate(f"h => {tb.VIEW('inspect_head_view')}.chipOf(h)", head))


def test_head_chips_overlay_heads_and_reach_the_url(server):
    url, _, _ = server
    with sync_api.sync_playwright() as p:
        browser, page = _open(p, url)
        titled = "v.dataset.title.startsWith(arg)"
        _chip(page, 3)  # drawn at once, in the browser
        tb._wait_view(page, "inspect_head_view", titled, "unas: head view, layer 2, heads 0, 3", 30)
        page.wait_for_function("() => /overlay=3/.test(location.search)", timeout=30_000)
        _chip(page, 7)
        tb._wait_view(page, "inspect_head_view", titled, "unas: head view, layer 2, heads 0, 3, 7", 30)
        page.wait_for_function("() => /overlay=3%2C7|overlay=3,7/.test(location.search)", timeout=30_000)
        tb._idle(page)
        tb._click_view(page, "inspect_head_view", 4)  # click to focus still works with the overlay
        tb._wait_view(page, "inspect_head_view", "v.dataset.title.includes('(focus: 4: ')")
        tb._idle(page)
        page.reload(wait_until="domcontentloaded")  # a new session: the heads come back from the URL
        tb._wait_view(page, "inspect_head_view", titled, "unas: head view, layer 2, heads 0, 3, 7", 120)
        tb._idle(page)
        _chip(page, 3)  # hide head 3 again
        tb._wait_view(page, "inspect_head_view", titled, "unas: head view, layer 2, heads 0, 7", 30)
        page.locator(".st-key-inspect_head_view .av-heads-button", has_text="only 0").click()
        # the focus (token 4) may come back from the URL too: "head 0" alone or "head 0 (focus: ...)"
        only = "/^unas: head view, layer 2, head 0( \\(focus: |$)/.test(v.dataset.title)"
        tb._wait_view(page, "inspect_head_view", only, None, 30)
        page.wait_for_function("() => !/overlay=/.test(location.search)", timeout=30_000)
        browser.close()


def test_neuron_view_follows_the_focus(server):
    url, _, _ = server
    with sync_api.sync_playwright() as p:
        browser, page = _open(p, url, "?neuron=1")
        assert "Click a token to focus it" in page.locator('[data-testid="stMain"]').inner_text()
        tb._click_view(page, "inspect_head_view", 4)
        title = (
            "() => [...document.querySelectorAll('.st-key-inspect_neuron_view .gtitle')]"
            ".some(t => /query 4: /.test(t.textContent))"
        )
        page.wait_for_function(title, timeout=60_000)
        tb._idle(page)
        tb._click_view(page, "inspect_head_view", 6)
        page.wait_for_function(title.replace("query 4: ", "query 6: "), timeout=60_000)
        text = page.locator('[data-testid="stMain"]').inner_text()
        assert "Score = Σ_d scale · q_d · k_d" in text and "DNAS (Eq. 5) first divides" in text
        browser.close()


def test_a_click_on_a_scatter_point_focuses_its_token_everywhere(server):
    url, _, _ = server
    with sync_api.sync_playwright() as p:
        browser = tb._browser(p)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.goto(f"{url}/embeddings", wait_until="domcontentloaded")
        chart = ".st-key-embed_scatter .js-plotly-plot"
        page.wait_for_selector(chart, timeout=tb.START_TIMEOUT_S * 1000)
        tb._idle(page)
        page.locator(chart).scroll_into_view_if_needed()
        # screen position of point 3 of the first trace (token 3 of this text)
        x, y = page.evaluate(
            """sel => { const gd = document.querySelector(sel), L = gd._fullLayout, t = gd._fullData[0];
                        const r = gd.getBoundingClientRect();
                        return [r.left + L._size.l + L.xaxis.l2p(t.x[3]),
                                r.top + L._size.t + L.yaxis.l2p(t.y[3])]; }""",
            chart,
        )
        page.mouse.click(x, y)
        page.wait_for_function("() => /focus=3/.test(location.search)", timeout=60_000)
        tb._idle(page)
        ringed = (
            f"() => {{ const gd = document.querySelector('{chart}'); const d = gd && gd._fullData; "
            "return d && d[d.length - 1].name.startsWith('focus: 3: '); }"
        )
        page.wait_for_function(ringed, timeout=30_000)
        page.goto(f"{url}/?{page.url.split('?', 1)[1]}", wait_until="domcontentloaded")  # to Inspect
        tb._heatmap(page, "unas: layer 2, head 0")
        tb._wait_view(page, "inspect_heatmap", "v.dataset.focus === '3'")
        browser.close()
