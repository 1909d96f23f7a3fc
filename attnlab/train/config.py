"""Run configuration: what a recipe (``attnlab/recipes/NAME.json``) or ``--config FILE.json`` holds.

    {
      "name": "enc-hnas", "description": "...",
      "model": {ModelConfig fields; vocab_size and max_len come from the data section},
      "data":  {DataConfig fields},
      "train": {TrainConfig fields}
    }

Every section is validated with a ``ValueError`` that names the field, the expected range and the value.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from attnlab.models import ModelConfig

__all__ = ["DataConfig", "TrainConfig", "RunConfig", "RECIPES_DIR", "list_recipes", "load_recipe",
           "RESUME_MUTABLE", "recipe_path", "recipe_file_kind",
           "section_differences"]

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
# train fields that may change on --resume (they do not change the trajectory of the weights)
RESUME_MUTABLE = {"steps", "threads", "log_every", "eval_every", "save_every", "keep_checkpoints",
                  "keep_optimizer"}


def _check(section: str, obj, name: str, ok: bool, expected: str) -> None:
    if not ok:
        raise ValueError(f"{section}.{name} must be {expected}, got {getattr(obj, name)!r}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _from_dict(cls, d: dict, section: str):
    if not isinstance(d, dict):
        raise ValueError(f"{section} must be a JSON object, got {type(d).__name__}")
    unknown = set(d) - {f.name for f in fields(cls)}
    if unknown:
        raise ValueError(f"unknown {section} keys {sorted(unknown)}; known: {[f.name for f in fields(cls)]}")
    return cls(**d)


@dataclass
class DataConfig:
    corpus: str = "kjv"  # "kjv" (default), "shakespeare", "kjv+shakespeare" or a .txt path
    max_chars: int | None = None  # use only the first max_chars characters of the corpus
    tokenizer: str = "wordpiece"  # "wordpiece" (default model's vocabulary, restricted) or "byte"
    vocab_size: int = 4096  # wordpiece pieces kept (byte: fixed at 261)
    seq_len: int = 64  # tokens per example, = the model's max_len
    mask_prob: float = 0.15  # encoder: share of tokens that are prediction targets

    def __post_init__(self):
        s = "data"
        _check(s, self, "corpus", isinstance(self.corpus, str) and self.corpus != "",
               "a corpus name ('kjv', 'shakespeare', 'kjv+shakespeare') or a file path")
        _check(s, self, "max_chars",
               self.max_chars is None or (_is_int(self.max_chars) and self.max_chars >= 16),
               "None or an integer >= 16")
        _check(s, self, "tokenizer", self.tokenizer in ("wordpiece", "byte"), "'wordpiece' or 'byte'")
        _check(s, self, "vocab_size", _is_int(self.vocab_size) and 64 <= self.vocab_size <= 30522,
               "an integer in [64, 30522]")
        _check(s, self, "seq_len", _is_int(self.seq_len) and 4 <= self.seq_len <= 4096,
               "an integer in [4, 4096]")
        _check(s, self, "mask_prob", 0.0 < self.mask_prob < 1.0, "in (0, 1)")


@dataclass
class TrainConfig:
    steps: int = 1000  # optimizer steps
    batch_size: int = 32  # global batch: examples per step over all DDP ranks
    lr: float = 1e-3  # peak learning rate (AdamW)
    min_lr: float = 1e-4  # cosine decay ends here
    warmup: int = 100  # linear warm-up steps
    weight_decay: float = 0.01  # on matrices and embeddings only (not biases, norms or HNAS theta)
    betas: tuple[float, float] = (0.9, 0.98)  # AdamW betas
    eps: float = 1e-8  # AdamW epsilon
    clip: float = 1.0  # gradient-norm clipping (0 = off)
    eval_every: int = 100  # held-out loss and column-mass summary every this many steps
    eval_batches: int = 4  # held-out batches per eval
    log_every: int = 10  # one metrics.jsonl line every this many steps
    save_every: int = 100  # checkpoint every this many steps (and at the end)
    keep_checkpoints: int = 2  # step directories kept (the newest ones)
    keep_optimizer: bool = True  # False: the final checkpoint drops the optimizer state (shipping)
    seed: int = 0  # seeds the initialization, the data order, the masks and dropout
    threads: int | None = None  # torch CPU threads (None: torch's default)

    def __post_init__(self):
        s = "train"
        if isinstance(self.betas, list):
            self.betas = tuple(self.betas)
        for name, lo in (("steps", 1), ("batch_size", 1), ("eval_every", 1), ("eval_batches", 1),
                         ("log_every", 1), ("save_every", 1), ("keep_checkpoints", 1), ("seed", 0)):
            value = getattr(self, name)
            _check(s, self, name, _is_int(value) and value >= lo, f"an integer >= {lo}")
        _check(s, self, "warmup", _is_int(self.warmup) and self.warmup >= 0, "an integer >= 0")
        _check(s, self, "lr", isinstance(self.lr, int | float) and 0.0 < self.lr <= 1.0, "in (0, 1]")
        _check(s, self, "min_lr", isinstance(self.min_lr, int | float) and 0.0 <= self.min_lr <= self.lr,
               f"in [0, lr={self.lr}]")
        _check(s, self, "weight_decay", 0.0 <= self.weight_decay < 1.0, "in [0, 1)")
        _check(s, self, "betas", len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas),
               "two numbers in [0, 1)")
        _check(s, self, "eps", 0.0 < self.eps < 1.0, "in (0, 1)")
        _check(s, self, "clip", self.clip >= 0.0, ">= 0 (0 = no clipping)")
        _check(s, self, "threads", self.threads is None or (_is_int(self.threads) and self.threads >= 1),
               "None or an integer >= 1")


@dataclass
class RunConfig:
    name: str = "custom"
    description: str = ""
    model: dict = field(default_factory=dict)  # ModelConfig fields except vocab_size and max_len
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self):
        if isinstance(self.data, dict):
            self.data = _from_dict(DataConfig, self.data, "data")
        if isinstance(self.train, dict):
            self.train = _from_dict(TrainConfig, self.train, "train")
        reserved = {"vocab_size", "max_len"} & set(self.model)
        if reserved:
            raise ValueError(f"model.{sorted(reserved)[0]} is set from the data section (tokenizer, "
                             "seq_len); remove it from the model section")
        self.model_config(vocab_size=4096)  # validates the model section now

    def model_config(self, vocab_size: int) -> ModelConfig:
        return ModelConfig.from_dict({**self.model, "vocab_size": vocab_size, "max_len": self.data.seq_len})

    def to_dict(self) -> dict:
        d = asdict(self)
        d["train"]["betas"] = list(d["train"]["betas"])
        return d

    @classmethod
    def from_dict(cls, d: dict) -> RunConfig:
        return _from_dict(cls, d, "config")

    @classmethod
    def from_file(cls, path: str | Path) -> RunConfig:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"config file {str(p)!r} does not exist")
        try:
            d = json.loads(p.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"config file {str(p)!r} is not valid JSON: {e}") from None
        return cls.from_dict(d)

    def differences(self, other: RunConfig) -> list[str]:
        """Fields that differ and would change the run (ignores RESUME_MUTABLE train fields)."""
        return section_differences(self.to_dict(), other.to_dict(), ("model", "data", "train"))


def section_differences(a: dict, b: dict, sections: tuple[str, ...]) -> list[str]:
    """``section.key: a != b`` for every field of ``sections`` where two configuration dicts differ, except
    the train fields a resume may change (RESUME_MUTABLE)."""
    out = []
    for section in sections:
        for key in sorted(set(a[section]) | set(b[section])):
            if section == "train" and key in RESUME_MUTABLE:
                continue
            if a[section].get(key) != b[section].get(key):
                out.append(f"{section}.{key}: {a[section].get(key)!r} != {b[section].get(key)!r}")
    return out


def recipe_file_kind(path: Path) -> str | None:
    """The ``kind`` field of a recipe file (the pretrained-model recipes: 'retrofit-hnas', 'mlm-head'),
    None for a small-model recipe or a file that is not a JSON object."""
    try:
        d = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return d.get("kind") if isinstance(d, dict) and isinstance(d.get("kind"), str) else None


def list_recipes(pretrained: bool = False) -> list[str]:
    """Shipped small-model recipes (RunConfig); with ``pretrained``, those that train on a pretrained
    model instead (attnlab.train.retrofit_config.HFRunConfig: retrofit-hnas, mlm-head)."""
    paths = RECIPES_DIR.glob("*.json")
    return sorted(p.stem for p in paths if (recipe_file_kind(p) is not None) == pretrained)


def recipe_path(name: str) -> Path:
    """The file of a shipped recipe name, or ``name`` itself when it is a JSON file; else a ValueError
    naming ``--recipe`` and the shipped recipes."""
    path = RECIPES_DIR / f"{name}.json"
    if path.is_file():
        return path
    if Path(name).is_file():
        return Path(name)
    raise ValueError(f"--recipe: unknown recipe {name!r}; available: {list_recipes() + list_recipes(True)}")


def load_recipe(name: str) -> RunConfig:
    """A shipped small-model recipe by name (``attnlab/recipes/NAME.json``) or a path to a JSON file."""
    return RunConfig.from_file(recipe_path(name))
