"""Configuration of the recipes that train a Hugging Face model through attnlab's swap: ``retrofit-hnas``
(learn HNAS's u per layer and head, the model frozen), ``mlm-head`` (learn a masked-LM head, the encoder
frozen), ``s2s-hnas`` (HNAS in the *encoder's* self-attention of an encoder-decoder, the paper's
summarization setting; a tiny BART built from ``arch`` and trained from scratch, or ``base.model``) and
``causal-lm`` (a small GPT-2 built from ``arch`` and trained from scratch with its own softmax attention:
a local causal LM for the retrofit; attnlab.train.causal_lm).
A recipe file (``attnlab/recipes/retrofit-hnas.json``) and ``--config FILE.json`` share one format::

    {"name": "retrofit-hnas", "kind": "retrofit-hnas", "description": "...",
     "base":  {BaseConfig fields: the model directory, u0, train_rest, rest_lr},
     "arch":  {Seq2SeqArch fields} (s2s-hnas with base.model null), {CausalLMArch fields} (causal-lm);
              else null or absent,
     "data":  {HFDataConfig fields: corpus, max_chars, seq_len, mask_rate, target_len},
     "train": {attnlab.train.config.TrainConfig fields}}

Every field is validated with a ValueError naming it, what was expected and what was seen.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from attnlab.train.causal_lm import CausalLMArch
from attnlab.train.config import TrainConfig, _check, _from_dict, _is_int, section_differences

__all__ = ["HF_KINDS", "ARCH_KINDS", "BaseConfig", "Seq2SeqArch", "CausalLMArch", "HFDataConfig",
           "HFRunConfig"]

HF_KINDS = ("retrofit-hnas", "mlm-head", "s2s-hnas", "causal-lm")  # recipe kinds that train a HF model


@dataclass
class BaseConfig:
    model: str | None = None  # a save_pretrained directory, made absolute (None: the embedded MiniLM)
    u0: float = 0.5  # retrofit: initial u of every head (theta_0 = logit(u0); 0.5 -> theta_0 = 0)
    train_rest: bool = False  # retrofit: also train the model's own weights (--train-rest)
    rest_lr: float = 1e-5  # retrofit with train_rest: peak learning rate of the model's own weights

    def __post_init__(self):
        s = "base"
        _check(s, self, "model", self.model is None or (isinstance(self.model, str) and self.model != ""),
               "null (the embedded MiniLM) or a model directory")
        if self.model is not None:  # relative to the working directory, as --corpus; stored absolute
            self.model = str(Path(self.model).expanduser().resolve())
        _check(s, self, "u0", isinstance(self.u0, (int, float)) and not isinstance(self.u0, bool)
               and 0.0 < self.u0 < 1.0, "a number in (0, 1)")
        _check(s, self, "train_rest", isinstance(self.train_rest, bool), "true or false")
        _check(s, self, "rest_lr", isinstance(self.rest_lr, (int, float)) and 0.0 < self.rest_lr <= 1.0,
               "in (0, 1]")


@dataclass
class HFDataConfig:
    corpus: str = "kjv"  # "kjv", "shakespeare", "kjv+shakespeare" or a text file (as attnlab train)
    max_chars: int | None = None  # use only the first max_chars characters of the corpus
    seq_len: int = 128  # tokens per window, the tokenizer's special tokens included
    mask_rate: float = 0.15  # masked LMs: share of the window's tokens scored (BERT's rule)
    target_len: int = 16  # s2s-hnas: the lead summary's tokens at most (its [CLS] and [SEP] not counted)

    def __post_init__(self):
        s = "data"
        _check(s, self, "corpus", isinstance(self.corpus, str) and self.corpus != "",
               "a corpus name ('kjv', 'shakespeare', 'kjv+shakespeare') or a file path")
        _check(s, self, "max_chars",
               self.max_chars is None or (_is_int(self.max_chars) and self.max_chars >= 16),
               "None or an integer >= 16")
        _check(s, self, "seq_len", _is_int(self.seq_len) and 4 <= self.seq_len <= 65536,
               "an integer in [4, 65536]")
        _check(s, self, "mask_rate", isinstance(self.mask_rate, (int, float)) and 0.0 < self.mask_rate < 1.0,
               "in (0, 1)")
        _check(s, self, "target_len", _is_int(self.target_len) and 1 <= self.target_len <= 1024,
               "an integer in [1, 1024]")


@dataclass
class Seq2SeqArch:
    """s2s-hnas: the tiny encoder-decoder built from scratch (transformers' BartConfig), dropout 0 so that
    a step is a deterministic function of its batch (exact resume)."""

    encoder_layers: int = 4  # encoder blocks: HNAS self-attention, u (encoder_layers, heads) learned
    decoder_layers: int = 2  # decoder blocks: softmax self- and cross-attention
    d_model: int = 128  # hidden size
    heads: int = 4  # attention heads in every attention (head dim d_model / heads)
    ffn_dim: int = 256  # feed-forward width of every block
    vocab_size: int = 4096  # WordPiece pieces kept from the corpus (attnlab.data.build_tokenizer)

    def __post_init__(self):
        s = "arch"
        for name, hi in (("encoder_layers", 64), ("decoder_layers", 64), ("d_model", 4096), ("heads", 64),
                         ("ffn_dim", 16384)):
            _check(s, self, name, _is_int(getattr(self, name)) and 1 <= getattr(self, name) <= hi,
                   f"an integer in [1, {hi}]")
        _check(s, self, "vocab_size", _is_int(self.vocab_size) and 64 <= self.vocab_size <= 65536,
               "an integer in [64, 65536]")
        if self.d_model % self.heads:
            raise ValueError(f"arch.d_model must be a multiple of arch.heads ({self.heads}), "
                             f"got {self.d_model}")


ARCH_KINDS = {"s2s-hnas": Seq2SeqArch, "causal-lm": CausalLMArch}  # kinds that build a model from arch


@dataclass
class HFRunConfig:
    name: str = "retrofit-hnas"
    kind: str = "retrofit-hnas"  # one of HF_KINDS
    description: str = ""
    base: BaseConfig = field(default_factory=BaseConfig)
    arch: Seq2SeqArch | CausalLMArch | None = None  # s2s-hnas / causal-lm from scratch: the model to build
    data: HFDataConfig = field(default_factory=HFDataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self):
        if self.kind not in HF_KINDS:
            raise ValueError(f"kind must be one of {list(HF_KINDS)}, got {self.kind!r}")
        if isinstance(self.base, dict):
            self.base = _from_dict(BaseConfig, self.base, "base")
        if isinstance(self.arch, dict) and self.kind in ARCH_KINDS:
            self.arch = _from_dict(ARCH_KINDS[self.kind], self.arch, "arch")
        if isinstance(self.data, dict):
            self.data = _from_dict(HFDataConfig, self.data, "data")
        if isinstance(self.train, dict):
            self.train = _from_dict(TrainConfig, self.train, "train")
        if self.kind == "mlm-head" and self.base.train_rest:
            raise ValueError("base.train_rest must be false for kind 'mlm-head' (the encoder stays frozen), "
                             "got true")
        if self.kind not in ARCH_KINDS and self.arch is not None:
            raise ValueError(f"arch is for kind 's2s-hnas' or 'causal-lm' (a model built from scratch), "
                             f"got an arch section with kind {self.kind!r}")
        if self.kind == "causal-lm":
            if self.base.model is not None:
                raise ValueError("base.model must be null for kind 'causal-lm' (it builds its model from "
                                 "arch and trains it from scratch; --model is for retrofit-hnas), got "
                                 f"{self.base.model!r}")
            if self.arch is None:
                raise ValueError("kind 'causal-lm' needs an arch section (the GPT-2 to build: n_layer, "
                                 "n_embd, n_head, n_inner, vocab_size); got none")
        if self.kind == "s2s-hnas" and self.base.model is None:
            if self.arch is None:
                raise ValueError("kind 's2s-hnas' needs base.model (an encoder-decoder directory) or an arch "
                                 "section (the tiny BART to build); got neither")
            if not self.base.train_rest:
                raise ValueError("base.train_rest must be true for kind 's2s-hnas' built from scratch "
                                 "(arch): a random model that does not train learns nothing; got false")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["train"]["betas"] = list(d["train"]["betas"])
        return d

    @classmethod
    def from_dict(cls, d: dict) -> HFRunConfig:
        return _from_dict(cls, d, "config")

    @classmethod
    def from_file(cls, path: str | Path) -> HFRunConfig:
        return cls.from_dict(_read(Path(path)))

    def differences(self, other: HFRunConfig) -> list[str]:
        """Fields that differ and would change the run (ignores RESUME_MUTABLE train fields)."""
        a, b = self.to_dict(), other.to_dict()
        out = [f"kind: {a['kind']!r} != {b['kind']!r}"] if a["kind"] != b["kind"] else []
        if a.get("arch") != b.get("arch"):
            out.append(f"arch: {a.get('arch')!r} != {b.get('arch')!r}")
        return out + section_differences(a, b, ("base", "data", "train"))


def _read(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"config file {str(path)!r} is not valid JSON: {e}") from None

