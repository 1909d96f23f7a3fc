"""Inspect on a causal model at long context (issue 32 item 5): a text change -> every chart, beside
the model's plain forward on the same tokens. One command, on a quiet machine:

    flock /tmp/attnlab-bench.lock python3 scripts/app_timings_long.py --tokens 2048 8192 --out long.json

It builds the causal model of issue 32 from its config (LLaMA shape: 12 layers, hidden 768, 12
heads, 4 KV heads, intermediate 2048, random weights; ``--arch gpt2``: a GPT-2 of the same size;
positions = the longest ``--tokens``) with MiniLM's tokenizer, saved with ``save_pretrained`` in a
temporary folder; times its plain forward (SDPA, no attnlab hook; median of 3) on a text of each
length; starts a fresh app (tests/test_browser.py's ``serve``: app/serve.py, attnlab's kernels built
first), opens Inspect on the model and, per length and ``--repeat`` times, commits a new text of that
many tokens (the clock starts at Ctrl+Enter, after the typing) until the zoomed region shows the
text's new first word and the run is over with every chart drawn. Prints and writes (JSON) each
time, the forward's, the target (1.5 x forward + 1 s) and the load average before and after.
Nothing is asserted (speed is measured, not tested).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlencode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

SENTENCE = "Attention lets every word look at every other word; a word nobody looks at is explained away. "
# one WordPiece token each ("warmup" was "warm" + "##up": the zoom never showed it, and the script
# waited its 600 s for the first text); text_of refuses a word that is not a single token
WORDS = "river mountain garden castle forest island".split()
WARM = "valley"
SHAPE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=2048)


def build_model(folder: Path, arch: str, positions: int):
    """The model of issue 32 with MiniLM's tokenizer, saved in ``folder``; -> its tokenizer."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    from attnlab import hf

    tokenizer = AutoTokenizer.from_pretrained(hf.default_model_path(), local_files_only=True)
    tokenizer.model_max_length = positions
    if arch == "llama":
        config = transformers.LlamaConfig(vocab_size=len(tokenizer), num_key_value_heads=4,
                                          max_position_embeddings=positions, **SHAPE)
    else:
        config = transformers.GPT2Config(vocab_size=len(tokenizer), n_embd=768, n_layer=12, n_head=12,
                                         n_inner=2048, n_positions=positions)
    torch.manual_seed(0)
    transformers.AutoModel.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return tokenizer


def text_of(tokenizer, n: int, word: str) -> str:
    """A text of about ``n`` tokens with [CLS] and [SEP], starting with "Round <word>."."""
    if tokenizer.tokenize(word) != [word]:
        raise ValueError(f"word must be one token of the tokenizer (the zoom's labels show tokens), got "
                         f"{word!r} -> {tokenizer.tokenize(word)}")
    body = SENTENCE * (n // 15 + 2)
    ids = tokenizer(f"Round {word}. {body}", add_special_tokens=False)["input_ids"][: n - 2]
    return tokenizer.decode(ids)


def forward_seconds(folder: Path, tokenizer, text: str) -> float:
    """Median of 3 plain forwards (SDPA, no attnlab hook) on ``text``, after one warm-up."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, attn_implementation="sdpa").eval()
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    times = []
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)  # warm-up
        for _ in range(3):
            t0 = time.perf_counter()
            model(input_ids=ids, use_cache=False)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def zoom_has(page, word: str, timeout_s: float) -> None:
    """Wait until a plotly chart (the zoomed region) has the token ``word`` among its query labels
    ("2: word"); an error on the page ends the wait at once, with its message."""
    page.wait_for_function(
        """word => document.querySelector('[data-testid="stException"]')
               || [...document.querySelectorAll('.js-plotly-plot')].some(
               d => d.data && d.data[0] && Array.isArray(d.data[0].y)
                    && d.data[0].y.some(t => String(t).endsWith(': ' + word)))""",
        arg=word, timeout=timeout_s * 1000)
    error = page.query_selector('[data-testid="stException"]')
    if error is not None:
        raise RuntimeError(f"the page failed: {error.inner_text()[:2000]}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192], help="text lengths (tokens)")
    ap.add_argument("--arch", choices=("llama", "gpt2"), default="llama")
    ap.add_argument("--repeat", type=int, default=3, help="text changes per length, 1 to 3 (default 3)")
    ap.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    args = ap.parse_args(argv)
    if not 1 <= args.repeat <= 3:
        ap.error(f"--repeat must be 1, 2 or 3, got {args.repeat}")
    import test_browser as tb
    from playwright import sync_api

    result: dict = {"load_average_before": os.getloadavg(), "cpus": os.cpu_count(), "arch": args.arch}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / f"long-{args.arch}"
        tokenizer = build_model(folder, args.arch, max(args.tokens))
        result["forward_s"] = {n: forward_seconds(folder, tokenizer, text_of(tokenizer, n, WARM))
                               for n in args.tokens}
        os.environ["ATTNLAB_MODEL_ROOTS"] = tmp
        os.environ["ATTNLAB_APP_MAX_TOKENS"] = str(max(args.tokens) + 16)
        with tb.serve(Path(tmp) / "server") as (url, _, _), sync_api.sync_playwright() as p:
            page = tb._browser(p).new_page(viewport={"width": 1600, "height": 1000})
            query = urlencode({"model": "Local Hugging Face directory…", "model_dir": str(folder)})
            page.goto(f"{url}/?{query}", wait_until="domcontentloaded")
            tb._idle(page, 600)
            box = page.get_by_label("Text", exact=True)
            result["text_change_s"] = {}
            for n in args.tokens:
                tb._set_text(page, text_of(tokenizer, n, WARM))  # the first run of a length: not timed
                zoom_has(page, WARM, 600)
                tb._idle(page, 600)
                times = []
                for word in WORDS[: args.repeat]:
                    box.fill(text_of(tokenizer, n, word))
                    t0 = time.monotonic()
                    box.press("Control+Enter")
                    zoom_has(page, word, 600)
                    tb._idle(page, 600)
                    times.append(time.monotonic() - t0)
                result["text_change_s"][n] = times
                target = 1.5 * result["forward_s"][n] + 1.0
                print(f"{n} tokens: forward {result['forward_s'][n]:.2f} s, text change -> all charts "
                      + ", ".join(f"{t:.2f} s" for t in times) + f" (target <= {target:.2f} s)")
    result["load_average_after"] = os.getloadavg()
    print(f"load average before {result['load_average_before']}, after {result['load_average_after']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
