"""DistributedDataParallel: 2 processes (gloo, CPU, loopback) under torchrun, interrupted and resumed,
match single-process training on the same global batch."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnlab.data import default_corpus
from attnlab.models import load
from attnlab.train import RunConfig, read_metrics, train

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(args: list[str], cwd: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), "-m", "attnlab.train", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


@pytest.mark.slow  # torchrun: two processes
def test_two_process_gloo_matches_single_process_with_resume(tmp_path):
    corpus = tmp_path / "kjv.txt"
    corpus.write_text(default_corpus()[:20_000], encoding="utf-8")
    config = RunConfig.from_dict({
        "name": "ddp",
        "model": {"kind": "encoder", "d_model": 16, "n_layers": 2, "n_heads": 2, "d_ff": 32,
                  "variant": ["hnas", "dnas"]},
        "data": {"corpus": str(corpus), "tokenizer": "byte", "seq_len": 16},
        "train": {"steps": 8, "batch_size": 8, "warmup": 2, "eval_every": 4, "eval_batches": 1,
                  "log_every": 1, "save_every": 2, "seed": 0, "threads": 1},
    })
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text(json.dumps(config.to_dict()))
    ddp = tmp_path / "ddp"
    _torchrun(["--config", str(cfg_file), "--out", str(ddp), "--no-progress", "--stop-after", "5"], tmp_path)
    assert json.loads((ddp / "latest.json").read_text())["step"] == 5
    _torchrun(["--config", str(cfg_file), "--out", str(ddp), "--no-progress", "--resume"], tmp_path)

    single = tmp_path / "single"
    train(config, single, progress=False)
    a, b = load(ddp).state_dict(), load(single).state_dict()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=2e-5, rtol=1e-4), k
    ra, rb = read_metrics(ddp / "metrics.jsonl"), read_metrics(single / "metrics.jsonl")
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == list(range(9))
    for x, y in zip(ra[1:], rb[1:], strict=True):
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-5)
        assert sum(x["u"], []) == pytest.approx(sum(y["u"], []), abs=1e-5)
    assert json.loads((ddp / "step-00000008" / "trainer_state.json").read_text())["world_size"] == 2
