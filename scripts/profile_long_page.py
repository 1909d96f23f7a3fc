"""Where a long-context page's time goes, server side, without a browser (issue 32 item 5).

    python3 scripts/profile_long_page.py --tokens 2048 8192 [--page inspect explaining_away] [--top 30]

Builds the causal model of scripts/app_timings_long.py (LLaMA shape, 12 layers, hidden 768, 12 heads,
4 KV heads, random weights; ``--arch gpt2``), times its plain forward (SDPA, median of 3), then per
length and page runs the page in Streamlit's AppTest (the real page scripts, no browser): a first
text (warm-up, not timed), then a text change, profiled (cProfile in the script thread). Prints the
page run's wall time, the seconds of each step (cumulative time of the functions in ``STEPS``; a
step inside another counts in both), the bytes the run sent (charts and components), and the top
functions by cumulative time. The load average is printed beside the figures.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "scripts"), str(REPO / "tests"), str(REPO / "app"), str(REPO)]

# step -> (file suffix, function name): cumulative seconds of that function in the profiled run
STEPS = {
    "plan: load, tokenize (_plan)": ("appkit/analysis.py", "_plan"),
    "window view (_window)": ("appkit/analysis.py", "_window"),
    "one head's map (_head)": ("appkit/long_context.py", "_head"),
    "block map + zoom (long_map)": ("appkit/long_context.py", "long_map"),
    "  block pooling (block_pool)": ("figures/long_maps.py", "block_pool"),
    "  plotly charts (st.plotly_chart)": ("elements/plotly_chart.py", "plotly_chart"),
    "head view / strip layer (_layer_span)": ("appkit/token_views.py", "_layer_span"),
    "token views' data (view_data)": ("appkit/token_views.py", "view_data"),
    "  base64 arrays (_b64)": ("appkit/token_views.py", "_b64"),
    "token views total (token_view)": ("appkit/token_views.py", "token_view"),
    "focus bar": ("appkit/token_views.py", "focus_bar"),
    "neuron section": ("appkit/neuron.py", "neuron_section"),
    "corpus search section": ("appkit/corpus_search.py", "corpus_search_section"),
    "export menus (export_menu)": ("appkit/export.py", "export_menu"),
    "column masses, streamed (column_masses)": ("compute/streamed.py", "column_masses"),
    "counts (StreamedWindow.counts)": ("compute/streamed.py", "counts"),
    "sink views (sink_views)": ("appkit/sinks_view.py", "sink_views"),
    "  counts (_counts)": ("appkit/sinks_view.py", "_counts"),
    "  masses (_masses)": ("appkit/sinks_view.py", "_masses"),
    "  massive activations (_activations)": ("appkit/sinks_view.py", "_activations"),
    "NaN note (nan_note)": ("appkit/analysis.py", "nan_note"),
    "explained away figures (show)": ("appkit/show.py", "show"),
    "explained away by (beyond.explained_away)": ("appkit/beyond.py", "explained_away"),
    "most explained away (most_explained_away)": ("figures/app_views.py", "most_explained_away"),
    "one head computed (head_weights)": ("compute/tiles.py", "head_weights"),
    "capture forwards (AnalysisStream._result)": ("hf/analysis/pipeline.py", "_result"),
    "json of component data (json.dumps)": ("json/__init__.py", "dumps"),
}


PROFILES: list = []  # (cProfile.Profile, seconds) of every script run, in order


def _profiled_runner(profiles: list):
    """Patch AppTest's script thread to run under cProfile (one Profile per run, appended)."""
    from streamlit.testing.v1.local_script_runner import LocalScriptRunner

    original = LocalScriptRunner._run_script_thread
    if getattr(original, "profiled", False):  # patched once: a second Profile would replace the first
        return

    def run(self):
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        try:
            original(self)
        finally:
            prof.disable()
            profiles.append((prof, time.perf_counter() - t0))

    run.profiled = True
    LocalScriptRunner._run_script_thread = run


