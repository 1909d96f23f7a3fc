"""``attnlab train --recipe retrofit-hnas --model DIR``: learn HNAS's u per layer and head on a frozen
pretrained model (docs/RETROFIT.md), and the entry point of both pretrained-model recipes.

    attnlab train --recipe retrofit-hnas --model models/gpt2 --out runs/retrofit-gpt2 [--steps N --lr X]
    attnlab train --recipe retrofit-hnas --model runs/minilm-mlm/model --out runs/retrofit-minilm
    attnlab train --recipe mlm-head --out runs/minilm-mlm          # MiniLM's masked-LM head first

Python::

    from attnlab.train.retrofit import load_retrofit, retrofit_hybrid_weights
    retrofit_hybrid_weights("runs/retrofit-gpt2")       # (L, H) u of the latest checkpoint
    model = load_retrofit("runs/retrofit-gpt2")         # HNASRetrofit: the base model with that theta
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from attnlab.stats.intervals import t_half_width
from attnlab.train.checkpoint import CheckpointError, read_latest
from attnlab.train.hf_trainer import HFTrainResult, read_step, train_objective
from attnlab.train.retrofit_config import HFRunConfig

__all__ = ["RetrofitObjective", "train_hf", "load_retrofit", "retrofit_hybrid_weights", "is_retrofit_run",
           "u_by_layer", "held_out_losses"]


class RetrofitObjective:
    """theta (and, with ``base.train_rest``, the model's own weights) of an HNASRetrofit."""

    def __init__(self, loaded, config: HFRunConfig, device: torch.device):
        from attnlab.hf.beyond.retrofit import HNASRetrofit

        self.module = HNASRetrofit(loaded, u0=config.base.u0, train_rest=config.base.train_rest).to(device)
        self.info = loaded.info

    def param_groups(self, config: HFRunConfig) -> list[dict]:
        groups = [{"params": [self.module.theta], "weight_decay": 0.0, "lr_scale": 1.0}]
        rest = list(self.module.rest_parameters().values())
        if rest:
            scale = config.base.rest_lr / config.train.lr
            groups.append({"params": rest, "weight_decay": config.train.weight_decay, "lr_scale": scale})
        return groups

    def loss(self, input_ids, labels):
        return self.module(input_ids, labels)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"theta": self.module.theta}  # (L, H)
        out |= {f"rest.{n}": p for n, p in self.module.rest_parameters().items()}
        return out

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        want = set(self.tensors())
        if set(tensors) != want or tensors["theta"].shape != self.module.theta.shape:
            raise CheckpointError(
                "the checkpoint's tensors do not fit this retrofit (expected theta of shape "
                f"{tuple(self.module.theta.shape)} and {len(want) - 1} rest tensors, got {len(tensors)} "
                "tensors)")
        with torch.no_grad():
            self.module.theta.copy_(tensors["theta"])
            for name, p in self.module.rest_parameters().items():
                p.copy_(tensors[f"rest.{name}"])

    def hybrid_weights(self) -> list:
        return self.module.hybrid_weights().tolist()

    def export(self, run_dir: Path) -> None:  # the checkpoint (theta + the base reference) is the product
        pass


