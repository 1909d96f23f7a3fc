"""MultiHeadAttention / HybridWeight, and the attention benchmark's plumbing (no timing asserted)."""

from __future__ import annotations

import pytest
import torch

from attnlab import VARIANTS, bench
from attnlab.cli import main as cli_main
from attnlab.modules import AttentionConfig, HybridWeight, MultiHeadAttention


def test_hybrid_weight_starts_at_half_and_is_learned():
    hw = HybridWeight(3)
    torch.testing.assert_close(hw().flatten(), torch.full((3,), 0.5))
    hw().sum().backward()
    assert hw.theta.grad is not None and torch.all(hw.theta.grad > 0)
    torch.testing.assert_close(HybridWeight(2, init_u=0.8)().flatten(), torch.full((2,), 0.8))
    with pytest.raises(ValueError, match="init_u"):
        HybridWeight(2, init_u=1.0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_multihead_attention_padding_and_hybrid(variant):
    torch.manual_seed(0)
    mha = MultiHeadAttention(AttentionConfig(d_model=16, n_heads=4, variant=variant, iters=2))
    x = torch.randn(2, 6, 16)
    keep = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    # padding masks keys and queries: a padded query must not enter DNAS's column sums
    out = mha(x, mask=keep[:, None, None, :] & keep[:, None, :, None])
    alone = mha(x[1:, :4])  # the padded example alone gives the same outputs
    torch.testing.assert_close(out[1:, :4], alone, atol=1e-5, rtol=1e-5)
    u = mha.hybrid_weight()
    assert (u is None) == (variant != "hnas")
    if u is not None:
        assert u.shape == (4,)
        out.sum().backward()
        grad = mha.hybrid.theta.grad  # (H,): u changes the output, so every head's theta gets a gradient
        assert grad.shape == (4,) and torch.isfinite(grad).all() and (grad != 0).all()


def test_config_errors():
    with pytest.raises(ValueError, match="variant"):
        AttentionConfig(variant="softmax")
    with pytest.raises(ValueError, match="divisible"):
        AttentionConfig(d_model=10, n_heads=4)


def test_attention_benchmark_runs_and_reports_ratios(capsys):
    res = bench.bench_attention(sizes=(32,), memory=False, repeats=1)
    ratios = res["ratio"][32]
    assert set(ratios) == {label for label, _, _ in (*bench.CASES, *bench.MASK_CASES)}
    times = res["time_s"][32]  # every ratio is that case's time over SDPA's (same mask), from the same run
    assert all(t > 0 for t in times.values())
    base = {lab: "sdpa" for lab in ratios}
    base |= {f"{v} {m}": f"sdpa {m}" for v in ("sdpa", "dnas") for m in ("keys", "causal")}
    base["hnas causal"] = "sdpa causal"
    assert all(ratios[lab] == pytest.approx(times[lab] / times[base[lab]]) for lab in ratios)
    assert ratios["sdpa keys"] == ratios["sdpa causal"] == 1.0
    table = bench.attention_markdown(res)
    assert "| 32 |" in table and "dnas" in table
    assert cli_main(["bench", "attention", "--sizes", "16", "--no-memory", "--repeats", "1"]) == 0
    assert "S=16" in capsys.readouterr().out


@pytest.mark.slow
def test_peak_memory_probe_sees_materialized_weights():
    """The probe measures real allocations: returning weights materializes (12, 512, 512) float32
    = 12 MiB several times over, while the fused DNAS path stays near the output's size."""
    big = bench._peak_extra_mib("dnas+weights", 512)
    small = bench._peak_extra_mib("dnas", 512)
    assert big > 12 and small >= 0 and small < big


def test_causal_analysis_benchmark_reports_each_run_after_its_warmup(tiny_model_dir):
    """``benchmark_causal``'s plumbing on a tiny saved model: untimed warm-up rounds, then each timed
    run's seconds beside the medians (no timing asserted); a bad ``warmup`` is a worded error."""
    from attnlab.hf.analysis.causal_benchmark import benchmark_causal

    res = benchmark_causal("llama", (24,), repeats=2, memory=False, directory=tiny_model_dir("llama"),
                           warmup=1)
    row = res["sizes"][24]
    assert row["warmup"] == 1 and row["repeats"] == 2
    assert len(row["forward_runs_s"]) == len(row["analyse_runs_s"]) == 2
    assert row["analyse_s"] == pytest.approx(sum(row["analyse_runs_s"]) / 2)
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=f"warmup must be a non-negative int .*got {bad!r}"):
            benchmark_causal("llama", (24,), warmup=bad)
