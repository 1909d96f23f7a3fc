"""The spec-driven builder shared by the app's pages and :func:`attnlab.figures.reproduce_figure`:
``build(kind, weights, tokens, params)`` -> :class:`FigureBundle` (figure + its data).

Kinds built from one analysis (weights ``{variant: (L, H, N, N)}`` of one window + its tokens)::

    grid            layer x head maps of one variant (attnlab.figures.attention_grid: one trace)
    heatmap         one head's map with token labels (attnlab.figures.attention_heatmap)
    heatmap_blocks  one head's map of a long context, means (or maxima) over token blocks, params
                    "block", "how"; heatmap_zoom: its region "rows" x "cols" at full resolution
                    (attnlab.figures.long_maps; one head computed, on access)
    head_view       lines from each query to each key, opacity = weight (bertviz-style); with
                    params["heads"] several heads of the layer overlaid, a colour each
    model_view      every layer x head as a small head view (bertviz's model view, <= 64 tokens)
    token_mass      the text's tokens shaded by the attention they receive (column mass), or by
                    the row a focused token sends
    column_mass     column-mass distributions per variant or layer (attnlab.figures, log axis)
    explained_away  explained-away fraction per layer and head, one panel per variant

Kinds built from several analyses ("sources", same tokens; ``params["variants"]`` holds one
variant per source)::

    panels          one head's map of every source side by side, one colour scale (or one each)
    differences     A - B, A - C, ... for one head, on one diverging scale centred at 0
    difference      A - B for one layer and head (diverging colours)
    js_distance     Jensen-Shannon distance between A and B per layer and head
    column_mass     (a list of sources) distributions overlaid, one curve per source

Every kind that shows tokens takes ``params["focus"]`` (a token position or None: click to focus).
Cross-attention (an encoder-decoder's (L, H, M, N) target x source maps): ``build(...,
query_tokens=...)`` names the M queries (``tokens`` are then the N keys) for heatmap, head_view,
model_view and grid; the focus is a key (a source token), drawn by the head and model views (the
maps outline a row and a column, which is self-attention's).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import torch

from attnlab.figures._data import as_array, block_mean, column_masses
from attnlab.figures.attention import attention_grid, attention_heatmap
from attnlab.figures.bundle import FigureBundle, long_table
from attnlab.figures.distributions import column_mass_distribution, explained_away_heatmap
from attnlab.figures.head_overlay import check_heads, head_overlay
from attnlab.figures.head_view import model_view
from attnlab.figures.long_maps import blocks_bundle, describe_block, head_map, pooled_panels, zoom_bundle
from attnlab.figures.views import js_distance_heatmap, panel_heatmaps, token_mass_strip

__all__ = ["KINDS", "MULTI_KINDS", "build"]

KINDS = (
    "grid",
    "heatmap",
    "heatmap_blocks",
    "heatmap_zoom",
    "head_view",
    "model_view",
    "token_mass",
    "column_mass",
    "explained_away",
    "panels",
    "differences",
    "difference",
    "js_distance",
)
PAIR_KINDS = ("difference", "js_distance")
CLICKABLE_MAX_TOKENS = 80  # heatmaps up to this size get one click target per cell
MULTI_KINDS = ("panels", "differences", *PAIR_KINDS)  # always a list of sources


def _sources(kind: str, weights, p: dict, labels, count: int | None = None, read=None):
    """The (L, H, N, N) array of each source's chosen variant (or what ``read(weights, name)`` makes
    of it), and the sources' labels."""
    if isinstance(weights, Mapping) or (count is not None and len(weights) != count):
        raise ValueError(
            f"{kind} needs {count or 'a list of'} sources of weights ({{variant: (L, H, N, N)}} each)"
        )
    variants = list(p["variants"])
    if len(variants) != len(weights):
        raise ValueError(f"{kind}: got {len(weights)} sources and {len(variants)} variants")
    read = read or (lambda w, name: as_array(w, name, 4))
    arrays = [read(w[v], f"weights[{k}][{v!r}]")
              for k, (w, v) in enumerate(zip(weights, variants, strict=True))]
    if len({a.shape for a in arrays}) != 1:
        raise ValueError(
            f"{kind}: every source must have one shape to compare, got {[a.shape for a in arrays]}"
        )
    labels = list(labels or [chr(ord("A") + k) for k in range(len(arrays))])
    return arrays, labels


