"""The training loop: AdamW + warm-up/cosine, clipping, periodic eval, metrics.jsonl, checkpoints,
exact resume, a clean stop on SIGTERM / SIGINT, and DistributedDataParallel under torchrun (gloo on
CPU, NCCL on CUDA)."""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from attnlab.checkpoint_io import atomic_write_json
from attnlab.data import (
    IGNORE_INDEX,
    DataPosition,
    LMData,
    _generator,
    build_tokenizer,
    corpus_fingerprint,
    load_corpus,
    load_tokenizer,
)
from attnlab.models import TransformerLM
from attnlab.schema import check_threads
from attnlab.train.checkpoint import (
    CheckpointError,
    clean_temporary,
    load_optimizer_state,
    load_trainer_state,
    read_latest,
    save_checkpoint,
)
from attnlab.train.config import RunConfig
from attnlab.train.metrics import METRICS_FILE, MetricsLog, column_mass_summary, evaluate, read_metrics
from attnlab.train.runtime import StopRequest, setup_distributed

__all__ = ["train", "TrainResult", "learning_rate", "prepare_run_dir", "column_mass_summary", "read_metrics",
           "MetricsLog"]

RECIPE_FILE = "recipe.json"


@dataclass
class TrainResult:
    run_dir: Path
    step: int  # last step trained
    final_loss: float | None
    final_eval_loss: float | None
    hybrid_weights: list[list[float]]  # (L, H)
    stopped_by: str | None = None  # "SIGTERM" / "SIGINT" (or "another rank's signal") if stopped early


