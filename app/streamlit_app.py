"""attnlab app: the entry point is a router over the pages in app/app_pages/.

Run from the repository root: ``bash scripts/app.sh`` (installs, then ``streamlit run app/streamlit_app.py``).
Unexpected errors become a short message on the page (the traceback goes to the server log);
``ATTNLAB_DEBUG=1`` lets them through (tests). The first run in a server process also removes the
upload folders that servers killed outright left behind (``appkit.sources.sweep_uploads_once``).
"""

import logging
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may reach a model hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # no spinning OpenMP threads on a shared CPU

import streamlit as st  # noqa: E402
from appkit.sources import sweep_uploads_once  # noqa: E402

PAGES = Path(__file__).parent / "app_pages"
FAVICON = Path(__file__).parent / "assets" / "favicon.png"  # served by this server: a material icon
# as page_icon made every page load fetch an SVG from fonts.gstatic.com (a failed request offline)

st.set_page_config(page_title="attnlab", page_icon=str(FAVICON), layout="wide")
sweep_uploads_once()  # upload folders of servers killed outright; once per server process
page = st.navigation(
    {
        "Analyse a text": [
            st.Page(PAGES / "inspect.py", title="Inspect", icon=":material/grid_on:", default=True),
            st.Page(PAGES / "explaining_away.py", title="Explaining away", icon=":material/blur_linear:"),
            st.Page(PAGES / "compare.py", title="Compare", icon=":material/compare:"),
            st.Page(PAGES / "embeddings.py", title="Embeddings", icon=":material/scatter_plot:"),
            st.Page(PAGES / "interventions.py", title="Interventions", icon=":material/swap_horiz:"),
            st.Page(PAGES / "corpus.py", title="Corpus", icon=":material/library_books:"),
            st.Page(PAGES / "swap_cost.py", title="Swap cost", icon=":material/trending_up:"),
        ],
        "Train": [
            st.Page(PAGES / "train.py", title="Train", icon=":material/model_training:"),
            st.Page(PAGES / "hybrid_weights.py", title="Hybrid weights", icon=":material/tune:"),
        ],
    }
)
try:
    page.run()
except Exception as e:  # st.stop / st.rerun are BaseExceptions and pass through
    if os.environ.get("ATTNLAB_DEBUG"):
        raise
    logging.getLogger("attnlab.app").exception("page %s failed", page.title)
    st.error(
        f"Something went wrong on this page ({e.__class__.__name__}: {e}). Other pages and sessions "
        "are unaffected; the details are in the server log."
    )