def _multi(kind: str, weights, tokens, p: dict, labels) -> FigureBundle:
    layer, head = p.get("layer"), p.get("head")
    if kind == "js_distance":
        (a, b), (la, lb) = _sources(kind, weights, p, labels, 2)
        from attnlab.stats import js_distance

        js = js_distance(torch.from_numpy(a), torch.from_numpy(b)).numpy()  # (L, H)
        fig = js_distance_heatmap(js, title=f"Jensen-Shannon distance, {la} vs {lb}", zmax=p.get("zmax"))
        table = long_table(js, [], ("layer", "head")).rename(columns={"weight": "js_distance"})
        return FigureBundle(fig, table, {"js_distance": js})
    # (N, N) each: the one head of each source (a streamed window computes that head alone), pooled
    # into token blocks beyond MAX_OVERVIEW tokens (attnlab/figures/long_maps.py)
    heads, names = _sources(kind, weights, p, labels, 2 if kind == "difference" else None,
                            read=lambda w, name: head_map(w, layer, head))
    maps, block, axis_labels, focus = pooled_panels(heads, p.get("focus"))
    cells = "" if block == 1 else f" ({describe_block(block, 'mean')})"
    extra = {} if block == 1 else {"block": np.array(block)}
    # one model for every panel ("M · unas", "M · dnas"): the panels are named by variant alone and
    # the figure's title names the model (the full names ran into each other above the panels)
    one_model = all(" · " in n for n in names) and len({n.rsplit(" · ", 1)[0] for n in names}) == 1
    short = [n.rsplit(" · ", 1)[1] for n in names] if one_model else names
    model = f"{names[0].rsplit(' · ', 1)[0]}: " if one_model else ""
    if kind == "panels":
        fig = panel_heatmaps(
            maps,
            tokens,
            short,
            shared_scale=p.get("shared_scale", True),
            focus=focus,
            title=f"{model}layer {layer}, head {head}{cells}"
            + (" — one colour scale" if p.get("shared_scale", True) else " — a colour scale per panel"),
            axis_labels=axis_labels,
        )
        table = pd.concat(
            [long_table(m, []).assign(panel=name) for m, name in zip(maps, names, strict=True)],
            ignore_index=True,
        )
        return FigureBundle(
            fig, table, {f"panel_{k}": m for k, m in enumerate(maps)} | {"tokens": np.array(tokens)} | extra
        )
    diffs = [maps[0] - m for m in maps[1:]]  # (N, N) each: A - B, A - C, ...
    titles = [f"{short[0]} minus {n}" for n in short[1:]]
    if kind == "difference":
        title = f"{names[0]} minus {names[1]}: layer {layer}, head {head}{cells}"
        fig = panel_heatmaps(diffs, tokens, [title], diverging=True, focus=focus, title=title,
                             axis_labels=axis_labels)
        return FigureBundle(
            fig, long_table(diffs[0], []), {"difference": diffs[0], "tokens": np.array(tokens)} | extra
        )
    lim = max(float(np.abs(d).max()) for d in diffs)
    fig = panel_heatmaps(
        diffs,
        tokens,
        titles,
        diverging=True,
        focus=focus,
        title=f"Differences from {names[0]}: layer {layer}, head {head}{cells} "
        f"(one scale, centred at 0, ±{lim:.3g})",
        axis_labels=axis_labels,
    )
    table = pd.concat(
        [long_table(d, []).assign(panel=t) for d, t in zip(diffs, titles, strict=True)], ignore_index=True
    ).rename(columns={"weight": "difference"})
    return FigureBundle(fig, table, {f"difference_{k + 1}": d for k, d in enumerate(diffs)} | extra)


