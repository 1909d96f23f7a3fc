"""The JSON files attnlab reads back, validated before anything is built from them.

    read_json(path)                       bytes -> JSON, bounded: size, depth (never a RecursionError)
    check_checkpoint_config(cfg, path)    an attnlab checkpoint's config.json (attnlab-checkpoint/1)
    check_trainer_state(state, path)      a checkpoint's trainer_state.json (what --resume continues)
    check_manifest(m, path)               an exported figure's manifest (attnlab-figure/1)
    check_analysis_manifest(m, path)      the manifest.json of an ``attnlab analyze`` output folder
    contained_file(folder, name, source)  a file name read from a checkpoint, kept inside its folder
    check_threads(n, name)                --threads / train.threads: at most 4 per core (max_threads())

Every number that decides an allocation is bounded here (``MODEL_LIMITS``; docs/TRAINING.md), so a
crafted file cannot make attnlab build a model of 100,000 layers. Errors are :class:`SchemaError`
(a ``ValueError``) naming the file, the field, what was expected and what was seen, e.g.
``runs/x/step-00000100/config.json: model.n_layers must be an integer in [1, 256], got 100000``.
They quote values of the named file's own fields only, never other files' contents.

Imports nothing from attnlab, so every layer may use it.
"""

from __future__ import annotations

import contextlib
import json
import math
import operator
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "SchemaError",
    "Field",
    "MAX_JSON_DEPTH",
    "MAX_JSON_BYTES",
    "MODEL_LIMITS",
    "GAM_LIMITS",
    "MAX_MODEL_PARAMETERS",
    "read_json",
    "loads",
    "check_fields",
    "check_model_config",
    "check_checkpoint_config",
    "check_trainer_state",
    "check_manifest",
    "check_analysis_manifest",
    "contained_file",
    "THREADS_PER_CORE",
    "MAX_THREADS",
    "max_threads",
    "check_threads",
]

MAX_JSON_DEPTH = 32  # nesting of objects and arrays (attnlab's own files use at most 5)
MAX_JSON_BYTES = 16_000_000  # a config, state or manifest file (attnlab's own are a few kB)

# Bounds on an attnlab checkpoint's model section: (lowest, highest) per field. The shipped
# checkpoints use at most 4,096 / 128 / 128 / 4 / 4 / 256; the bounds leave ample room for any model
# attnlab can train on one machine, and keep what a crafted file can allocate finite.
MODEL_LIMITS = {
    "vocab_size": (6, 1 << 20),  # 1,048,576 token ids
    "max_len": (2, 1 << 16),  # 65,536 positions
    "d_model": (1, 1 << 14),  # 16,384
    "n_layers": (1, 256),
    "n_heads": (1, 256),
    "d_ff": (1, 1 << 16),  # 65,536
    "iters": (1, 10_000),  # Sinkhorn rounds (the normalizers' own bound)
    "pad_id": (0, (1 << 20) - 1),
}
GAM_LIMITS = {"n_brains": (1, 64), "rank": (1, 1 << 14), "degree": (1, 16), "max_len": (1, 1 << 16)}
# An estimate of the parameters the config builds (embeddings + per-layer projections and MLP):
# above this many (4 GiB of float32) the config is refused before anything is allocated.
MAX_MODEL_PARAMETERS = 1 << 30


class SchemaError(ValueError):
    """A JSON file attnlab reads back does not hold what it should; the message names the file, the
    field, what was expected and what was seen."""


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------


