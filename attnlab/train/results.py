"""The numbers and figures of docs/RESULTS.md.

    python -m attnlab.train results [--checkpoints checkpoints] [--figures docs/figures] [--seeds 5]
    python -m attnlab.train multiview [--seeds 5] [--steps 600]

(a) HNAS hybrid weights u per layer of the shipped ``enc-hnas`` model (final, and the curves from its
    metrics.jsonl); (b) column-mass distributions of ``enc-unas`` / ``enc-dnas`` / ``enc-hnas`` on
    held-out windows; (c) the multi-view task (attnlab.data.MultiViewTask) with unas, dnas, hnas over
    several seeds. Figures are PNG (plotly + kaleido), numbers are returned (and printed) as JSON.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from attnlab.data import LMData, MultiViewConfig, MultiViewTask, load_corpus, load_tokenizer
from attnlab.models import MultiViewModel, load, load_config
from attnlab.train.metrics import read_metrics

__all__ = ["multiview_run", "multiview_experiment", "column_mass_distribution", "build_results"]

MV_EVAL_SEED = 10_000
EPS_RELATIVE = 0.1  # a key is epsilon-explained-away when its relative column mass is below this


# ----------------------------------------------------------------------------------------------
# (c) the multi-view task
# ----------------------------------------------------------------------------------------------


def _relative_column_mass(w: torch.Tensor) -> torch.Tensor:
    """(B, H, M, N) weights -> (B, H, N) column mass * N / M (mean 1)."""
    M, N = w.shape[-2:]
    return w.sum(-2) * (N / M)


def multiview_run(variant: str, seed: int, steps: int = 600, batch_size: int = 128, lr: float = 3e-3,
                  config: MultiViewConfig | None = None, n_eval: int = 4096) -> dict:
    """Train one MultiViewModel; held-out accuracy of the global target (majority attribute over all
    keys) and of the per-query target, and the explained-away share of keys."""
    task = MultiViewTask(config)
    c = task.config
    torch.manual_seed(seed)
    model = MultiViewModel(c.d_feature, c.n_views, c.n_classes, variant)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for step in range(steps):
        b = task.sample(batch_size, seed, step)
        qlog, glog = model(b["queries"], b["keys"], b["key_view"])
        loss = F.cross_entropy(qlog.flatten(0, 1), b["query_target"].flatten())
        loss = loss + F.cross_entropy(glog, b["target"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        b = task.sample(n_eval, MV_EVAL_SEED)
        qlog, glog, w = model(b["queries"], b["keys"], b["key_view"], return_weights=True)
        rel = _relative_column_mass(w)
    u = model.hybrid_weight()
    return {
        "variant": variant, "seed": seed, "steps": steps,
        "accuracy": float((glog.argmax(-1) == b["target"]).float().mean()),
        "query_accuracy": float((qlog.argmax(-1) == b["query_target"]).float().mean()),
        "explained_away": float((rel < EPS_RELATIVE).float().mean()),
        "low_mass": float((rel < 0.5).float().mean()),  # keys receiving under half the mean mass
        "mass_p10": float(torch.quantile(rel.flatten(), 0.1)),
        "u": None if u is None else float(u.detach()),
    }


def _spread(xs: list[float]) -> dict:
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
            "min": min(xs), "max": max(xs), "values": xs}


def multiview_experiment(variants=("unas", "dnas", "hnas"), seeds: int = 5, steps: int = 600,
                         progress: bool = False, threads: int | None = 1) -> dict:
    """Every variant x seeds 0..seeds-1; mean, std (over seeds), min and max of each metric.
    ``threads``: torch CPU threads while it runs (1 avoids oversubscription on a shared machine)."""
    runs = []
    prev = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        for v in variants:
            for s in range(seeds):
                runs.append(multiview_run(v, s, steps))
                if progress:
                    r = runs[-1]
                    print(f"multiview {v} seed {s}: accuracy {r['accuracy']:.3f}, query accuracy "
                          f"{r['query_accuracy']:.3f}, explained away {r['explained_away']:.3f}", flush=True)
    finally:
        torch.set_num_threads(prev)
    summary = {}
    for v in variants:
        rs = [r for r in runs if r["variant"] == v]
        metrics = ("accuracy", "query_accuracy", "explained_away", "low_mass", "mass_p10")
        summary[v] = {k: _spread([r[k] for r in rs]) for k in metrics}
        if v == "hnas":
            summary[v]["u"] = _spread([r["u"] for r in rs])
    return {"config": vars(MultiViewConfig()), "seeds": seeds, "steps": steps, "summary": summary,
            "runs": runs}


# ----------------------------------------------------------------------------------------------
# (b) column mass of trained language models
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def column_mass_distribution(run_dir: str | Path, n_windows: int = 64,
                             text: str | None = None) -> torch.Tensor:
    """Relative column mass (L, n_windows * H * N) of a trained encoder on held-out windows of its
    corpus (unmasked text: [CLS] + tokens + [SEP])."""
    model = load(run_dir)
    cfg = load_config(run_dir)
    tok = load_tokenizer(run_dir)
    dc = cfg["data"]
    corpus = text if text is not None else load_corpus(dc["corpus"], dc.get("max_chars"))
    ids = torch.tensor(tok.encode_corpus(corpus), dtype=torch.long)
    data = LMData(ids, seq_len=dc["seq_len"], kind=model.config.kind, vocab_size=tok.vocab_size,
                  seed=cfg["train"]["seed"])
    inputs = data.windows("eval", n_windows)
    out = model(inputs, return_weights=True)
    return torch.stack([_relative_column_mass(w).flatten() for w in out.weights])


def _mass_stats(rel: torch.Tensor, M: int) -> list[dict]:
    q = torch.tensor([0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99])
    out = []
    for layer in rel:
        qs = torch.quantile(layer, q.to(layer.device)).tolist()
        out.append({"p01": qs[0], "p05": qs[1], "p25": qs[2], "p50": qs[3], "p75": qs[4], "p95": qs[5],
                    "p99": qs[6], "min": float(layer.min()),
                    "explained_away": float((layer < EPS_RELATIVE).float().mean()),
                    "below_dnas_bound": float((layer < 1.0 / M - 1e-6).float().mean())})
    return out


# ----------------------------------------------------------------------------------------------
# Everything for docs/RESULTS.md
# ----------------------------------------------------------------------------------------------


def _write(fig, path: Path) -> str:
    """PNG through attnlab's kaleido session (one Chromium kept per process; attnlab.figures.export)."""
    from attnlab.figures.export import export_figure

    export_figure(fig, Path(path), width=900, height=500, scale=1)
    return str(path)


