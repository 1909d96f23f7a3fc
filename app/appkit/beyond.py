"""The app's views beyond weights: explained away by contribution / without sinks, rollout and flow,
per-head interventions. Cached computations on a :class:`appkit.analysis.WindowView`; the math is in
``attnlab.contributions``, ``attnlab.sinks``, ``attnlab.flow`` and ``attnlab.hf.beyond.interventions``,
the figures in ``attnlab.figures.beyond``."""

from __future__ import annotations

import numpy as np
import pandas as pd
import streamlit as st
import torch

import attnlab
from appkit.analysis import WindowView
from appkit.show import show, show_bundle
from appkit.sources import load
from attnlab import contributions, flow, sinks, stats
from attnlab.figures import beyond as figs
from attnlab.figures import explained_away_heatmap
from attnlab.figures.app_views import FigureBundle
from attnlab.hf.beyond import interventions
from attnlab.hf.capture import values
from attnlab.hf.compute.head_maps import HeadMaps

BY = ("weight", "contribution")


def _hf_model(view: WindowView, lm_head: bool = False):
    loaded = load(view.settings.source)
    if not hasattr(loaded, "lock"):  # a native attnlab checkpoint
        raise ValueError(
            "this view needs a Hugging Face model (native attnlab checkpoints have no value path here)"
        )
    if lm_head and loaded.info.causal:
        return _lm(loaded.info.path, str(loaded.device))
    return loaded


@st.cache_resource(show_spinner="Loading the model with its LM head…", max_entries=2)
def _lm(path: str, device: str):
    return interventions.load_with_lm_head(path, device=device)


@st.cache_resource(max_entries=8, ttl=1800, show_spinner="Reading value vectors…")
def _norms(key: str, _view: WindowView) -> dict[str, torch.Tensor]:
    s = _view.settings
    loaded = _hf_model(_view)
    ids = torch.tensor([_view.input_ids])
    summaries = values.window_value_summaries(
        loaded, ids, tuple(_view.weights), s.mode, {"u": s.u, "iters": s.iters}
    )
    return {v: summaries[v].norms for v in _view.weights}


def explained_away(prefix: str, view: WindowView, eps: float, by: str, without_sinks: bool) -> None:
    """The explained-away heatmap by contribution and/or without sink keys (first + special tokens)."""
    if view.kind is not None:  # an encoder-decoder's kind (appkit/seq2seq.py): no value vectors captured
        st.info("Explained away by contribution or without sink keys is computed for one text's "
                "self-attention; for an encoder-decoder, choose by weight with the sink keys kept.")
        return
    try:
        norms = _norms(view.key, view) if by == "contribution" else {}
    except ValueError as e:
        st.warning(str(e))
        return
    N = view.shape[2]
    exclude = (
        sinks.sink_keys(N, torch.from_numpy(np.asarray(view.special, dtype=bool))) if without_sinks else None
    )
    fractions = {
        v: contributions.explained_away_fraction_by(  # a streamed window's HeadMaps: streamed sums
            w if isinstance(w, HeadMaps) else torch.from_numpy(w), eps, norms=norms.get(v), exclude=exclude
        )
        .double()
        .numpy()
        for v, w in view.weights.items()
    }
    what = f"by {by}" + (", sink keys excluded" if without_sinks else "")
    fig = explained_away_heatmap(
        fractions, title=f"Explained-away fraction ({what}), relative mass < {eps:g}"
    )
    rows = [
        pd.DataFrame(
            {
                "variant": v,
                "layer": np.repeat(np.arange(f.shape[0]), f.shape[1]),
                "head": np.tile(np.arange(f.shape[1]), f.shape[0]),
                "value": f.reshape(-1),
            }
        )
        for v, f in fractions.items()
    ]
    show_bundle(prefix, "explained_away_beyond", FigureBundle(fig, pd.concat(rows), fractions))


