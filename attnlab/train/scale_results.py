"""The HNAS-at-scale runs (issue 29; recipes enc8-{unas,dnas,hnas}, scripts/hnas_scale.sh) against the
paper's Fig. 4 (u per layer: above 0.5 everywhere, lower near the output) and Table 2 (the held-out
loss of UNAS, DNAS and HNAS), for docs/RESULTS.md, section "(e) At scale".

    python -m attnlab.train scale-results [--checkpoints checkpoints] [--figures docs/figures]
                                          [--runs runs/hnas-scale] [--windows 512]

Every model is read from its checkpoint folder (shipped ones under ``checkpoints/``, unfinished ones
under ``--runs``). Only finished runs enter the numbers and figures: an unfinished run is listed with
its step and ``"used": false`` (a run still at step 0 would count as a seed whose u is exactly 0.5), unless
``--include-unfinished`` asks for an interim reading at their latest checkpoints (steps > 0 only).
What is computed:

- u per layer: each HNAS seed's mean over heads (L,), then per layer the mean over seeds with its 95 %
  t-interval (n - 1 degrees of freedom), and whether every seed's and the interval's lower end lie
  above 0.5;
- the trend over layers: each seed's least-squares slope of layer-mean u against the layer index, the
  one-sample t-test of those slopes against 0 (the test that treats seeds, not heads, as the
  replicates), and Spearman's rank correlation of the seed-averaged layer means with the layer index;
- held-out masked-LM loss per model on the same windows and masks (the corpus' held-out split, masks
  of seed 0), nats per target token, with a 95 % percentile bootstrap interval over windows, and each
  model's paired difference to the UNAS model on the same windows (bootstrap over windows too);
- column-mass quantiles and the explained-away share (relative mass below 0.1) per layer of each model,
  on held-out windows (results.column_mass_distribution).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from attnlab.stats.intervals import t_half_width
from attnlab.train.results import _mass_stats, _write, column_mass_distribution

__all__ = [
    "SCALE_RUNS",
    "t_interval",
    "u_per_layer",
    "trend_test",
    "window_losses",
    "bootstrap_ratio",
    "find_runs",
    "build_scale_results",
]

# variant -> the run names of scripts/hnas_scale.sh
SCALE_RUNS = {
    "unas": ("enc8-unas-s0",),
    "dnas": ("enc8-dnas-s0",),
    "hnas": ("enc8-hnas-s0", "enc8-hnas-s1", "enc8-hnas-s2"),
}
BOOTSTRAP = 2000  # resamples of the bootstrap intervals (seeded)


def t_interval(values: Sequence[float], level: float = 0.95) -> dict:
    """{"mean", "low", "high", "n"}: the mean of ``values`` with its t-interval (NaN bounds for n < 2)."""
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or len(x) == 0:
        raise ValueError(f"values must be a non-empty 1-D sequence, got shape {x.shape}")
    mean = float(x.mean())
    if len(x) < 2:
        return {"mean": mean, "low": float("nan"), "high": float("nan"), "n": 1}
    half = float(t_half_width(x, level=level))
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": len(x)}


def u_per_layer(u_by_seed: Mapping[str, np.ndarray]) -> dict:
    """u_by_seed: {run: (L, H) final u}. -> {"layers": [per layer: t_interval of the seeds' head means,
    "seeds": {run: value}], "every_seed_above_half", "interval_above_half" (the lower ends > 0.5)}."""
    if not u_by_seed:
        raise ValueError("u_by_seed must hold at least one HNAS run, got none")
    shapes = {np.shape(u) for u in u_by_seed.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"u_by_seed must hold (L, H) arrays of one shape, got shapes {sorted(shapes)}")
    means = {run: np.asarray(u, dtype=np.float64).mean(1) for run, u in u_by_seed.items()}  # (L,) each
    L = next(iter(shapes))[0]
    layers = []
    for layer in range(L):
        row = t_interval([m[layer] for m in means.values()])
        row["seeds"] = {run: float(m[layer]) for run, m in means.items()}
        layers.append(row)
    return {
        "layers": layers,
        "every_seed_above_half": bool(all((m > 0.5).all() for m in means.values())),
        "interval_above_half": bool(len(means) > 1 and all(r["low"] > 0.5 for r in layers)),
    }


def trend_test(layer_means: np.ndarray) -> dict:
    """layer_means (S, L): each seed's head-mean u per layer. -> per-seed slopes of u against the layer
    index (per layer), their one-sample t-test against 0 (two-sided p and one-sided p for "lower near
    the output", i.e. slope < 0; NaN with one seed), and Spearman's rho of the seed mean with the layer
    index with its two-sided p."""
    from scipy import stats

    y = np.asarray(layer_means, dtype=np.float64)
    if y.ndim != 2 or y.shape[1] < 3:
        raise ValueError(f"layer_means must be (seeds, layers) with at least 3 layers, got shape {y.shape}")
    x = np.arange(y.shape[1], dtype=np.float64)
    slopes = [float(np.polyfit(x, row, 1)[0]) for row in y]
    if len(slopes) > 1 and np.std(slopes) > 0:
        t = stats.ttest_1samp(slopes, 0.0)
        p_two, p_less = float(t.pvalue), float(stats.ttest_1samp(slopes, 0.0, alternative="less").pvalue)
    else:
        p_two = p_less = float("nan")
    rho = stats.spearmanr(x, y.mean(0))
    return {
        "slopes": slopes,
        "slope": t_interval(slopes),
        "p_two_sided": p_two,
        "p_lower_near_output": p_less,
        "spearman_rho": float(rho.statistic),
        "spearman_p": float(rho.pvalue),
    }


@torch.no_grad()
def window_losses(
    run_dir: str | Path, n_windows: int = 512, batch_size: int = 32
) -> tuple[np.ndarray, np.ndarray]:
    """(loss sum, target count) per held-out window (n,) of a trained encoder: the first ``n_windows``
    windows of its corpus' held-out split, masked as the trainer masks them with seed 0 (the same
    windows and masks for every model of one corpus and tokenizer)."""
    from attnlab.data import LMData, load_corpus, load_tokenizer
    from attnlab.models import load, load_config

    model, cfg, tok = load(run_dir), load_config(run_dir), load_tokenizer(run_dir)
    model.eval()
    dc = cfg["data"]
    ids = torch.tensor(tok.encode_corpus(load_corpus(dc["corpus"], dc.get("max_chars"))), dtype=torch.long)
    data = LMData(
        ids,
        seq_len=dc["seq_len"],
        kind=model.config.kind,
        vocab_size=tok.vocab_size,
        mask_prob=dc.get("mask_prob", 0.15),
        seed=0,
    )
    sums, counts = [], []
    for b in data.eval_batches(batch_size, -(-n_windows // batch_size)):
        out = model(b["input_ids"], labels=b["labels"])
        sel = b["labels"] != -100  # (B, T); out.logits (K, V) at the selected positions, row-major
        per = F.cross_entropy(out.logits.float(), b["labels"][sel], reduction="none")  # (K,)
        row = sel.nonzero()[:, 0]
        B = b["labels"].shape[0]
        sums.append(torch.zeros(B, dtype=torch.float64).index_add_(0, row, per.double()))
        counts.append(sel.sum(1).double())
    return torch.cat(sums)[:n_windows].numpy(), torch.cat(counts)[:n_windows].numpy()


def bootstrap_ratio(
    sums: np.ndarray,
    counts: np.ndarray,
    minus: tuple[np.ndarray, np.ndarray] | None = None,
    level: float = 0.95,
    seed: int = 0,
) -> dict:
    """Loss per target token sum(sums) / sum(counts) (minus another model's on the same windows, paired)
    with its percentile bootstrap interval over windows."""
    sums, counts = np.asarray(sums, np.float64), np.asarray(counts, np.float64)
    if sums.shape != counts.shape or sums.ndim != 1 or len(sums) == 0:
        raise ValueError(
            f"sums and counts must be equal non-empty 1-D arrays, got {sums.shape} and {counts.shape}"
        )
    if minus is not None and np.asarray(minus[0]).shape != sums.shape:
        raise ValueError(
            f"minus must hold the same windows, got {np.asarray(minus[0]).shape} for {sums.shape}"
        )

    def stat(idx):
        value = sums[idx].sum(-1) / counts[idx].sum(-1)
        if minus is not None:
            value = value - minus[0][idx].sum(-1) / minus[1][idx].sum(-1)
        return value

    rng = np.random.default_rng(seed)
    draws = stat(rng.integers(0, len(sums), size=(BOOTSTRAP, len(sums))))
    lo, hi = np.quantile(draws, [(1 - level) / 2, (1 + level) / 2])
    return {
        "value": float(stat(np.arange(len(sums)))),
        "low": float(lo),
        "high": float(hi),
        "n_windows": len(sums),
    }


def find_runs(checkpoints: str | Path, runs: str | Path | None) -> dict[str, dict]:
    """{run name: {"dir", "variant", "step", "steps", "finished"}} of every scale run found: the shipped
    checkpoint first, else the unfinished run folder."""
    out = {}
    for variant, names in SCALE_RUNS.items():
        for name in names:
            for root in (Path(checkpoints), None if runs is None else Path(runs)):
                d = None if root is None else root / name
                if d is None or not (d / "latest.json").is_file():
                    continue
                step = int(json.loads((d / "latest.json").read_text())["step"])
                steps = (
                    int(json.loads((d / "recipe.json").read_text())["train"]["steps"])
                    if (d / "recipe.json").is_file()
                    else step
                )
                out[name] = {
                    "dir": d,
                    "variant": variant,
                    "step": step,
                    "steps": steps,
                    "finished": step >= steps,
                }
                break
    return out


def build_scale_results(
    checkpoints: str | Path = "checkpoints",
    figures: str | Path = "docs/figures",
    runs: str | Path | None = "runs/hnas-scale",
    n_windows: int = 512,
    include_unfinished: bool = False,
) -> dict:
    """Every number and figure of docs/RESULTS.md (e) (module docstring) from the scale runs found
    (finished ones; with ``include_unfinished`` also those past step 0); writes
    ``figures``/scale_{u,loss,column_mass}.png and scale_results.json and returns the numbers."""
    import plotly.graph_objects as go

    from attnlab.data import load_corpus
    from attnlab.figures.training import LAYER_COLORS
    from attnlab.models import load, load_config

    found = find_runs(checkpoints, runs)
    if not found:
        raise FileNotFoundError(
            f"no scale run ({', '.join(n for ns in SCALE_RUNS.values() for n in ns)}) "
            f"in {checkpoints}" + ("" if runs is None else f" or {runs}")
        )
    used = {n: r for n, r in found.items() if r["finished"] or (include_unfinished and r["step"] > 0)}
    if not used:
        raise FileNotFoundError(
            "no finished scale run yet ("
            + ", ".join(f"{n} at step {r['step']} of {r['steps']}" for n, r in found.items())
            + "); --include-unfinished reads runs past step 0 at their latest checkpoints"
        )
    fig_dir = Path(figures)
    fig_dir.mkdir(parents=True, exist_ok=True)
    res: dict = {
        "runs": {n: {**{k: (str(v) if k == "dir" else v) for k, v in r.items()}, "used": n in used}
                 for n, r in found.items()},
        "figures": [],
    }
    found = used
    hnas = {n: load(r["dir"]).hybrid_weights().numpy() for n, r in found.items() if r["variant"] == "hnas"}
    if hnas:
        res["u"] = u_per_layer(hnas)
        L = len(res["u"]["layers"])
        if L >= 3:
            res["trend"] = trend_test(np.stack([u.mean(1) for u in hnas.values()]))
        fig = go.Figure()
        x = list(range(1, L + 1))
        rows = res["u"]["layers"]
        if len(hnas) > 1:
            fig.add_trace(
                go.Scatter(
                    x=x + x[::-1],
                    y=[r["high"] for r in rows] + [r["low"] for r in rows][::-1],
                    fill="toself",
                    mode="lines",
                    fillcolor="rgba(44,160,44,0.2)",
                    line={"width": 0},
                    name="95 % t-interval over seeds",
                    hoverinfo="skip",
                )
            )
        fig.add_trace(
            go.Scatter(
                x=x,
                y=[r["mean"] for r in rows],
                mode="lines+markers",
                name="mean over seeds",
                line={"color": "black"},
            )
        )
        for i, run in enumerate(hnas):
            fig.add_trace(
                go.Scatter(
                    x=x,
                    y=[r["seeds"][run] for r in rows],
                    mode="markers",
                    name=run,
                    marker={"size": 8, "color": LAYER_COLORS[i % len(LAYER_COLORS)]},
                )
            )
        fig.add_hline(y=0.5, line_dash="dot")
        fig.update_layout(
            title=f"HNAS u per layer, mean over heads, {len(hnas)} seed(s) (enc8-hnas)",
            xaxis_title="layer (1 = input side)",
            yaxis_title="u (1 = DNAS, 0 = UNAS)",
        )
        res["figures"].append(_write(fig, fig_dir / "scale_u.png"))
    # held-out loss on the same windows and masks, paired differences to UNAS
    losses = {n: window_losses(r["dir"], n_windows) for n, r in found.items()}
    ref = next((n for n, r in found.items() if r["variant"] == "unas"), None)
    res["loss"] = {
        n: {
            **bootstrap_ratio(*w),
            "minus_unas": None if ref is None or n == ref else bootstrap_ratio(*w, minus=losses[ref]),
        }
        for n, w in losses.items()
    }
    if len(hnas) > 1:
        res["loss_hnas_over_seeds"] = t_interval([res["loss"][n]["value"] for n in hnas])
    names = list(res["loss"])
    fig = go.Figure(
        go.Bar(
            x=names,
            y=[res["loss"][n]["value"] for n in names],
            error_y={
                "type": "data",
                "symmetric": False,
                "array": [res["loss"][n]["high"] - res["loss"][n]["value"] for n in names],
                "arrayminus": [res["loss"][n]["value"] - res["loss"][n]["low"] for n in names],
            },
        )
    )
    lo = min(res["loss"][n]["low"] for n in names)
    fig.update_layout(
        title=f"Held-out masked-LM loss, {n_windows} windows (whiskers: 95 % bootstrap)",
        yaxis_title="nats per target token",
        yaxis_range=[lo - 0.1, None],
    )
    res["figures"].append(_write(fig, fig_dir / "scale_loss.png"))
    # column mass per layer
    res["column_mass"] = {}
    first = next(iter(found.values()))["dir"]
    text = load_corpus(load_config(first)["data"]["corpus"])
    fig = go.Figure()
    colors = {"unas": "#d62728", "dnas": "#1f77b4", "hnas": "#2ca02c"}
    for n, r in found.items():
        rel = column_mass_distribution(r["dir"], text=text)
        M = load_config(r["dir"])["data"]["seq_len"]
        res["column_mass"][n] = _mass_stats(rel, M)
        if n.endswith("-s0"):  # one box set per variant: the seed-0 model
            pick = torch.randperm(rel.shape[1], generator=torch.Generator().manual_seed(0))[:4000]
            xs = [f"layer {layer + 1}" for layer in range(rel.shape[0]) for _ in range(len(pick))]
            fig.add_trace(
                go.Box(
                    y=rel[:, pick].clamp_min(1e-4).flatten().tolist(),
                    x=xs,
                    name=n,
                    boxpoints=False,
                    marker_color=colors[r["variant"]],
                    line_color=colors[r["variant"]],
                )
            )
    fig.add_hline(y=0.1, line_dash="dot")
    fig.update_layout(
        boxmode="group",
        yaxis_type="log",
        yaxis_title="relative column mass (log)",
        title="Relative column mass m_j N/M per layer, held-out windows (dotted: 0.1, explained away below)",
    )
    res["figures"].append(_write(fig, fig_dir / "scale_column_mass.png"))
    (fig_dir / "scale_results.json").write_text(json.dumps(res, indent=2) + "\n")
    return res
