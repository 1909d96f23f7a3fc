"""Training metrics and evaluation: metrics.jsonl (one JSON object per line, written live and
read back tolerant of a torn last line) and the held-out loss with its column-mass summary."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from attnlab.checkpoint_io import atomic_write_bytes
from attnlab.models import TransformerLM

__all__ = ["METRICS_FILE", "parse_metrics", "read_metrics", "MetricsLog", "column_mass_summary", "evaluate"]

METRICS_FILE = "metrics.jsonl"

# ----------------------------------------------------------------------------------------------
# Metrics log
# ----------------------------------------------------------------------------------------------


def parse_metrics(text: str) -> list[dict]:
    """The complete records of metrics.jsonl text: JSON objects with a "step" (a torn last line from a
    kill, or any other line that is not such an object, is skipped)."""
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "step" in rec:
            out.append(rec)
    return out


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The complete JSON lines of a metrics.jsonl file (see :func:`parse_metrics`); [] if missing."""
    p = Path(path)
    return parse_metrics(p.read_text(encoding="utf-8")) if p.is_file() else []


class MetricsLog:
    """Appends one JSON object per line, flushed at once, so a reader (the app) sees it live."""

    def __init__(self, path: Path, keep_through_step: int | None):
        self.path = Path(path)
        if keep_through_step is not None:  # resume: drop lines past the checkpoint (and torn lines)
            kept = [r for r in read_metrics(self.path) if r["step"] <= keep_through_step]
            atomic_write_bytes(self.path, "".join(json.dumps(r) + "\n" for r in kept).encode("utf-8"))
        self._f = open(self.path, "a", buffering=1, encoding="utf-8")  # line buffered

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def sync(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


# ----------------------------------------------------------------------------------------------
# Eval statistics
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def column_mass_summary(weights: list[torch.Tensor], eps: float = 0.1) -> list[dict]:
    """Per layer, over examples, heads and keys: quantiles of the relative column mass
    m_j * N / M (mean 1; no padding in training batches), its minimum, and the share of keys with
    relative mass below ``eps`` (epsilon-explained-away, relative). ``dnas_bound`` = N/M * 1/N = 1/M,
    the DNAS lower bound in the same units."""
    out = []
    q = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95])
    for w in weights:  # (B, H, M, N)
        M, N = w.shape[-2:]
        rel = (w.float().sum(-2) * (N / M)).flatten()  # (B*H*N,)
        qs = torch.quantile(rel, q.to(rel.device)).tolist()
        out.append({
            "p05": qs[0], "p25": qs[1], "p50": qs[2], "p75": qs[3], "p95": qs[4],
            "min": float(rel.min()), "explained_away": float((rel < eps).float().mean()),
            "dnas_bound": 1.0 / M,
        })
    return out


@torch.no_grad()
def evaluate(model: TransformerLM, batches: list[dict], device) -> tuple[float, list[dict]]:
    """Mean held-out loss per target token, and the column-mass summary of the first batch."""
    was_training = model.training
    model.eval()
    total, count, summary = 0.0, 0, []
    for i, b in enumerate(batches):
        out = model(b["input_ids"].to(device), labels=b["labels"].to(device), loss_reduction="sum",
                    return_weights=(i == 0))
        total += float(out.loss)
        count += out.n_targets
        if i == 0:
            summary = column_mass_summary(out.weights)
    model.train(was_training)
    return total / max(count, 1), summary
