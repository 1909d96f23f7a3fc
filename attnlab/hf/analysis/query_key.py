"""One layer's queries and keys for one model input, through the capture path the analysis uses
(``capture_qk`` for a Hugging Face model, ``capture_attention_inputs`` + ``AttentionInputs.query_key``
for a native attnlab checkpoint), and a score as the sum of its per-dimension products (what
bertviz's neuron view draws): ``s_ij = scale · Σ_d q_id k_jd`` (docs/DESIGN.md §1).

The scores are the model's own: softmax over a row of :meth:`LayerQueryKey.scores` is that row of
the UNAS map ``hf.analyze`` gives (tested to 1e-5). Grouped-query layers keep their H_kv key heads;
query head h reads key head ``h // (H / H_kv)``.

The families captured at the score level (attnlab/hf/capture/score_adapters.py: MPNet, DeBERTa-v2,
GPT-Neo, BLOOM, Falcon) are refused (:func:`check_query_key_vectors`): what is captured there is the
scores after the model's own biases (an identity stands in for the keys), with no q and k vectors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnlab.normalizers.checks import scalar

__all__ = ["LayerQueryKey", "check_query_key_vectors", "layer_query_key", "query_keys"]


@dataclass(frozen=True)
class LayerQueryKey:
    """Queries and keys of one layer for one model input (batch of one)."""

    layer: int
    query: torch.Tensor  # (H, N, D) float32, after projection (and rotary embedding)
    key_heads: torch.Tensor  # (H_kv, N, D) float32, the layer's key heads (not repeated)
    scaling: float  # the layer's score scale (1/sqrt(D) unless the model says otherwise)
    mask: torch.Tensor | None  # (N, N) bool, True = may attend (causal and padding included); None: all
    softcap: float | None = None  # logits -> softcap * tanh(logits / softcap) (Gemma 2)

    @property
    def n_heads(self) -> int:
        return self.query.shape[0]

    @property
    def group(self) -> int:
        """Query heads per key head (1 without grouped-query attention)."""
        return self.query.shape[0] // self.key_heads.shape[0]

    def key_head(self, head: int) -> int:
        """The key head query head ``head`` reads."""
        self._check("head", head, self.n_heads)
        return head // self.group

    def _check(self, name: str, value, n: int) -> int:
        value = scalar(value)  # numpy and 0-d tensor numbers as Python ones
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n:
            raise ValueError(f"{name} must be an int in [0, {n}), got {value!r}")
        return value

    def products(self, head: int, query: int, key: int) -> torch.Tensor:
        """(D,) float64: ``scale · q_d · k_d`` of query position ``query`` and key position ``key``
        in ``head``; their sum is the pair's score before any softcap (:meth:`scores`)."""
        N = self.query.shape[1]
        self._check("head", head, self.n_heads)
        self._check("query", query, N)
        self._check("key", key, self.key_heads.shape[1])
        q = self.query[head, query].double()  # (D,)
        k = self.key_heads[self.key_head(head), key].double()  # (D,)
        return self.scaling * q * k

    def scores(self, head: int) -> torch.Tensor:
        """(N, N) float32 logits of ``head``: scale · q kᵀ, softcapped where the layer is, -inf where
        the mask forbids a pair. Softmax over a row is that row of the UNAS map."""
        self._check("head", head, self.n_heads)
        q = self.query[head]  # (N, D)
        k = self.key_heads[self.key_head(head)]  # (N, D)
        s = (q @ k.T) * self.scaling  # (N, N)
        if self.softcap is not None:
            s = self.softcap * torch.tanh(s / self.softcap)
        return s if self.mask is None else s.masked_fill(~self.mask, float("-inf"))


def _square_mask(mask: torch.Tensor | None, causal: bool, n: int) -> torch.Tensor | None:
    """A captured mask (bool, broadcastable to (B, H, N, N)) -> (N, N) of batch 0 (every head shares
    it); a causal layer without one gets j <= i."""
    if mask is None:
        return torch.ones(n, n, dtype=torch.bool).tril() if causal else None
    m = torch.as_tensor(mask).to("cpu")
    return torch.broadcast_to(m, (*m.shape[:-2], n, n)).reshape(-1, n, n)[0].clone()


