"""A source text and a target text through an encoder-decoder (T5, BART, mBART, Pegasus, Marian):
the three kinds of attention (attnlab/hf/capture/seq2seq.py) under every variant.

The encoder reads the source (its tokens as the tokenizer encodes a text, special tokens included);
the decoder reads the target teacher-forced: the decoder start token, then the target's tokens as the
tokenizer encodes it (``decoder_start_token_id`` + target ids: the labels shifted right, with the last
label kept so that every target token is a query). Without a target the decoder reads its start token
alone (one query row: what the first generated token attends). Shapes, per variant:
``weights["encoder"]`` (L_enc, H, N, N), ``weights["decoder"]`` (L_dec, H, M, M),
``weights["cross"]`` (L_dec, H, M, N); N source tokens, M target tokens (start token included).

Recompute mode: every variant from the scores the model normalizes (T5's relative position bias
included); swap mode: the variant replaces the attention of every layer of the three kinds (the BART
family; T5 adds a position bias attnlab_<variant> does not model and is refused).
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import torch

from attnlab.hf.analysis.seq2seq_result import Seq2SeqResult
from attnlab.hf.capture.interface import use_variant
from attnlab.hf.capture.run_state import DEFAULT_U, _layer_value, check_settings
from attnlab.hf.capture.seq2seq import FAMILIES, KINDS, capture_scores
from attnlab.hf.capture.windows import Window, check_token_ids, iter_windows, plan_windows, special_affixes
from attnlab.hf.capture.windows import tokenize_text as _tokenize
from attnlab.hf.compute.weights import check_arguments
from attnlab.hf.load.model_info import LoadedModel
from attnlab.hf.load.seq2seq import decoder_start_id
from attnlab.normalizers import attention_weights, check_params

__all__ = ["analyze_seq2seq", "causal_given", "check_target", "seq2seq_windows"]


def check_target(target, info) -> None:
    """ValueError naming ``target`` when it is given to a model that is not an encoder-decoder, or is not
    a non-empty str (None: the decoder start token alone)."""
    if target is None:
        return
    if not info.encoder_decoder:
        what = "a causal" if info.causal else "an encoder-only"
        raise ValueError(f"target is for encoder-decoder models (T5, BART, ...); {info.name} is {what} "
                         f"{info.model_type} model: expected target=None, got a {type(target).__name__}")
    if not isinstance(target, str):
        raise ValueError(f"target must be a str (or None: the decoder start token alone), got "
                         f"{type(target).__name__}")
    if not target.strip():
        raise ValueError("target is empty (or only whitespace): expected the text the decoder reads, or "
                         "target=None for the decoder start token alone")


def _one_window(loaded: LoadedModel, text: str, name: str, room: int) -> Window:
    """``text`` as one window of the tokenizer's tokens with its special tokens; ValueError naming
    ``name`` when it is longer than ``room`` tokens."""
    tokenizer = loaded.tokenizer
    prefix, suffix = special_affixes(tokenizer)
    tokenized = _tokenize(tokenizer, text)
    if len(tokenized) == 0:
        raise ValueError(f"{name} produced no tokens for this tokenizer; expected at least one")
    check_token_ids(tokenized, prefix + suffix, loaded.model.get_input_embeddings().num_embeddings, tokenizer)
    n_special = len(prefix) + len(suffix)
    if len(tokenized) + n_special > room:
        raise ValueError(f"{name} is too long for {loaded.info.name}: expected at most {room - n_special} "
                         f"tokens ({room} with its special tokens), got {len(tokenized)}")
    windowing = plan_windows(len(tokenized), max(len(tokenized), 2) + n_special, n_special, 0)
    return next(iter_windows(tokenizer, text, tokenized, windowing))


def seq2seq_windows(loaded: LoadedModel, source: str, target: str | None) -> tuple[Window, Window]:
    """(the encoder's window: the source's tokens, the decoder's: its start token, then the target's)."""
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"text must be a non-empty str (the source the encoder reads), got {source!r:.40}")
    check_target(target, loaded.info)
    limit = loaded.info.max_length
    src = _one_window(loaded, source, "text", limit)
    start = decoder_start_id(loaded.model.config)
    start_token = loaded.tokenizer.convert_ids_to_tokens([start])[0]
    if target is None:
        return src, Window(index=0, start=0, stop=0, input_ids=[start], tokens=[start_token], word_ids=[None],
                           special=np.ones(1, dtype=bool), punctuation=np.zeros(1, dtype=bool),
                           char_spans=[(-1, -1)])
    tgt = _one_window(loaded, target, "target", limit - 1)  # the start token takes a position
    return src, dataclasses.replace(
        tgt, input_ids=[start, *tgt.input_ids], tokens=[start_token, *tgt.tokens],
        word_ids=[None, *tgt.word_ids], special=np.concatenate([[True], tgt.special]),
        punctuation=np.concatenate([[False], tgt.punctuation]),
        char_spans=[(-1, -1), *tgt.char_spans])


def _check_shapes(given: dict, info) -> None:
    """A per-head tensor parameter must broadcast to each kind's (L, H)."""
    shapes = {"encoder": (info.n_layers, info.n_heads), "decoder": (info.decoder_layers, info.decoder_heads)}
    for kind, (L, H) in shapes.items():
        try:
            check_settings(given, L, H)
        except ValueError as e:
            raise ValueError(f"{e} (the {kind} of {info.name})") from None