def learning_rate(step: int, cfg) -> float:
    """Linear warm-up to ``lr`` over ``warmup`` steps, then cosine decay to ``min_lr`` at ``steps``."""
    if cfg.warmup and step <= cfg.warmup:
        return cfg.lr * step / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_matrix = p.dim() >= 2 and "hybrid" not in name
        (decay if is_matrix else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _step_seed(seed: int, step: int, rank: int) -> int:
    return int(torch.randint(0, 2**62, (1,), generator=_generator(seed, 4, step, rank)))


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------


def prepare_run_dir(run_dir: Path, config, resume: bool, is_main: bool = True) -> dict | None:
    """Validate ``run_dir`` against ``resume`` and ``config`` (a RunConfig, or any configuration with
    ``from_file`` and ``differences``: attnlab.train.retrofit_config); returns latest.json (None = start
    at step 0)."""
    recipe = run_dir / RECIPE_FILE
    latest = read_latest(run_dir) if run_dir.is_dir() else None
    if not resume:
        if latest is not None or recipe.exists():
            step = f" (step {latest['step']})" if latest else ""
            raise ValueError(f"{run_dir} already holds a run{step}; pass --resume to continue it, "
                             "or choose another --out")
        return None
    if not recipe.exists():
        raise ValueError(f"--resume: {run_dir} holds no run (no {RECIPE_FILE}); train without --resume first")
    saved = type(config).from_file(recipe)
    diff = config.differences(saved)
    if diff:
        raise ValueError(f"--resume: {run_dir} was trained with a different config: " + "; ".join(diff))
    if is_main:
        clean_temporary(run_dir)
    return latest


def _with_checkpoint_rescale(model_cfg, step_dir: Path):
    """``model_cfg`` with GAMConfig.rescale as recorded in (or implied by) the checkpoint in step_dir."""
    from attnlab.models import load_config, model_config_from_checkpoint

    saved = model_config_from_checkpoint(load_config(step_dir)["model"]).gam_options.get("rescale")
    if saved is None or model_cfg.gam_options.get("rescale") == saved:
        return model_cfg
    return type(model_cfg).from_dict({**model_cfg.to_dict(),
                                      "gam_options": {**model_cfg.gam_options, "rescale": saved}})


def train(config: RunConfig, run_dir: str | os.PathLike, *, resume: bool = False, device: str | None = None,
          progress: bool = True, text: str | None = None, stop_after: int | None = None) -> TrainResult:
    """Train ``config`` into ``run_dir`` (see attnlab.train.checkpoint for the layout).

    ``resume=True`` continues from ``latest.json`` with the same optimizer state, data position and
    per-step random streams, so N straight steps and k steps + resume to N give the same weights.
    ``text`` overrides the corpus named in the config (tests). ``stop_after`` ends this invocation after
    that step (with a checkpoint) without changing the schedule, as if the run were interrupted there.
    SIGTERM or SIGINT (when called from the main thread) does the same at the end of the current step;
    the result's ``stopped_by`` names the signal. Under torchrun every rank calls this; rank 0 writes the
    files, and the ranks agree on the step to stop at (the stop flag is all-reduced with the loss).
    """
    run_dir = Path(run_dir)
    tc, dc = config.train, config.data
    ddp = setup_distributed(device)
    stop = StopRequest()
    try:
        stop.install()
        if tc.batch_size % ddp.world:
            raise ValueError(f"train.batch_size={tc.batch_size} must be divisible by the number of "
                             f"processes ({ddp.world})")
        if tc.threads:
            torch.set_num_threads(check_threads(tc.threads, "train.threads (--threads)"))
        latest = prepare_run_dir(run_dir, config, resume, ddp.main)
        if ddp.world > 1:  # every rank has read the directory before rank 0 writes to it
            dist.barrier()

        corpus = text if text is not None else load_corpus(dc.corpus, dc.max_chars)
        fingerprint = corpus_fingerprint(corpus)
        if latest is not None:
            step_dir = run_dir / latest["dir"]
            state = load_trainer_state(step_dir, latest["step"])
            if state.get("corpus_sha256") != fingerprint:
                raise ValueError(f"--resume: the corpus differs from the one {run_dir} was trained on "
                                 f"(sha256 {fingerprint[:12]} != {str(state.get('corpus_sha256'))[:12]})")
            tokenizer = load_tokenizer(step_dir)
        else:
            state = None
            tokenizer = build_tokenizer(dc.tokenizer, corpus, dc.vocab_size)
        model_cfg = config.model_config(tokenizer.vocab_size)
        if latest is not None:  # GAM's overflow guard as the checkpoint was trained (old ones: on)
            model_cfg = _with_checkpoint_rescale(model_cfg, step_dir)
        ids = torch.tensor(tokenizer.encode_corpus(corpus), dtype=torch.long)
        data = LMData(ids, seq_len=dc.seq_len, kind=model_cfg.kind, vocab_size=tokenizer.vocab_size,
                      mask_prob=dc.mask_prob, seed=tc.seed)
        data.check_batch(tc.batch_size)
        if ddp.main:
            run_dir.mkdir(parents=True, exist_ok=True)
            if latest is None and not (run_dir / RECIPE_FILE).exists():
                atomic_write_json(run_dir / RECIPE_FILE, config.to_dict())

        torch.manual_seed(tc.seed)
        model = TransformerLM(model_cfg).to(ddp.device)
        optimizer = torch.optim.AdamW(_param_groups(model, tc.weight_decay), lr=tc.lr, betas=tc.betas,
                                      eps=tc.eps)
        start, position, tokens_seen = 0, DataPosition(), 0
        if latest is not None:
            from attnlab.models import load as load_model

            model.load_state_dict(load_model(step_dir).state_dict())
            load_optimizer_state(optimizer, step_dir)
            start, position = state["step"], DataPosition.from_dict(state["data_position"])
            tokens_seen = state.get("tokens_seen", 0)
            if start > tc.steps:
                raise ValueError(f"--resume: {run_dir} is at step {start}, beyond train.steps={tc.steps}")
        wrapped = model
        if ddp.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            ids_ = [ddp.device] if ddp.device.type == "cuda" else None
            wrapped = DistributedDataParallel(model, device_ids=ids_)

        as_dict = config.to_dict()
        extra = {"name": config.name, "data": as_dict["data"], "train": as_dict["train"]}
        eval_batches = data.eval_batches(tc.batch_size, tc.eval_batches) if ddp.main else []
        keep_through = start if latest is not None else -1  # a fresh start keeps no old line
        log = MetricsLog(run_dir / METRICS_FILE, keep_through_step=keep_through) if ddp.main else None

        window = [0.0, 0]  # loss sum and steps since the last metrics line (kept across a resume)
        if state is not None:
            window = list(state.get("loss_window", window))

        def trainer_state(step, pos):
            return {"data_position": pos.to_dict(), "tokens_seen": tokens_seen, "corpus_sha256": fingerprint,
                    "world_size": ddp.world, "run": config.name, "step": step, "loss_window": list(window)}

        def checkpoint(step, pos, final=False):
            if ddp.main:
                log.sync()
                save_checkpoint(run_dir, step, model, optimizer, trainer_state(step, pos), extra, tokenizer,
                                keep=tc.keep_checkpoints, with_optimizer=tc.keep_optimizer or not final)
            if ddp.world > 1:
                dist.barrier()

        if latest is None:  # step 0: initial eval line and checkpoint
            if ddp.main:
                ev_loss, cm = evaluate(model, eval_batches, ddp.device)
                log.write({"step": 0, "eval_loss": ev_loss, "lr": 0.0, "u": model.hybrid_weights().tolist(),
                           "column_mass": cm, "tokens": 0})
            checkpoint(0, position)

        bar = None
        if ddp.main and progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=tc.steps, initial=start, desc=config.name, unit="step", dynamic_ncols=True)
        per_rank = tc.batch_size // ddp.world
        lo, hi = ddp.rank * per_rank, (ddp.rank + 1) * per_rank
        t_last, tok_last = time.perf_counter(), 0
        last_loss, last_eval = None, None
        model.train()
        end = tc.steps if stop_after is None else max(start, min(tc.steps, stop_after))
        stopped_by = None
        for step in range(start + 1, end + 1):
            batch, position = data.batch(step, position, tc.batch_size)
            n_global = int((batch["labels"] != IGNORE_INDEX).sum())
            lr = learning_rate(step, tc)
            for group in optimizer.param_groups:
                group["lr"] = lr
            torch.manual_seed(_step_seed(tc.seed, step, ddp.rank))  # dropout stream of this step
            ids = batch["input_ids"][lo:hi].to(ddp.device)
            labels = batch["labels"][lo:hi].to(ddp.device)
            out = wrapped(ids, labels=labels, loss_reduction="sum")
            # DDP averages gradients over ranks: scale so the result is the global per-token mean
            (out.loss * (ddp.world / max(n_global, 1))).backward()
            if tc.clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), tc.clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tokens = batch["input_ids"].numel()
            tokens_seen += tokens
            tok_last += tokens
            loss_sum = out.loss.detach()
            stopping = stop.signum is not None
            if ddp.world > 1:  # one all-reduce: the global loss, and whether any rank was asked to stop
                both = torch.stack([loss_sum.float(), torch.tensor(float(stopping), device=loss_sum.device)])
                dist.all_reduce(both)
                loss_sum, stopping = both[0], bool(both[1] > 0)
            window[0] += float(loss_sum) / max(n_global, 1)
            window[1] += 1
            is_eval = step % tc.eval_every == 0 or step == tc.steps
            if ddp.main and (step % tc.log_every == 0 or is_eval):
                now = time.perf_counter()
                rec = {"step": step, "loss": window[0] / window[1], "lr": lr,
                       "tokens_per_s": tok_last / max(now - t_last, 1e-9), "tokens": tokens_seen,
                       "u": model.hybrid_weights().tolist()}
                last_loss = rec["loss"]
                if is_eval:
                    rec["eval_loss"], rec["column_mass"] = evaluate(model, eval_batches, ddp.device)
                    last_eval = rec["eval_loss"]
                log.write(rec)
                if bar is not None:
                    post = {"loss": f"{rec['loss']:.3f}"}
                    if is_eval:
                        post["eval"] = f"{last_eval:.3f}"
                    bar.set_postfix(post)
                t_last, tok_last, window = time.perf_counter(), 0, [0.0, 0]
            if bar is not None:
                bar.update(1)
            if step % tc.save_every == 0 or step == end or stopping:
                checkpoint(step, position, final=step == tc.steps)
            if stopping and step < end:  # (a signal during the last step changes nothing)
                end, stopped_by = step, stop.name or "another rank's signal"
                break
        if bar is not None:
            bar.close()
        if log is not None:
            log.close()
        if stopped_by and ddp.main:
            cause = f"{stop.name} received" if stop.name else "another rank received a stop signal"
            print(f"attnlab train: {cause}: stopped after step {end} with a checkpoint; "
                  f"continue with --resume (--out {run_dir})", file=sys.stderr, flush=True)
        return TrainResult(run_dir, end, last_loss, last_eval, model.hybrid_weights().tolist(), stopped_by)
    finally:
        stop.restore()
        if ddp.initialized_here and dist.is_initialized():
            dist.destroy_process_group()


__all__ += ["CheckpointError"]
