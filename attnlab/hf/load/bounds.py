"""Bounds on a Hugging Face ``config.json``, checked against the weights' own shapes before transformers
builds anything from it (a crafted ``num_hidden_layers: 1000000`` would otherwise allocate for minutes).

    check_config_bounds(config, directory)   -> None, or ModelLoadError naming the field

Two checks, both from small files (the config and the safetensors headers; no tensor is read):

1. every size field is an integer in ``HF_LIMITS`` (layers, heads, widths, vocabulary, positions);
2. the config fits the weights: no more layers than the weights hold; hidden, intermediate and
   vocabulary sizes no larger than the weights' largest dimension; learned positions no more than the
   weights' position table; and the parameters the config describes at most ``SIZE_SLACK`` times the
   weights' own element count (+ 10 M), so the model cannot be far larger than its weights.

Bounds are documented in docs/ANALYSIS.md ("Model directories: what is checked").
"""

from __future__ import annotations

import re
from pathlib import Path

from attnlab.checkpoint_io import safetensors_shapes
from attnlab.hf.load.model_info import ModelLoadError
from attnlab.schema import SchemaError, contained_file, read_json

__all__ = ["HF_LIMITS", "SIZE_SLACK", "check_config_bounds", "weight_shapes"]

_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_HEADS = ("num_attention_heads", "n_head", "num_heads", "num_key_value_heads")
_WIDTH = ("hidden_size", "n_embd", "d_model", "dim")
_FF = ("intermediate_size", "n_inner", "ffn_dim", "hidden_dim", "d_ff")
_VOCAB = ("vocab_size",)
_POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")
# (names, lowest, highest): generous for any released model (LLaMA-3 405B: 126 layers, 128 heads,
# 16,384 wide, 53,248 intermediate, 128,256 ids; 10 M positions exist with rotary embeddings).
HF_LIMITS = (
    (_LAYERS, 1, 1024),
    (_HEADS, 1, 1024),
    (_WIDTH, 1, 1 << 16),
    (_FF, 1, 1 << 18),
    (_VOCAB, 1, 1 << 22),
    (_POSITIONS, 1, 1 << 24),
    (("type_vocab_size",), 0, 1 << 16),
)
SIZE_SLACK = 4  # parameters the config describes <= SIZE_SLACK x the weights' elements + 10 M
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers?|h|blocks?|block)\.(\d+)\.")
_POSITION_TABLE = re.compile(r"(position_embeddings|wpe|embed_positions)\.weight$")


def _sections(config: dict) -> list[tuple[str, dict]]:
    """The config and its nested model sections (e.g. ``text_config``), with a prefix for messages."""
    out = [("", config)]
    out += [(f"{k}.", v) for k, v in config.items() if isinstance(v, dict) and k.endswith("_config")]
    return out


def _first(section: dict, names) -> int | None:
    return next((section[n] for n in names if isinstance(section.get(n), int)), None)


def weight_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """{tensor: shape} over the model's safetensors files, from their headers (shards named by
    ``model.safetensors.index.json`` must be files inside ``directory``)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                seen = type(weight_map).__name__
                raise SchemaError(f"{index}: weight_map must be a JSON object, got {seen}")
            files = [contained_file(directory, name, index) for name in sorted(set(weight_map.values()))]
        except (SchemaError, AttributeError) as e:
            raise ModelLoadError(f"cannot load the model in {directory}: {e}") from None
    else:
        files = sorted(directory.glob("*.safetensors"))
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            shapes.update(safetensors_shapes(f))
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot load the model in {directory}: {e}") from None
    return shapes


def check_config_bounds(config: dict, directory: Path) -> None:
    """ModelLoadError, naming ``config.json``'s field, what was expected and what was seen, when a size
    is out of ``HF_LIMITS`` or does not fit the weights (see the module docstring)."""
    source = directory / "config.json"
    for prefix, section in _sections(config):
        for names, low, high in HF_LIMITS:
            for name in names:
                value = section.get(name)
                if value is None:
                    continue
                if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                    raise ModelLoadError(f"{source}: {prefix}{name} must be an integer in [{low}, {high:,}], "
                                         f"got {repr(value)[:40]}")
    shapes = weight_shapes(directory)
    if not shapes:
        return
    largest = max((d for s in shapes.values() for d in s), default=1)
    numel = sum(_prod(s) for s in shapes.values())
    layers_held = {int(m.group(1)) for k in shapes for m in [_LAYER_INDEX.search(k)] if m}
    tables = [s[0] for k, s in shapes.items() if _POSITION_TABLE.search(k) and len(s) == 2]
    for prefix, section in _sections(config):
        layers, width = _first(section, _LAYERS), _first(section, _WIDTH)
        if layers is not None and layers_held and layers > max(layers_held) + 1:
            name = next(n for n in _LAYERS if section.get(n) == layers)
            raise ModelLoadError(f"{source}: {prefix}{name} is {layers}, but the weights hold "
                                 f"{max(layers_held) + 1} layers; expected at most that many")
        for names in (_WIDTH, _FF, _VOCAB):
            value = _first(section, names)
            if value is not None and value > largest:
                name = next(n for n in names if section.get(n) == value)
                raise ModelLoadError(f"{source}: {prefix}{name} is {value:,}, larger than any dimension of "
                                     f"the weights (at most {largest:,}); expected a size the weights have")
        positions = _first(section, _POSITIONS)
        if positions is not None and tables and positions > max(tables):
            name = next(n for n in _POSITIONS if section.get(n) == positions)
            raise ModelLoadError(f"{source}: {prefix}{name} is {positions:,}, but the weights' position "
                                 f"table has {max(tables):,} rows; expected at most that many")
        if layers is not None and width is not None:
            ff = _first(section, _FF) or 4 * width
            vocab = _first(section, _VOCAB) or 0
            estimate = layers * (4 * width * width + 3 * width * ff) + vocab * width
            if estimate > SIZE_SLACK * numel + 10_000_000:
                raise ModelLoadError(
                    f"{source}: {prefix}the config describes about {estimate:,} parameters ({layers} layers "
                    f"x {width} wide, intermediate {ff}), the weights hold {numel:,}; expected a config "
                    "that matches its weights"
                )


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
