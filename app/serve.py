"""Serve the app warm: ``python app/serve.py [streamlit run options]`` (scripts/app.sh, the Dockerfile
and tests/test_browser.py start it so).

Before the server listens, this process imports what every page run needs (torch, transformers,
plotly, attnlab, the page helpers), loads attnlab's CPU kernels and the embedded MiniLM into the
same caches the pages read (``appkit.sources.load`` is an ``st.cache_resource``; pages import the
same ``appkit`` modules from ``sys.modules``), so the first page is not the one that waits for them.
Then it runs ``streamlit run app/streamlit_app.py`` in this process with the given options.
A model that fails to load here is not fatal: the page shows the message as it would have.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

APP = Path(__file__).resolve().parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may reach a model hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
log = logging.getLogger("attnlab.serve")


def warm() -> float:
    """Import, build and load what the first page run would; seconds taken."""
    t0 = time.monotonic()
    sys.path.insert(0, str(APP))  # as `streamlit run` puts the script's folder first
    import plotly.graph_objects  # noqa: F401
    from appkit import analysis, controls, show, token_views  # noqa: F401
    from appkit.sources import EMBEDDED, load

    from attnlab import kernels

    kernels.cpu_ops()
    try:
        load(EMBEDDED)
    except ValueError as e:  # hf.ModelLoadError: the page will say so
        log.warning("the embedded model did not load: %s", e)
    return time.monotonic() - t0


# Streamlit's page cannot tell from its URL whether /corpus is the page "corpus" of an app at / or an
# app served at /corpus, so it asked /corpus/_stcore/health first (a 404 in the console, a wasted
# round trip: streamlit/streamlit#7074). Its documented window.__streamlit settings (BACKEND_BASE_URL,
# MAIN_PAGE_BASE_URL; streamlit/streamlit#11378, #11537) say where the server and the main page are.
BASE_URL_SCRIPT = """<script>
window.__streamlit = Object.assign({}, window.__streamlit, (() => {
  const base = window.location.origin + "/%s";
  return {BACKEND_BASE_URL: base, MAIN_PAGE_BASE_URL: base};
})());
</script>
"""


def static_dir_with_base_url(static: Path, base_url_path: str, into: Path) -> Path:
    """A copy of Streamlit's static folder in ``into`` (links to its files) whose index.html names
    the server's base URL (``server.baseUrlPath``) before Streamlit's script reads it."""
    into.mkdir(parents=True, exist_ok=True)
    for entry in static.iterdir():
        if entry.name != "index.html" and not (into / entry.name).exists():
            (into / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    html = (static / "index.html").read_text(encoding="utf-8")
    script = BASE_URL_SCRIPT % base_url_path.strip("/").replace('"', "")
    (into / "index.html").write_text(html.replace("<head>", "<head>\n" + script, 1), encoding="utf-8")
    return into


def serve_base_url() -> None:
    """Make this server's Streamlit serve index.html from a folder that names its base URL."""
    import atexit
    import shutil
    import tempfile

    from streamlit import config, file_util

    into = Path(tempfile.mkdtemp(prefix="attnlab-static-"))
    atexit.register(shutil.rmtree, into, ignore_errors=True)
    static = Path(file_util.get_static_dir())
    # called when the server makes its routes, after `streamlit run` has read its options
    file_util.get_static_dir = lambda: str(
        static_dir_with_base_url(static, config.get_option("server.baseUrlPath") or "", into)
    )


def main(argv: list[str]) -> None:
    from streamlit.web import cli

    logging.getLogger("streamlit").setLevel(logging.ERROR)  # no "missing ScriptRunContext" warnings
    took = warm()
    logging.getLogger("streamlit").setLevel(logging.WARNING)
    print(f"attnlab: warmed up in {took:.1f} s (torch, transformers, MiniLM, kernels)", flush=True)
    sys.argv = ["streamlit", "run", str(APP / "streamlit_app.py"), *argv]
    serve_base_url()
    cli.main()


if __name__ == "__main__":
    main(sys.argv[1:])
