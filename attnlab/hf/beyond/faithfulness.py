"""Faithfulness per normalizer: do a variant's token-importance measures rank the tokens the way
removing them does? (Jain & Wallace 2019, "Attention is not Explanation", Sec. 4, asked of each
variant.)

For each variant the model runs in swap mode (the variant in every layer). Per text token j:

- importance measures, from that run: ``column_mass`` (mean over layers and heads of m_j),
  ``contribution_mass`` (mean of c_j = m_j ||f_h(x_j)||, ``attnlab.contributions``), ``rollout``
  (mean over outputs i of the rollout R_ij, ``attnlab.stats.attention_rollout``) and ``flow`` (mean
  over outputs of the max-flow value, ``attnlab.flow``; left out with a note beyond its size limit);
- leave-one-token-out importance: token j masked out (attention mask 0: neither key nor query),
  the cosine distance 1 - cos(y, y^(-j)) of the output y = mean over the tokens other than j of the
  final hidden states.

Kendall's tau-b (``scipy.stats.kendalltau``) between each measure and the leave-one-out importance
over the text tokens (special tokens are neither masked nor ranked); NaN where one side is constant.
Cost: per variant 1 + n forwards (n text tokens, ``batch_size`` at a time) and the flow (see
``attnlab.flow``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from attnlab import contributions, flow, stats
from attnlab.hf.capture.interface import use_variant
from attnlab.hf.capture.values import record_values, summarize, value_paths
from attnlab.hf.capture.variant_params import variant_kwargs
from attnlab.hf.load.loading import LoadedModel, model_on
from attnlab.normalizers import VARIANTS
from attnlab.normalizers.checks import scalar

__all__ = ["MEASURES", "FaithfulnessResult", "faithfulness", "token_importance"]

MEASURES = ("column_mass", "contribution_mass", "rollout", "flow")


@dataclass
class FaithfulnessResult:
    """Kendall tau of each (variant, measure) and the per-token values behind it."""

    table: object  # DataFrame: variant, measure, tau, p_value, n_tokens
    importance: dict[str, dict[str, torch.Tensor]]  # variant -> measure -> (n,) over the ranked tokens
    leave_one_out: dict[str, torch.Tensor]  # variant -> (n,)
    tokens: list[str]  # the ranked (text) tokens
    positions: list[int]  # their positions in the window
    notes: list[str] = field(default_factory=list)


def token_importance(
    weights: torch.Tensor,
    norms: torch.Tensor | None = None,
    measures: Sequence[str] = MEASURES,
    notes: list[str] | None = None,
) -> dict[str, torch.Tensor]:
    """measure -> (N,) importance of each key from one window's weights (L, H, N, N) (and value norms
    (L, H, N) for ``contribution_mass``); ``flow`` is skipped (with a note) beyond its size limit."""
    L, H, N, _ = weights.shape
    out = {}
    for m in measures:
        if m == "column_mass":
            out[m] = stats.column_mass(weights).mean((0, 1))
        elif m == "contribution_mass":
            if norms is None:
                raise ValueError("contribution_mass needs norms (L, H, N), the value norms of the same run")
            out[m] = contributions.contribution_mass(weights, norms).mean((0, 1))
        elif m == "rollout":
            out[m] = stats.attention_rollout(weights).mean(0)
        elif m == "flow":
            if flow.flow_work(L, N, N) > flow.MAX_FLOW_WORK:
                if notes is not None:
                    notes.append(f"flow left out: {N} tokens x {L} layers is over attnlab.flow.MAX_FLOW_WORK")
                continue
            out[m] = flow.attention_flow(weights).mean(0).float()
        else:
            raise ValueError(f"measures must be among {MEASURES}, got {m!r}")
    return out


def _pooled_without(hidden: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Mean of hidden (B, N, D) over the positions where keep (B, N) is True -> (B, D)."""
    k = keep.to(hidden.dtype)[..., None]
    return (hidden * k).sum(1) / k.sum(1).clamp_min(1.0)


def _leave_one_out(net, ids, positions, batch_size, step=None) -> torch.Tensor:
    """Cosine distance of the pooled output with and without each of ``positions`` (n,); ``step(b)``
    after each batch of b masked copies."""
    N = ids.shape[1]
    base = net(
        input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True, use_cache=False
    ).hidden_states[-1]  # (1, N, D)
    out = []
    for p0 in range(0, len(positions), batch_size):
        pos = torch.tensor(positions[p0 : p0 + batch_size], device=ids.device)
        keep = torch.ones(len(pos), N, dtype=torch.long, device=ids.device)
        keep[torch.arange(len(pos)), pos] = 0
        y = net(
            input_ids=ids.expand(len(pos), -1),
            attention_mask=keep,
            output_hidden_states=True,
            use_cache=False,
        ).hidden_states[-1]  # (b, N, D)
        a = _pooled_without(base.expand(len(pos), -1, -1), keep.bool())
        b = _pooled_without(y, keep.bool())
        out.append(1.0 - torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1))
        if step is not None:
            step(len(pos))
    return torch.cat(out).cpu()


