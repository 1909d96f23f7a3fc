"""Timings of issue 30's new views (items 10-13) in a real browser. One command:

    flock /tmp/attnlab-bench.lock python3 scripts/app_timings_views30.py --out views30_timings.json

starts a fresh server (tests/test_browser.py's ``serve``), drives Debian's Chromium at 1600x1000 and
prints, then writes as JSON, each figure (seconds; ``--repeat`` runs of each, default 3):

- ``overlay_chip_drawn``: a click on a head chip of Inspect's head view -> the head view redrawn
  with that head (in the browser, no server round trip);
- ``overlay_chip_kept``: the same click -> the URL names the heads and the run (the focus bar's
  fragment) is over;
- ``neuron_focus_click``: with the neuron view on (``?neuron=1``), a click on a head-view token ->
  the neuron view redrawn for that query (a whole-page rerun) and the run over;
- ``scatter_point_click``: a click on a point of the Embeddings scatter (PCA, token representations)
  -> the URL names its token as the focus, the point ringed, the run over;
- ``pooled_queries_keys``: on Embeddings, "queries and keys" with 3 layers x 4 heads pooled -> the
  scatter drawn (the first time: one forward, no cache);
- ``drill_down_drawn``: a click on another head's map in Inspect's layer x head grid (item 10) ->
  the heatmap titled with that layer and head (a whole-page rerun: Python sends the new map);
- ``drill_down_kept``: the same click -> the URL names the layer and head and the run is over.

Targets: a chip, point or drill-down click like click to focus (<= 0.3 s); the neuron view like a
text change at 50 tokens (<= 0.5 s). Nothing is asserted; the load average before and after is
stored. ``--only drill_down`` (or chips, neuron, embeddings) runs one group, e.g. as a smoke check
with ``--repeat 1``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import test_browser as tb  # noqa: E402  (its server, waits and clicks)
from playwright import sync_api  # noqa: E402

TITLE = "unas: layer 2, head 0"
HEAD_VIEW = "inspect_head_view"
CHART = ".st-key-embed_scatter .js-plotly-plot"


def _timed(action, check) -> float:
    t0 = time.monotonic()
    action()
    check()
    return time.monotonic() - t0


def _open(browser, url: str):
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    page.goto(url, wait_until="domcontentloaded")
    tb._heatmap(page, TITLE)
    tb._idle(page)
    return page


def chips(browser, url: str, repeat: int) -> dict[str, list[float]]:
    page = _open(browser, url)
    out = {"overlay_chip_drawn": [], "overlay_chip_kept": []}
    page.locator(f".st-key-{HEAD_VIEW} .attnlab-view").scroll_into_view_if_needed()
    for head in (3, 5, 7)[:repeat]:
        xy = page.evaluate(f"h => {tb.VIEW(HEAD_VIEW)}.chipOf(h)", head)
        page.mouse.move(*xy)
        t0 = time.monotonic()
        page.mouse.click(*xy)
        tb._wait_view(page, HEAD_VIEW, "v.dataset.title.includes(', ' + arg)", str(head))
        out["overlay_chip_drawn"].append(time.monotonic() - t0)
        page.wait_for_function(
            "h => /overlay=/.test(location.search) && location.search.includes(h)", arg=str(head)
        )
        tb._idle(page)
        out["overlay_chip_kept"].append(time.monotonic() - t0)
    page.close()
    return out


def neuron(browser, url: str, repeat: int) -> list[float]:
    page = _open(browser, f"{url}/?neuron=1")
    times = []
    for position in (4, 6, 8)[:repeat]:
        xy = tb._point_view(page, HEAD_VIEW, position)
        shown = (
            "p => [...document.querySelectorAll('.st-key-inspect_neuron_view .gtitle')]"
            ".some(t => t.textContent.includes('query ' + p + ': '))"
        )

        def check(p=position, shown=shown):
            page.wait_for_function(shown, arg=p, timeout=60_000)
            tb._idle(page)

        times.append(_timed(lambda xy=xy: page.mouse.click(*xy), check))
    page.close()
    return times


def _point(page, index: int) -> tuple[float, float]:
    return page.evaluate(
        """([sel, i]) => { const gd = document.querySelector(sel), L = gd._fullLayout, t = gd._fullData[0];
                            const r = gd.getBoundingClientRect();
                            return [r.left + L._size.l + L.xaxis.l2p(t.x[i]),
                                    r.top + L._size.t + L.yaxis.l2p(t.y[i])]; }""",
        [CHART, index],
    )


def embeddings(browser, url: str, repeat: int) -> dict[str, list[float]]:
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    page.goto(f"{url}/embeddings", wait_until="domcontentloaded")
    page.wait_for_selector(CHART, timeout=tb.START_TIMEOUT_S * 1000)
    tb._idle(page)
    out = {"scatter_point_click": []}
    for index in (3, 9, 15)[:repeat]:
        page.locator(CHART).scroll_into_view_if_needed()
        xy = _point(page, index)
        page.mouse.move(*xy)

        def check(i=index):
            page.wait_for_function("i => location.search.includes('focus=' + i)", arg=i, timeout=60_000)
            ring = (
                f"() => {{ const d = document.querySelector('{CHART}')._fullData; "
                f"return d[d.length - 1].name.startsWith('focus: {i}: '); }}"
            )
            page.wait_for_function(ring, timeout=60_000)
            tb._idle(page)

        out["scatter_point_click"].append(_timed(lambda xy=xy: page.mouse.click(*xy), check))
    page.get_by_text("queries and keys (AttentionViz)").click()
    tb._idle(page)
    page.get_by_text("Pool over more layers").click()
    for label, values in (("Also layers", ("0", "4")), ("Also heads", ("1", "2", "3"))):
        box = page.get_by_label(label)
        for v in values:
            box.click()
            page.get_by_role("option", name=v, exact=True).click()
            tb._idle(page)
    out["pooled_queries_keys"] = [0.0]  # the selects above ran it once; time a fresh layer set
    box = page.get_by_label("Also layers")
    box.click()
    t0 = time.monotonic()
    page.get_by_role("option", name="5", exact=True).click()
    page.wait_for_function(
        f"() => document.querySelector('{CHART} .gtitle').textContent.includes('layers 0, 2, 4, 5')",
        timeout=120_000,
    )
    tb._idle(page)
    out["pooled_queries_keys"] = [time.monotonic() - t0]
    page.close()
    return out


def drill_down(browser, url: str, repeat: int) -> dict[str, list[float]]:
    page = _open(browser, url)
    out = {"drill_down_drawn": [], "drill_down_kept": []}
    for layer, head in ((4, 3), (1, 2), (5, 7))[:repeat]:
        xy = tb._point_in_sight(page, "inspect_grid", layer, head)
        page.mouse.move(*xy)
        t0 = time.monotonic()
        page.mouse.click(*xy)
        tb._heatmap(page, f"unas: layer {layer}, head {head}", timeout_s=60)
        out["drill_down_drawn"].append(time.monotonic() - t0)
        page.wait_for_function(
            "a => location.search.includes('layer=' + a[0]) && location.search.includes('head=' + a[1])",
            arg=[layer, head],
        )
        tb._idle(page)
        out["drill_down_kept"].append(time.monotonic() - t0)
    page.close()
    return out


GROUPS = ("chips", "neuron", "embeddings", "drill_down")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each measurement, 1 to 3 (default 3)")
    ap.add_argument("--only", choices=GROUPS, action="append", help="run only these groups (default: all)")
    args = ap.parse_args(argv)
    only = set(args.only or GROUPS)
    if not 1 <= args.repeat <= 3:
        ap.error(f"--repeat must be 1, 2 or 3, got {args.repeat}")
    result: dict = {"load_average_before": os.getloadavg(), "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp, tb.serve(Path(tmp)) as (url, _, _):
        with sync_api.sync_playwright() as p:
            browser = tb._browser(p)
            timings = chips(browser, url, args.repeat) if "chips" in only else {}
            if "neuron" in only:
                timings["neuron_focus_click"] = neuron(browser, url, args.repeat)
            if "embeddings" in only:
                timings |= embeddings(browser, url, args.repeat)
            if "drill_down" in only:
                timings |= drill_down(browser, url, args.repeat)
            browser.close()
    result.update(timings_s=timings, load_average_after=os.getloadavg())
    for what, times in timings.items():
        print(f"{what}: " + ", ".join(f"{t:.2f} s" for t in times))
    print(f"load average before {result['load_average_before']}, after {result['load_average_after']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
