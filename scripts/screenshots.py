"""Screenshots of every page of the app at 1600x1000 and 1280x800 (issue 30's screenshot walk). One
command, from the repository root:

    PYTHONPATH=. python3 scripts/screenshots.py --out /tmp/attnlab-shots

starts a fresh server on a free port (tests/test_browser.py's ``serve``: app/serve.py, offline, runs
and texts in a temporary folder), drives Debian's Chromium with Playwright, and for each viewport
opens every page on the embedded MiniLM and its sample text, waits until the page has finished
(no "Running..." status, no stale element or skeleton, every plotly chart and browser-drawn token
view drawn, then once more after a pause, for a page that reruns itself), and writes

- ``<page>_<w>x<h>.png``: what the user sees first, and ``<page>_<w>x<h>_sK.png`` (K = 1, 2, ...):
  the main column scrolled one viewport further each time, down to its end (at most ``--sections``);
- ``inspect-gam_<w>x<h>...``: Inspect on the shipped GAM checkpoint (checkpoints/enc-gam), when
  present: its Φ, Θ and combined maps;
- ``inspect-long_<w>x<h>...``: Inspect on a tiny random causal LLaMA (2 layers, hidden 64, 2,048
  positions, MiniLM's tokenizer; written to a temporary folder) with a text of ~1,700 tokens: the
  block-downsampled map and the zoom.

Nothing is measured or asserted; the file names are printed. ``--pages`` picks some pages only
(url paths, ``inspect`` for the first page; ``inspect-gam``, ``inspect-long`` for the extras).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlencode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import test_browser as tb  # noqa: E402  (its server, waits and browser)
from playwright import sync_api  # noqa: E402

VIEWPORTS = ((1600, 1000), (1280, 800))
PAGES = ["inspect", "explaining_away", "compare", "embeddings", "interventions", "corpus", "swap_cost",
         "train", "hybrid_weights"]
EXTRAS = ["inspect-gam", "inspect-long"]
GAM = REPO / "checkpoints" / "enc-gam"
LONG_TEXT = " ".join(["The cat sat on the mat because it was tired and the dog barked at it."] * 100)

# The main column's scroll container (Streamlit 1.4x+: stMain; older: the app view container).
SCROLLER = """(() => {
    for (const sel of ['[data-testid="stMain"]', '[data-testid="stAppViewContainer"]']) {
        const e = document.querySelector(sel);
        if (e && e.scrollHeight > e.clientHeight + 1 && getComputedStyle(e).overflowY !== 'visible') return e;
    }
    return document.scrollingElement;
})()"""


def build_tiny_llama(path: Path) -> Path:
    """A random LLaMA (2 layers, hidden 64, 4 heads, 2,048 positions) with MiniLM's tokenizer."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    from attnlab import hf

    tokenizer = AutoTokenizer.from_pretrained(hf.default_model_path(), local_files_only=True)
    tokenizer.model_max_length = 2048
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id,
    )
    torch.manual_seed(0)
    transformers.AutoModel.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def settle(page, timeout_s: float = 300) -> None:
    """Wait until the page's run is over and everything is drawn (tb._idle, and every browser-drawn
    token view has its data and its canvas), twice with a pause between: a page may rerun itself."""
    for pause in (1500, 1000):
        page.wait_for_timeout(pause)
        tb._idle(page, timeout_s)
        page.wait_for_function(
            "() => [...document.querySelectorAll('.attnlab-view')]"
            ".every(v => v.attnlab && v.childElementCount > 0)",
            timeout=timeout_s * 1000,
        )


def shoot(page, out: Path, name: str, width: int, height: int, sections: int) -> list[Path]:
    """The viewport, then the main column scrolled down one viewport at a time to its end."""
    written = [out / f"{name}_{width}x{height}.png"]
    page.evaluate(f"() => {{ {SCROLLER}.scrollTop = 0; }}")
    page.wait_for_timeout(300)
    page.screenshot(path=str(written[-1]))
    for k in range(1, sections + 1):
        moved = page.evaluate(
            f"""() => {{ const e = {SCROLLER}; const before = e.scrollTop;
                         e.scrollTop = before + e.clientHeight - 60; return e.scrollTop - before; }}"""
        )
        if moved <= 0:
            break
        page.wait_for_timeout(400)  # lazily drawn charts, a scroll-linked redraw
        written.append(out / f"{name}_{width}x{height}_s{k}.png")
        page.screenshot(path=str(written[-1]))
    return written


def run(url: str, out: Path, pages: list[str], sections: int, long_model: Path | None) -> list[Path]:
    written: list[Path] = []
    with sync_api.sync_playwright() as p:
        for width, height in VIEWPORTS:
            browser = tb._browser(p)
            page = browser.new_page(viewport={"width": width, "height": height})
            for name in pages:
                if name == "inspect-gam":
                    if not (GAM / "latest.json").is_file():
                        print(f"skipped {name}: no checkpoint at {GAM}")
                        continue
                    query = urlencode({"model": "enc-gam (shipped)"})
                    page.goto(f"{url}/?{query}", wait_until="domcontentloaded")
                elif name == "inspect-long":
                    if long_model is None:
                        continue
                    query = urlencode({"model": "Local Hugging Face directory…",
                                       "model_dir": str(long_model)})
                    page.goto(f"{url}/?{query}", wait_until="domcontentloaded")
                    page.wait_for_selector('[data-testid="stMain"] h1', timeout=300_000)
                    settle(page)
                    tb._set_text(page, LONG_TEXT)
                    page.locator(".st-key-inspect_heatmap_blocks .js-plotly-plot").wait_for(timeout=300_000)
                else:
                    path = "" if name == "inspect" else name
                    page.goto(f"{url}/{path}", wait_until="domcontentloaded")
                page.wait_for_selector('[data-testid="stMain"] h1', timeout=300_000)
                settle(page)
                shots = shoot(page, out, name, width, height, sections)
                errors = page.locator('[data-testid="stException"], [data-testid="stAlertContentError"]')
                note = f" ({errors.count()} error box(es) on the page)" if errors.count() else ""
                print(f"{name} {width}x{height}: {len(shots)} screenshot(s){note}", flush=True)
                written += shots
            browser.close()
    return written


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/attnlab-shots"), help="folder for the PNGs")
    ap.add_argument("--pages", nargs="*", default=PAGES + EXTRAS,
                    help=f"pages to take (default: all): {' '.join(PAGES + EXTRAS)}")
    ap.add_argument("--sections", type=int, default=12,
                    help="viewports scrolled below the first, at most (default 12)")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.pages) - set(PAGES + EXTRAS))
    if unknown:
        ap.error(f"unknown page(s) {unknown}; expected some of {PAGES + EXTRAS}")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        long_model = None
        if "inspect-long" in args.pages:
            long_model = build_tiny_llama(tmp / "models" / "tiny-llama")
            roots = [str(tmp / "models"), *filter(None, [os.environ.get("ATTNLAB_MODEL_ROOTS")])]
            os.environ["ATTNLAB_MODEL_ROOTS"] = os.pathsep.join(roots)  # the server may load it
        with tb.serve(tmp / "server") as (url, _, _):
            written = run(url, args.out, args.pages, args.sections, long_model)
    print(f"{len(written)} screenshots in {args.out}")
    return written


if __name__ == "__main__":
    main()
