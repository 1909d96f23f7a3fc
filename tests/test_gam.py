"""GAM: factorized scores vs the literal Eq. (16), standard-attention equivalence, brains, positions."""

from __future__ import annotations

import math

import pytest
import torch

import attnlab
from attnlab.modules import AttentionConfig, GAMAttention, GAMConfig, MultiHeadAttention
from attnlab.scores import gam_scores_reference, signed_power

F64 = torch.float64


def _gam(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = GAMConfig(**{"d_model": 6, "n_heads": 2, **kw})
    return GAMAttention(cfg).to(F64)


def _y(seed=1, B=2, T=4, M=6):
    return torch.randn(B, T, M, generator=torch.Generator().manual_seed(seed), dtype=F64)


@pytest.mark.parametrize("power", [1.0, 2.0, 3.0, 1.5, 0.5])
@pytest.mark.parametrize("rank", [None, 2])
def test_power_law_scores_equal_eq16(power, rank):
    gam = _gam(f="power", power=power, rank=rank, n_brains=2)  # the default: the paper's function
    y = _y()
    eps = gam.brain_scores(y)  # (B, H, N_B, T, T)
    B = gam.scores.matrix() * gam._scale  # (H, N_B, M, M)

    def f(x):  # Eq. (17), real-valued: x^n for integer n, sign(x)|x|^n otherwise
        return signed_power(x, power)

    for b in range(2):
        for h in range(2):
            for brain in range(2):
                ref = gam_scores_reference(y[b], B[h, brain], f)
                torch.testing.assert_close(eps[b, h, brain], ref)


@pytest.mark.parametrize("rank", [None, 3])
def test_polynomial_scores_equal_eq16(rank):
    gam = _gam(f="poly", degree=3, rank=rank)  # the default: the paper's function
    with torch.no_grad():
        gam.poly.copy_(torch.tensor([0.7, -0.2, 0.05], dtype=F64))  # A_l
    y = _y(2)
    eps = gam.brain_scores(y)
    B = gam.scores.matrix() * gam._scale
    A = gam.poly.detach()

    def f(x):  # Eq. (18)
        return sum(A[l - 1] * x**l for l in range(1, 4))

    for b in range(2):
        for h in range(2):
            torch.testing.assert_close(eps[b, h, 0], gam_scores_reference(y[b], B[h, 0], f))


def test_degree_rescaling_is_documented_scale():
    """Degree-n features are scaled by rms(y)^(1-n): eps_rescaled = rms_a^(1-n) rms_b^(1-n) eps."""
    plain = _gam(f="power", power=3.0, rescale=False)
    scaled = _gam(f="power", power=3.0, rescale=True)
    y = _y(3)
    rms = y.pow(2).mean(-1).add(1e-6).sqrt()  # (B, T)
    factor = (rms[:, :, None] * rms[:, None, :]) ** (1 - 3.0)
    torch.testing.assert_close(scaled.brain_scores(y), plain.brain_scores(y) * factor[:, None, None])


@pytest.mark.parametrize("variant", attnlab.VARIANTS)
def test_gam_with_one_brain_power_one_low_rank_equals_standard_attention(variant):
    """N_B = 1, n1 = 1, B = scale * W_Q W_K^T (GAM Eqs. 11-12): exactly multi-head attention."""
    torch.manual_seed(0)
    d, H = 8, 2
    mha = MultiHeadAttention(AttentionConfig(d_model=d, n_heads=H, variant=variant, iters=2)).to(F64)
    gam = GAMAttention(GAMConfig(d_model=d, n_heads=H, rank=d // H, variant=variant, iters=2)).to(F64)
    Wq, Wk, Wv = mha.qkv.weight.split(d, dim=0)  # (d, d) each, rows = output features
    bq, bk, bv = mha.qkv.bias.split(d)
    # q/k biases are removed below: GAM's B has no bias term
    with torch.no_grad():
        mha.qkv.bias[: 2 * d] = 0
        gam.scores.W_Q.copy_(Wq.T.reshape(d, H, d // H).permute(1, 0, 2)[:, None])  # (H, 1, M, d)
        gam.scores.W_K.copy_(Wk.T.reshape(d, H, d // H).permute(1, 0, 2)[:, None])
        gam.value.weight.copy_(Wv)
        gam.value.bias.copy_(bv)
        gam.out.load_state_dict(mha.out.state_dict())
        if variant == "hnas":
            gam.hybrid.theta.copy_(torch.tensor([0.3, -1.0]))
            mha.hybrid.theta.copy_(torch.tensor([0.3, -1.0]))
    x = _y(4, B=2, T=5, M=d)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])[:, None, None, :]
    for causal in (False, True):
        if causal and variant == "sinkhorn":
            continue
        torch.testing.assert_close(gam(x, mask=mask, causal=causal), mha(x, mask=mask, causal=causal))
        gw = gam(x, mask=mask, causal=causal, return_weights=True)[1]
        mw = mha(x, mask=mask, causal=causal, return_weights=True)[1]
        torch.testing.assert_close(gw, mw)


def test_brain_weights_uniform_and_learned_sum_to_one():
    uni = _gam(n_brains=3)
    torch.testing.assert_close(uni.brain_weights(), torch.full((3,), 1 / 3, dtype=F64))
    learned = _gam(n_brains=3, brain_weights="learned")
    with torch.no_grad():
        learned.brain_logits.copy_(torch.tensor([0.0, 1.0, -2.0]))
    w = learned.brain_weights()
    assert torch.isclose(w.sum(), torch.tensor(1.0, dtype=F64))
    assert w[1] > w[0] > w[2]


def test_brains_mix_weights_per_eq14():
    gam = _gam(n_brains=3, brain_weights="learned", variant="dnas", rank=2)
    with torch.no_grad():
        gam.brain_logits.copy_(torch.tensor([0.2, -0.5, 1.0]))
    y = _y(5)
    _, phi = gam(y, return_weights=True)
    psi = attnlab.attention_weights(gam.brain_scores(y), "dnas")  # (B, H, N_B, T, T)
    expect = torch.einsum("bhntk,n->bhtk", psi, gam.brain_weights())
    torch.testing.assert_close(phi, expect)
    # the output is Phi Y W_V, whichever path computes it
    out = gam(y)
    values = gam.value(y).view(2, 4, 2, 3).transpose(1, 2)
    z = (expect @ values).transpose(1, 2).reshape(2, 4, 6)
    torch.testing.assert_close(out, gam.out(z))


@pytest.mark.parametrize("variant", attnlab.VARIANTS)
def test_any_normalizer_inside_gam(variant):
    gam = _gam(variant=variant, n_brains=2, f="poly", degree=2, iters=3)
    y = _y(6, T=7)
    out, w = gam(y, return_weights=True)
    spec = attnlab.variant_spec(variant)
    if spec.rows_sum_to_one:
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 7, dtype=F64))
    else:  # softmax1: a convex mix of brains whose rows sum to < 1
        assert ((w.sum(-1) > 0) & (w.sum(-1) < 1)).all()
    torch.testing.assert_close(gam(y), out)
    if spec.column_floor is not None:  # a convex mix of brains keeps the floor (HNAS: u = 0.5 at init)
        floor = spec.column_floor(attnlab.check_params(variant, {}))
        assert (w.sum(-2) >= floor / 7 - 1e-9).all()


def test_relative_positions_seed_examples():
    # "My name is Vikram": (My, name, is) and (My, name, Vikram), GAM Eqs. (33-35), (39-41)
    r = attnlab.relative_positions(torch.tensor([0, 1, 2]))
    assert r.tolist() == [[1, 2, 3], [2, 1, 2], [3, 2, 1]]
    r = attnlab.relative_positions(torch.tensor([0, 1, 3]))
    assert r[0].tolist() == [1, 2, 4]
    assert r[1].tolist() == [2, 1, 3]
    assert r[2].tolist() == [4, 3, 1]
    batched = attnlab.relative_positions(torch.tensor([[0, 1, 2], [0, 1, 3]]))
    assert batched.shape == (2, 3, 3) and batched[1, 0].tolist() == [1, 2, 4]


def test_linear_combination_of_content_and_position():
    gam = _gam(relative_position=True, c1=0.3, max_len=8, n_brains=2)
    y = _y(7)
    pos = torch.tensor([0, 2, 3, 7])
    out, w = gam(y, positions=pos, return_weights=True)
    phi = torch.einsum("bhntk,n->bhtk", attnlab.attention_weights(gam.brain_scores(y), "unas"),
                       gam.brain_weights())
    p = gam.position_embedding(pos.expand(2, 4))
    theta = torch.einsum("bhntk,n->bhtk",
                         attnlab.attention_weights(gam.brain_scores(p, positional=True), "unas"),
                         gam.brain_weights(gam.position_brain_logits))
    torch.testing.assert_close(w, 0.3 * phi + 0.7 * theta)  # Eq. (20) applied to the weights
    torch.testing.assert_close(gam(y, positions=pos), out)
    # gaps in the corpus change the position branch
    assert not torch.allclose(gam(y, positions=torch.arange(4)), out)


def test_geometric_combination_rows_sum_to_one():
    gam = _gam(relative_position=True, combine="geometric", max_len=8, variant="dnas")
    y = _y(8, T=6)
    out, w = gam(y, return_weights=True)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 6, dtype=F64))
    torch.testing.assert_close(gam(y), out)


def test_learned_c1_and_gradients():
    gam = _gam(relative_position=True, c1=None, max_len=6, n_brains=2, brain_weights="learned",
               f="poly", degree=2, variant="hnas")
    y = _y(9, B=1, T=3).requires_grad_()
    assert torch.autograd.gradcheck(lambda y: gam(y), (y,))
    gam(y).sum().backward()
    for name, p in gam.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert 0 < float(gam.c1().detach()) < 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_high_powers_do_not_overflow_with_the_opt_in_guard(dtype):
    torch.manual_seed(0)
    cfg = GAMConfig(d_model=8, n_heads=2, f="poly", degree=6, n_brains=2, rescale=True)
    gam = GAMAttention(cfg).to(dtype)
    gam_p = GAMAttention(GAMConfig(d_model=8, n_heads=2, f="power", power=7.0, rescale=True)).to(dtype)
    y = (30 * torch.randn(2, 5, 8)).to(dtype)
    for g in (gam, gam_p):
        out, w = g(y, return_weights=True)
        assert torch.isfinite(out).all() and torch.isfinite(w).all()


def test_gam_causal_and_masked():
    gam = _gam(variant="dnas", relative_position=True, max_len=8)
    y = _y(10, T=6)
    out = gam(y, causal=True)
    y2 = y.clone()
    y2[:, 4:] += 1
    torch.testing.assert_close(gam(y2, causal=True)[:, :4], out[:, :4])


def test_gam_config_errors():
    with pytest.raises(ValueError, match="GAMConfig.f"):
        GAMConfig(f="cubic")
    with pytest.raises(ValueError, match="GAMConfig.c1"):
        GAMConfig(c1=1.5)
    with pytest.raises(ValueError, match="variant"):
        GAMConfig(variant="softmax")
    gam = _gam(relative_position=True, max_len=3)
    with pytest.raises(ValueError, match="max_len"):
        gam(_y(11, T=4))


def test_scale_default():
    assert math.isclose(_gam(rank=3)._scale, 1 / math.sqrt(3))
    assert math.isclose(_gam()._scale, 1 / math.sqrt(6))


def test_rescale_is_opt_in_and_changes_scores_only_when_asked():
    assert GAMConfig().rescale is False
    y = _y(12)
    paper = _gam(f="power", power=2.0).brain_scores(y)
    guarded = _gam(f="power", power=2.0, rescale=True).brain_scores(y)
    assert not torch.allclose(paper, guarded)  # the guard changes the function for n1 != 1
    one = _gam(f="power", power=1.0).brain_scores(y)
    torch.testing.assert_close(_gam(f="power", power=1.0, rescale=True).brain_scores(y), one)


def test_checkpoint_configs_record_rescale_and_old_ones_load_with_it():
    from attnlab.models import ModelConfig, model_config_from_checkpoint

    base = {"kind": "encoder", "vocab_size": 16, "max_len": 8, "d_model": 8, "n_layers": 1, "n_heads": 2,
            "gam": True, "gam_options": {"f": "power", "power": 2.0}}
    new = ModelConfig.from_dict(base)
    assert new.to_dict()["gam_options"]["rescale"] is False  # recorded in every new checkpoint
    assert model_config_from_checkpoint(new.to_dict()).gam_config(0).rescale is False
    old = model_config_from_checkpoint(base)  # written before the default changed: no key
    assert old.gam_config(0).rescale is True and old.to_dict()["gam_options"]["rescale"] is True
    no_gam = model_config_from_checkpoint({**base, "gam": False, "gam_options": {}})
    assert "rescale" not in no_gam.gam_options


def test_shipped_gam_checkpoint_loads_with_its_training_behaviour():
    from pathlib import Path

    from attnlab import models

    run = Path(__file__).resolve().parents[1] / "checkpoints" / "enc-gam"
    if not (run / "latest.json").is_file():
        pytest.skip("checkpoints/enc-gam is not in this checkout")
    model = models.load(run)
    layers = [b.attn for b in model.blocks if b.is_gam]
    assert layers and all(a.config.rescale is True for a in layers)  # trained before the default changed
    assert all(a.config.f == "power" and a.config.power == 1.0 for a in layers)  # where rescale is a no-op


def test_relative_positions_refuses_duplicates_and_overflow():
    with pytest.raises(ValueError, match="positions must be distinct.*position 3 twice"):
        attnlab.relative_positions(torch.tensor([0, 3, 3]))
    with pytest.raises(ValueError, match="positions must be distinct"):
        attnlab.relative_positions(torch.tensor([[0, 1], [2, 2]]))
    big = torch.tensor([torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max])
    with pytest.raises(ValueError, match="positions must span"):
        attnlab.relative_positions(big)
    with pytest.raises(ValueError, match="positions must be an integer"):
        attnlab.relative_positions(torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="positions"):
        attnlab.relative_positions([0, 2**70])
    widest = attnlab.relative_positions(torch.tensor([2**62, -(2**62) + 2]))  # span 2**63 - 2: r fits
    assert widest.tolist() == [[1, 2**63 - 1], [2**63 - 1, 1]]
    assert attnlab.relative_positions(torch.zeros(0, dtype=torch.long)).shape == (0, 0)
    gam = _gam(relative_position=True, max_len=8)
    with pytest.raises(ValueError, match="positions must be distinct"):
        gam(_y(13, T=3), positions=torch.tensor([0, 1, 1]))


@pytest.mark.parametrize("bad, match", [
    (torch.zeros(4, 6, dtype=F64), r"x must have shape \(B, T, d_model=6\), got \(4, 6\)"),
    (torch.zeros(1, 4, 5, dtype=F64), r"x must have shape \(B, T, d_model=6\)"),
    (torch.zeros(1, 4, 6, dtype=torch.long), "x must be a floating-point tensor"),
    ([[0.0] * 6], "x must be a floating-point tensor"),
])
def test_modules_refuse_bad_inputs_with_worded_errors(bad, match):
    gam = _gam()
    torch.manual_seed(0)
    mha = MultiHeadAttention(AttentionConfig(d_model=6, n_heads=2)).to(F64)
    for module in (gam, mha):
        with pytest.raises(ValueError, match=match):
            module(bad)
    x = _y(14, B=1, T=4)
    for module in (gam, mha):
        with pytest.raises(ValueError, match="mask must broadcast"):
            module(x, mask=torch.ones(3, dtype=torch.bool))
        with pytest.raises(ValueError, match="mask must be a boolean"):
            module(x, mask=torch.ones(4))
        keys = torch.tensor([True, True, False, True])
        out = module(x, mask=keys)  # a key-only (T,) mask
        torch.testing.assert_close(out, module(x, mask=keys[None, None, None]))


def test_resume_keeps_the_checkpoints_rescale(tmp_path):
    import json

    from attnlab.models import ModelConfig
    from attnlab.train.trainer import _with_checkpoint_rescale

    model = {"kind": "encoder", "vocab_size": 16, "max_len": 8, "d_model": 8, "n_layers": 1, "n_heads": 2,
             "gam": True, "gam_options": {"f": "power", "power": 2.0}}
    step = tmp_path / "step-00000001"
    step.mkdir()
    (step / "config.json").write_text(json.dumps({"format": "attnlab-checkpoint/1", "model": model}))
    (step / "model.safetensors").write_bytes(b"")
    recipe = ModelConfig.from_dict(model)  # the recipe has no rescale: today's default, off
    assert recipe.gam_options["rescale"] is False
    resumed = _with_checkpoint_rescale(recipe, step)  # the old checkpoint was trained with it on
    assert resumed.gam_config(0).rescale is True
    model["gam_options"]["rescale"] = False
    (step / "config.json").write_text(json.dumps({"format": "attnlab-checkpoint/1", "model": model}))
    assert _with_checkpoint_rescale(recipe, step) is recipe
