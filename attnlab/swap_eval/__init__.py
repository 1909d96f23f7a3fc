"""Swap evaluation: what a normalizer costs a pretrained model's language modelling, per layer and position.

    from attnlab.swap_eval import swap_eval
    result = swap_eval("docs/", "models/gpt2", ["dnas", "sinkhorn", "softmax1"], "each", out="runs/swap")
    result.loss_delta()        # per (variant, layer): loss, delta vs the model, 95 % bootstrap CIs
    result.loss_by_position()  # per (variant, layer, position): loss (the StreamingLLM-style curve)

Every window of every document is scored by the model with its LM head (causal: next-token loss,
encoders: seeded masked-token loss; :mod:`attnlab.hf.beyond.lm_loss`) unswapped and with each variant
swapped into each layer (``"each"``) and/or every layer (``"all"``). Modules: ``job`` (settings, swaps,
manifest, shards, resume, local engine), ``summary`` (tables, bootstrap), ``figures``, ``ray_engine``
(ray.data map_batches), ``cli`` (``attnlab swap-eval``). docs/SWAP_EVAL.md describes the outputs.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SwapEvalResult", "swap_eval", "open_result"]

ENGINES = ("local", "ray")


@dataclass
class SwapEvalResult:
    """A finished (or opened) swap-eval run directory."""

    out: Path
    manifest: dict

    @property
    def rows(self) -> Path:
        """The Parquet dataset of rows (per document, swap and position)."""
        return self.out / "rows"

    def loss_delta(self):
        import pandas as pd

        return pd.read_parquet(self.out / "loss_delta.parquet")

    def loss_by_position(self):
        import pandas as pd

        return pd.read_parquet(self.out / "loss_by_position.parquet")


def open_result(out: str | os.PathLike) -> SwapEvalResult:
    """A finished run's directory -> SwapEvalResult; ValueError when it is not one."""
    from attnlab.swap_eval.job import FORMAT, MANIFEST, _read_json

    out = Path(out)
    manifest = _read_json(out / MANIFEST)
    if manifest.get("format") != FORMAT or not (out / "loss_delta.parquet").is_file():
        raise ValueError(
            f"out {str(out)!r} is not a finished swap-eval run (no {MANIFEST} of format {FORMAT} "
            "and loss_delta.parquet)"
        )
    return SwapEvalResult(out, manifest)


def swap_eval(
    source,
    model,
    variants=("dnas", "sinkhorn", "softmax1"),
    layers: str = "each",
    *,
    out,
    params: dict | None = None,
    window: int | None = None,
    mask_rate: float = 0.15,
    max_docs: int | None = None,
    text_column: str = "text",
    id_column: str | None = None,
    engine: str | None = None,
    ray_address: str | None = None,
    workers: int = 1,
    shard_docs: int = 8,
    bootstrap: int = 1000,
    seed: int = 0,
    overwrite: bool = False,
    device=None,
    progress: bool = False,
    **variant_params,
) -> SwapEvalResult:
    """Score every document of ``source`` unswapped and under every swap; rows, tables, figures in ``out``.

    Args:
        source: as :func:`attnlab.corpus.analyze_corpus` ("kjv", a folder, a .jsonl/.csv/.parquet file).
        model: a local model directory whose weights carry an LM head (causal or masked).
        variants: names or "all"; layers: "each" (one swap per layer), "all" (every layer at once) or
            "each,all"; params / **variant_params: variant parameters (u=..., iters=...).
        window: tokens per window (default: the model's max length, at most 512); mask_rate, seed: the
            masked-LM mask (and the bootstrap's seed); bootstrap: resamples for the CIs.
        engine: "local" or "ray" (default: "ray" when ``ray_address`` is given, else "local");
            workers: Ray actors. shard_docs: documents per shard (the unit of resume).
        overwrite: replace a run in ``out`` made with other settings (otherwise refused).
    """
    from attnlab.corpus import _check_int
    from attnlab.corpus.job import Progress
    from attnlab.corpus.variants import resolve
    from attnlab.hf import load_model
    from attnlab.normalizers.checks import plain_number, scalar
    from attnlab.swap_eval import job
    from attnlab.swap_eval.figures import write_figures
    from attnlab.swap_eval.summary import loss_delta_table, position_table

    engine = engine or ("ray" if ray_address is not None else "local")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if ray_address is not None and engine != "ray":
        raise ValueError("ray_address needs engine='ray'")
    workers = _check_int("workers", workers, 1)
    if engine == "local" and workers != 1:
        raise ValueError(f"workers={workers} needs engine='ray'; the local engine runs one process")
    shard_docs = _check_int("shard_docs", shard_docs, 1)
    max_docs = _check_int("max_docs", max_docs, 1, allow_none=True)
    bootstrap = _check_int("bootstrap", bootstrap, 1)
    seed = _check_int("seed", seed, 0)
    window, mask_rate = scalar(window), plain_number(mask_rate)  # numpy: Python numbers (JSON manifest)
    if layers not in job.LAYER_MODES:
        raise ValueError(f"layers must be one of {job.LAYER_MODES}, got {layers!r}")
    if isinstance(mask_rate, bool) or not isinstance(mask_rate, (int, float)) or not 0 < mask_rate <= 1:
        raise ValueError(f"mask_rate must be a number in (0, 1], got {mask_rate!r}")
    if model is None or not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model must be a local model directory with an LM head, got {model!r}")
    if isinstance(variants, (list, tuple)) and not variants:
        raise ValueError("variants must name at least one variant, got none")
    info = load_model(model, device="cpu").info  # cached; causal models change variant defaults
    names, full = resolve(variants, {**(params or {}), **variant_params}, "swap", info)
    settings = job.SwapEvalSettings(
        model=str(Path(model).resolve()),
        variants=names,
        layers=layers,
        params=full,
        window=window,
        mask_rate=float(mask_rate),
        max_docs=max_docs,
        shard_docs=shard_docs,
        bootstrap=bootstrap,
        seed=seed,
    )
    cluster = None
    if engine == "ray":  # fail fast (unreachable address) before the counting pass
        from attnlab.swap_eval import ray_engine

        cluster = ray_engine.connect(ray_address, workers)
    run = job.prepare(
        source,
        out,
        settings,
        text_column=text_column,
        id_column=id_column,
        overwrite=overwrite,
        device=device if engine == "local" else "cpu",
        progress=progress,
    )
    t0 = time.perf_counter()
    stats = (
        job.run_local(run, progress)
        if engine == "local"
        else ray_engine.run_ray(run, cluster, workers, progress)
    )
    delta = loss_delta_table(run.out / "rows", job.BASELINE, bootstrap, seed)
    positions = position_table(run.out / "rows", job.BASELINE)
    for name, table in (("loss_delta", delta), ("loss_by_position", positions)):
        job.write_parquet(table, run.out / f"{name}.parquet")
        table.to_csv(run.out / f"{name}.csv", index=False)
    figures = write_figures(run.out / "figures", delta, positions)
    manifest = {
        **run.manifest,
        "engine": engine,
        "workers": workers,
        "figures": figures,
        "last_run": {**stats, "wall_s": time.perf_counter() - t0, "finished": time.time()},
    }
    job.write_json(run.out / job.MANIFEST, manifest)
    Progress.final(run.out, engine)
    return SwapEvalResult(run.out, manifest)
