"""``--engine ray`` (or ``--ray-address``): the same shards, scored by ``ray.data`` ``map_batches`` on an
actor pool, the corpus job's Ray path (:mod:`attnlab.corpus.ray_engine`: its ``connect`` and
timings are reused). Each actor (:class:`ShardScorer`) loads the model with its LM head once, then
scores one shard per batch with :func:`attnlab.swap_eval.job.score_documents` -- the function the
local engine calls -- and writes it with the same atomic rename, so the rows are those of the local
engine. A killed actor is restarted by Ray and its shard retried; a shard written twice has the same
content. With ``ray_address`` the cluster's workers must see ``out`` (a shared file system).
"""

from __future__ import annotations

import json
import os
import time

from attnlab.corpus.ray_engine import Cluster, _phases, connect

__all__ = ["connect", "run_ray", "ShardScorer"]


class ShardScorer:
    """Ray Data callable class: the model is loaded once per actor; one batch = one shard."""

    def __init__(self, out: str, settings: dict, threads: int, device: str):
        import torch

        from attnlab.hf import load_language_model
        from attnlab.swap_eval.job import SwapEvalSettings, plan_swaps

        torch.set_num_threads(threads)
        self.out = out
        self.settings = SwapEvalSettings.from_dict(settings)
        self.loaded = load_language_model(self.settings.model, device=device)
        self.swaps = plan_swaps(self.loaded.info, self.settings)
        self.ready = time.time()

    def __call__(self, batch: dict) -> dict:
        from attnlab.corpus.rows import write_shard
        from attnlab.corpus.sources import split_parts
        from attnlab.swap_eval.job import score_documents

        out = {"shard": [], "tokens": [], "pid": [], "ready": [], "begin": [], "end": [], "cpu": []}
        for shard, docs_json in zip(batch["shard"], batch["docs"], strict=True):
            begin, cpu = time.time(), time.process_time()
            docs = [
                (i, doc_id, split_parts(text, self.settings.part_chars))
                for i, doc_id, text in json.loads(docs_json)
            ]
            table, n_tokens = score_documents(self.loaded, docs, self.swaps, self.settings)
            write_shard(self.out, int(shard), table)
            for key, value in (
                ("shard", int(shard)),
                ("tokens", n_tokens),
                ("pid", os.getpid()),
                ("ready", self.ready),
                ("begin", begin),
                ("end", time.time()),
                ("cpu", time.process_time() - cpu),
            ):
                out[key].append(value)
        return out


def run_ray(run, cluster: Cluster, workers: int, progress: bool = False, threads: int = 1) -> dict:
    """Score the pending shards of ``run`` on ``workers`` Ray actors; -> {"shards", "tokens", "s", ...}."""
    import ray.data

    from attnlab.corpus.job import Progress

    pending = run.pending()
    bar = Progress(run, pending, progress, "ray")
    t0, wall0, cpu0 = time.perf_counter(), time.time(), time.process_time()
    items = [
        {"shard": k, "docs": json.dumps([(i, d, "".join(parts)) for i, d, parts in docs])}
        for k, docs in run.texts(pending)
    ]
    records: dict[int, dict] = {}  # shard -> its first report
    try:
        if items:
            gpus = 1.0 if cluster.gpus >= 1 else 0.0
            ds = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
                ShardScorer,
                batch_size=1,
                num_cpus=1,
                num_gpus=gpus,
                max_restarts=-1,
                max_task_retries=-1,
                fn_constructor_kwargs=dict(
                    out=str(run.out.resolve()),
                    settings=run.settings.as_dict(),
                    threads=threads,
                    device="cuda" if gpus else "cpu",
                ),
                compute=ray.data.ActorPoolStrategy(size=workers),
            )
            for record in ds.iter_rows():
                shard = int(record["shard"])
                if records.setdefault(shard, record) is record:  # a retried shard reports twice
                    bar.shard_done(shard, int(record["tokens"]))
    except BaseException:
        bar.close("interrupted")
        raise
    bar.close("scored")
    if run.pending():
        raise RuntimeError(f"Ray finished without shards {run.pending()[:5]}; run the same command again")
    return {
        "shards": len(pending),
        "tokens": sum(int(r["tokens"]) for r in records.values()),
        "s": time.perf_counter() - t0,
        "ray_init_s": cluster.started_s,
        "driver_cpu_s": time.process_time() - cpu0,
        **_phases(list(records.values()), wall0, time.time()),
    }