def train_hf(config: HFRunConfig, run_dir, *, resume: bool = False, device: str | None = None,
             progress: bool = True, text: str | None = None, stop_after: int | None = None) -> HFTrainResult:
    """Train a ``retrofit-hnas``, ``mlm-head``, ``s2s-hnas`` or ``causal-lm`` configuration into
    ``run_dir``; ``base.model`` is the model directory (None: the embedded MiniLM; s2s-hnas and causal-lm
    build theirs from ``arch``). ValueError naming ``--model`` when the model has no LM
    head (retrofit) or is not a masked LM (mlm-head)."""
    from attnlab.hf.load.loading import load_language_model, load_model
    from attnlab.hf.load.model_info import resolve_device

    dev = resolve_device(device or "auto", "--device")
    if config.kind in ("s2s-hnas", "causal-lm"):  # a model of their own (arch): seq2seq_hnas, causal_lm
        from attnlab.data import load_corpus
        from attnlab.train.causal_lm import causal_lm_objective
        from attnlab.train.seq2seq_hnas import seq2seq_objective

        if text is None:
            text = load_corpus(config.data.corpus, config.data.max_chars)
        make = seq2seq_objective if config.kind == "s2s-hnas" else causal_lm_objective
        objective = make(config, run_dir, resume, dev, text)
        return train_objective(config, objective, objective.tokenizer, run_dir, resume=resume,
                               device=str(dev), progress=progress, text=text, stop_after=stop_after)
    model_dir = config.base.model
    if model_dir is not None and not Path(model_dir).is_dir():
        raise ValueError(f"--model (base.model) must be a model directory, got {config.base.model!r}, "
                         "which does not exist")
    if config.kind == "mlm-head":
        from attnlab.train.mlm_head import MLMHeadObjective

        base = load_model(model_dir, device=dev)
        objective = MLMHeadObjective(base, dev)
    else:
        try:
            loaded = load_language_model(model_dir, device=dev)
        except ValueError as e:
            raise ValueError(f"--model {config.base.model or '(embedded MiniLM)'}: {e}; an encoder without "
                             "its masked-LM head can get one: attnlab train --recipe mlm-head --model DIR "
                             "--out RUN, then --model RUN/model") from None
        objective = RetrofitObjective(loaded, config, dev)
        base = loaded
    return train_objective(config, objective, base.tokenizer, run_dir, resume=resume, device=str(dev),
                           progress=progress, text=text, stop_after=stop_after)


def is_retrofit_run(run_dir: str | os.PathLike) -> bool:
    """True for a run directory of ``attnlab train --recipe retrofit-hnas`` (its recipe.json's kind), or of
    ``s2s-hnas`` (u of the encoder, also theta in its checkpoints: :func:`retrofit_hybrid_weights`)."""
    from attnlab.train.config import recipe_file_kind

    return recipe_file_kind(Path(run_dir) / "recipe.json") in ("retrofit-hnas", "s2s-hnas")


def retrofit_hybrid_weights(run_dir: str | os.PathLike) -> tuple[torch.Tensor, int]:
    """((L, H) u = sigmoid(theta), step) of a retrofit run's latest checkpoint (no model is loaded); an
    s2s-hnas run's is (encoder layers, heads)."""
    latest = read_latest(Path(run_dir))
    if latest is None:
        raise CheckpointError(f"{run_dir} has no checkpoint yet (no latest.json)")
    meta, tensors = read_step(Path(run_dir) / latest["dir"])
    if meta.get("kind") not in ("retrofit-hnas", "s2s-hnas") or "theta" not in tensors:
        raise CheckpointError(f"{run_dir} is not a retrofit-hnas or s2s-hnas run (kind {meta.get('kind')!r})")
    return torch.sigmoid(tensors["theta"].double()), int(meta.get("step", latest["step"]))


def _load_run(run_dir, device="cpu"):
    """(RetrofitObjective with the latest checkpoint's tensors, its LoadedModel, the run's config)."""
    from attnlab.hf.load.loading import load_language_model

    latest = read_latest(Path(run_dir))
    if latest is None:
        raise CheckpointError(f"{run_dir} has no checkpoint yet (no latest.json)")
    meta, tensors = read_step(Path(run_dir) / latest["dir"])
    config = HFRunConfig.from_file(Path(run_dir) / "recipe.json")
    loaded = load_language_model(None if meta.get("base_embedded") else meta.get("base_model"), device=device)
    objective = RetrofitObjective(loaded, config, torch.device(device))
    objective.load_tensors(tensors)
    return objective, loaded, config


def load_retrofit(run_dir: str | os.PathLike, device="cpu"):
    """The HNASRetrofit of a run's latest checkpoint: its base model (loaded with its LM head from the
    directory the checkpoint names) with the trained theta (and the trained rest, if any)."""
    return _load_run(run_dir, device)[0].module


