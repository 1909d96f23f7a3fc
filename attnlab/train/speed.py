"""Training throughput of one model with different attention variants, measured in one run.

    attnlab train speed [--recipe enc-unas] [--steps 10] [--rounds 3] [--variants unas dnas hnas]

Random token batches of the recipe's shape (no corpus, no disk); each round times ``steps`` full
training steps (forward, backward, clipping, AdamW) per variant, variants interleaved so that load
from other processes hits all of them alike; the median over rounds is reported with the ratio to
the first variant (the baseline, unas). Runs on CUDA when available (or ``--device``).
"""

from __future__ import annotations

import platform
import statistics
import time

import torch

from attnlab.data import IGNORE_INDEX
from attnlab.models import TransformerLM
from attnlab.train.config import RunConfig

__all__ = ["training_speed", "format_table"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def training_speed(config: RunConfig, variants=("unas", "dnas", "hnas"), steps: int = 10, rounds: int = 3,
                   warmup: int = 2, device: str | None = None, vocab_size: int | None = None) -> dict:
    """tokens/s of training steps for each variant: {"results": {variant: {...}}, "setup": {...}}."""
    if steps < 1 or rounds < 1:
        raise ValueError(f"steps and rounds must be >= 1, got steps={steps}, rounds={rounds}")
    from attnlab.train.runtime import check_device

    dev = torch.device(check_device(device) or ("cuda" if torch.cuda.is_available() else "cpu"))
    tc, dc = config.train, config.data
    vocab = vocab_size or (261 if dc.tokenizer == "byte" else dc.vocab_size)
    base = config.model_config(vocab)
    models, opts = {}, {}
    for v in variants:
        torch.manual_seed(tc.seed)
        cfg = config.model_config(vocab)
        cfg.variant = v
        models[v] = TransformerLM(type(cfg).from_dict(cfg.to_dict())).to(dev).train()
        opts[v] = torch.optim.AdamW(models[v].parameters(), lr=tc.lr)
    g = torch.Generator().manual_seed(0)
    B, T = tc.batch_size, dc.seq_len
    ids = torch.randint(5, vocab, (B, T), generator=g)
    labels = torch.where(torch.rand(B, T, generator=g) < (dc.mask_prob if base.kind == "encoder" else 1.0),
                         ids, torch.full_like(ids, IGNORE_INDEX))
    ids, labels = ids.to(dev), labels.to(dev)

    def run(v, n):
        m, opt = models[v], opts[v]
        for _ in range(n):
            out = m(ids, labels=labels)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

    for v in variants:
        run(v, warmup)
    times = {v: [] for v in variants}
    for _ in range(rounds):
        for v in variants:
            _sync(dev)
            t0 = time.perf_counter()
            run(v, steps)
            _sync(dev)
            times[v].append(time.perf_counter() - t0)
    tokens = B * T * steps
    results = {}
    for v in variants:
        med = statistics.median(times[v])
        results[v] = {"tokens_per_s": tokens / med, "step_ms": 1000 * med / steps,
                      "rounds_tokens_per_s": [tokens / t for t in times[v]]}
    ref = results[variants[0]]["tokens_per_s"]
    for v in variants:
        results[v]["ratio"] = results[v]["tokens_per_s"] / ref
    setup = {"device": str(dev), "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda"
             else platform.processor() or platform.machine(), "torch": torch.__version__,
             "threads": torch.get_num_threads(), "batch_size": B, "seq_len": T, "vocab_size": vocab,
             "d_model": base.d_model, "n_layers": base.n_layers, "n_heads": base.n_heads, "kind": base.kind,
             "steps": steps, "rounds": rounds, "baseline": variants[0]}
    return {"setup": setup, "results": results}


def format_table(res: dict) -> str:
    s = res["setup"]
    lines = [f"training speed on {s['device']} ({s['device_name']}, {s['threads']} threads), {s['kind']} "
             f"L={s['n_layers']} d={s['d_model']} H={s['n_heads']}, batch {s['batch_size']} x {s['seq_len']}",
             "| variant | tokens/s | ms/step | ratio to " + s["baseline"] + " |", "|---|---|---|---|"]
    for v, r in res["results"].items():
        lines.append(f"| {v} | {r['tokens_per_s']:.0f} | {r['step_ms']:.1f} | {r['ratio']:.2f} |")
    return "\n".join(lines)
