"""A position bias that arrives inside the attention mask (transformers >= 5.25's Falcon with ALiBi: the
bias slope_h * j / sqrt(Dh) is written into the additive float mask it hands the AttentionInterface).

The interface's q and k then do not make the scores: the layer's scores are

    S = scale * q k^T + A      (A: the float mask, (B, 1|H, M, N); masked entries <= finfo.min / 2)

so the capture and the swap work on S, as the families of attnlab/hf/capture/scores.py do: the captured
layer holds S with the identity as keys (``scores.scores_as_layer``), and a variant's weights are its
normalizer of S under the mask (``scores.variant_weights``). A mask of only 0 and "masked" carries no
bias and takes the plain q, k path.
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import repeat_kv

from attnlab.hf.capture.run_state import UnsupportedModelError

__all__ = ["KWARG", "split_mask", "biased_scores", "family_of"]

# the capture's layer hooks get the bias under this keyword: hooks that compute from q and k (the fused
# analyses) decline such a layer; the value trace, which reads only values, takes it
KWARG = "attnlab_mask_bias"


def split_mask(attention_mask: torch.Tensor | None,
               n_keys: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """transformers' mask, read once -> (allowed, bias).

    allowed: bool (B, 1|H, M, n_keys), True = may attend, or None (no mask). Boolean masks pass through,
    integer ones are nonzero = attend, additive float ones are 0 = attend and masked <= finfo.min / 2
    (or -inf). bias: the float mask itself when it also holds other values (a position bias), else None.
    """
    if attention_mask is None:
        return None, None
    mask = attention_mask[..., :n_keys]
    if mask.dtype == torch.bool:
        return mask, None
    if not mask.is_floating_point():
        return mask != 0, None
    allowed, blocked = mask == 0, mask <= torch.finfo(mask.dtype).min / 2
    if bool((allowed | blocked).all()):
        return allowed, None
    return ~blocked, mask


def biased_scores(module, query: torch.Tensor, key: torch.Tensor, bias: torch.Tensor, scale: float,
                  softcap: float | None) -> torch.Tensor:
    """S = scale * q k^T + bias in float32 (B, H, M, N); query (B, H, M, D), key (B, H_kv, N, D) (grouped
    heads repeated here). A softcap beside a mask bias is refused: no model combines them, and where the
    cap would go relative to the bias is not defined."""
    if softcap is not None:
        raise UnsupportedModelError(
            f"{type(module).__name__} passes a softcap and a position bias in its attention mask; attnlab "
            "does not know whether the cap comes before the bias or after it: not supported"
        )
    k = repeat_kv(key, query.shape[1] // key.shape[1])  # (B, H, N, D)
    scores = torch.matmul(query.float(), k.float().transpose(-1, -2)).mul_(scale)  # (B, H, M, N)
    return scores.add_(bias.float())


def family_of(module) -> str:
    """How messages name a layer captured through its mask bias, e.g. "Falcon (a position bias in its
    attention mask)"."""
    name = type(module).__name__
    return f"{name.removesuffix('Attention') or name} (a position bias in its attention mask)"