@torch.no_grad()
def held_out_losses(run_dir: str | os.PathLike, text: str | None = None) -> dict[str, float]:
    """The run's held-out loss (nats per scored token; its eval batches: the same windows and masks as
    ``eval_loss`` in metrics.jsonl) with u = 0 (the model's own attention), 0.5 (the start), 1 (DNAS)
    in every head, and with the trained u. ``text`` replaces the run's corpus (tests)."""
    from attnlab.data import load_corpus
    from attnlab.train.hf_data import HFWindows

    objective, loaded, config = _load_run(run_dir)
    dc, tc, module = config.data, config.train, objective.module
    corpus = text if text is not None else load_corpus(dc.corpus, dc.max_chars)
    data = HFWindows(loaded.tokenizer, corpus, seq_len=dc.seq_len, causal=loaded.info.causal,
                     vocab_size=len(loaded.tokenizer), mask_rate=dc.mask_rate, seed=tc.seed)
    batches = data.eval_batches(tc.batch_size, tc.eval_batches)
    trained = hybrid_weight_of(module)
    out = {}
    settings = (("u=0 (model)", 0.0), ("u=0.5 (start)", 0.5), ("u=1 (DNAS)", 1.0), ("trained u", trained))
    for name, u in settings:
        u = torch.full_like(trained, u) if isinstance(u, float) else u
        total, count = 0.0, 0
        for b in batches:
            loss, n = module(b["input_ids"], b["labels"], u=u)
            total, count = total + float(loss), count + n
        out[name] = total / max(count, 1)
    return out


def hybrid_weight_of(module) -> torch.Tensor:
    """(L, H) u = sigmoid(theta) of an HNASRetrofit, detached, on its device."""
    return torch.sigmoid(module.theta.detach())


def u_by_layer(run_dirs) -> list[dict]:
    """Per layer, over runs (seeds) of the same model: u averaged over heads in each run (the paper's
    Fig. 4 quantity), their mean and a 95 % t-interval over runs (None with one run).

    -> [{"layer", "mean", "ci_low", "ci_high", "runs": [u of each run], "step": [step of each run]}]
    """
    per_run = [retrofit_hybrid_weights(d) for d in run_dirs]  # [((L, H), step)]
    if not per_run:
        raise ValueError("run_dirs must name at least one retrofit run, got none")
    shapes = {tuple(u.shape) for u, _ in per_run}
    if len(shapes) != 1:
        raise ValueError(f"run_dirs must be runs of one model (one (L, H) shape), got shapes "
                         f"{sorted(shapes)}")
    layer_u = torch.stack([u.mean(-1) for u, _ in per_run])  # (R, L)
    R = layer_u.shape[0]
    mean = layer_u.mean(0)
    half = t_half_width(layer_u.numpy(), axis=0) if R > 1 else None  # (L,): the 95 % t-interval
    return [{"layer": la, "mean": float(mean[la]),
             "ci_low": None if half is None else float(mean[la] - half[la]),
             "ci_high": None if half is None else float(mean[la] + half[la]),
             "runs": layer_u[:, la].tolist(), "step": [s for _, s in per_run]}
            for la in range(layer_u.shape[1])]


def main(argv: list[str] | None = None) -> int:
    """``python -m attnlab.train.retrofit [--losses] RUN [RUN ...]``: u per layer over the runs, and
    with ``--losses`` each run's :func:`held_out_losses` (JSON lines)."""
    import json
    import sys

    args = sys.argv[1:] if argv is None else list(argv)
    losses = "--losses" in args
    args = [a for a in args if a != "--losses"]
    try:
        for row in u_by_layer(args):
            print(json.dumps(row))
        for run in args if losses else ():
            print(json.dumps({"run": str(run), "held_out_loss": held_out_losses(run)}))
    except (ValueError, OSError, CheckpointError) as e:
        print(f"attnlab.train.retrofit: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