def rollout_and_flow(prefix: str, view: WindowView, variant: str) -> None:
    """Rollout (every output) or attention flow (one output position) of the chosen variant."""
    if not st.toggle("Show rollout and attention flow", key=f"{prefix}_rollout_show"):
        return
    if view.query_tokens is not None:  # an encoder-decoder's cross-attention (appkit/seq2seq.py)
        st.info("Rollout and flow chain a stack's self-attention layers; cross-attention (target rows × "
                "source columns) is no such chain: show the encoder's or the decoder's attention.")
        return
    L, _, N = view.shape
    kind = st.radio("Map", ["rollout", "flow"], horizontal=True, key=f"{prefix}_rollout_kind")
    w = torch.from_numpy(view.weights[variant])
    if kind == "rollout":
        b = figs.token_map(
            stats.attention_rollout(w).numpy(), view.tokens, title=f"{variant}: attention rollout"
        )
    else:
        fit = int(flow.MAX_FLOW_WORK // flow.flow_work(L, N, 1))
        if fit < 1:
            st.info(
                f"Attention flow of {N} tokens x {L} layers is over its size limit "
                "(attnlab.flow.MAX_FLOW_WORK); use a shorter window."
            )
            return
        out = st.selectbox(
            "Output position",
            list(range(N)),
            format_func=lambda i: f"{i}: {view.tokens[i]}",
            key=f"{prefix}_flow_output",
        )
        with st.spinner("Max flow per input token…"):
            b = _flow(view.key, variant, int(out), view)
    show_bundle(prefix, f"{kind}_{variant}", b, width="stretch")


@st.cache_resource(max_entries=16, ttl=1800, show_spinner=False)
def _flow(key: str, variant: str, output: int, _view: WindowView) -> FigureBundle:
    f = flow.attention_flow(torch.from_numpy(_view.weights[variant]), [output]).numpy()
    return figs.token_map(
        f, _view.tokens, [output], title=f"{variant}: attention flow from position {output}"
    )


@st.cache_resource(max_entries=8, ttl=1800, show_spinner=False)
def intervention_result(key: str, variant: str, _view: WindowView) -> interventions.InterventionResult:
    """Every head of the window swapped to ``variant`` in turn (cached per analysis and variant)."""
    loaded = _hf_model(_view, lm_head=True)
    given = {"u": _view.settings.u}  # the page's settings, as far as they apply (causal: iters = 1)
    if not loaded.info.causal:
        given["iters"] = _view.settings.iters
    params = {p.name: given[p.name] for p in attnlab.variant_spec(variant).params if p.name in given}
    bar = st.progress(0.0, text=f"Swapping each head to {variant}…")
    try:
        return interventions.head_interventions(
            loaded,
            torch.tensor([_view.input_ids]),  # the window chosen on the page
            variant,
            params,
            on_progress=lambda done, total: bar.progress(done / total),
        )
    finally:
        bar.empty()


def intervention_table(result: interventions.InterventionResult) -> pd.DataFrame:
    """The result's tidy rows, the measures named for people (``figs.MEASURE_TITLES``)."""
    table = result.table()
    return table.assign(measure=table["measure"].map(lambda m: figs.MEASURE_TITLES.get(m, m)))


def before_after(prefix: str, view: WindowView, variant: str, layer: int, head: int, text: str) -> None:
    """One head's map before (the model's softmax) and after the swap to ``variant`` on one colour
    scale, then after minus before on a scale centred at 0; each with its Export menu."""
    model = view.settings.source.label
    params = {"layer": layer, "head": head, "focus": None}
    show(prefix, "before_after", "panels", [view, view], {**params, "variants": ["unas", variant]},
         labels=[f"{model} · before (softmax)", f"{model} · after ({variant})"], text=text)
    show(prefix, "difference", "difference", [view, view], {**params, "variants": [variant, "unas"]},
         labels=[f"after ({variant})", "before (softmax)"], text=text)
