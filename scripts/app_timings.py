"""The app's timings of issue 14 in a real browser, and screenshots of every page. One command:

    flock /tmp/attnlab-bench.lock python3 scripts/app_timings.py --out app_timings.json --shots /tmp/shots

starts a fresh `streamlit run` (tests/test_browser.py's ``serve``), drives Debian's Chromium with
Playwright at 1600x1000 and prints, then writes as JSON, each figure (seconds; ``--repeat`` runs of
each, default 3):

- ``first_load``: the server up (health check answered) -> Inspect's heatmap drawn, then -> every
  chart drawn and the script run over (the first page run loads MiniLM and analyses the sample);
- ``page_load_warm``: a new tab on the warm server -> every chart drawn;
- ``text_change_50`` / ``text_change_512`` / ``text_change_1440``: a new text committed (~50 / ~512
  tokens, one window; ~1,500 tokens, three windows, the first shown;
  the clock starts at the commit, Ctrl+Enter, after the text is typed) -> every view and chart of
  Inspect redrawn with it and the run over;
- ``window_change``: the window slider moved (a ~900-token text, two windows) -> the window's charts;
- ``click_to_focus_cell`` / ``click_to_focus_head_view``: a click on a heatmap cell / a head-view
  token (the clock starts at the click, the mouse already over the token) -> the focus drawn in the
  map and the model view, the server told (the URL names it) and the run over.

Targets (issue 14): first load <= 8 s after the server is up; text change -> all charts <= 0.5 s at
50 tokens, <= 1 s at 512, <= 1.5 s at ~1,440 (issue 30 item 15); window change <= 1 s; click to focus
<= 0.3 s. The load average before and
after is printed and stored: timings on a loaded machine measure the contention. With ``--shots``
every page (and each chart) is also captured at 1600x1000 and 1280x800 after the timings.
Nothing is asserted here (speed is measured, not tested); tests/test_browser.py runs it once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import test_browser as tb  # noqa: E402  (its server, waits and clicks)
from playwright import sync_api  # noqa: E402

TITLE = "unas: layer 2, head 0"  # the Inspect heatmap's title with the default settings
TEXT_50 = "The harbour lantern and the umbrella rarely share a word; " * 4  # 50 tokens with [CLS], [SEP]
TEXT_512 = tb.LONG_TEXT  # ~505 tokens, one window
TEXT_2_WINDOWS = tb.LONG_2_WINDOWS  # ~900 tokens: two windows
TEXT_1440 = " ".join([tb.LONG_TEXT] * 3)  # ~1,500 tokens: the issue 30 item 15 case (three windows)
VIEWPORTS = ((1600, 1000), (1280, 800))
PAGES = [*tb.PAGES, "interventions", "corpus"]  # url paths ("": Inspect)


def _timed(page, action, check) -> float:
    """Seconds from ``action`` until ``check`` holds and the page is idle (run over, charts drawn)."""
    t0 = time.monotonic()
    action()
    check()
    tb._idle(page)
    return time.monotonic() - t0


def measure(p, url: str, t_up: float, repeat: int = 3) -> dict[str, list[float]]:
    """Every figure of the module docstring, ``repeat`` times each (first_load: once, two stages)."""
    out: dict[str, list[float]] = {}
    browser = tb._browser(p)
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    page.goto(url, wait_until="domcontentloaded")
    tb._heatmap(page, TITLE)
    heatmap = time.monotonic() - t_up
    tb._idle(page, 300)
    out["first_load"] = [heatmap, time.monotonic() - t_up]
    page.close()

    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    t0 = time.monotonic()
    page.goto(url, wait_until="domcontentloaded")
    tb._heatmap(page, TITLE)
    tb._idle(page)
    out["page_load_warm"] = [time.monotonic() - t0]

    # each run brings a word no earlier text had, and the wait is for that word among the map's keys
    # (a word of the previous text would let the old chart pass for the new one)
    changes = (
        ("text_change_50", TEXT_50, "river mountain garden"),
        ("text_change_512", TEXT_512, "castle forest island"),
        ("text_change_1440", TEXT_1440, "valley harbour meadow"),
    )
    box = page.get_by_label("Text", exact=True)
    for name, text, words in changes:
        out[name] = []
        for word in words.split()[:repeat]:
            box.fill(f"Round {word}. {text}")  # the typing is not timed: from the commit on
            drawn = partial(tb._heatmap, page, TITLE, word, 120)
            out[name].append(_timed(page, lambda: box.press("Control+Enter"), drawn))

    tb._set_text(page, tb.TEXT)
    tb._heatmap(page, TITLE, "umbrella", 120)
    tb._idle(page)
    n = page.evaluate(f"() => {tb.VIEW('inspect_heatmap')}.attnlab.n")

    def focused(position):  # drawn in every view, and the server has it (the URL, then idle)
        def check():
            tb._wait_view(page, "inspect_heatmap", "v.dataset.focus === String(arg)", position)
            tb._wait_view(page, "inspect_model_view", "v.dataset.focus === String(arg)", position)
            page.wait_for_function("arg => window.location.search.includes('focus=' + arg)", arg=position)

        return check

    def click(key, *where):  # from the click on: scrolling there and moving the mouse are not timed
        xy = tb._point_view(page, key, *where)
        return _timed(page, lambda: page.mouse.click(*xy), focused(where[0]))

    cells = [(3 + 4 * k) % n for k in range(repeat)]
    out["click_to_focus_cell"] = [click("inspect_heatmap", q, 1) for q in cells]  # cell (q, 1): query q
    tokens = [(5 + 4 * k) % n for k in range(repeat)]
    out["click_to_focus_head_view"] = [click("inspect_head_view", q) for q in tokens]

    tb._set_text(page, TEXT_2_WINDOWS)
    slider = page.locator(".st-key-inspect_window")
    slider.wait_for(timeout=120_000)
    tb._idle(page)
    steps = [("ArrowRight", 2), ("ArrowLeft", 1)] * repeat
    out["window_change"] = [
        _timed(
            page,
            lambda key=key: slider.get_by_role("slider").press(key, timeout=120_000),
            lambda shown=shown: page.get_by_text(f"Window {shown} of ").wait_for(timeout=60_000),
        )
        for key, shown in steps[:repeat]
    ]
    browser.close()
    return out


def screenshots(p, url: str, shots: Path) -> list[Path]:
    """Every page at each viewport (``<page>_<w>x<h>.png``) and each of its charts (``..._chartK.png``),
    after the page's run is over, on the sample text."""
    shots.mkdir(parents=True, exist_ok=True)
    written = []
    for width, height in VIEWPORTS:
        browser = tb._browser(p)
        page = browser.new_page(viewport={"width": width, "height": height})
        for path in PAGES:
            page.goto(f"{url}/{path}", wait_until="domcontentloaded")
            page.wait_for_selector('[data-testid="stMain"] h1', timeout=180_000)
            page.wait_for_timeout(1500)
            tb._idle(page, 300)
            page.wait_for_timeout(1000)  # a page that reruns itself once (a fragment, a rerun) settles
            tb._idle(page, 300)
            name = path or "inspect"
            written.append(shots / f"{name}_{width}x{height}.png")
            page.screenshot(path=str(written[-1]))
            # plotly charts and the browser-drawn token views (app/assets/token_views.js)
            charts = page.locator(".stPlotlyChart, .attnlab-view:not([data-kind=focus_bar])")
            for k in range(charts.count()):
                charts.nth(k).scroll_into_view_if_needed()
                written.append(shots / f"{name}_{width}x{height}_chart{k}.png")
                charts.nth(k).screenshot(path=str(written[-1]))
        browser.close()
    return written


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    ap.add_argument("--shots", type=Path, default=None, help="also write screenshots of every page here")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each measurement, 1 to 3 (default 3)")
    args = ap.parse_args(argv)
    if not 1 <= args.repeat <= 3:
        ap.error(f"--repeat must be 1, 2 or 3, got {args.repeat}")
    load_before = os.getloadavg()
    result: dict = {"load_average_before": load_before, "cpus": os.cpu_count()}

    def report(**more) -> None:
        result.update(more, load_average_after=os.getloadavg())
        if args.out:
            args.out.write_text(json.dumps(result, indent=2))

    with tempfile.TemporaryDirectory() as tmp, tb.serve(Path(tmp)) as (url, t_spawn, t_up):
        with sync_api.sync_playwright() as p:
            timings = measure(p, url, t_up, args.repeat)
            report(server_spawn_to_health_s=t_up - t_spawn, timings_s=timings)
            print(f"server spawn -> health check: {t_up - t_spawn:.2f} s")
            for what, times in timings.items():
                print(f"{what}: " + ", ".join(f"{t:.2f} s" for t in times))
            after = result["load_average_after"]
            print(f"load average before {load_before}, after {after} ({os.cpu_count()} CPUs)")
            sys.stdout.flush()
            if args.shots:
                shots = [str(s) for s in screenshots(p, url, args.shots)]
                report(screenshots=shots)
                print(f"{len(shots)} screenshots in {args.shots}")
    return result


if __name__ == "__main__":
    main()
