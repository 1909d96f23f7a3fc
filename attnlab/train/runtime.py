"""How a training process runs: stopping cleanly on SIGTERM / SIGINT, and the distributed set-up
under torchrun (gloo on CPU, NCCL on CUDA)."""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["STOP_SIGNALS", "StopRequest", "Dist", "setup_distributed", "check_device"]

# ----------------------------------------------------------------------------------------------
# Stopping on a signal
# ----------------------------------------------------------------------------------------------

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """SIGTERM / SIGINT while training: remember it, so the loop finishes the step it is in, writes a
    resumable checkpoint and returns (the app's Stop button sends SIGTERM; torchrun forwards SIGTERM
    and SIGINT to every worker).

    :meth:`install` sets the handlers in the main thread only (the only thread Python delivers signals
    to; ``train()`` run in another thread keeps the caller's handlers); :meth:`restore` puts the
    previous ones back. A second SIGINT aborts at once (KeyboardInterrupt), as pressing Ctrl-C
    twice should; a repeated SIGTERM only repeats the request.
    """

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:  # no I/O here: the loop reports the stop
        if signum == signal.SIGINT and self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum

    @property
    def name(self) -> str | None:
        return None if self.signum is None else signal.Signals(self.signum).name


# ----------------------------------------------------------------------------------------------
# Distributed set-up
# ----------------------------------------------------------------------------------------------


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    initialized_here: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0


def check_device(device) -> str | None:
    """``device`` when it is None, 'auto', 'cpu', 'cuda' or 'cuda:<index>'; else a ValueError naming
    ``--device`` (``torch.device('tpu')`` would raise an unworded RuntimeError)."""
    ok = device in (None, "auto", "cpu", "cuda") or (
        isinstance(device, str) and device.startswith("cuda:") and device[5:].isdigit())
    if not ok:
        raise ValueError(f"--device must be 'cpu', 'cuda', 'cuda:<index>' or 'auto', got {device!r}")
    return device


def setup_distributed(device: str | None) -> Dist:
    check_device(device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    want_cuda = torch.cuda.is_available() if device in (None, "auto") else device.startswith("cuda")
    if want_cuda and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    if world <= 1:
        dev = torch.device(device if device not in (None, "auto") else ("cuda" if want_cuda else "cpu"))
        return Dist(device=dev)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = "nccl" if want_cuda else "gloo"
    dev = torch.device(f"cuda:{local_rank}") if want_cuda else torch.device("cpu")
    if want_cuda:
        torch.cuda.set_device(dev)
    here = False
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
        here = True
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, dev, here)
