"""Token vectors for the Embeddings page, and UMAP in a warmed background process.

UMAP (umap-learn + pynndescent) JIT-compiles for tens of seconds the first time it runs in a
process. The page shows PCA at once; :func:`start_warmup` starts ONE worker process (spawn) that
runs a tiny UMAP to compile everything, and later projections go to that warm worker
(:func:`umap_job`), so the server process never stalls on numba. ``ATTNLAB_UMAP=off`` disables it.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ProcessPoolExecutor
from multiprocessing import get_context

import numpy as np
import streamlit as st
import torch

from appkit.analysis import WindowView
from appkit.sources import NativeModel, load
from attnlab import hf
from attnlab.figures import app_views
from attnlab.hf.analysis.query_key import check_query_key_vectors

_LOCK = threading.Lock()
_STATE: dict = {"pool": None, "warm": None}
_JOBS: OrderedDict[str, Future] = OrderedDict()
MAX_JOBS = 16


def enabled() -> bool:
    return os.environ.get("ATTNLAB_UMAP", "on").lower() not in ("off", "0", "false")


def start_warmup() -> None:
    """Start the UMAP worker and its warm-up fit (idempotent, returns at once)."""
    if not enabled():
        return
    with _LOCK:
        if _STATE["pool"] is None:
            _STATE["pool"] = ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn"))
            sample = np.random.default_rng(0).normal(size=(48, 16)).astype(np.float32)
            _STATE["warm"] = _STATE["pool"].submit(app_views.umap_2d, sample, 8)


def status() -> str:
    """ "off", "idle" (not started), "warming", "ready" or "failed: <reason>"."""
    if not enabled():
        return "off"
    warm = _STATE["warm"]
    if warm is None:
        return "idle"
    if not warm.done():
        return "warming"
    exc = warm.exception()
    return "ready" if exc is None else f"failed: {exc.__class__.__name__}: {exc}"


def umap_job(key: str, x: np.ndarray) -> Future:
    """The UMAP projection of ``x`` (n, d) by the warm worker, one job per key (kept for reuse)."""
    start_warmup()
    with _LOCK:
        if key not in _JOBS:
            _JOBS[key] = _STATE["pool"].submit(app_views.umap_2d, x)
            while len(_JOBS) > MAX_JOBS:
                _JOBS.popitem(last=False)
        _JOBS.move_to_end(key)
        return _JOBS[key]


def _query_key(model, input_ids: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s (q, k), each (H, N, D), through the library's capture path (the one
    ``hf.analyze`` and ``attnlab analyze`` use): ``hf.capture_attention_inputs`` and the layer's own
    ``qkv`` projection for a native attnlab checkpoint (``AttentionInputs.query_key``),
    ``hf.capture_qk`` for a Hugging Face model (stopping after that layer's q and k)."""
    if isinstance(model, NativeModel):
        if model.model.blocks[layer].is_gam:
            raise ValueError(
                f"layer {layer} of {model.info.name} is a GAM layer: it has no separate queries and "
                "keys; pick another layer or the token representations"
            )
        with model.lock, torch.no_grad(), hf.capture_attention_inputs(model.model) as captured:
            model.model(input_ids)
            q, k = captured[layer].query_key()  # (B, H, N, D) each
    else:
        check_query_key_vectors(model)  # MPNet, DeBERTa-v2, GPT-Neo, BLOOM, Falcon: scores, no q and k
        with model.lock, torch.no_grad():
            with hf.capture_qk(model.model, stop_after=layer + 1) as captured:
                model.model(input_ids=input_ids, use_cache=False)
            q, k = captured[layer].query, captured[layer].key  # (B, H, N, D) each
    return q[0], k[0]


def _hidden(model, input_ids: torch.Tensor, layer: int) -> torch.Tensor:
    """(N, C): the output of block ``layer`` (Hugging Face's ``hidden_states[layer + 1]``; for a
    native checkpoint the residual stream after that block)."""
    with model.lock, torch.no_grad():
        if not isinstance(model, NativeModel):
            return model.model(input_ids=input_ids, output_hidden_states=True).hidden_states[layer + 1][0]
        captured = {}

        def keep(module, args, out) -> None:  # returns None: the block's output is left as it is
            captured["x"] = out[0]  # the block returns (x, weights)

        hook = model.model.blocks[layer].register_forward_hook(keep)
        try:
            model.model(input_ids)
        finally:
            hook.remove()
        return captured["x"][0]


@st.cache_resource(max_entries=6, ttl=1800, show_spinner=False)
def vectors(view_key: str, layer: int, head: int, what: str, _view: WindowView):
    """-> (x (n, d) float32, kinds (n,) "token" | "query" | "key"): hidden states after ``layer``, or the
    layer's queries and keys of ``head`` in one space (AttentionViz: keys translated and scaled, which
    leaves every row's softmax unchanged)."""
    model = load(_view.settings.source)
    input_ids = torch.tensor([_view.input_ids], device=model.device)  # the model may run on a GPU
    if model.info.encoder_decoder:  # two texts, two stacks (appkit/seq2seq.py)
        raise ValueError(f"{model.info.name} is an encoder-decoder: Embeddings shows one text's layers "
                         "(an encoder-only or decoder-only model); Inspect shows its three kinds of "
                         "attention")
    if what == "hidden":
        x = _hidden(model, input_ids, layer).float().cpu().numpy()
        return x, ["token"] * len(x)
    q, k = _query_key(model, input_ids, layer)
    q, k = app_views.joint_query_key(q[head].float().cpu().numpy(), k[head].float().cpu().numpy())
    return np.concatenate([q, k]), ["query"] * len(q) + ["key"] * len(k)


COLOR_BY = ("token", "position", "column mass")


def colors(view: WindowView, layer: int, head: int | None, by: str, kinds: list[str]) -> list:
    """One colour value per point (points are tokens, or queries then keys): the token text, its
    position, or the attention it receives as a key (column mass of the first variant; mean over
    heads when ``head`` is None)."""
    n = len(view.tokens)
    index = [i % n for i in range(len(kinds))]
    if by == "token":
        return [view.tokens[i] for i in index]
    if by == "position":
        return index
    w = view.weights[next(iter(view.weights))][layer]  # (H, N, N) of the first variant (only it computed)
    mass = (w.sum(-2).mean(0) if head is None else w[head].sum(-2)).astype(float)  # (N,)
    return [round(float(mass[i]), 4) for i in index]
