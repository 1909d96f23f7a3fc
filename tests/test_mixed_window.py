"""One bidirectional window whose variants are partly fused (attnlab/hf/compute/mixed.py): sparsemax and
a plugin next to the fused variants (softmax1 among these: the kernel has its output). Their statistics
equal the materialized reference's, the fused variants' equal those of the fused ones analysed alone,
and no weight is computed for a table."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

import attnlab
from attnlab import hf, stats
from attnlab.hf.compute import fused_sums
from attnlab.hf.compute import weights as weights_module
from attnlab.normalizers import DEFAULT_VARIANTS, VARIANTS

pytestmark = pytest.mark.filterwarnings("ignore:attnlab.hf. variant")
PLUGIN = "tempered_mixed_test"  # a registered variant without an hf kernel: it streams


def _tempered(logits, ctx):
    return torch.softmax(logits / ctx.t, dim=-1)


@pytest.fixture
def plugin():
    from attnlab.normalizers import specs

    attnlab.register_variant(PLUGIN, _tempered, replace=True,
                             params=(attnlab.Param("t", float, 2.0, 0.01, 100.0, "temperature"),))
    yield PLUGIN
    specs.unregister_variant(PLUGIN)  # later tests in this worker see the registry as it was


def _values(table: pd.DataFrame) -> pd.Series:
    keys = [c for c in ("variant", "layer", "head", "statistic", "window") if c in table.columns]
    return table.set_index(keys)["value"].sort_index()


def _reference_table(window) -> pd.DataFrame:
    """The statistics from every variant's whole weights (computed now), as before the split."""
    weights = {v: window.weights[v] for v in window.weights}
    return stats.tidy_table(weights, special=torch.from_numpy(window.window.special), window=window.index)


def test_statistics_equal_the_materialized_reference(minilm, english_text, plugin):
    window = hf.analyze(english_text, minilm, variants=(*VARIANTS, plugin)).windows[0]
    got = _values(window.table())
    assert window.weights.computed == ()  # the table computed no weights (fused or streamed)
    want = _values(_reference_table(window))
    assert set(got.index.get_level_values("variant")) == {*VARIANTS, plugin}
    both = want.index.intersection(got.index)
    assert len(both) == len(want)
    # float32 sums of other orders: the min-over-bound ratios (~500) move in their 7th digit
    torch.testing.assert_close(torch.tensor(got[both].to_numpy()), torch.tensor(want[both].to_numpy()),
                               rtol=2e-5, atol=2e-6, equal_nan=True)
    fused_alone = _values(hf.analyze(english_text, minilm, variants=VARIANTS).windows[0].table())
    mine = got[got.index.get_level_values("variant").isin(VARIANTS)]
    pd.testing.assert_series_equal(mine.sort_index(), fused_alone.loc[mine.index].sort_index())


def test_weights_on_access_are_the_generic_paths(minilm, english_text, plugin):
    """The streamed variant's weights come from attention_weights on the captured scores (so do
    sparsemax's, a fused variant whose weights are its reference function's); the fused ones' from
    the fused analysis, as when analysed alone."""
    result = hf.analyze(english_text, minilm, variants=(plugin, "unas", "sparsemax", "dnas"), t=3.0)
    assert tuple(result.weights) == (plugin, "unas", "sparsemax", "dnas")
    alone = hf.analyze(english_text, minilm, variants=("unas", "dnas", "sparsemax"))
    for v in ("unas", "dnas", "sparsemax"):
        torch.testing.assert_close(result.weights[v], alone.weights[v], atol=0, rtol=0)
    # the analysis' forward has the kernel's attention outputs in place of SDPA's (equal to float32
    # rounding), so later layers' q, k differ from this plain capture's by about that much
    scores = minilm_scores(minilm, result.windows[0])  # (L, H, N, N)
    torch.testing.assert_close(result.weights["sparsemax"], attnlab.attention_weights(scores, "sparsemax"),
                               atol=2e-5, rtol=0)
    torch.testing.assert_close(result.weights[plugin], attnlab.attention_weights(scores, plugin, t=3.0),
                               atol=2e-5, rtol=0)


def minilm_scores(minilm, window) -> torch.Tensor:
    """(L, H, N, N) the captured scores of one window (q k^T scaled), by the capture forward."""
    from attnlab.hf.capture.interface import capture_qk

    ids = torch.tensor([window.window.input_ids])
    with torch.no_grad(), capture_qk(minilm.model, stop_after=minilm.info.n_layers) as captured:
        minilm.model(input_ids=ids, attention_mask=torch.ones_like(ids))
    return torch.stack([c.scaling * c.query[0] @ c.key[0].transpose(-1, -2) for c in captured])



def test_only_streamed_variants(minilm, english_text, plugin):
    """No variant in a slot (the fused analysis does not run): the plugin alone, streamed."""
    calls = []
    original = fused_sums.variants_with_sums
    try:
        fused_sums.variants_with_sums = lambda *a, **k: calls.append(1) or original(*a, **k)
        window = hf.analyze(english_text, minilm, variants=(plugin,), t=3.0).windows[0]
        got = _values(window.table())
    finally:
        fused_sums.variants_with_sums = original
    assert not calls
    want = _values(_reference_table(window))
    torch.testing.assert_close(torch.tensor(got[want.index].to_numpy()), torch.tensor(want.to_numpy()),
                               rtol=2e-5, atol=2e-6, equal_nan=True)


def test_the_capture_forward_takes_the_fused_variants_sums(minilm, english_text, monkeypatch, plugin):
    """With a variant outside the fused analysis, the kernel still takes the fused variants' row sums as
    the layers run (no second pass over q, k for them)."""
    if weights_module._layerwise(minilm, torch.ones(1, 8, dtype=torch.long), torch.ones(1, 8),
                                 DEFAULT_VARIANTS, {}, None) is None:
        pytest.skip("attnlab's analysis kernel is not built here")
    calls = []
    original = fused_sums.variants_with_sums

    def spy(*args, **kwargs):
        calls.append(kwargs.get("write"))
        return original(*args, **kwargs)

    monkeypatch.setattr(fused_sums, "variants_with_sums", spy)
    hf.analyze(english_text, minilm, variants=(*VARIANTS, plugin)).windows[0].table()
    assert calls == []