def _tokens(loaded: LoadedModel, text, window_index: int, window, overlap) -> tuple[torch.Tensor, list]:
    """(input ids (1, N) on the model's device, special-token flags) of an analysed Window, or of window
    ``window_index`` of a text (cut as analyze cuts it)."""
    from attnlab.hf.analysis.one_window import text_window
    from attnlab.hf.capture.windows import Window

    if not isinstance(text, Window):
        if not isinstance(text, str) or not text.strip():
            raise ValueError(
                "text must be a non-empty str (or an attnlab.hf.Window); there is nothing to leave out"
            )
        text = text_window(loaded, text, window_index, window=window, overlap=overlap)
    return torch.tensor([text.input_ids], device=loaded.device), [bool(x) for x in text.special]


def faithfulness(
    model: LoadedModel | str | os.PathLike | None,
    text,
    variants: Sequence[str] = VARIANTS,
    params: Mapping[str, Mapping] | None = None,
    *,
    measures: Sequence[str] = MEASURES,
    window_index: int = 0,
    window: int | None = None,
    overlap: int | None = None,
    batch_size: int = 16,
    device=None,
    progress: bool = False,
    on_progress=None,
) -> FaithfulnessResult:
    """Kendall tau between each importance measure and leave-one-token-out importance, per variant.

    Args:
        model: a LoadedModel, a model directory or None (the embedded MiniLM).
        text: a text, or a :class:`attnlab.hf.Window` of an analysis (its ids and special-token flags).
        window_index: for a text, which of its windows (0-based, cut as :func:`attnlab.hf.analyze` cuts
            them: ``window`` tokens each, ``overlap`` shared); ValueError for one the text lacks.
        variants: registered variants; params: {variant: its parameters} (defaults for the rest).
        measures: any of ``MEASURES``.
        batch_size: masked copies of the text per forward.
        progress: a tqdm bar over the variants' leave-one-out forwards (one per text token and variant:
            the cost grows as N forwards of N tokens); on_progress: called as on_progress(done, total)
            after each batch (e.g. a Streamlit progress bar).

    Raises ValueError for an empty text, a window the text lacks, or one with fewer than 2 text tokens
    (nothing to rank).
    """
    from scipy.stats import kendalltau

    loaded = model_on(model, device)
    if isinstance(variants, str):
        variants = (variants,)
    variants = tuple(dict.fromkeys(variants))
    for v in variants:
        if v not in VARIANTS:
            raise ValueError(f"variants must be among {tuple(VARIANTS)}, got {v!r}")
    bad = [m for m in measures if m not in MEASURES]
    if bad or not measures:
        raise ValueError(f"measures must be a non-empty subset of {MEASURES}, got {list(measures)!r}")
    batch_size = scalar(batch_size)  # numpy and 0-d tensor numbers as Python ones
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    ids, special = _tokens(loaded, text, window_index, window, overlap)  # (1, N), N flags
    positions = [i for i, sp in enumerate(special) if not sp]
    if len(positions) < 2:
        raise ValueError(
            f"leave-one-out needs a text of at least 2 tokens to rank, got {len(positions)} "
            "(special tokens are not counted)"
        )
    params = dict(params or {})
    importance, loo, notes = {}, {}, []
    rows = []
    total, done = len(variants) * len(positions), [0]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, unit="token", desc="leaving tokens out", leave=False)

    def step(n: int) -> None:
        done[0] += n
        if bar is not None:
            bar.update(n)
        if on_progress is not None:
            on_progress(done[0], total)

    with contextlib.ExitStack() as stack, loaded.lock, torch.no_grad():
        if bar is not None:
            stack.callback(bar.close)
        # under the lock, as every caller: a traced model's first call runs a forward of its own
        paths = value_paths(loaded.model) if "contribution_mass" in measures else None
        for v in variants:
            kw = variant_kwargs(v, params.get(v), causal=loaded.info.causal)
            with (
                use_variant(loaded.model, v, **kw, return_weights=True),
                record_values(loaded.model, paths or []) as forwards,
            ):
                out = loaded.model(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    output_attentions=True,
                    use_cache=False,
                )
            # the masked copies need neither weights nor recorded values: the variant's fused attention
            # where it has one (no (b, H, N, N) per layer), and nothing kept per batch
            with use_variant(loaded.model, v, **kw):
                loo[v] = _leave_one_out(loaded.model, ids, positions, batch_size, step)
            weights = torch.stack(out.attentions)[:, 0].float().cpu()  # (L, H, N, N)
            norms = summarize(forwards[0], paths).norms if paths else None
            imp = token_importance(weights, norms, measures, notes if v == variants[0] else None)
            importance[v] = {m: x[positions].double() for m, x in imp.items()}
            for m, x in importance[v].items():
                res = kendalltau(x.numpy(), loo[v].numpy())
                rows.append(
                    {
                        "variant": v,
                        "measure": m,
                        "tau": float(res.statistic),
                        "p_value": float(res.pvalue),
                        "n_tokens": len(positions),
                    }
                )
    import pandas as pd

    tokens = loaded.tokenizer.convert_ids_to_tokens([int(ids[0, i]) for i in positions])
    return FaithfulnessResult(
        table=pd.DataFrame(rows),
        importance=importance,
        leave_one_out=loo,
        tokens=tokens,
        positions=positions,
        notes=notes,
    )
