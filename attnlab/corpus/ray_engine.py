"""``--engine ray``: the same shards, computed by ``ray.data`` ``map_batches`` on an actor pool.

Each actor (:class:`ShardAnalyzer`, a callable class) loads the model once, then analyses one shard
per batch with :func:`attnlab.corpus.rows.analyse_shard` -- the function the local engine calls --
and writes it to ``out/rows/`` (and its token index to ``out/index/``) with the same atomic rename,
so the rows, and hence the summary, are those of ``--engine local``. The driver ships the text of
the pending shards as dataset items and reads back one small record per shard (progress). A killed
actor is restarted by Ray and its shard retried (``max_restarts`` / ``max_task_retries``); a shard
written twice has the same content.

Without ``ray_address`` a local Ray is started (``ray.init(num_cpus=workers)``); with it the driver
joins that cluster, whose workers must see ``out`` (a shared file system) and have attnlab installed.
An unreachable address fails within seconds: a TCP probe before ``ray.init``, then short GCS
connection timeouts (a port that accepts connections but is no Ray head).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from dataclasses import dataclass

__all__ = ["connect", "run_ray", "ShardAnalyzer", "probe"]

PROBE_TIMEOUT_S = 3.0  # TCP connection to the head
CONNECT_TIMEOUT_S = 3.0  # Ray's GCS client retries (something listens but is not a Ray head)
RAY_CLIENT_PORT = 10001
GCS_PORT = 6379


@dataclass
class Cluster:
    address: str | None  # None: a local Ray this process started
    gpus: float  # GPUs in the cluster
    started_s: float  # seconds ray.init took


def probe(address: str, timeout: float = PROBE_TIMEOUT_S) -> None:
    """ValueError naming ``ray_address`` unless a TCP connection to it opens within ``timeout``."""
    if not isinstance(address, str) or not address.strip():
        raise ValueError(f"ray_address must be 'host:port' or 'ray://host:port', got {address!r}")
    if address == "auto":
        return
    rest = address.split("://", 1)[1] if "://" in address else address
    host, _, port = rest.rpartition(":")
    if not host:
        host, port = rest, str(RAY_CLIENT_PORT if address.startswith("ray://") else GCS_PORT)
    if not port.isdigit():
        raise ValueError(f"ray_address must be 'host:port' or 'ray://host:port', got {address!r}")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as e:
        raise ValueError(f"ray_address {address!r} is unreachable ({e.strerror or e.__class__.__name__} "
                         f"within {timeout:g} s); is a Ray head running there?") from None


@contextlib.contextmanager
def _stderr_silenced():
    """fd 2 to /dev/null (Ray's C++ client logs every retry there) while joining a cluster."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def connect(address: str | None, workers: int) -> Cluster:
    """Join ``address`` or start a local Ray with ``workers`` CPUs (reusing one already running)."""
    import ray

    if address is not None:
        probe(address)
    t0 = time.perf_counter()
    env = {"OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    if not ray.is_initialized():
        kwargs = dict(include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                      runtime_env={"env_vars": env})
        if address is None:
            ray.init(num_cpus=workers, **kwargs)
        else:  # give up after seconds, not Ray's default minute of retries, when no GCS answers
            os.environ.setdefault("RAY_gcs_rpc_server_reconnect_timeout_s", str(int(CONNECT_TIMEOUT_S)))
            os.environ.setdefault("RAY_gcs_rpc_server_connect_timeout_s", str(int(CONNECT_TIMEOUT_S)))
            try:
                with _stderr_silenced():
                    ray.init(address=address, **kwargs)
            except ConnectionError as e:
                raise ValueError(f"ray_address {address!r}: {e}; is a Ray head running there?") from None
    import logging

    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    # With reservation on, Ray Data held back half the CPUs of a small local Ray: 1 of 2 actors ran.
    ctx.op_resource_reservation_enabled = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    gpus = float(ray.cluster_resources().get("GPU", 0.0))
    return Cluster(address, gpus, time.perf_counter() - t0)


class ShardAnalyzer:
    """Ray Data callable class: the model is loaded once per actor; one batch = one shard."""

    def __init__(self, out: str, model: str | None, settings: dict, threads: int, device: str):
        import numpy as np
        import torch

        from attnlab.corpus.job import COUNTS
        from attnlab.corpus.token_classes import frequency_bins
        from attnlab.hf import load_model

        torch.set_num_threads(threads)
        self.out, self.settings = out, settings
        # the counting pass's frequencies, read from the run directory (which every worker sees):
        # small constructor arguments only, nothing in the object store that a restart would need
        counts = np.load(os.path.join(out, COUNTS), allow_pickle=False)
        self.bins = frequency_bins(counts, settings["n_bins"])
        self.loaded = load_model(model, device=device)
        self.ready = time.time()  # start-up done: imports, model loaded (wall clock, for the driver)
        marker = os.environ.get("ATTNLAB_CORPUS_PID_DIR")  # tests: where actors say who they are
        if marker:
            open(os.path.join(marker, f"{os.getpid()}.pid"), "w").close()

    def __call__(self, batch: dict) -> dict:
        from attnlab.corpus.rows import analyse_shard, write_outputs
        from attnlab.corpus.sources import split_parts

        out = {"shard": [], "tokens": [], "pid": [], "ready": [], "begin": [], "end": [], "cpu": []}
        part_chars = self.settings["part_chars"]
        for shard, docs_json in zip(batch["shard"], batch["docs"], strict=True):
            begin, cpu = time.time(), time.process_time()
            docs = [(i, doc_id, split_parts(text, part_chars)) for i, doc_id, text in json.loads(docs_json)]
            table, index, n_tokens = analyse_shard(self.loaded, docs, self.settings, self.bins)
            write_outputs(self.out, int(shard), table, index)  # the token index first, then the rows
            for key, value in (("shard", int(shard)), ("tokens", n_tokens), ("pid", os.getpid()),
                               ("ready", self.ready), ("begin", begin), ("end", time.time()),
                               ("cpu", time.process_time() - cpu)):
                out[key].append(value)
        return out


def run_ray(run, cluster: Cluster, workers: int, progress: bool = False, threads: int = 1) -> dict:
    """Analyse the pending shards of ``run`` on ``workers`` Ray actors; -> {"shards", "tokens", "s"}."""
    import ray.data

    from attnlab.corpus.job import Progress

    pending = run.pending()
    bar = Progress(run, pending, progress, "ray")
    t0 = time.perf_counter()
    if not pending:
        bar.close("analysed")
        return {"shards": 0, "tokens": 0, "s": 0.0, "ray_init_s": cluster.started_s}
    items = [{"shard": k, "docs": json.dumps([(i, d, "".join(parts)) for i, d, parts in docs])}
             for k, docs in run.texts(pending)]
    gpus = 1.0 if cluster.gpus >= 1 else 0.0
    settings = {**run.row_settings(), "part_chars": run.settings.part_chars}
    ds = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        ShardAnalyzer,
        fn_constructor_kwargs=dict(out=str(run.out.resolve()), model=run.settings.model, settings=settings,
                                   threads=threads,
                                   device="cuda" if gpus else "cpu"),
        batch_size=1,
        compute=ray.data.ActorPoolStrategy(size=workers),
        num_cpus=1,
        num_gpus=gpus,
        max_restarts=-1,
        max_task_retries=-1,
    )
    tokens, done, records = 0, set(), []
    wall0, cpu0 = time.time(), time.process_time()
    try:
        for record in ds.iter_rows():
            shard = int(record["shard"])
            if shard in done:
                continue
            done.add(shard)
            records.append(record)
            tokens += int(record["tokens"])
            bar.shard_done(shard, int(record["tokens"]))
    except BaseException:
        bar.close("interrupted")
        raise
    bar.close("analysed")
    missing = run.pending()
    if missing:
        raise RuntimeError(f"Ray finished without shards {missing[:5]}; run the same command again")
    return {"shards": len(pending), "tokens": tokens, "s": time.perf_counter() - t0,
            "ray_init_s": cluster.started_s, "driver_cpu_s": time.process_time() - cpu0,
            **_phases(records, wall0, time.time())}


def _phases(records: list[dict], start: float, stop: float) -> dict:
    """Start-up and steady state of a Ray run from the actors' records (wall-clock times).

    startup_s: from the dataset's start to the first actor ready (its imports and model load done:
    no shard can start before); all_ready_s: to the last actor ready; steady_s: from the first actor
    ready to the end (so it errs on the long side); busy_s: seconds the actors spent in shards, cpu_s:
    their CPU time there (threads summed);
    actors: distinct processes that analysed shards (a restarted actor is a new one).
    """
    if not records:
        return {}
    ready = min(float(r["ready"]) for r in records)
    return {"startup_s": max(0.0, ready - start), "steady_s": max(0.0, stop - ready),
            "all_ready_s": max(0.0, max(float(r["ready"]) for r in records) - start),
            "busy_s": sum(float(r["end"]) - float(r["begin"]) for r in records),
            "cpu_s": sum(float(r["cpu"]) for r in records),
            "actors": len({int(r["pid"]) for r in records})}