def _steps(prof: cProfile.Profile) -> dict[str, tuple[float, int]]:
    """step -> (cumulative seconds, calls) of STEPS' functions (0 when not called)."""
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    out = {}
    for step, (suffix, name) in STEPS.items():
        ct, calls = 0.0, 0
        for (file, _, fname), (_, nc, _, cum, _callers) in stats.items():
            if fname == name and file.endswith(suffix):
                ct, calls = ct + cum, calls + nc
        out[step] = (ct, calls)
    return out


def _sent_bytes(at) -> dict[str, int]:
    """Bytes of each chart's spec and component's JSON the run sent."""
    out = {}
    for c in at.get("plotly_chart"):
        out[f"chart {c.proto.id[-40:]}"] = len(c.proto.spec)
    for c in at.get("bidi_component"):
        out[f"component {c.key}"] = len(c.proto.json)
    return out


def profile_page(folder: Path, tokenizer, n: int, page: str, top: int) -> dict:
    from app_timings_long import WARM, WORDS, text_of
    from streamlit.testing.v1 import AppTest

    profiles = PROFILES
    _profiled_runner(profiles)
    app = str(REPO / "app" / "streamlit_app.py")
    at = AppTest.from_file(app, default_timeout=1800)
    at.query_params.update({"model": "Local Hugging Face directory…", "model_dir": str(folder)})
    at.run()
    if page != "inspect":
        at.switch_page(f"app_pages/{page}.py").run()
    key = "inspect_text" if page == "inspect" else "away_text"
    at.text_area(key=key).set_value(text_of(tokenizer, n, WARM)).run()  # warm-up: not counted
    assert not at.exception, [e.message for e in at.exception]
    profiles.clear()
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    at.text_area(key=key).set_value(text_of(tokenizer, n, WORDS[0])).run()  # the text change
    wall = time.perf_counter() - t0
    assert not at.exception, [e.message for e in at.exception]
    prof, _ = profiles[-1]
    steps = _steps(prof)
    sent = _sent_bytes(at)
    print(f"\n=== {page}, {n} tokens: text change -> page run done {wall:.2f} s "
          f"(load {load:.2f} -> {os.getloadavg()[0]:.2f})")
    for step, (s, calls) in steps.items():
        if calls:
            print(f"  {step:48s} {s:7.2f} s  ({calls} calls)")
    print(f"  bytes sent: {sum(sent.values()):,} ({', '.join(f'{k} {v:,}' for k, v in sent.items())})")
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(top)
    print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[-(top + 8) * 200:])
    return {"wall_s": wall, "load": [load, os.getloadavg()[0]],
            "steps": {k: v[0] for k, v in steps.items() if v[1]}, "bytes_sent": sent}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--arch", choices=("llama", "gpt2"), default="llama")
    ap.add_argument("--page", nargs="+", default=["inspect"], choices=("inspect", "explaining_away"))
    ap.add_argument("--top", type=int, default=25, help="functions listed by cumulative time")
    ap.add_argument("--no-forward", action="store_true", help="skip timing the plain forward")
    ap.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    args = ap.parse_args(argv)
    from app_timings_long import WARM, build_model, forward_seconds, text_of

    result: dict = {"arch": args.arch, "pages": {}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / f"long-{args.arch}"
        tokenizer = build_model(folder, args.arch, max(args.tokens))
        os.environ.update(ATTNLAB_MODEL_ROOTS=tmp, ATTNLAB_APP_MAX_TOKENS=str(max(args.tokens) + 16),
                          ATTNLAB_RUNS_DIR=str(Path(tmp) / "runs"), ATTNLAB_UMAP="off",
                          ATTNLAB_UPLOADS_DIR=str(Path(tmp) / "uploads"),
                          ATTNLAB_TEXTS_DIR=str(Path(tmp) / "texts"))
        for n in args.tokens:
            if not args.no_forward:
                load = os.getloadavg()[0]
                f = forward_seconds(folder, tokenizer, text_of(tokenizer, n, WARM))
                print(f"{n} tokens: plain forward {f:.2f} s (load {load:.2f}); target 1.5 x forward + 1 s "
                      f"= {1.5 * f + 1:.2f} s")
                result[f"forward_{n}"] = f
            for page in args.page:
                result["pages"][f"{page}_{n}"] = profile_page(folder, tokenizer, n, page, args.top)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