def _one_head(kind: str, v: str, w: np.ndarray, tokens, p: dict, query_tokens=None) -> FigureBundle:
    """heatmap, head_view, token_mass of one variant's (L, H, M, N) weights (``query_tokens``: the M
    queries of cross-attention; token_mass takes self-attention only)."""
    layer, head, focus = p["layer"], p.get("head"), p.get("focus")
    arrays = {"tokens": np.array(tokens)}
    if query_tokens is not None:
        arrays["query_tokens"] = np.array(query_tokens)
    if kind == "heatmap":
        fig = attention_heatmap(
            w[layer, head],
            tokens,
            query_tokens=query_tokens,
            title=f"{v}: layer {layer}, head {head}",
            focus=focus if query_tokens is None else None,  # a row and a column: self-attention
            zmax=p.get("zmax"),
            click_targets=p.get("clickable", False) and w.shape[-1] <= CLICKABLE_MAX_TOKENS,
        )
        return FigureBundle(
            fig, long_table(w[layer, head], []), {v: w[layer, head], **arrays}
        )
    if kind == "head_view":  # params["heads"]: the heads overlaid (None: the one head)
        heads = check_heads(p.get("heads") or [head], w.shape[1])
        if head not in heads:
            raise ValueError(f"head_view: heads {heads} must include the head shown, {head}")
        maps = w[layer, heads]  # (h, M, N)
        named = f"head {head}" if len(heads) == 1 else "heads " + ", ".join(map(str, heads))
        fig = head_overlay(
            maps, tokens, heads, title=f"{v}: head view, layer {layer}, {named}",
            min_weight=p.get("min_weight", 0.02), focus=focus, query_tokens=query_tokens,
        )
        if len(heads) == 1:
            return FigureBundle(fig, long_table(maps[0], []), {v: maps[0], **arrays})
        table = long_table(maps, ["head"]).assign(head=lambda t: np.asarray(heads)[t["head"]])
        return FigureBundle(fig, table, {v: maps, "heads": np.array(heads), **arrays})
    if query_tokens is not None:
        raise ValueError(f"{kind} draws self-attention: query_tokens (cross-attention) are not taken")
    sel = w[layer] if head is None else w[layer, head][None]  # (h, N, N)
    where = f"layer {layer}, " + ("mean over heads" if head is None else f"head {head}")
    if focus is None:
        mass = sel.sum(-2).mean(0)  # (N,) column mass, mean over the heads shown
        title, what, column = f"{v}: attention each token receives ({where})", "mass", "column_mass"
    else:
        mass = sel[:, focus, :].mean(0)  # (N,) the row the focused token sends
        title, what, column = f"{v}: attention {focus}: {tokens[focus]} sends ({where})", "weight", "sent"
    fig = token_mass_strip(tokens, mass, title=title, bound=1.0 / len(tokens), focus=focus, what=what)
    table = pd.DataFrame({"position": np.arange(len(tokens)), "token": tokens, column: mass})
    return FigureBundle(fig, table, {column: mass})


def _explained_away(w, eps: float) -> np.ndarray:
    """(L, H) share of keys with relative column mass < eps (attnlab.stats.explained_away_fraction);
    a streamed window's from its streamed column masses (no map computed), NaN propagating."""
    if getattr(w, "window", None) is None:
        from attnlab.stats import explained_away_fraction

        w = torch.from_numpy(as_array(w, "weights", 4))
        return explained_away_fraction(w, eps, relative=True).numpy()
    cm, M = column_masses(w)  # (L, H, N)
    rel = cm * (cm.shape[-1] / max(M, 1))
    return np.where(np.isnan(rel), np.nan, rel < eps).mean(-1).astype(np.float32)


