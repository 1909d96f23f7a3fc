"""``attnlab analyze`` beyond weights: --contributions, --sinks, --flow, --interventions, --faithfulness.

Outputs, in the same ``--out`` folder (listed in manifest.json's ``files``; settings under
``settings.beyond``):

    statistics.csv, summary.*  --contributions adds the rows of attnlab.contributions.CONTRIBUTION_STATISTICS
    sinks.csv                  --sinks: attnlab.sinks.SINK_STATISTICS per window/variant/layer/head
    sink_rate.csv              --sinks: window, variant, layer, eps, sink_rate (share of heads whose
                               causal-corrected importance of key 0 exceeds --sink-eps; Gu et al. 2024)
    sink_importance.csv        --sinks: window, variant, layer, head, key, token, importance of the first
                               FIRST_KEYS keys (sum_i pi_ij / queries that may attend j; Gu et al. 2024)
    massive_activations.csv    --sinks, Hugging Face models: window, layer, max_abs, token_index, token,
                               dim, median_abs, ratio (one plain forward per window; Sun et al. 2024)
    flow.npz                   --flow: one (n_outputs, N) array per variant, outputs, tokens, window
    interventions.csv          --interventions VARIANT: window, variant, layer, head, measure, value
    faithfulness.csv           --faithfulness: window, variant, measure, tau, p_value, n_tokens
    figures/*.html             one figure for each of the above (as the other figures)

Flow, interventions and faithfulness describe one window, ``--window-index`` (default 0; they cost a
max flow per token pair, L x H swapped forwards, N forwards); a note says so for longer texts.
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_arguments", "check", "requested", "preflight", "per_window", "finish", "manifest_settings"]

SINK_CHOICES = ("first", "special", "first+special")  # = attnlab.sinks.SINK_CHOICES (no torch import here)
FIRST_KEYS = 16  # keys per (layer, head) in sink_importance.csv (= attnlab.figures.sinks.FIRST_KEYS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("beyond weights (docs/STATISTICS.md)")
    add = group.add_argument
    add(
        "--contributions",
        action="store_true",
        help="contribution norms (Kobayashi et al. 2020): contribution statistics in statistics.csv",
    )
    add(
        "--sinks",
        action="store_true",
        help="attention sinks: sinks.csv (sink mass, statistics without sinks), sink_rate.csv, "
        "sink_importance.csv, massive_activations.csv",
    )
    add(
        "--sink-eps",
        type=float,
        default=0.3,
        metavar="EPS",
        help="a head is a sink when the importance of key 0 exceeds EPS (sink_rate.csv; Gu et al. 2024: 0.3)",
    )
    add(
        "--sink-keys",
        choices=SINK_CHOICES,
        default="first+special",
        help="which keys are sinks for --sinks (default: first+special)",
    )
    add("--flow", action="store_true", help="attention flow (Abnar & Zuidema 2020) of one window: flow.npz")
    add(
        "--flow-outputs",
        metavar="LIST",
        default=None,
        help="comma-separated output positions for --flow (default: all, if within the size limit)",
    )
    add(
        "--interventions",
        metavar="VARIANT",
        default=None,
        help="swap each head to VARIANT in turn: interventions.csv (L x H output change of one window)",
    )
    add(
        "--window-index",
        metavar="K",
        type=int,
        default=0,
        help="the window (0-based, as in tokens.json) that --flow, --interventions and --faithfulness "
        "describe (default: 0)",
    )
    add(
        "--faithfulness",
        action="store_true",
        help="Kendall tau of importance measures vs leave-one-token-out, per variant: faithfulness.csv",
    )


def requested(args) -> bool:
    return bool(args.contributions or args.sinks or args.flow or args.interventions or args.faithfulness)


def check(args, error) -> None:
    """Flag checks before any heavy work; ``error``: the CLI's InputError class."""
    if not 0 <= args.sink_eps <= 1:  # (also refuses NaN)
        raise error(f"--sink-eps must be a number in [0, 1], got {args.sink_eps}")
    if args.window_index < 0:
        raise error(f"--window-index must be >= 0, got {args.window_index}")
    if args.flow_outputs is not None:
        if not args.flow:
            raise error("--flow-outputs needs --flow")
        try:
            args.flow_outputs = [int(x) for x in args.flow_outputs.split(",") if x.strip()]
        except ValueError:
            raise error(
                f"--flow-outputs must be comma-separated integers, got {args.flow_outputs!r}"
            ) from None
        if not args.flow_outputs:
            raise error("--flow-outputs names no position")


