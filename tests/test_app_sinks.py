"""Issue 32 item 4 in the app: Explaining away's sink views (app/appkit/sinks_view.py) -- importance of
the first keys by layer, sink rate by layer, first-token mass per layer and head, massive activations
by layer -- on a long streamed causal window (~1,650 tokens, no variant's whole weights computed), on
a short sliding-window window (Mistral: fewer queries see a key) and on a bidirectional model (the
analogue, said so). Each against a literal float64 computation on eager attention and hidden states."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("streamlit.testing.v1")
import test_app_issue30 as base  # noqa: E402
import test_app_long_context as long  # noqa: E402
from test_sinks_outputs import _literal_massive  # noqa: E402

app_env, deferred, long_llama = base.app_env, base.deferred, long.long_llama
messages, run_page = base.messages, base.run_page


def _eager(directory, ids: list[int]):
    """(attentions (L, H, N, N) float64, hidden states) of one eager forward, in float64."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(directory, attn_implementation="eager").double()
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_attentions=True, output_hidden_states=True)
    return torch.stack([a[0] for a in out.attentions]), out.hidden_states


def _literal_importance(a: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """sum_i a_ij / n_j, a loop over keys; n_j = N - j queries (at most ``window`` in a sliding one)."""
    L, H, N, _ = a.shape
    out = torch.zeros(L, H, N, dtype=torch.float64)
    for j in range(N):
        stop = N if window is None else min(N, j + window)
        out[..., j] = a[..., j:stop, j].sum(-1) / (stop - j)
    return out


def _arr(values) -> np.ndarray:
    """A trace's array (a list, or plotly's typed array {"dtype", "bdata"[, "shape"]}) as float64."""
    if isinstance(values, dict) and "shape" not in values:
        import base64

        return np.frombuffer(base64.b64decode(values["bdata"]), dtype=values["dtype"]).astype(np.float64)
    return long._z({"z": values}).astype(np.float64)


def _check_sink_views(at, directory, ids, window: int | None = None) -> None:
    """The four views of unas (the model's own softmax) against the eager model's float64 numbers."""
    assert not at.exception and not at.error, messages(at)
    a, hidden = _eager(directory, ids)
    L, H, N, _ = a.shape
    literal = _literal_importance(a, window)
    by_key = long._chart(at, "away_sink_importance")["data"][0]
    k = min(16, N)
    np.testing.assert_allclose(_arr(by_key["z"]), literal[..., :k].mean(1).numpy(), atol=2e-6)
    assert by_key["x"][0].startswith("0: ")
    rate = next(t for t in long._chart(at, "away_sink_rate")["data"] if t["name"] == "unas")
    want = [float((literal[layer, :, 0] > 0.3).double().mean()) for layer in range(L)]
    assert _arr(rate["y"]).tolist() == want
    at.select_slider(key="away_sink_eps").set_value(0.05).run()  # the eps control
    rate = next(t for t in long._chart(at, "away_sink_rate")["data"] if t["name"] == "unas")
    assert _arr(rate["y"]).tolist() == [float((literal[layer, :, 0] > 0.05).double().mean())
                                        for layer in range(L)]
    first = long._z(long._chart(at, "away_first_token_mass")["data"][0])  # (L, H)
    np.testing.assert_allclose(first, a[..., 0].mean(-1).numpy(), atol=2e-6)
    bars = long._chart(at, "away_massive_activations")["data"][0]
    max_abs = _arr(bars["y"])
    for layer in range(L - 1):  # (the last hidden state has the final norm applied)
        ref = _literal_massive(hidden[layer + 1][0])
        assert max_abs[layer] == pytest.approx(ref["max_abs"], rel=1e-4)
        assert bars["text"][layer].startswith(f"{ref['token_index']}: ")
        assert bars["text"][layer].endswith(f"dim {ref['dim']}")
    at.selectbox(key="away_sink_heads").set_value(1).run()  # one head instead of the mean
    by_key = long._chart(at, "away_sink_importance")["data"][0]
    np.testing.assert_allclose(_arr(by_key["z"]), literal[:, 1, :k].numpy(), atol=2e-6)


def test_sink_views_on_a_long_streamed_causal_window(long_llama, monkeypatch):
    """~1,650 tokens, HeadMaps.materialize refused: the views come from the streamed sums."""
    from attnlab import hf

    at = long._page(long_llama, monkeypatch, "explaining_away")
    assert "causal-corrected importance" in " ".join(c.value for c in at.caption)
    ids = hf.stream_analysis(long.TEXT, hf.load_model(str(long_llama)), ("unas",)).window(0).window.input_ids
    assert len(ids) > 512
    _check_sink_views(at, long_llama, ids)


def test_sink_views_on_a_short_sliding_window_model(app_env, monkeypatch, english_text):
    """Mistral's sliding window (8 keys): key j is seen by min(N - j, 8) queries, from the masks."""
    from appkit import state
    from conftest import build_tiny_model

    from attnlab import hf

    directory = build_tiny_model("mistral", app_env / "mistral")
    monkeypatch.setenv("ATTNLAB_TEXTS_DIR", str(app_env / "texts"))
    text = english_text[:200]
    at = run_page("explaining_away", model="Local Hugging Face directory…", model_dir=str(directory),
                  text=state.store_text(text))
    ids = hf.stream_analysis(text, hf.load_model(str(directory)), ("unas",)).window(0).window.input_ids
    assert len(ids) <= 512
    _check_sink_views(at, directory, ids, window=8)


def test_sink_views_on_a_bidirectional_model_say_what_they_are(app_env):
    """MiniLM: the analogue (every query sees every key: I_j = m_j / N), said so; every view drawn."""
    at = run_page("explaining_away")
    assert not at.exception and not at.error, messages(at)
    assert "This model is bidirectional" in " ".join(c.value for c in at.caption)
    for name in ("sink_importance", "sink_rate", "first_token_mass", "massive_activations"):
        assert long._chart(at, f"away_{name}")["data"]


def test_sink_views_on_an_attnlab_checkpoint_say_it_has_no_massive_activations(app_env):
    """A shipped native checkpoint (bidirectional): the importance views are drawn, massive activations
    (hooks on transformers layers) are not, and the page says why."""
    at = run_page("explaining_away")
    hnas = [o for o in at.selectbox(key="away_model").options if o.startswith("enc-hnas")]
    if not hnas:
        pytest.skip("no shipped checkpoint enc-hnas")
    at.selectbox(key="away_model").set_value(hnas[0]).run()
    assert not at.exception and not at.error, messages(at)
    assert "attnlab's own checkpoints have none" in messages(at)
    for name in ("sink_importance", "sink_rate", "first_token_mass"):
        assert long._chart(at, f"away_{name}")["data"]