def build_results(checkpoints: str | Path = "checkpoints", figures: str | Path = "docs/figures",
                  seeds: int = 5, mv_steps: int = 600, multiview_json: str | Path | None = None) -> dict:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    ck, fig_dir = Path(checkpoints), Path(figures)
    fig_dir.mkdir(parents=True, exist_ok=True)
    res: dict = {"figures": []}
    names = [n for n in ("enc-unas", "enc-dnas", "enc-hnas", "enc-gam") if (ck / n / "latest.json").is_file()]
    if not names:
        raise FileNotFoundError(f"no trained checkpoints (enc-unas, enc-dnas, enc-hnas, enc-gam) in {ck}")

    # training curves and final losses
    fig = go.Figure()
    res["final"] = {}
    for n in names:
        recs = [r for r in read_metrics(ck / n / "metrics.jsonl") if "eval_loss" in r]
        fig.add_trace(go.Scatter(x=[r["step"] for r in recs], y=[r["eval_loss"] for r in recs], name=n))
        res["final"][n] = {"step": recs[-1]["step"], "eval_loss": recs[-1]["eval_loss"]}
    fig.update_layout(title="Held-out masked-LM loss (KJV)", xaxis_title="step",
                      yaxis_title="loss per target token")
    res["figures"].append(_write(fig, fig_dir / "eval_loss.png"))

    # (a) HNAS hybrid weights
    if "enc-hnas" in names:
        u = load(ck / "enc-hnas").hybrid_weights()  # (L, H)
        recs = [r for r in read_metrics(ck / "enc-hnas" / "metrics.jsonl") if "u" in r]
        L = u.shape[0]
        res["hnas_u"] = {"per_head": u.tolist(), "layer_mean": u.mean(1).tolist(),
                         "all_layers_above_half": bool((u.mean(1) > 0.5).all())}
        fig = make_subplots(rows=1, cols=2,
                            subplot_titles=("layer mean of u during training", "u per head, final"))
        for layer in range(L):
            fig.add_trace(go.Scatter(x=[r["step"] for r in recs],
                                     y=[sum(r["u"][layer]) / len(r["u"][layer]) for r in recs],
                                     name=f"layer {layer + 1}"), row=1, col=1)
            fig.add_trace(go.Scatter(x=[layer + 1] * u.shape[1], y=u[layer].tolist(), mode="markers",
                                     showlegend=False, marker={"size": 9}), row=1, col=2)
        fig.add_trace(go.Scatter(x=list(range(1, L + 1)), y=u.mean(1).tolist(), mode="lines+markers",
                                 name="layer mean", line={"color": "black"}), row=1, col=2)
        for col in (1, 2):
            fig.add_hline(y=0.5, line_dash="dot", row=1, col=col)
        fig.update_xaxes(title_text="step", row=1, col=1)
        fig.update_xaxes(title_text="layer (1 = input side)", row=1, col=2)
        fig.update_yaxes(title_text="u (1 = DNAS, 0 = UNAS)")
        fig.update_layout(title="HNAS hybrid weight u (enc-hnas)")
        res["figures"].append(_write(fig, fig_dir / "hnas_u.png"))

    # (b) column mass
    res["column_mass"] = {}
    fig = go.Figure()
    text = load_corpus(load_config(ck / names[0])["data"]["corpus"])
    colors = {"enc-unas": "#d62728", "enc-dnas": "#1f77b4", "enc-hnas": "#2ca02c"}
    for n in [x for x in ("enc-unas", "enc-dnas", "enc-hnas") if x in names]:
        rel = column_mass_distribution(ck / n, text=text)
        M = load_config(ck / n)["data"]["seq_len"]
        res["column_mass"][n] = _mass_stats(rel, M)
        pick = torch.randperm(rel.shape[1], generator=torch.Generator().manual_seed(0))[:4000]
        ys = rel[:, pick].clamp_min(1e-4)  # (L, 4000)
        xs = [f"layer {layer + 1}" for layer in range(rel.shape[0]) for _ in range(len(pick))]
        fig.add_trace(go.Box(y=ys.flatten().tolist(), x=xs, name=n, boxpoints=False,
                             marker_color=colors[n], line_color=colors[n]))
        res["column_mass"]["dnas_bound"] = 1.0 / M
    fig.add_hline(y=1.0 / M, line_dash="dash")  # plotly misplaces hline annotations on log axes
    fig.add_hline(y=EPS_RELATIVE, line_dash="dot")
    fig.update_layout(boxmode="group", yaxis_type="log", yaxis_title="relative column mass (log)",
                      title="Relative column mass m_j N/M, held-out KJV windows (64 windows x 4 heads)<br>"
                            f"<sup>dashed: DNAS bound m_j >= 1/N (relative 1/M = {1.0 / M:.4f}); "
                            f"dotted: epsilon = {EPS_RELATIVE} (explained away below)</sup>")
    res["figures"].append(_write(fig, fig_dir / "column_mass.png"))

    # (c) multi-view task (or the numbers of an earlier run: --multiview-json)
    if multiview_json:
        mv = json.loads(Path(multiview_json).read_text())
        mv = mv.get("multiview", mv)
        seeds = mv["seeds"]
    else:
        mv = multiview_experiment(seeds=seeds, steps=mv_steps)
    res["multiview"] = mv
    fig = go.Figure()
    labels = {"accuracy": "global target (all keys)", "query_accuracy": "per-query target"}
    for metric in ("accuracy", "query_accuracy"):
        s = mv["summary"]
        fig.add_trace(go.Bar(x=list(s), y=[s[v][metric]["mean"] for v in s],
                             error_y={"type": "data", "array": [s[v][metric]["std"] for v in s]},
                             name=labels[metric]))
    fig.update_layout(barmode="group", yaxis_title="accuracy", yaxis_range=[0.5, 1.0],
                      title=f"Multi-view task: held-out accuracy, {seeds} seeds (bar: mean, whisker: std)")
    res["figures"].append(_write(fig, fig_dir / "multiview.png"))
    (fig_dir / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    return res