def _depth(obj) -> int:
    """Nesting depth of parsed JSON (iterative: no recursion however deep)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, d)
            if d <= MAX_JSON_DEPTH:  # deeper than that is refused anyway
                stack.extend((x, d + 1) for x in (node.values() if isinstance(node, dict) else node))
    return deepest


def loads(text: str | bytes, source: str | os.PathLike, max_depth: int = MAX_JSON_DEPTH):
    """JSON of ``text`` read from ``source`` (named in errors); SchemaError when it is not JSON or is
    nested deeper than ``max_depth`` (RecursionError never escapes)."""
    try:
        obj = json.loads(text)
    except RecursionError:
        raise SchemaError(f"{source}: JSON nested more than {max_depth} levels deep, expected at most "
                          f"{max_depth}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        json_error = isinstance(e, json.JSONDecodeError)
        where = f"line {e.lineno} column {e.colno}" if json_error else f"byte {e.start}"
        raise SchemaError(f"{source} is not valid JSON ({e.__class__.__name__} at {where})") from None
    if _depth(obj) > max_depth:
        raise SchemaError(f"{source}: JSON nested more than {max_depth} levels deep, expected at most "
                          f"{max_depth}")
    return obj


def read_json(path: str | os.PathLike, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH):
    """The JSON in ``path``: at most ``max_bytes`` bytes and ``max_depth`` levels, else SchemaError.
    OSError (missing, unreadable) passes through."""
    p = Path(path)
    size = p.stat().st_size
    if size > max_bytes:
        raise SchemaError(f"{p} is {size:,} bytes, over the {max_bytes:,}-byte limit of a JSON config")
    return loads(p.read_bytes(), p, max_depth)


def contained_file(folder: str | os.PathLike, name, source: str | os.PathLike) -> Path:
    """``folder / name`` for a file name read from ``source`` (a checkpoint's JSON), only when it is a
    plain name inside ``folder`` (symlinks resolved): ``/etc/passwd`` or ``../../x`` are refused
    with a SchemaError that quotes the name, never the file."""
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name
            or "\0" in name):
        raise SchemaError(f"{source}: a file name inside {folder} was expected, got {_show(name)}")
    base = Path(folder).resolve()
    path = (base / name).resolve()
    if path.parent != base:
        raise SchemaError(f"{source}: {name!r} leads outside {folder} (a link to {path.parent}); "
                          "expected a file inside the checkpoint folder")
    return base / name


# ----------------------------------------------------------------------------------------------
# Fields
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """What one JSON field must be. ``kind``: "int", "number", "str", "bool", "object", "list";
    ``low``/``high``: inclusive bounds of a number; ``choices``: allowed values; ``null``: None allowed."""

    kind: str
    required: bool = True
    low: float | None = None
    high: float | None = None
    choices: tuple | None = None
    null: bool = False

    def expected(self) -> str:
        if self.choices is not None:
            text = "one of " + ", ".join(map(repr, self.choices))
        else:
            text = {"int": "an integer", "number": "a finite number", "str": "a string",
                    "bool": "true or false", "object": "a JSON object", "list": "a JSON list"}[self.kind]
            if self.low is not None and self.high is not None:
                text += f" in [{_num(self.low)}, {_num(self.high)}]"
            elif self.low is not None:
                text += f" >= {_num(self.low)}"
        return text + (" or null" if self.null else "")

    def ok(self, value) -> bool:
        if value is None:
            return self.null
        if self.choices is not None and not isinstance(value, dict | list):
            return value in self.choices and (isinstance(value, bool) == isinstance(self.choices[0], bool))
        kind_ok = {
            "int": isinstance(value, int) and not isinstance(value, bool),
            "number": isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value),
            "str": isinstance(value, str),
            "bool": isinstance(value, bool),
            "object": isinstance(value, dict),
            "list": isinstance(value, list),
        }[self.kind]
        if not kind_ok:
            return False
        if self.kind in ("int", "number"):
            return (self.low is None or value >= self.low) and (self.high is None or value <= self.high)
        return True


def _num(x) -> str:
    if isinstance(x, int) and abs(x) >= 10_000:
        return f"{x:,}"
    return f"{x:g}" if isinstance(x, float) else str(x)


def _show(value) -> str:
    """A value as seen, short: its repr up to 60 characters, or its type for a container."""
    if isinstance(value, dict | list):
        return f"a JSON {'object' if isinstance(value, dict) else 'list'} of {len(value)} entries"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_fields(obj, fields: Mapping[str, Field], source, where: str = "") -> dict:
    """``obj`` (a JSON object) checked against ``fields``; -> obj. Fields not listed pass through
    (their owner checks them). SchemaError: '<source>: <where><name> must be <expected>, got <seen>'."""
    if not isinstance(obj, dict):
        name = where.rstrip(".") or "the file"
        seen = _show(obj) if isinstance(obj, list) else type(obj).__name__
        raise SchemaError(f"{source}: {name} must be a JSON object, got {seen}")
    for name, f in fields.items():
        if name not in obj:
            if f.required:
                raise SchemaError(f"{source}: {where}{name} is missing (expected {f.expected()})")
            continue
        if not f.ok(obj[name]):
            raise SchemaError(f"{source}: {where}{name} must be {f.expected()}, got {_show(obj[name])}")
    return obj


# ----------------------------------------------------------------------------------------------
# attnlab checkpoints
# ----------------------------------------------------------------------------------------------

CHECKPOINT_FORMAT = "attnlab-checkpoint/1"  # = attnlab.checkpoint_io.CHECKPOINT_FORMAT

_MODEL_FIELDS = {
    "kind": Field("str", required=False, choices=("encoder", "decoder")),
    # the sizes every checkpoint writes are required; the rest take ModelConfig's defaults (older files)
    **{name: Field("int", required=name in ("vocab_size", "d_model", "n_layers"), low=lo, high=hi)
       for name, (lo, hi) in MODEL_LIMITS.items()},
    "variant": Field("str", required=False),  # or a list; ModelConfig checks the names
    "gam_options": Field("object", required=False),
    "u": Field("number", required=False, low=0.0, high=1.0),
    "learn_u": Field("bool", required=False),
    "dropout": Field("number", required=False, low=0.0, high=1.0),
}
_GAM_FIELDS = {name: Field("int", required=False, low=lo, high=hi, null=name == "rank")
               for name, (lo, hi) in GAM_LIMITS.items()}


def check_model_config(model, source, where: str = "model.") -> dict:
    """The ``model`` section of a checkpoint: types, ``MODEL_LIMITS``, ``GAM_LIMITS`` and the size
    estimate (``MAX_MODEL_PARAMETERS``), before a model is built from it."""
    fields = dict(_MODEL_FIELDS)
    if isinstance(model, dict) and isinstance(model.get("variant"), list):
        fields["variant"] = Field("list")
    if isinstance(model, dict) and isinstance(model.get("gam"), list):
        fields["gam"] = Field("list")
    else:
        fields["gam"] = Field("bool", required=False)
    check_fields(model, fields, source, where)
    if "gam_options" in model:
        check_fields(model["gam_options"], _GAM_FIELDS, source, f"{where}gam_options.")
    for name in ("variant", "gam"):
        value = model.get(name)
        if isinstance(value, list) and len(value) != model["n_layers"]:
            raise SchemaError(f"{source}: {where}{name} must be one value or a list of n_layers="
                              f"{model['n_layers']} values, got a list of {len(value)}")
    d, ff, layers = model["d_model"], model.get("d_ff", _DEFAULT["d_ff"]), model["n_layers"]
    heads, positions = model.get("n_heads", _DEFAULT["n_heads"]), model.get("max_len", _DEFAULT["max_len"])
    brains = (model.get("gam_options") or {}).get("n_brains", 1)
    per_layer = 4 * d * d + 2 * d * ff + (2 * brains * heads * d * d if model.get("gam") else 0)
    estimate = (model["vocab_size"] + positions) * d + layers * per_layer
    if estimate > MAX_MODEL_PARAMETERS:
        raise SchemaError(
            f"{source}: {where[:-1] or 'model'} describes about {estimate:,} parameters (n_layers={layers}, "
            f"d_model={d}, d_ff={ff}, vocab_size={model['vocab_size']}, max_len={positions}); "
            f"expected at most {MAX_MODEL_PARAMETERS:,}"
        )
    return model


# ModelConfig's defaults of the optional sizes (attnlab/models.py; not imported: schema imports no torch)
_DEFAULT = {"d_ff": 256, "n_heads": 4, "max_len": 128}

_TOKENIZER_FIELDS = {"kind": Field("str", choices=("byte", "wordpiece")),
                     "vocab_file": Field("str", required=False)}


def check_checkpoint_config(config, source) -> dict:
    """An attnlab checkpoint's ``config.json``: format, the model section (:func:`check_model_config`),
    the tokenizer entry (kind; vocab_file a file name) and the step."""
    check_fields(config, {"format": Field("str"), "model": Field("object"),
                          "tokenizer": Field("object", required=False, null=True),
                          "step": Field("int", required=False, low=0)}, source)
    if config["format"] != CHECKPOINT_FORMAT:
        raise SchemaError(f"{source}: format must be {CHECKPOINT_FORMAT!r}, got {_show(config['format'])} "
                          "(not an attnlab checkpoint)")
    check_model_config(config["model"], source)
    if config.get("tokenizer") is not None:
        check_fields(config["tokenizer"], _TOKENIZER_FIELDS, source, "tokenizer.")
    return config


_STATE_FIELDS = {
    "step": Field("int", low=0),
    "data_position": Field("object"),
    "tokens_seen": Field("int", required=False, low=0),
    "corpus_sha256": Field("str", required=False),
    "world_size": Field("int", required=False, low=1),
    "loss_window": Field("list", required=False),
}
_POSITION_FIELDS = {"epoch": Field("int", low=0), "cursor": Field("int", low=0)}


def check_trainer_state(state, source, step: int | None = None) -> dict:
    """A checkpoint's ``trainer_state.json``: step >= 0 (equal to ``step``, the checkpoint's, when
    given), data_position {epoch, cursor >= 0}, tokens_seen >= 0, loss_window [sum, count]."""
    check_fields(state, _STATE_FIELDS, source)
    check_fields(state["data_position"], _POSITION_FIELDS, source, "data_position.")
    if step is not None and state["step"] != step:
        raise SchemaError(f"{source}: step must be {step} (the checkpoint's step), got {state['step']}")
    window = state.get("loss_window")
    if window is not None and not (
            len(window) == 2 and Field("number").ok(window[0]) and Field("int", low=0).ok(window[1])):
        raise SchemaError(f"{source}: loss_window must be [a finite loss sum, a step count >= 0], "
                          f"got {_show(window)}")
    return state


# ----------------------------------------------------------------------------------------------
# Manifests
# ----------------------------------------------------------------------------------------------

FIGURE_FORMAT = "attnlab-figure/1"  # = attnlab.figures.reproduce.MANIFEST_FORMAT
_INDEX = Field("int", required=False, low=0, null=True)  # a layer, head or token position
_FIGURE_PARAMS = {
    "layer": _INDEX, "head": _INDEX, "focus": _INDEX,
    "variant": Field("str", required=False), "variants": Field("list", required=False),
    "max_tokens": Field("int", required=False, low=1, high=4096),
    "eps": Field("number", required=False, low=0.0),
    "group": Field("str", required=False, choices=("variant", "layer")),
    "dist": Field("str", required=False, choices=("ecdf", "histogram")),
    "shared_scale": Field("bool", required=False),
}


def check_manifest(m, source, kinds: tuple[str, ...] = ()) -> dict:
    """An exported figure's manifest (``attnlab-figure/1``): figure {kind, params, window, labels},
    input {sha256}, sources [{model, settings}]; layer, head and focus are indices >= 0 (or null)."""
    check_fields(m, {"format": Field("str"), "figure": Field("object"), "input": Field("object"),
                     "sources": Field("list")}, source)
    if m["format"] != FIGURE_FORMAT:
        raise SchemaError(f"{source}: format must be {FIGURE_FORMAT!r}, got {_show(m['format'])} "
                          "(not an attnlab figure manifest)")
    check_fields(m["figure"], {"kind": Field("str", choices=kinds or None), "params": Field("object"),
                               "window": Field("int", low=0, high=1 << 31),
                               "labels": Field("list", required=False)}, source, "figure.")
    check_fields(m["figure"]["params"], _FIGURE_PARAMS, source, "figure.params.")
    for name in ("variants",):
        values = m["figure"]["params"].get(name)
        if values is not None and not all(isinstance(v, str) for v in values):
            raise SchemaError(f"{source}: figure.params.{name} must be a list of variant names, "
                              f"got {_show(values)}")
    labels = m["figure"].get("labels") or []
    if not all(isinstance(x, str) for x in labels):
        raise SchemaError(f"{source}: figure.labels must be a list of strings, got {_show(labels)}")
    check_fields(m["input"], {"sha256": Field("str")}, source, "input.")
    if not m["sources"]:
        raise SchemaError(f"{source}: sources must list at least one source, got an empty list")
    for k, src in enumerate(m["sources"]):
        check_fields(src, {"model": Field("object"), "settings": Field("object")}, source, f"sources[{k}].")
        u = src["settings"].get("u")
        if u is not None and not (Field("number", low=0.0, high=1.0).ok(u) or isinstance(u, list)):
            raise SchemaError(f"{source}: sources[{k}].settings.u must be a number in [0, 1] or a list "
                              f"per layer, got {_show(u)}")
    return m


def check_analysis_manifest(m, source) -> dict:
    """The ``manifest.json`` of an ``attnlab analyze`` output folder, as far as reproduce_figure reads
    it: input {sha256}."""
    check_fields(m, {"input": Field("object")}, source)
    check_fields(m["input"], {"sha256": Field("str")}, source, "input.")
    return m


# ----------------------------------------------------------------------------------------------
# Thread counts (--threads, train.threads)
# ----------------------------------------------------------------------------------------------

THREADS_PER_CORE = 4  # --threads / train.threads: at most this many per CPU core ...
MAX_THREADS = 1024  # ... and never more than this many (each torch thread is an OS thread)


def max_threads() -> int:
    """The most torch CPU threads a command may ask for: 4 per core of this machine (at least 8, so the
    app's Train page's choices always fit), at most 1,024."""
    return min(MAX_THREADS, max(8, THREADS_PER_CORE * (os.cpu_count() or 1)))


def check_threads(value, name: str = "--threads") -> int | None:
    """``value`` (None = torch's default) when it is an integer in [1, max_threads()]; else a ValueError
    naming ``name``, the range and what was given."""
    if value is None:
        return None
    high = max_threads()
    if not isinstance(value, (bool, float)):
        with contextlib.suppress(TypeError):  # a numpy or 0-d tensor integer as a Python int
            value = operator.index(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise ValueError(f"{name} must be an integer in [1, {high}] ({THREADS_PER_CORE} per CPU core, at "
                         f"most {MAX_THREADS}), got {value!r}")
    return value
