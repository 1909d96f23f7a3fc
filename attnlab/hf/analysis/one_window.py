"""One window of a text, cut as :func:`attnlab.hf.analyze` cuts it: what attention flow, per-head
interventions and faithfulness describe (they cost a model pass per head or per token, or a max
flow per token pair, so they take one window, ``window_index``, not the whole text)."""

from __future__ import annotations

from itertools import islice

import torch

from attnlab.hf.capture.windows import Window, iter_windows
from attnlab.hf.load.loading import LoadedModel
from attnlab.normalizers.checks import scalar

__all__ = ["text_window", "window_flow"]


def text_window(
    loaded: LoadedModel, text: str, window_index: int = 0, *, window: int | None = None,
    overlap: int | None = None,
) -> Window:
    """Window ``window_index`` (0-based) of ``text`` for ``loaded``'s tokenizer, with analyze's windowing
    (``window`` tokens incl. special tokens, by default analyze's: a causal model's whole context,
    else min(max length, 512); ``overlap`` text tokens).

    ValueError for an empty text, or naming ``window_index`` and how many windows the text has.
    """
    from attnlab.hf.analysis.pipeline import stream_analysis

    if not isinstance(text, str) or not text.strip():
        raise ValueError("text must be a non-empty str; there is nothing to cut into windows")
    stream = stream_analysis(text, loaded, ("unas",), window=window, overlap=overlap)
    n = stream.windowing.n_windows
    window_index = scalar(window_index)  # numpy and 0-d tensor numbers as Python ones
    if isinstance(window_index, bool) or not isinstance(window_index, int) or not 0 <= window_index < n:
        raise ValueError(
            f"window_index must be an integer in [0, {n - 1}]: the text has {n} window(s) of "
            f"{stream.windowing.window} tokens; got {window_index!r}"
        )
    windows = iter_windows(loaded.tokenizer, text, stream.tokenized, stream.windowing)
    return next(islice(windows, window_index, None))


def window_flow(
    model,
    text: str,
    variant: str = "unas",
    outputs=None,
    *,
    window_index: int = 0,
    window: int | None = None,
    overlap: int | None = None,
    mode: str = "recompute",
    **params,
) -> tuple[torch.Tensor, Window]:
    """Attention flow (:func:`attnlab.flow.attention_flow`) of one window of ``text`` under ``variant``:
    -> (flow (n_outputs, N), the window). The size limit is checked before the model runs."""
    from attnlab import flow
    from attnlab.hf.analysis.pipeline import stream_analysis
    from attnlab.hf.load.loading import model_on

    loaded = model_on(model, None)
    win = text_window(loaded, text, window_index, window=window, overlap=overlap)
    N, L = len(win.input_ids), loaded.info.n_layers
    n_out = N if outputs is None else len(list(outputs))
    if flow.flow_work(L, N, n_out) > flow.MAX_FLOW_WORK:
        fit = int(flow.MAX_FLOW_WORK // flow.flow_work(L, N, 1))
        raise ValueError(
            f"outputs: the flow of {n_out} output(s) of a {N}-token window over {L} layers is over "
            f"attnlab.flow.MAX_FLOW_WORK={flow.MAX_FLOW_WORK:.2g}; "
            + (f"pass at most {fit} positions as outputs" if fit else "use a smaller window")
        )
    stream = stream_analysis(text, loaded, (variant,), mode, window=window, overlap=overlap, **params)
    weights = stream.window(window_index).weights[variant]  # (L, H, N, N)
    return flow.attention_flow(weights, outputs), win
