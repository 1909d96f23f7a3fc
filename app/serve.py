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


def main(argv: list[str]) -> None:
    from streamlit.web import cli

    logging.getLogger("streamlit").setLevel(logging.ERROR)  # no "missing ScriptRunContext" warnings
    took = warm()
    logging.getLogger("streamlit").setLevel(logging.WARNING)
    print(f"attnlab: warmed up in {took:.1f} s (torch, transformers, MiniLM, kernels)", flush=True)
    sys.argv = ["streamlit", "run", str(APP / "streamlit_app.py"), *argv]
    cli.main()


if __name__ == "__main__":
    main(sys.argv[1:])
