"""The fused analysis inside the capture forward (attnlab/hf/compute/fused_forward.py): the kernel's attention
output in place of SDPA's, the row sums computed layer by layer, and where it steps aside."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnlab import hf, kernels
from attnlab.hf.capture.interface import capture_qk
from attnlab.hf.compute import fused_sums
from attnlab.hf.compute import weights as hf_weights
from attnlab.hf.compute.fused_forward import LayerwiseAnalysis
from attnlab.normalizers import variant_specs

KERNEL = tuple(s.name for s in variant_specs() if s.hf_kernel)


@pytest.fixture(scope="module")
def ops():
    found = kernels.analysis_ops()
    if found is None:
        pytest.skip(f"attnlab's CPU kernels not available: {kernels.build_error()}")
    return found


def _buffers(M, N, S):
    z = torch.zeros
    return [z(M, 3, N), torch.ones(M, 3, N), z(M, 3, N), z(M, N, 3 + 2 * S), z(M, N, 2 + S), z(M, N, 10)]


@pytest.mark.parametrize("M, N, D, Dv", [(3, 64, 32, 32), (2, 37, 16, 20), (2, 70, 8, 40), (1, 9, 4, 1)])
@pytest.mark.parametrize("analyse", [True, False])
def test_kernel_attention_output_equals_softmax_times_v(ops, M, N, D, Dv, analyse):
    """``heads`` with v and out: out = softmax(scale q k^T) v against float64, with v and out strided as
    the model's (B, N, H, Dv) layout gives them, row and column tails, and one wide head (scores over
    200 nats: its exponentials underflow as SDPA's do); ``analyse=False`` computes the output alone."""
    torch.manual_seed(M * N)
    q, k = torch.randn(M, N, D), torch.randn(M, N, D)
    q[0] *= 30.0  # a wide head
    v = torch.randn(1, N, M, Dv)[0].transpose(0, 1)  # (M, N, Dv), row stride M * Dv
    out = torch.full((1, N, M, Dv), float("nan"))[0].transpose(0, 1)
    bufs = _buffers(M, N, 1)
    scale = D ** -0.5
    f64 = torch.float64
    linear = ops.heads(q, k, torch.full((M,), scale, dtype=f64), torch.zeros(1, N), 3,
                       torch.ones(M, dtype=torch.bool), torch.full((M,), 0.5, dtype=f64), torch.arange(M),
                       None, None, None, None, *bufs, *(True,) * 5, v, out, analyse)
    assert not bool(linear[0])
    ref = torch.softmax(scale * q.double() @ k.double().transpose(-1, -2), -1) @ v.double()
    torch.testing.assert_close(out[1:].double(), ref[1:], rtol=1e-5, atol=1e-6)
    # scores of ~200 carry ~1e-5 of float32 rounding into their exponentials (SDPA's too)
    torch.testing.assert_close(out[0].double(), ref[0], rtol=1e-3, atol=5e-5)
    assert bool((bufs[-1] == 0).all()) != analyse  # the statistics only when analysed


def test_kernel_attention_output_arguments(ops):
    q = k = v = torch.randn(1, 8, 4)
    f64 = torch.float64
    args = (q, k, torch.ones(1, dtype=f64), torch.zeros(0, 8), 1, torch.ones(1, dtype=torch.bool),
            torch.full((1,), 0.5, dtype=f64), torch.zeros(1, dtype=torch.int64), None, None, None, None,
            *_buffers(1, 8, 0), *(True,) * 5)
    with pytest.raises(RuntimeError, match="v and out go together"):
        ops.heads(*args, v, None)
    with pytest.raises(RuntimeError, match="out must be float32 of v's shape"):
        ops.heads(*args, v, torch.empty(1, 8, 3))
    with pytest.raises(RuntimeError, match="analyse=False is for the attention output alone"):
        ops.heads(*args, None, None, False)
    plain = list(args)
    plain[5] = None  # check_span without order: the kernel orders the maps itself only with neither
    with pytest.raises(RuntimeError, match="order and check_span go together"):
        ops.heads(*plain)


def _ids(minilm, text, n):
    from attnlab.hf.capture.windows import special_affixes, tokenize_text

    prefix, suffix = special_affixes(minilm.tokenizer)
    body = tokenize_text(minilm.tokenizer, text).ids[: n - len(prefix) - len(suffix)].tolist()
    return torch.tensor([[*prefix, *body, *suffix]])