def causal_given(variants, given: dict) -> dict:
    """The parameters the decoder's self-attention takes: ``given`` less those a variant's causal rule
    refuses (e.g. Sinkhorn's iters > 1), which then take the rule's value (iters=1) there, while the
    encoder's and the cross-attention, not causal, take them as given."""
    refused = {n for n, x in given.items() for v in variants if not _causal_accepts(v, n, x)}
    return {n: x for n, x in given.items() if n not in refused}


def _causal_accepts(variant: str, name: str, value) -> bool:
    try:
        check_params(variant, {name: value}, causal=True)
    except ValueError:
        return False
    return True


def _recompute(loaded: LoadedModel, src: torch.Tensor, tgt: torch.Tensor, variants, given: dict) -> dict:
    """kind -> variant -> (L, H, M, N) from the captured scores (attnlab/hf/capture/seq2seq.py), each
    call's weights computed as the forward runs (one call's scores held at a time). The decoder's
    self-attention takes :func:`causal_given`'s parameters, the encoder and cross-attention ``given``."""
    out = {k: {v: [] for v in variants} for k in KINDS}
    per_kind = {"encoder": given, "decoder": causal_given(variants, given), "cross": given}

    def consume(r) -> None:  # scores (1, H, M, N), mask (1, 1, M, N)
        H = r.scores.shape[1]
        params = {n: _layer_value(x, r.layer, H) for n, x in per_kind[r.kind].items()}
        for v in variants:
            w = attention_weights(r.scores, v, mask=r.mask, causal=r.kind == "decoder", **params)
            out[r.kind][v].append(w[0].cpu())  # (H, M, N)

    with loaded.lock, torch.no_grad(), capture_scores(loaded.model, loaded.info.model_type, consume):
        loaded.model(input_ids=src, decoder_input_ids=tgt, use_cache=False)
    return {k: {v: torch.stack(ws) for v, ws in per.items()} for k, per in out.items()}


def _swap(loaded: LoadedModel, src: torch.Tensor, tgt: torch.Tensor, variants, given: dict) -> dict:
    """kind -> variant -> (L, H, M, N) with the variant in place of every attention (output_attentions)."""
    name, _, swappable = FAMILIES[loaded.info.model_type]
    if not swappable:
        raise ValueError(f"mode='swap' is not supported for {name} ({loaded.info.name}): {name} adds a "
                         "relative position bias to its attention scores, which attnlab_<variant> does not "
                         "model; "
                         "expected mode='recompute', got mode='swap'")
    tensors = [n for n, x in given.items() if isinstance(x, torch.Tensor) and x.numel() > 1]
    if tensors:
        raise ValueError(f"{tensors[0]}: swap mode on an encoder-decoder takes one value for every layer "
                         "(its attention calls interleave the decoder's self- and cross-attention); expected "
                         f"a number, got a tensor of shape {tuple(given[tensors[0]].shape)}")
    out = {k: {} for k in KINDS}
    for v in variants:
        with loaded.lock, torch.no_grad(), use_variant(loaded.model, v, return_weights=True, **given):
            res = loaded.model(input_ids=src, decoder_input_ids=tgt, output_attentions=True, use_cache=False)
        for kind, maps in zip(KINDS, (res.encoder_attentions, res.decoder_attentions, res.cross_attentions),
                              strict=True):
            out[kind][v] = torch.stack(maps)[:, 0].float().cpu()  # (L, H, M, N)
    return out


def analyze_seq2seq(text: str, loaded: LoadedModel, target: str | None, variants, mode: str = "recompute",
                    u=None, iters=None, **params) -> Seq2SeqResult:
    """The analysis of :func:`attnlab.hf.analyze` for an encoder-decoder (see this module's docstring):
    ``text`` is the source, ``target`` the text the decoder reads (None: its start token alone)."""
    info = loaded.info
    variants, given = check_arguments(variants, mode, {"u": u, "iters": iters, **params})
    _check_shapes(given, info)
    for v in variants:  # the decoder's self-attention is causal: each variant's causal rule applies
        check_params(v, given)  # there (causal_given); the encoder and cross-attention take ``given``
    if mode == "swap":
        for v in variants:
            check_params(v, given, causal=True)  # one value for every call of the three kinds
    src_window, tgt_window = seq2seq_windows(loaded, text, target)
    dev = loaded.device
    src = torch.tensor([src_window.input_ids], device=dev)  # (1, N)
    tgt = torch.tensor([tgt_window.input_ids], device=dev)  # (1, M)
    compute = _recompute if mode == "recompute" else _swap
    weights = compute(loaded, src, tgt, variants, given)
    from attnlab.hf.analysis.pipeline import _causal_notes

    decoder = causal_given(variants, given)
    causal = [n.replace(f"{info.name} is causal", "the decoder's self-attention is causal")
              for n in _causal_notes(info.name, variants, decoder)]
    kept = {n: given[n] for n in given.keys() - decoder.keys()}
    if kept:  # e.g. iters=5: the encoder and cross-attention take it, the decoder the causal rule's
        causal.append("the encoder's self-attention and the cross-attention are not causal: they take "
                      + ", ".join(f"{n}={x!r}" for n, x in sorted(kept.items())))
    notes = list(loaded.notes) + causal
    if target is None:
        notes.append("no target: the decoder reads its start token alone (one query row)")
    digest = hashlib.sha256(f"{text}\x00{target or ''}".encode()).hexdigest()
    return Seq2SeqResult(model=info, variants=variants, mode=mode, u=given.get("u", DEFAULT_U),
                         iters=check_params("sinkhorn", {"iters": given.get("iters")})["iters"],
                         source=src_window, target=tgt_window, weights=weights, text_sha256=digest,
                         notes=notes, device=str(dev))
