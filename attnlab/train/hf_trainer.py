"""The training loop of the recipes on a Hugging Face model (``retrofit-hnas``, ``mlm-head``, ``s2s-hnas``,
``causal-lm``).

It is ``attnlab train``'s loop for an *objective* that owns the few trainable tensors (theta of the
HNAS retrofit, or a masked-LM head) while the pretrained model stays frozen: AdamW with warm-up and
cosine decay (:func:`attnlab.train.trainer.learning_rate`), clipping, a held-out loss, metrics.jsonl in
``attnlab train``'s format (``step``, ``loss``, ``lr``, ``tokens_per_s``, ``tokens``, ``u`` (L, H) for
the retrofit, ``eval_loss`` at eval steps), crash-safe step directories (:func:`write_step`), exact
resume and a clean stop on SIGTERM / SIGINT. A run directory holds::

    recipe.json        the run configuration (attnlab.train.retrofit_config.HFRunConfig)
    metrics.jsonl      one JSON object per logged step
    latest.json        {"step": N, "dir": "step-0000000N"}
    step-0000000N/     hf_run.json (format, kind, the base model's directory, step, shape),
                       weights.safetensors (only the trained tensors), optimizer.safetensors,
                       trainer_state.json
    model/             mlm-head, s2s-hnas and causal-lm, at the end: the model with its head, for
                       hf.load_language_model
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from attnlab.checkpoint_io import atomic_write_bytes, atomic_write_json
from attnlab.data import DataPosition, corpus_fingerprint, load_corpus
from attnlab.schema import check_threads, read_json
from attnlab.train.checkpoint import (
    CheckpointError,
    load_optimizer_state,
    load_trainer_state,
    write_step,
)
from attnlab.train.metrics import METRICS_FILE, MetricsLog
from attnlab.train.retrofit_config import HFRunConfig
from attnlab.train.runtime import StopRequest, check_device
from attnlab.train.trainer import RECIPE_FILE, learning_rate, prepare_run_dir

__all__ = ["Objective", "HFTrainResult", "RUN_FILE", "WEIGHTS_FILE", "RUN_FORMAT", "train_objective",
           "read_step"]

RUN_FILE = "hf_run.json"
WEIGHTS_FILE = "weights.safetensors"
RUN_FORMAT = "attnlab-hf-run/1"


class Objective(Protocol):
    """What the loop trains: a few tensors of a frozen pretrained model."""

    info: object  # the model's attnlab.hf ModelInfo (n_layers, n_heads, causal, path)

    def param_groups(self, config: HFRunConfig) -> list[dict]: ...  # AdamW groups, each with "lr_scale"
    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]: ...
    def tensors(self) -> dict[str, torch.Tensor]: ...  # what a checkpoint saves
    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None: ...
    def hybrid_weights(self) -> list | None: ...  # (L, H) u for metrics.jsonl, or None
    def export(self, run_dir: Path) -> None: ...  # the final product (mlm-head, causal-lm: model/)
    # optional: make_data(tokenizer, corpus, config) -> batches with HFWindows' interface (s2s-hnas)


@dataclass
class HFTrainResult:
    run_dir: Path
    step: int  # last step trained
    final_loss: float | None
    final_eval_loss: float | None
    hybrid_weights: list | None  # (L, H) u of the retrofit, None for mlm-head
    stopped_by: str | None = None  # "SIGTERM" / "SIGINT" if stopped early


def read_step(step_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(hf_run.json, tensors of weights.safetensors) of a step directory; CheckpointError otherwise."""
    try:
        meta = read_json(step_dir / RUN_FILE)
        if not isinstance(meta, dict) or meta.get("format") != RUN_FORMAT:
            raise ValueError(f"{step_dir / RUN_FILE} is not a {RUN_FORMAT} file")
        return meta, st_load((step_dir / WEIGHTS_FILE).read_bytes())
    except Exception as e:  # noqa: BLE001 -- OSError, SchemaError, SafetensorError: one worded error
        raise CheckpointError(f"cannot read the checkpoint in {step_dir}: {e}") from None


@torch.no_grad()
def _evaluate(objective: Objective, batches: list[dict], device) -> float:
    total, count = 0.0, 0
    for b in batches:
        loss, n = objective.loss(b["input_ids"].to(device), b["labels"].to(device))
        total, count = total + float(loss), count + n
    return total / max(count, 1)


