"""attnlab.models: per-layer variants, GAM layers, causal leak-freeness, padding, save/load."""

import pytest
import torch
import torch.nn.functional as F

from attnlab import VARIANTS
from attnlab.data import IGNORE_INDEX
from attnlab.models import ModelConfig, MultiViewModel, TransformerLM, load, save
from attnlab.modules import GAMAttention, MultiHeadAttention

TINY = dict(vocab_size=40, max_len=12, d_model=16, n_layers=2, n_heads=2, d_ff=32)
GAM_OPTS = {"n_brains": 2, "rank": 4, "relative_position": True, "brain_weights": "learned", "c1": None}


def _model(**kw):
    torch.manual_seed(0)
    return TransformerLM(ModelConfig(**{**TINY, **kw})).double()


def test_per_layer_variants_and_hybrid_weights():
    model = _model(n_layers=4, variant=["unas", "dnas", "hnas", "sinkhorn"])
    kinds = [b.attn.config.variant for b in model.blocks]
    assert kinds == ["unas", "dnas", "hnas", "sinkhorn"]
    u = model.hybrid_weights()
    assert u.shape == (4, 2)
    assert u[0].tolist() == [0.0, 0.0] and u[1].tolist() == [1.0, 1.0] and u[2].tolist() == [0.5, 0.5]
    with torch.no_grad():
        model.blocks[2].attn.hybrid.theta.fill_(2.0)
    assert torch.allclose(model.hybrid_weights()[2], torch.sigmoid(torch.tensor(2.0)).expand(2))


def test_gam_layers_per_layer():
    model = _model(n_layers=3, gam=[True, False, True], variant="hnas", gam_options=GAM_OPTS)
    types = [type(b.attn) for b in model.blocks]
    assert types == [GAMAttention, MultiHeadAttention, GAMAttention]
    assert model.hybrid_weights().shape == (3, 2)
    ids = torch.randint(5, 40, (2, 10))
    out = model(ids, labels=ids)
    out.loss.backward()
    theta = model.blocks[0].attn.hybrid.theta
    assert theta.grad is not None and torch.isfinite(theta.grad).all()


@pytest.mark.parametrize("gam", [False, True])
@pytest.mark.parametrize("variant", VARIANTS)
def test_decoder_is_leak_free(variant, gam):
    """Changing a later token never changes the logits of earlier positions."""
    model = _model(kind="decoder", variant=variant, gam=gam, gam_options=GAM_OPTS if gam else {})
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 40, (3, 12), generator=g)
    base = model(ids).logits
    for t in (3, 7, 11):
        changed = ids.clone()
        changed[:, t] = (changed[:, t] - 5 + 1) % 35 + 5
        out = model(changed).logits
        assert torch.allclose(out[:, :t], base[:, :t], atol=1e-12, rtol=0), (variant, t)
        assert not torch.allclose(out[:, t], base[:, t])


@pytest.mark.parametrize("variant", VARIANTS)
def test_encoder_is_bidirectional_and_ignores_padding(variant):
    model = _model(variant=variant)
    ids = torch.randint(5, 40, (2, 10), generator=torch.Generator().manual_seed(2))
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] - 5 + 1) % 35 + 5
    assert not torch.allclose(model(changed).logits[:, 0], model(ids).logits[:, 0])
    # padded positions (attention_mask 0) influence nothing else
    mask = torch.ones_like(ids)
    mask[:, 7:] = 0
    padded = ids.clone()
    padded[:, 7:] = 9
    a = model(ids, attention_mask=mask).logits[:, :7]
    b = model(padded, attention_mask=mask).logits[:, :7]
    assert torch.allclose(a, b, atol=1e-12)
    assert torch.isfinite(model(ids, attention_mask=mask).logits).all()


def test_labels_give_cross_entropy_at_labelled_positions():
    model = _model()
    ids = torch.randint(5, 40, (2, 10))
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[0, 3], labels[1, 5], labels[1, 6] = 7, 8, 9
    out = model(ids, labels=labels)
    full = model(ids).logits
    sel = labels != IGNORE_INDEX
    assert out.logits.shape == (3, 40) and out.n_targets == 3
    assert torch.allclose(out.loss, F.cross_entropy(full[sel], labels[sel]))
    assert torch.allclose(model(ids, labels=labels, loss_reduction="sum").loss, out.loss * 3)


def test_weights_are_returned_per_layer():
    model = _model(variant="dnas")
    out = model(torch.randint(5, 40, (2, 10)), return_weights=True)
    assert len(out.weights) == 2 and out.weights[0].shape == (2, 2, 10, 10)
    assert torch.allclose(out.weights[0].sum(-1), torch.ones(2, 2, 10, dtype=torch.float64))
    assert (out.weights[0].sum(-2) >= 1.0 / 10 - 1e-9).all()  # DNAS column bound


def test_save_and_load_round_trip_without_unpickling(tmp_path, monkeypatch):
    model = _model(n_layers=3, variant=["hnas", "dnas", "unas"], gam=[False, True, False],
                   gam_options=GAM_OPTS)
    model = model.float()
    with torch.no_grad():
        model.blocks[0].attn.hybrid.theta.fill_(0.7)
    save(model, tmp_path / "ck")

    def refuse(*a, **k):
        raise AssertionError("torch.load must not be used")

    monkeypatch.setattr(torch, "load", refuse)
    again = load(tmp_path / "ck")
    ids = torch.randint(5, 40, (2, 10))
    assert torch.equal(again(ids).logits, model.eval()(ids).logits)
    assert torch.equal(again.hybrid_weights(), model.hybrid_weights())
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load(tmp_path)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"variant": "softmax"}, "variant must be one of"),
        ({"variant": ["unas"]}, "n_layers=2"),
        ({"gam": [True]}, "n_layers=2"),
        ({"d_model": 15}, "divisible by n_heads"),
        ({"n_layers": 0}, "n_layers must be an integer >= 1"),
        ({"dropout": 1.5}, "dropout must be in"),
        ({"u": 1.0}, "u must be in"),
        ({"kind": "seq2seq"}, "kind must be"),
        ({"gam": True, "gam_options": {"bogus": 1}}, "unknown or reserved"),
        ({"gam": True, "gam_options": {"n_brains": 0}}, "n_brains"),
        ({"kind": "decoder", "variant": "sinkhorn", "iters": 3}, "iters must be 1 for causal sinkhorn"),
    ],
)
def test_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**TINY, **kw})


def test_too_long_input():
    with pytest.raises(ValueError, match="max_len=12"):
        _model()(torch.randint(5, 40, (1, 13)))


def test_multiview_model_shapes():
    for variant in ("unas", "dnas", "hnas"):
        m = MultiViewModel(d_feature=8, n_views=2, n_classes=3, variant=variant, d_model=16)
        q, g, w = m(torch.randn(4, 5, 8), torch.randn(4, 6, 8), torch.zeros(4, 6, dtype=torch.long),
                    return_weights=True)
        assert q.shape == (4, 5, 3) and g.shape == (4, 3) and w.shape == (4, 1, 5, 6)
        assert (m.hybrid_weight() is None) == (variant != "hnas")