def build(
    kind: str,
    weights: Mapping[str, np.ndarray] | Sequence[Mapping[str, np.ndarray]],
    tokens: Sequence[str],
    params: Mapping,
    *,
    u: float | None = None,
    labels: Sequence[str] | None = None,
    query_tokens: Sequence[str] | None = None,
) -> FigureBundle:
    """Build a figure of ``kind`` (see ``KINDS``) and its data.

    Args:
        kind: one of ``KINDS``.
        weights: ``{variant: (L, H, N, N)}`` of one window; for ``MULTI_KINDS`` (and an overlaid
            column_mass) a list of such dicts (sources A, B, ..., same tokens).
        tokens: the window's N tokens.
        params: the kind's settings: ``variant``, ``layer``, ``head``, ``focus`` (maps), ``heads``
            (head_view: the heads overlaid); ``variants``, ``layer`` (None = all), ``group``
            ("variant" | "layer"), ``dist`` ("ecdf" | "histogram") for column_mass; ``eps``
            (relative) for explained_away; ``max_tokens`` for grid;
            ``variants`` = one variant per source and ``shared_scale`` for the multi-source kinds;
            ``zmax`` (js_distance) the top of the colour scale, one for several maps compared.
        u: HNAS weight for the u/N line of column_mass (float only).
        labels: display names of the sources (multi-source kinds).
        query_tokens: cross-attention's M query tokens (heatmap, head_view, model_view, grid; weights
            (L, H, M, N), ``tokens`` the N keys, the focus a key); None: self-attention.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    p = dict(params)
    if kind in MULTI_KINDS:
        return _multi(kind, weights, tokens, p, labels)
    if kind == "column_mass" and not isinstance(weights, Mapping):  # several sources overlaid
        labels = list(labels or [f"source {k}" for k in range(len(weights))])
        chosen = list(p["variants"])
        if not len(labels) == len(chosen) == len(weights):
            raise ValueError("column_mass over several sources needs one label and one variant per source")
        p["hnas"] = "hnas" in chosen
        p.setdefault("legend", "panel")  # a curve per source: the page's panels, not variants
        weights = {f"{lab} · {v}": w[v] for lab, v, w in zip(labels, chosen, weights, strict=True)}
        p["variants"] = list(weights)
    if not isinstance(weights, Mapping):
        raise ValueError(f"{kind} needs one source of weights {{variant: (L, H, N, N)}}")
    if kind in ("grid", "model_view"):
        v = p["variant"]
        w = as_array(weights[v], f"weights[{v!r}]", 4)
        arrays = {v: w, "tokens": np.array(tokens)}
        if query_tokens is not None:
            arrays["query_tokens"] = np.array(query_tokens)
        if kind == "model_view":
            fig = model_view(w, tokens, title=f"{v}: model view (every layer and head)", focus=p.get("focus"),
                             query_tokens=query_tokens)
            return FigureBundle(fig, long_table(w, ["layer", "head"]), arrays)
        fig = attention_grid(
            w,
            tokens,
            title=f"{v}: attention by layer and head",
            max_tokens=p.get("max_tokens", 64),
            cell_px=72,
            focus=p.get("focus") if query_tokens is None else None,  # a row and a column: self-attention
        )
        pooled, _ = block_mean(w, p.get("max_tokens", 64))
        return FigureBundle(fig, long_table(pooled, ["layer", "head"]), arrays)
    if kind in ("heatmap_blocks", "heatmap_zoom"):  # one head of a long context: that head alone read
        return (blocks_bundle if kind == "heatmap_blocks" else zoom_bundle)(weights[p["variant"]], tokens, p)
    if kind in ("heatmap", "head_view", "token_mass"):
        v = p["variant"]
        return _one_head(kind, v, as_array(weights[v], f"weights[{v!r}]", 4), tokens, p, query_tokens)
    if kind == "column_mass":
        variants = list(p.get("variants") or list(weights))
        layer, group = p.get("layer"), p.get("group", "variant")
        masses, frames = {}, []
        for v in variants:
            cm, _ = column_masses(weights[v])  # (L, H, N); a streamed window's without its maps
            for lay in range(cm.shape[0]) if layer is None else [layer]:
                name = v if group == "variant" else f"{v} · layer {lay}"
                masses.setdefault(name, []).append(cm[lay].reshape(-1))
                frames.append(long_table(cm[lay], ["head"], ("key",)).assign(variant=v, layer=lay))
        masses = {k: np.concatenate(x) for k, x in masses.items()}
        n = int(next(iter(weights.values())).shape[-1])
        where = "every layer" if layer is None else f"layer {layer}"
        fig = column_mass_distribution(
            masses,
            n,
            u=u if p.get("hnas", "hnas" in variants) else None,
            kind=p.get("dist", "ecdf"),
            title=f"Column mass per key ({where}, every head)",
            legend_title=p.get("legend", "variant" if group == "variant" else "variant · layer"),
        )
        table = pd.concat(frames, ignore_index=True).rename(columns={"weight": "column_mass"})
        return FigureBundle(
            fig, table, {k.replace(" · ", "_").replace(" ", ""): x for k, x in masses.items()}
        )
    # explained_away
    eps = float(p["eps"])
    variants = list(p.get("variants") or list(weights))
    fractions = {v: _explained_away(weights[v], eps) for v in variants}
    fig = explained_away_heatmap(fractions, title=f"Explained-away fraction (relative column mass < {eps:g})")
    table = pd.concat(
        [long_table(f, [], ("layer", "head")).assign(variant=v) for v, f in fractions.items()],
        ignore_index=True,
    ).rename(columns={"weight": "explained_away"})
    return FigureBundle(fig, table, dict(fractions))