def preflight(args, stream, error) -> list[str]:
    """Checks that need the planned stream (sizes, the model's head): fail before anything is written."""
    from attnlab import flow
    from attnlab.normalizers import VARIANTS

    w, k = stream.windowing, args.window_index
    if k >= w.n_windows:
        raise error(
            f"--window-index must be in [0, {w.n_windows - 1}]: the text has {w.n_windows} window(s) of "
            f"{w.window} tokens; got {k}"
        )
    n0 = min(w.content, w.n_tokens - w.starts[k]) + (w.window - w.content)  # tokens of window k
    notes = []
    args._loaded = stream.loaded  # massive activations: one plain forward per window (per_window)
    if args.interventions is not None and args.interventions not in VARIANTS:
        raise error(f"--interventions must be one of {','.join(VARIANTS)}, got {args.interventions!r}")
    if args.flow:
        outputs = args.flow_outputs or list(range(n0))
        bad = [o for o in outputs if not 0 <= o < n0]
        if bad:
            raise error(f"--flow-outputs must be positions in [0, {n0 - 1}] (window {k}), got {bad}")
        work = flow.flow_work(stream.model.n_layers, n0, len(outputs))
        if work > flow.MAX_FLOW_WORK:
            fit = int(flow.MAX_FLOW_WORK // flow.flow_work(stream.model.n_layers, n0, 1))
            raise error(
                f"--flow for {len(outputs)} output(s) of a {n0}-token window needs ~{work:.2g} edge visits, "
                "over "
                f"attnlab.flow.MAX_FLOW_WORK={flow.MAX_FLOW_WORK:.2g}: "
                + (f"choose at most {fit} with --flow-outputs" if fit else "use a smaller --window")
            )
    if args.interventions and stream.model.causal:
        from attnlab.hf.beyond.interventions import load_with_lm_head

        args._lm = load_with_lm_head(stream.model.path, device=stream.device)  # worded error without a head
    if w.n_windows > 1 and (args.flow or args.interventions or args.faithfulness):
        notes.append(
            f"--flow/--interventions/--faithfulness describe window {k} only "
            f"(the text has {w.n_windows} windows; choose another with --window-index)"
        )
    return notes


def per_window(args, result, tmp: Path, first: bool) -> list[str]:
    """Per-window outputs (sinks.csv rows); -> files written the first time. Keeps the result of window
    ``--window-index`` for :func:`finish`."""
    if result.window.index == getattr(args, "window_index", 0):
        args._chosen = result
    if not args.sinks:
        return []
    result.sinks(which=args.sink_keys).to_csv(tmp / "sinks.csv", mode="a", header=first, index=False)
    names = ["sinks.csv", *_literature_sinks(args, result, tmp, first)]
    return names if first else []


def _literature_sinks(args, result, tmp: Path, first: bool) -> list[str]:
    """sink_rate.csv, sink_importance.csv (Gu et al. 2024) and massive_activations.csv (Sun et al. 2024)
    rows of one window, appended; -> the files this window writes."""
    import numpy as np
    import pandas as pd

    from attnlab.hf.beyond.activations import activations_table
    from attnlab.hf.load.native import NativeModel

    k, eps = result.window.index, args.sink_eps
    rates = result.sink_rate(eps=eps)  # {variant: (L,)}
    pd.concat([pd.DataFrame({"window": k, "variant": v, "layer": np.arange(len(r)), "eps": eps,
                             "sink_rate": r.numpy()}) for v, r in rates.items()]).to_csv(
        tmp / "sink_rate.csv", mode="a", header=first, index=False)
    parts = []
    for v, imp in result.sink_importance().items():  # (L, H, N)
        L, H, N = imp.shape
        n = min(FIRST_KEYS, N)
        parts.append(pd.DataFrame({
            "window": k, "variant": v, "layer": np.repeat(np.arange(L), H * n),
            "head": np.tile(np.repeat(np.arange(H), n), L), "key": np.tile(np.arange(n), L * H),
            "token": np.tile(np.asarray(result.tokens[:n], dtype=object), L * H),
            "importance": imp[..., :n].double().reshape(-1).numpy()}))
    pd.concat(parts).to_csv(tmp / "sink_importance.csv", mode="a", header=first, index=False)
    loaded = getattr(args, "_loaded", None)
    if loaded is None or isinstance(loaded, NativeModel):  # attnlab's own checkpoints: no hooks on layers
        return ["sink_rate.csv", "sink_importance.csv"]
    table = activations_table(loaded, result.window.input_ids)
    table.insert(0, "window", k)
    table.to_csv(tmp / "massive_activations.csv", mode="a", header=first, index=False)
    return ["sink_rate.csv", "sink_importance.csv", "massive_activations.csv"]


def finish(args, stream, result, tmp: Path) -> tuple[list[str], list[str], dict]:
    """Analyses of window ``--window-index`` -> (files written, notes, figures {name: plotly figure}).
    ``result``: the first window's (the chosen one's, kept by :func:`per_window`, is used instead)."""
    import numpy as np
    import pandas as pd
    import torch

    from attnlab import flow
    from attnlab.figures import beyond as fig
    from attnlab.hf.beyond import faithfulness, interventions

    written, notes, figures = [], [], {}
    if args.contributions:
        figures["contributions"] = fig.weight_vs_contribution(result.table()).figure
    result = getattr(args, "_chosen", None) or result
    k = result.window.index
    if args.sinks:
        figures["sinks"] = fig.sink_mass_by_layer(pd.read_csv(tmp / "sinks.csv")).figure
        figures.update(_sink_figures(args, tmp, k))
    if args.flow:
        outputs = args.flow_outputs or list(range(len(result.tokens)))
        arrays = {v: flow.attention_flow(w, outputs).numpy() for v, w in result.weights.items()}
        np.savez(tmp / "flow.npz", outputs=np.array(outputs), tokens=np.array(result.tokens),
                 window=np.array(k), **arrays)
        written.append("flow.npz")
        bundle = fig.flow_heatmap(arrays, result.tokens, outputs, title=f"Attention flow (window {k})")
        figures["flow"] = bundle.figure
    if args.interventions:
        model = getattr(args, "_lm", None) or stream.loaded
        ids = torch.tensor([result.window.input_ids])
        res = interventions.head_interventions(
            model, ids, args.interventions, _scalars(stream.params), progress=not args.quiet
        )
        res.table().assign(window=k)[["window", *res.table().columns]].to_csv(
            tmp / "interventions.csv", index=False
        )
        written.append("interventions.csv")
        figures["interventions"] = fig.intervention_heatmap(res.measures, args.interventions).figure
    if args.faithfulness:
        given = _scalars(stream.params)
        res = faithfulness.faithfulness(
            stream.loaded, result.window, stream.variants, dict.fromkeys(stream.variants, given),
            progress=not args.quiet,
        )
        table = res.table.assign(window=k)[["window", *res.table.columns]]
        table.to_csv(tmp / "faithfulness.csv", index=False)
        written.append("faithfulness.csv")
        notes += res.notes
        figures["faithfulness"] = fig.faithfulness_bars(res.table).figure
    return written, notes, figures


def _sink_figures(args, tmp: Path, k: int) -> dict:
    """Window ``k``'s sink rate per layer, each variant's importance of the first keys (mean over
    heads) and, when measured, the massive activations per layer: {name: plotly figure}."""
    import pandas as pd

    from attnlab.figures import sinks as fig

    rate = pd.read_csv(tmp / "sink_rate.csv")
    rate = rate[rate.window == k]
    per = {v: p.sort_values("layer").sink_rate.to_numpy() for v, p in rate.groupby("variant", sort=False)}
    out = {"sink_rate": fig.sink_rate_by_layer(per, args.sink_eps).figure}
    imp = pd.read_csv(tmp / "sink_importance.csv", keep_default_na=False, na_values=[""])
    imp = imp[imp.window == k]
    for v, part in imp.groupby("variant", sort=False):
        L, H, n = part.layer.max() + 1, part["head"].max() + 1, part.key.max() + 1
        tokens = part[(part.layer == 0) & (part["head"] == 0)].sort_values("key").token.astype(str).tolist()
        cube = part.sort_values(["layer", "head", "key"]).importance.to_numpy().reshape(L, H, n)
        out[f"sink_importance_{v}"] = fig.importance_by_layer(cube, tokens, v, keys=n).figure
    if (tmp / "massive_activations.csv").exists():
        act = pd.read_csv(tmp / "massive_activations.csv", keep_default_na=False, na_values=[""])
        out["massive_activations"] = fig.massive_activations_by_layer(act[act.window == k]).figure
    return out


def _scalars(params) -> dict:
    """The variant parameters given as numbers (a per-head u tensor applies to the analysis only)."""
    return {k: v for k, v in (params or {}).items() if not hasattr(v, "shape")}


def manifest_settings(args) -> dict:
    return {
        "contributions": bool(args.contributions),
        "sinks": args.sink_keys if args.sinks else None,
        "sink_eps": args.sink_eps if args.sinks else None,
        "flow_outputs": (args.flow_outputs or "all") if args.flow else None,
        "interventions": args.interventions,
        "faithfulness": bool(args.faithfulness),
        "window_index": args.window_index if (args.flow or args.interventions or args.faithfulness) else None,
    }