def train_objective(config: HFRunConfig, objective: Objective, tokenizer, run_dir, *, resume: bool = False,
                    device: str | None = None, progress: bool = True, text: str | None = None,
                    stop_after: int | None = None) -> HFTrainResult:
    """Train ``objective`` on ``config``'s corpus into ``run_dir`` (see the module docstring).

    ``resume=True`` continues from latest.json with the same optimizer state, data position and loss
    window: N straight steps and k steps + resume give the same tensors. ``text`` replaces the corpus
    (tests); ``stop_after`` ends this invocation after that step with a checkpoint.
    """
    from attnlab.train.hf_data import HFWindows  # (imports transformers)

    run_dir, tc, dc = Path(run_dir), config.train, config.data
    dev = torch.device("cpu" if check_device(device) in (None, "auto", "cpu") else device)
    stop = StopRequest()
    try:
        stop.install()
        if tc.threads:
            torch.set_num_threads(check_threads(tc.threads, "train.threads (--threads)"))
        latest = prepare_run_dir(run_dir, config, resume)
        corpus = text if text is not None else load_corpus(dc.corpus, dc.max_chars)
        if not corpus.strip():
            raise ValueError(f"data.corpus {dc.corpus!r} is empty; expected text to train on")
        fingerprint = corpus_fingerprint(corpus)
        info = objective.info
        make_data = getattr(objective, "make_data", None)  # s2s-hnas: (source, lead summary) pairs
        data = make_data(tokenizer, corpus, config) if make_data is not None else HFWindows(
            tokenizer, corpus, seq_len=dc.seq_len, causal=info.causal, vocab_size=len(tokenizer),
            mask_rate=dc.mask_rate, seed=tc.seed)
        data.check_batch(tc.batch_size, dc.corpus)
        groups = objective.param_groups(config)
        optimizer = torch.optim.AdamW(groups, lr=tc.lr, betas=tc.betas, eps=tc.eps)
        start, position, tokens_seen, window = 0, DataPosition(), 0, [0.0, 0]
        if latest is not None:
            step_dir = run_dir / latest["dir"]
            state = load_trainer_state(step_dir, latest["step"])
            if state.get("corpus_sha256") != fingerprint:
                raise ValueError(f"--resume: the corpus differs from the one {run_dir} was trained on "
                                 f"(sha256 {fingerprint[:12]} != {str(state.get('corpus_sha256'))[:12]})")
            objective.load_tensors(read_step(step_dir)[1])
            load_optimizer_state(optimizer, step_dir)
            start, position = state["step"], DataPosition.from_dict(state["data_position"])
            tokens_seen, window = state.get("tokens_seen", 0), list(state.get("loss_window", window))
            if start > tc.steps:
                raise ValueError(f"--resume: {run_dir} is at step {start}, beyond train.steps={tc.steps}")
        else:
            run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_json(run_dir / RECIPE_FILE, config.to_dict())
        eval_batches = data.eval_batches(tc.batch_size, tc.eval_batches)
        log = MetricsLog(run_dir / METRICS_FILE, keep_through_step=start if latest is not None else -1)
        meta = {"format": RUN_FORMAT, "kind": config.kind, "base_model": info.path,
                "base_embedded": bool(getattr(info, "embedded", False)),
                "n_layers": info.n_layers, "n_heads": info.n_heads, "causal": info.causal}

        def checkpoint(step: int, final: bool = False) -> None:
            log.sync()

            def write(tmp: Path) -> None:
                tensors = {k: v.detach().cpu().contiguous() for k, v in objective.tensors().items()}
                atomic_write_bytes(tmp / WEIGHTS_FILE, st_save(tensors, metadata={"step": str(step)}))
                atomic_write_json(tmp / RUN_FILE, {**meta, "step": step})

            state = {"data_position": position.to_dict(), "tokens_seen": tokens_seen, "loss_window": window,
                     "corpus_sha256": fingerprint, "world_size": 1, "run": config.name}
            with_optimizer = tc.keep_optimizer or not final
            kept = optimizer if with_optimizer else None
            write_step(run_dir, step, write, kept, state, tc.keep_checkpoints)

        if latest is None:  # step 0: the initial held-out loss and a checkpoint
            log.write({"step": 0, "eval_loss": _evaluate(objective, eval_batches, dev), "lr": 0.0,
                       "u": objective.hybrid_weights(), "tokens": 0})
            checkpoint(0)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=tc.steps, initial=start, desc=config.name, unit="step", dynamic_ncols=True)
        t_last, tok_last, last_loss, last_eval, stopped_by = time.perf_counter(), 0, None, None, None
        end = tc.steps if stop_after is None else max(start, min(tc.steps, stop_after))
        for step in range(start + 1, end + 1):
            batch, position = data.batch(step, position, tc.batch_size)
            lr = learning_rate(step, tc)
            for group in optimizer.param_groups:
                group["lr"] = lr * group["lr_scale"]
            loss, n = objective.loss(batch["input_ids"].to(dev), batch["labels"].to(dev))
            (loss / max(n, 1)).backward()
            if tc.clip > 0:
                torch.nn.utils.clip_grad_norm_([p for g in groups for p in g["params"]], tc.clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tokens = batch["input_ids"].numel()
            tokens_seen, tok_last = tokens_seen + tokens, tok_last + tokens
            window = [window[0] + float(loss.detach()) / max(n, 1), window[1] + 1]
            stopping = stop.signum is not None
            is_eval = step % tc.eval_every == 0 or step == tc.steps
            if step % tc.log_every == 0 or is_eval:
                now = time.perf_counter()
                rec = {"step": step, "loss": window[0] / window[1], "lr": lr,
                       "tokens_per_s": tok_last / max(now - t_last, 1e-9), "tokens": tokens_seen,
                       "u": objective.hybrid_weights()}
                last_loss = rec["loss"]
                if is_eval:
                    rec["eval_loss"] = last_eval = _evaluate(objective, eval_batches, dev)
                log.write(rec)
                if bar is not None:
                    post = {"loss": f"{rec['loss']:.3f}"}
                    bar.set_postfix(post | ({"eval": f"{last_eval:.3f}"} if is_eval else {}))
                t_last, tok_last, window = time.perf_counter(), 0, [0.0, 0]
            if bar is not None:
                bar.update(1)
            if step % tc.save_every == 0 or step == end or stopping:
                checkpoint(step, final=step == tc.steps)
            if stopping and step < end:
                end, stopped_by = step, stop.name
                break
        if bar is not None:
            bar.close()
        log.close()
        if end == tc.steps:
            objective.export(run_dir)
        if stopped_by:
            print(f"attnlab train: {stopped_by} received: stopped after step {end} with a checkpoint; "
                  f"continue with --resume (--out {run_dir})", file=sys.stderr, flush=True)
        return HFTrainResult(run_dir, end, last_loss, last_eval, objective.hybrid_weights(), stopped_by)
    finally:
        stop.restore()
