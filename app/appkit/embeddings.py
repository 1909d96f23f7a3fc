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


def _native_vectors(model: NativeModel, ids: list[int], layer: int, head: int, what: str):
    block = model.model.blocks[layer]
    captured = {}
    if what == "hidden":
        handle = block.register_forward_hook(lambda m, args, out: captured.__setitem__("x", out[0]))
    else:
        if block.is_gam:
            raise ValueError(
                f"layer {layer} of {model.info.name} is a GAM layer: it has no separate queries and "
                "keys; pick another layer or the token representations"
            )
        handle = block.attn.qkv.register_forward_hook(lambda m, args, out: captured.__setitem__("qkv", out))
    try:
        with model.lock, torch.no_grad():
            model.model(torch.tensor([ids]))
    finally:
        handle.remove()
    if what == "hidden":
        return captured["x"][0], None  # (N, C)
    H = model.info.n_heads
    q, k, _ = captured["qkv"][0].chunk(3, dim=-1)  # (N, C) each
    D = q.shape[-1] // H
    return q[:, head * D : (head + 1) * D], k[:, head * D : (head + 1) * D]  # (N, D)


@st.cache_resource(max_entries=6, ttl=1800, show_spinner=False)
def vectors(view_key: str, layer: int, head: int, what: str, _view: WindowView):
    """-> (x (n, d) float32, kinds (n,) "token" | "query" | "key"): hidden states after ``layer``, or the
    layer's queries and keys of ``head`` in one space (AttentionViz: keys translated and scaled, which
    leaves every row's softmax unchanged)."""
    model = load(_view.settings.source)
    ids = _view.input_ids
    if isinstance(model, NativeModel):
        a, b = _native_vectors(model, ids, layer, head, what)
    else:
        input_ids = torch.tensor([ids], device=model.device)  # the model may run on a GPU
        with model.lock, torch.no_grad():
            if what == "hidden":
                out = model.model(input_ids=input_ids, output_hidden_states=True)
                a, b = out.hidden_states[layer + 1][0], None  # (N, C): output of block `layer`
            else:
                with hf.capture_qk(model.model) as captured:
                    model.model(input_ids=input_ids, use_cache=False)
                a, b = captured[layer].query[0, head], captured[layer].key[0, head]  # (N, D) each
    if b is None:
        x = a.float().cpu().numpy()
        return x, ["token"] * len(x)
    q, k = app_views.joint_query_key(a.float().cpu().numpy(), b.float().cpu().numpy())
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
    w = next(iter(view.weights.values()))[layer]  # (H, N, N)
    mass = (w.sum(-2).mean(0) if head is None else w[head].sum(-2)).astype(float)  # (N,)
    return [round(float(mass[i]), 4) for i in index]
