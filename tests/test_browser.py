"""The app in a real browser: Playwright driving Debian's Chromium against `streamlit run` on
127.0.0.1 and a free port. Paste a text, the heatmap renders, switch the variant, download a PNG and
check it is a valid image. Also measures (prints, never asserts) the first page load of a fresh server
and the Inspect-ready time after a text change of 512 tokens (warm); run with -s to see them.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
import zlib
from pathlib import Path

import pytest

sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = "/usr/bin/chromium"
pytestmark = [
    pytest.mark.slow,  # a Streamlit server and a browser
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed"),
]

REPO = Path(__file__).resolve().parents[1]
BROWSER_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
START_TIMEOUT_S = 180  # a fresh server imports torch + transformers and loads MiniLM on a busy 2-core box
TEXT = "Zebras and penguins rarely share an umbrella, but the penguin explains the zebra away."
LONG_TEXT = " ".join(
    ["Attention lets every word look at every other word, and a word nobody looks at is explained away."] * 25
)  # 500 tokens; with "Round <word>." and [CLS] ... [SEP]: 505-506 tokens, one window


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    assert data[12:16] == b"IHDR" and struct.unpack(">I", data[29:33])[0] == zlib.crc32(data[12:29])
    assert data.endswith(b"IEND\xaeB`\x82"), "truncated PNG"
    return struct.unpack(">II", data[16:24])


@pytest.fixture
def server(tmp_path):
    """`streamlit run app/streamlit_app.py` from the repository root; yields (url, start time)."""
    port = _free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "ATTNLAB_UMAP": "off",
        "ATTNLAB_RUNS_DIR": str(tmp_path / "runs"),
        "OMP_WAIT_POLICY": "PASSIVE",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "streamlit",
            "run",
            "app/streamlit_app.py",
            "--server.address",
            "127.0.0.1",
            "--server.port",
            str(port),
            "--server.headless",
            "true",
            "--browser.gatherUsageStats",
            "false",
        ],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        while time.monotonic() - t0 < START_TIMEOUT_S:
            try:
                if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).status == 200:
                    break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError((tmp_path / "server.log").read_text()) from None
                time.sleep(0.3)
        yield url, t0
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()


def _heatmap(page, title: str, token: str | None = None, timeout_s: float = START_TIMEOUT_S) -> None:
    """Wait until the Inspect page's big heatmap is drawn with ``title`` and has ``token`` among its
    key labels (plotly draws only some tick labels of a long axis, so read the plot's data)."""
    page.wait_for_function(
        """([title, token]) => {
            const gd = document.querySelector('.st-key-inspect_heatmap .js-plotly-plot');
            if (!gd || !gd._fullLayout || !gd.data || !gd.data.length) return false;
            const t = gd.layout.title;
            const shown = typeof t === 'string' ? t : (t && t.text);
            return shown === title && (!token || gd.data[0].x.some(x => String(x).includes(token)));
        }""",
        arg=[title, token],
        timeout=timeout_s * 1000,
    )


def _idle(page, timeout_s: float = 120):
    """Wait until the script run is over (no 'running' status widget, no stale element) and every
    plotly chart on the page is drawn."""
    page.wait_for_function(
        """() => !document.querySelector('[data-testid="stStatusWidget"]')
              && !document.querySelector('[data-stale="true"]')
              && [...document.querySelectorAll('.js-plotly-plot')].every(gd => gd._fullLayout)""",
        timeout=timeout_s * 1000,
    )


def _set_text(page, text: str) -> None:
    box = page.get_by_label("Text", exact=True)
    box.fill(text)
    box.press("Control+Enter")  # commit the text area (as blurring it would)


def test_paste_switch_variant_download_png(server, tmp_path):
    url, t_start = server
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        page = browser.new_page(viewport={"width": 1500, "height": 1000}, accept_downloads=True)
        page.goto(url, wait_until="domcontentloaded")
        _heatmap(page, "unas: layer 2, head 0")
        first_load = time.monotonic() - t_start
        _idle(page)

        _set_text(page, TEXT)
        _heatmap(page, "unas: layer 2, head 0", "umbrella", 120)
        _idle(page)

        page.locator(".st-key-inspect_variant button").filter(has_text="dnas").click()
        _heatmap(page, "dnas: layer 2, head 0", "umbrella", 120)
        _idle(page)

        page.locator(".st-key-inspect_heatmap_export button").first.click()  # the heatmap's Export menu
        png_button = page.locator(".st-key-inspect_heatmap_png button")
        png_button.wait_for(state="visible", timeout=30_000)
        with page.expect_download(timeout=180_000) as info:
            png_button.click()
        target = tmp_path / "heatmap.png"
        info.value.save_as(target)
        width, height = _png_size(target.read_bytes())
        assert info.value.suggested_filename == "heatmap.png" and width > 300 and height > 300

        # Measurement (not a requirement of this test): Inspect ready after a text change, 512 tokens, warm
        page.keyboard.press("Escape")
        ready = []
        for word in ("zeppelin", "lantern", "harbour"):
            t0 = time.monotonic()
            _set_text(page, f"Round {word}. {LONG_TEXT}")
            _heatmap(page, "dnas: layer 2, head 0", word, 120)
            _idle(page)
            ready.append(time.monotonic() - t0)
        browser.close()
    print(f"\n[measure] first page load of a fresh server (spawn -> heatmap visible): {first_load:.1f} s")
    times = ", ".join(f"{r:.2f} s" for r in ready)
    print(f"[measure] Inspect ready after a text change, ~512 tokens, warm: {times}")