def test_layerwise_sums_equal_the_kernel_on_the_captured_qk(ops, minilm, english_text):
    """The row sums taken layer by layer in the capture forward are bitwise those of
    ``variants_with_sums`` on the q, k that forward captured; its attention outputs keep the q, k of
    the last layer within float rounding of a plain (SDPA) capture forward."""
    ids = _ids(minilm, english_text, 96)
    L, H, N = minilm.info.n_layers, minilm.info.n_heads, ids.shape[1]
    special = torch.zeros(N, dtype=torch.bool)
    special[[0, N - 1]] = True
    hook = LayerwiseAnalysis(L, H, N, KERNEL, 0.3, 3, [special], ops, 2)
    with torch.no_grad():
        with capture_qk(minilm.model, stop_after=L, layer_hook=hook) as fused:
            minilm.model(input_ids=ids, use_cache=False)
        with capture_qk(minilm.model, stop_after=L) as plain:
            minilm.model(input_ids=ids, use_cache=False)
    assert hook.done == L and hook.active
    q = torch.stack([c.query for c in fused]).float()
    k = torch.stack([c.key for c in fused]).float()
    _, expected = fused_sums.variants_with_sums(q, k, [c.scaling for c in fused], KERNEL, 0.3, 3, [special],
                                                write=())
    got = hook.sums()
    for v in KERNEL:
        for key, t in expected[v].items():
            assert (t is None) == (got[v][key] is None)
            if t is not None:
                assert torch.equal(got[v][key], t), (v, key)
    assert torch.equal(fused[0].query, plain[0].query)  # the first layer's input is the model's
    torch.testing.assert_close(fused[-1].query, plain[-1].query, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fused[-1].key, plain[-1].key, rtol=1e-4, atol=1e-5)


def test_layerwise_steps_aside_for_a_layer_it_cannot_take(ops):
    """A masked, causal, float64 or out-of-order layer runs the model's own attention (None) and turns
    the hook off: no sums come from it, and the caller computes them from the captured q, k."""
    H, N, D = 2, 8, 4
    q = torch.randn(1, H, N, D)
    hook = LayerwiseAnalysis(2, H, N, KERNEL, 0.5, 3, [torch.zeros(N, dtype=torch.bool)], ops, 1)
    call = lambda layer, **kw: hook(layer, kw.get("q", q), q, q, kw.get("mask"), 0.5, 0.0, False,  # noqa: E731
                                    kw.get("causal", False), False, kw.get("kwargs", {}))
    out = call(0)
    assert out.shape == (1, N, H, D) and hook.active
    mask = torch.ones(1, 1, N, N, dtype=torch.bool)
    mask[..., 0] = False
    assert call(1, mask=mask) is None and not hook.active and hook.sums() is None
    for kw in ({"causal": True}, {"q": q.double()}, {"kwargs": {"softcap": 30.0}}):
        fresh = LayerwiseAnalysis(2, H, N, KERNEL, 0.5, 3, None, ops, 1)
        assert fresh(0, kw.get("q", q), q, q, None, 0.5, 0.0, False, kw.get("causal", False), False,
                     kw.get("kwargs", {})) is None
    fresh = LayerwiseAnalysis(2, H, N, KERNEL, 0.5, 3, None, ops, 1)
    assert fresh(1, q, q, q, None, 0.5, 0.0, False, False, False, {}) is None  # not layer 0 first
    all_true = torch.ones(1, 1, N, N, dtype=torch.bool)
    fresh = LayerwiseAnalysis(2, H, N, KERNEL, 0.5, 3, None, ops, 1)
    assert fresh(0, q, q, q, all_true, 0.5, 0.0, False, False, False, {}) is not None  # masks nothing


def test_analysis_with_the_layerwise_hook_matches_the_analysis_without(ops, minilm, english_text,
                                                                       monkeypatch):
    """A whole analysis (every variant, every statistic) with the hook against the same analysis with
    SDPA in the capture forward: the same table to float rounding carried through the layers."""
    with_hook = hf.analyze(english_text, minilm, window=128).table()
    monkeypatch.setattr(hf_weights, "_layerwise", lambda *a: None)
    without = hf.analyze(english_text, minilm, window=128).table()
    keys = ["variant", "layer", "head", "statistic"]
    assert (with_hook[keys].values == without[keys].values).all()
    np.testing.assert_allclose(with_hook["value"].to_numpy(), without["value"].to_numpy(), rtol=2e-3,
                               atol=1e-5)
