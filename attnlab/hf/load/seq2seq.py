"""Loading an encoder-decoder (T5, BART, mBART, Pegasus, Marian): one probe forward through the
score capture of attnlab/hf/capture/seq2seq.py proves that every attention call is one of the three
declared kinds, and gives the facts of :class:`ModelInfo` (the encoder's layers and heads, the decoder's)."""

from __future__ import annotations

from pathlib import Path

import torch

from attnlab.hf.capture.run_state import UnsupportedModelError
from attnlab.hf.capture.seq2seq import KINDS, capture_scores
from attnlab.hf.load.model_info import ModelInfo, ModelLoadError

__all__ = ["seq2seq_info", "decoder_start_id"]


def decoder_start_id(config) -> int:
    """The token the decoder starts from: ``decoder_start_token_id``, else the pad token (T5's rule)."""
    for name in ("decoder_start_token_id", "pad_token_id", "bos_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value >= 0:
            return value
    raise ModelLoadError(f"the {config.model_type} config names no decoder_start_token_id (nor a pad token); "
                         "attnlab cannot tell which token the decoder starts from")


def seq2seq_info(directory: Path, model, tokenizer, config, max_length: int, device) -> ModelInfo:
    """-> the :class:`ModelInfo` of an encoder-decoder after a probe forward (2 source tokens, the
    decoder start token); ModelLoadError naming the directory when the probe fails or finds a kind
    missing."""
    ids = tokenizer("attention", add_special_tokens=True)["input_ids"][:4] or [0]
    source = torch.tensor([ids], device=device)  # (1, N)
    target = torch.tensor([[decoder_start_id(config)]], device=device)  # (1, 1)
    try:
        with capture_scores(model, config.model_type) as records, torch.no_grad():
            model(input_ids=source, decoder_input_ids=target, use_cache=False)
    except UnsupportedModelError as e:
        raise ModelLoadError(f"unsupported model in {directory}: {e}") from None
    except Exception as e:  # noqa: BLE001 -- the model's own code failed on a plain forward
        raise ModelLoadError(f"unsupported model in {directory}: {type(model).__name__} failed on a plain "
                             f"forward pass ({e.__class__.__name__}: {e})") from None
    found = {k: [r for r in records if r.kind == k] for k in KINDS}
    missing = [k for k, rs in found.items() if not rs]
    if missing:
        raise ModelLoadError(f"unsupported model in {directory}: no {', '.join(missing)} attention was seen "
                             "in a forward pass (expected encoder, decoder and cross attention)")
    enc, dec = found["encoder"], found["decoder"]
    return ModelInfo(
        path=str(directory.resolve()),
        name=directory.resolve().name,
        model_type=config.model_type,
        architecture=type(model).__name__,
        n_layers=len(enc),
        n_heads=enc[0].scores.shape[1],
        n_kv_heads=enc[0].scores.shape[1],
        max_length=max_length,
        causal=False,
        embedded=False,
        encoder_decoder=True,
        decoder_layers=len(dec),
        decoder_heads=dec[0].scores.shape[1],
    )
