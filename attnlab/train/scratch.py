"""What the Hugging Face recipes that build their model from scratch share (``s2s-hnas``: a tiny BART,
``causal-lm``: a small GPT-2): the corpus's tokenizer and the run's starting model, ``RUN/base-model``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

__all__ = ["BASE_DIR", "base_model_dir", "corpus_tokenizer"]

BASE_DIR = "base-model"  # RUN/base-model: the random-init model a from-scratch run starts from


def corpus_tokenizer(corpus: str, vocab_size: int, max_len: int):
    """The scale runs' tokenizer rule as a ``BertTokenizerFast``: the MiniLM uncased WordPiece vocabulary
    restricted to the ``vocab_size`` pieces ``corpus`` uses most (:func:`attnlab.data.build_tokenizer`);
    ``[PAD] [UNK] [CLS] [SEP] [MASK]`` = ids 0-4."""
    from transformers import BertTokenizerFast

    from attnlab.data import build_tokenizer

    pieces = build_tokenizer("wordpiece", corpus, vocab_size).vocab  # ids 0-4: the specials
    tokenizer = BertTokenizerFast(vocab={t: i for i, t in enumerate(pieces)}, do_lower_case=True,
                                  model_max_length=max_len)
    if len(tokenizer) != len(pieces):
        raise ValueError(f"the tokenizer kept {len(tokenizer)} of the {len(pieces)} vocabulary pieces")
    return tokenizer


def base_model_dir(run_dir, resume: bool, build: Callable[[Path], object]) -> Path:
    """``RUN/base-model``: built by ``build(directory)`` at a run's start (the run's seed draws its
    weights); on ``--resume`` the saved one. ValueError when a resumed run has none, or when a new run
    would start over a directory that already holds a run."""
    base_dir = Path(run_dir) / BASE_DIR
    if not (base_dir / "config.json").is_file():
        if resume:
            raise ValueError(f"--resume: {run_dir} has no {BASE_DIR}/ (the model the run started from)")
        if (Path(run_dir) / "recipe.json").exists():
            raise ValueError(f"{run_dir} already holds a run; pass --resume to continue it, or choose "
                             "another --out")
        build(base_dir)
    return base_dir
