"""``attnlab analyze`` beyond weights: --contributions, --sinks, --flow, --interventions, --faithfulness.

Outputs, in the same ``--out`` folder (listed in manifest.json's ``files``; settings under
``settings.beyond``):

    statistics.csv, summary.*  --contributions adds the rows of attnlab.contributions.CONTRIBUTION_STATISTICS
    sinks.csv                  --sinks: attnlab.sinks.SINK_STATISTICS per window/variant/layer/head
    flow.npz                   --flow: window 0, one (n_outputs, N) array per variant, outputs, tokens
    interventions.csv          --interventions VARIANT: window 0, layer, head, measure, value
    faithfulness.csv           --faithfulness: window 0, variant, measure, tau, p_value, n_tokens
    figures/*.html             one figure for each of the above (as the other figures)

Flow, interventions and faithfulness describe the first window (they cost a max flow per token pair,
L x H forwards, N forwards); a note says so for longer texts.
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_arguments", "check", "requested", "preflight", "per_window", "finish", "manifest_settings"]

SINK_CHOICES = ("first", "special", "first+special")  # = attnlab.sinks.SINK_CHOICES (no torch import here)


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
        help="attention sinks: sinks.csv (sink mass, statistics without sinks)",
    )
    add(
        "--sink-keys",
        choices=SINK_CHOICES,
        default="first+special",
        help="which keys are sinks for --sinks (default: first+special)",
    )
    add("--flow", action="store_true", help="attention flow (Abnar & Zuidema 2020) of window 0: flow.npz")
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
        help="swap each head of window 0 to VARIANT in turn: interventions.csv (L x H output change)",
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

    w = stream.windowing
    n0 = min(w.content, w.n_tokens) + (w.window - w.content)  # tokens of window 0
    from attnlab.normalizers import VARIANTS

    notes = []
    if args.interventions is not None and args.interventions not in VARIANTS:
        raise error(f"--interventions must be one of {','.join(VARIANTS)}, got {args.interventions!r}")
    if args.flow:
        outputs = args.flow_outputs or list(range(n0))
        bad = [o for o in outputs if not 0 <= o < n0]
        if bad:
            raise error(f"--flow-outputs must be positions in [0, {n0 - 1}] (window 0), got {bad}")
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
        from attnlab.hf.interventions import load_with_lm_head

        args._lm = load_with_lm_head(stream.model.path, device=stream.device)  # worded error without a head
    if w.n_windows > 1 and (args.flow or args.interventions or args.faithfulness):
        notes.append(
            "--flow/--interventions/--faithfulness describe window 0 only "
            f"(the text has {w.n_windows} windows)"
        )
    return notes


def per_window(args, result, tmp: Path, first: bool) -> list[str]:
    """Per-window outputs (sinks.csv rows); -> files written the first time."""
    if not args.sinks:
        return []
    result.sinks(which=args.sink_keys).to_csv(tmp / "sinks.csv", mode="a", header=first, index=False)
    return ["sinks.csv"] if first else []


def finish(args, stream, result, tmp: Path) -> tuple[list[str], list[str], dict]:
    """Window-0 analyses -> (files written, notes, figures {name: plotly figure})."""
    import numpy as np
    import pandas as pd
    import torch

    from attnlab import flow
    from attnlab.figures import beyond as fig
    from attnlab.hf import faithfulness, interventions

    written, notes, figures = [], [], {}
    if args.contributions:
        figures["contributions"] = fig.weight_vs_contribution(result.table()).figure
    if args.sinks:
        figures["sinks"] = fig.sink_mass_by_layer(pd.read_csv(tmp / "sinks.csv")).figure
    if args.flow:
        outputs = args.flow_outputs or list(range(len(result.tokens)))
        arrays = {v: flow.attention_flow(w, outputs).numpy() for v, w in result.weights.items()}
        np.savez(tmp / "flow.npz", outputs=np.array(outputs), tokens=np.array(result.tokens), **arrays)
        written.append("flow.npz")
        figures["flow"] = fig.flow_heatmap(arrays, result.tokens, outputs).figure
    if args.interventions:
        model = getattr(args, "_lm", None) or stream.loaded
        ids = torch.tensor([result.window.input_ids])
        res = interventions.head_interventions(
            model, ids, args.interventions, _scalars(stream.params), progress=not args.quiet
        )
        res.table().to_csv(tmp / "interventions.csv", index=False)
        written.append("interventions.csv")
        figures["interventions"] = fig.intervention_heatmap(res.measures, args.interventions).figure
    if args.faithfulness:
        given = _scalars(stream.params)
        res = faithfulness.faithfulness(
            stream.loaded, result.window, stream.variants, dict.fromkeys(stream.variants, given)
        )
        res.table.to_csv(tmp / "faithfulness.csv", index=False)
        written.append("faithfulness.csv")
        notes += res.notes
        figures["faithfulness"] = fig.faithfulness_bars(res.table).figure
    return written, notes, figures


def _scalars(params) -> dict:
    """The variant parameters given as numbers (a per-head u tensor applies to the analysis only)."""
    return {k: v for k, v in (params or {}).items() if not hasattr(v, "shape")}


def manifest_settings(args) -> dict:
    return {
        "contributions": bool(args.contributions),
        "sinks": args.sink_keys if args.sinks else None,
        "flow_outputs": (args.flow_outputs or "all") if args.flow else None,
        "interventions": args.interventions,
        "faithfulness": bool(args.faithfulness),
    }