def check_query_key_vectors(model) -> None:
    """ValueError for a Hugging Face ``model`` (``hf.load_model``) captured at the score level
    (attnlab/hf/capture/scores.py): its captured "query" is the score matrix after the model's own
    biases and its "key" an identity, so per-dimension q and k vectors do not exist. An encoder-decoder
    (attnlab/hf/capture/seq2seq.py) is refused too: one text's layer has no single q and k there."""
    from attnlab.hf.capture.score_adapters import adapter_for

    info = getattr(model, "info", None)
    if getattr(info, "encoder_decoder", False):
        raise ValueError(f"{info.name} is an encoder-decoder ({info.model_type}): its layers' queries and "
                         "keys come in three kinds (encoder, decoder, cross) over two texts; per-layer q "
                         "and k vectors of one text are not offered for it (expected an encoder-only or "
                         "decoder-only model)")

    adapter = adapter_for(getattr(model, "model", model))
    if adapter is not None:
        raise ValueError(_score_level_message(model, adapter.family, adapter.scores))


def _score_level_message(model, family: str, scores: str | None = None) -> str:
    what = f" ({scores})" if scores else ""
    name = getattr(getattr(model, "info", None), "name", "this model")
    return (f"{name} is a {family} model: its attention bypasses transformers' AttentionInterface, so "
            f"attnlab captures the scores at the module's softmax{what}, after the model's own biases, "
            "and no query and key vectors: there is no per-dimension q · k to show for it")


def layer_query_key(model, input_ids, layer: int) -> LayerQueryKey:
    """Layer ``layer``'s queries and keys for ``input_ids`` ((N,) or (1, N): one model input, special
    tokens included, e.g. a window's ``input_ids``), from ``model`` (``hf.load_model`` or a native
    checkpoint, ``hf.load_native``). The forward stops after that layer's q and k (Hugging Face).
    ValueError for a layer out of range, a GAM layer (per-brain scores, no single q and k), or a
    model captured at the score level (MPNet, DeBERTa-v2, GPT-Neo, BLOOM, Falcon;
    :func:`check_query_key_vectors`)."""
    return query_keys(model, input_ids, [layer])[layer]


def query_keys(model, input_ids, layers) -> dict[int, LayerQueryKey]:
    """:func:`layer_query_key` of several ``layers`` from one forward (up to the last of them)."""
    from attnlab.hf.capture.interface import capture_qk
    from attnlab.hf.load.native import NativeModel, capture_attention_inputs

    n_layers = model.info.n_layers
    layers = sorted({scalar(layer) for layer in layers})  # numpy and 0-d tensor numbers as Python ones
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n_layers:
            raise ValueError(f"layer must be an int in [0, {n_layers}), got {layer!r}")
    if not layers:
        raise ValueError("layers must name at least one layer")
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1).to(model.device)  # (1, N)
    N = ids.shape[1]
    out = {}
    with model.lock, torch.no_grad():
        if isinstance(model, NativeModel):
            for layer in layers:
                if model.model.blocks[layer].is_gam:
                    raise ValueError(
                        f"layer {layer} of {model.info.name} is a GAM layer: its scores are per brain, "
                        "with no single query and key"
                    )
            with capture_attention_inputs(model.model) as captured:
                model.model(ids)
            for layer in layers:
                c = captured[layer]
                q, k = c.query_key()  # (1, H, N, D) each
                out[layer] = LayerQueryKey(
                    layer,
                    q[0].float().cpu(),
                    k[0].float().cpu(),
                    q.shape[-1] ** -0.5,
                    _square_mask(c.mask, c.causal, N),
                )
            return out
        check_query_key_vectors(model)  # before the forward
        with capture_qk(model.model, stop_after=layers[-1] + 1) as captured:
            model.model(input_ids=ids, use_cache=False)
    for layer in layers:
        c = captured[layer]  # query (1, H, N, D), key_heads (1, H_kv, N, D)
        if c.scores_of is not None:  # scores S (1, H, N, N) with identity keys (capture/scores.py)
            raise ValueError(_score_level_message(model, c.scores_of))
        out[layer] = LayerQueryKey(
            layer,
            c.query[0].float().cpu(),
            c.key_heads[0].float().cpu(),
            float(c.scaling),
            _square_mask(c.mask, c.causal, N),
            c.softcap,
        )
    return out
