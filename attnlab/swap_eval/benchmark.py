"""``python -m attnlab.bench swap-eval``: a swap-eval's time against the plain forward (issue 28's target).

In one run, on the same model and the same texts (``n_docs`` KJV chapters cut to one 512-token window
each), interleaved, medians of ``repeats``:

    forward      the model with its LM head on every text's window (``model(input_ids)``, no grad)
    swap_eval    ``attnlab.swap_eval.swap_eval`` over the same texts as documents (``layers="each"``,
                 ``variants``): the whole call (counting pass, every window unswapped and under every
                 swap, Parquet shards, bootstrap tables, figures)

Target: swap_eval <= (1 + swaps) x forward x 1.2, swaps = len(variants) x L. Each swap reuses the
unswapped forward's block outputs below its layer (hf.beyond.lm_loss.window_losses), so a swap in
layer l runs L - l blocks. The model is MiniLM-sized with random weights and an LM head, built from
a config (``shape``: "bert", masked LM like MiniLM-L6; "gpt2", the same size causal), MiniLM's tokenizer.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

__all__ = ["benchmark_swap_eval", "build_lm"]

SHAPES = ("bert", "gpt2")
# MiniLM-L6's shape: 6 layers, width 384, 12 heads, intermediate 1536, 512 positions
LAYERS, WIDTH, HEADS, INTERMEDIATE, POSITIONS = 6, 384, 12, 1536, 512


def build_lm(shape: str, directory: Path, seed: int = 0) -> Path:
    """A MiniLM-sized model of ``shape`` with its LM head and random weights, saved to ``directory``."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

    from attnlab.hf import default_model_path

    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {SHAPES}, got {shape!r}")
    tokenizer = AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True)
    torch.manual_seed(seed)
    if shape == "bert":
        config = BertConfig(vocab_size=len(tokenizer), hidden_size=WIDTH, num_hidden_layers=LAYERS,
                            num_attention_heads=HEADS, intermediate_size=INTERMEDIATE,
                            max_position_embeddings=POSITIONS)
        model = BertForMaskedLM(config)
    else:
        config = GPT2Config(vocab_size=len(tokenizer), n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS,
                            n_inner=INTERMEDIATE, n_positions=POSITIONS)
        model = GPT2LMHeadModel(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def benchmark_swap_eval(shape: str = "bert", n_docs: int = 100, variants=("dnas",), repeats: int = 1,
                        shard_docs: int = 10) -> dict:
    import torch

    from attnlab import hf
    from attnlab.corpus.benchmark import _texts
    from attnlab.hf.capture.windows import special_affixes
    from attnlab.swap_eval import swap_eval

    tmp = Path(tempfile.mkdtemp(prefix="attnlab-bench-swap-"))
    model_dir = build_lm(shape, tmp / shape)
    loaded = hf.load_language_model(model_dir)
    texts = _texts(loaded, n_docs)
    (tmp / "docs").mkdir()
    for i, t in enumerate(texts):
        (tmp / "docs" / f"{i:03d}.txt").write_text(t)
    prefix, suffix = special_affixes(loaded.tokenizer)
    windows = [torch.tensor([[*prefix, *loaded.tokenizer(t, add_special_tokens=False)["input_ids"], *suffix]])
               for t in texts]  # (1, <= 512) each

    def forward() -> int:
        with torch.no_grad():
            for ids in windows:
                loaded.model(input_ids=ids, use_cache=False)
        return sum(w.shape[1] for w in windows)

    def swapped(r: int) -> dict:
        result = swap_eval(str(tmp / "docs"), model_dir, list(variants), "each", out=tmp / f"run{r}",
                           shard_docs=shard_docs, bootstrap=200)
        return result.manifest

    forward()  # warm-up
    load = [os.getloadavg()[0]]
    times: dict[str, list[float]] = {"forward": [], "swap_eval": []}
    manifest: dict = {}
    for r in range(repeats):
        t0 = time.perf_counter()
        tokens = forward()
        times["forward"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        manifest = swapped(r)
        times["swap_eval"].append(time.perf_counter() - t0)
        load.append(os.getloadavg()[0])
    med = {k: statistics.median(v) for k, v in times.items()}
    swaps = len(variants) * loaded.info.n_layers
    target = (1 + swaps) * med["forward"] * 1.2
    return {"shape": shape, "documents": n_docs, "tokens": tokens, "variants": list(variants), "swaps": swaps,
            "torch_threads": torch.get_num_threads(), "seconds": times, "median_s": med,
            "ratio_to_forward": med["swap_eval"] / med["forward"], "target_ratio": (1 + swaps) * 1.2,
            "met": med["swap_eval"] <= target, "load_average": load,
            "n_documents_scored": manifest.get("n_documents"), "out": str(tmp)}
