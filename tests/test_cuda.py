"""CUDA paths against CPU float32 results (all skipped without a CUDA device).

Run on a GPU machine by ``scripts/device_check.sh`` (``pytest -m cuda``). Every check computes the same
thing twice from identical inputs and weights, on the CPU in float32 (the reference) and on the device,
and compares them with a tolerance relative to the largest reference magnitude:

    attend        every variant, causal or not, no mask / key padding / query padding / both / arbitrary
                  (with empty rows and columns); no-grad forward (the fused LSE + SDPA path) and forward +
                  gradients of q, k, v and of a tensor u (hnas); at N = 70 (the small fused autograd
                  function, M*N <= SMALL_SCORES), 300 and 140 x 600 (blocked column LSE, several key and
                  query blocks)
    weights       return_weights=True (the materialized pipeline), with gradients
    half          bfloat16 / float16 inputs: finite, close to float32 on the same (rounded) inputs
    GAM           GAMAttention forward, weights and all gradients with identical weights
    TransformerLM a few AdamW steps of encoder / decoder models mixing variants, an HNAS GAM layer
    train         attnlab.train.train(device="cuda"): metrics match a CPU run, the checkpoint loads, resume

The helpers take the device (and the device side's dtype) as arguments, so they also run on the CPU
(e.g. float64 against float32) to size the tolerances where no GPU is available.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import attnlab
from attnlab import VARIANTS
from attnlab.data import IGNORE_INDEX
from attnlab.models import ModelConfig, TransformerLM, load
from attnlab.modules import GAMAttention, GAMConfig

HAS_CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]

TOL = 1e-4  # float32 device vs float32 CPU, relative to the largest reference magnitude
B, H, D = 2, 3, 16
# (M, N): small = the fused small-problem autograd function; large / cross = the blocked column LSE
# (KEY_BLOCK 256: 2 and 3 key blocks) and, causal, the query-blocked pass (QUERY_BLOCK 128)
SIZES = {"small": (70, 70), "large": (300, 300), "cross": (140, 600)}
MASKS = (None, "keys", "queries", "padding", "arbitrary")


@pytest.fixture(autouse=True)
def _ieee_float32_matmul(ieee_float32_matmul):
    """Full float32 matmuls on the device for every test here (conftest.ieee_float32_matmul)."""


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _close(got, want, what: str, tol: float = TOL, atol: float = 0.0) -> None:
    """max |got - want| <= tol * max |want| + atol (got may live on the device, in another dtype)."""
    if want is None or got is None:
        assert got is None and want is None, f"{what}: one side is None"
        return
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.isfinite(got).all(), f"{what}: {int((~torch.isfinite(got)).sum())} non-finite values"
    scale = float(want.abs().max()) if want.numel() else 0.0
    err = float((got - want).abs().max()) if want.numel() else 0.0
    assert err <= tol * max(scale, 1e-6) + atol, (
        f"{what}: max |diff| {err:.3g} > {tol:g} x max |ref| {scale:.3g} + {atol:.3g}"
    )


def _close_grads(got: dict, want: dict, label: str, tol: float) -> None:
    """Parameter gradients, each to ``tol`` of its own scale plus tol/100 of the largest gradient of all:
    some are small differences of large terms (the brain logits' softmax, with nearly equal brains),
    whose rounding error follows the terms, not the result."""
    assert set(got) == set(want), f"{label}: gradients of {sorted(set(got) ^ set(want))} on one side only"
    floor = 1e-2 * tol * max(float(g.abs().max()) for g in want.values() if g is not None)
    for name in want:
        _close(got[name], want[name], f"{label}: grad {name}", tol, atol=floor)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _mask(kind, m: int, n: int, seed: int = 1):
    """Boolean mask of one kind, broadcastable to (B, H, m, n); True = may attend."""
    if kind is None:
        return None
    g = _gen(seed)
    keys = torch.rand(B, n, generator=g) > 0.2
    keys[1, -(n // 5):] = False  # a padded tail
    queries = torch.rand(B, m, generator=g) > 0.2
    queries[1, -(m // 6):] = False
    if kind == "keys":
        return keys[:, None, None, :]  # (B, 1, 1, N)
    if kind == "queries":
        return queries[:, None, :, None]  # (B, 1, M, 1)
    if kind == "padding":  # what TransformerLM builds
        return queries[:, None, :, None] & keys[:, None, None, :]  # (B, 1, M, N)
    mask = torch.rand(B, H, m, n, generator=g) > 0.3  # arbitrary (B, H, M, N)
    mask[0, 1, 3, :] = False  # an empty row
    mask[1, 2, :, 5] = False  # an empty column
    return mask


def _qkv(m: int, n: int, seed: int = 0):
    g = _gen(seed)
    q = torch.randn(B, H, m, D, generator=g) * 1.5
    k = torch.randn(B, H, n, D, generator=g) * 1.5
    v = torch.randn(B, H, n, D, generator=g)
    grad_out = torch.randn(B, H, m, D, generator=g)
    u = 0.2 + 0.6 * torch.rand(1, H, 1, 1, generator=g)
    return q, k, v, grad_out, u


def _run_attend(inputs, variant, mask, device, dtype, grad, **kw):
    """attend on (device, dtype) from copies of the CPU inputs: [out] or [out, dq, dk, dv(, du)]
    (with return_weights: [out, weights, ...])."""
    q, k, v, grad_out, u = inputs
    leaves = [t.to(device, dtype, copy=True).requires_grad_(grad) for t in (q, k, v)]
    uu = u.to(device, dtype, copy=True).requires_grad_(grad) if variant == "hnas" else None
    if "u" in kw:  # a float u given by the caller
        uu = kw.pop("u")
    m = None if mask is None else mask.to(device)
    with torch.set_grad_enabled(grad):
        res = attnlab.attend(*leaves, variant, mask=m, u=uu, **kw)
    outs = list(res) if isinstance(res, tuple) else [res]
    if grad:
        (outs[0] * grad_out.to(device, dtype)).sum().backward()
        outs += [t.grad for t in leaves]
        if isinstance(uu, torch.Tensor):
            outs.append(uu.grad)
    return outs


def _iters(variant: str, causal: bool) -> int:
    return 3 if variant == "sinkhorn" and not causal else 1


# ----------------------------------------------------------------------------------------------
# (a) attend: every variant, masks, causal, forward and gradients, small and large paths
# ----------------------------------------------------------------------------------------------


def check_attend(variant, causal, mask_kind, size, device="cuda", dtype=torch.float32, tol=TOL):
    m, n = SIZES[size]
    inputs = _qkv(m, n)
    mask = _mask(mask_kind, m, n)
    kw = dict(causal=causal, iters=_iters(variant, causal))
    names = ["out", "grad q", "grad k", "grad v", "grad u"]
    for grad in (False, True):
        want = _run_attend(inputs, variant, mask, "cpu", torch.float32, grad, **kw)
        got = _run_attend(inputs, variant, mask, device, dtype, grad, **kw)
        assert len(got) == len(want)
        for name, a, b in zip(names, got, want, strict=False):
            _close(a, b, f"{variant} causal={causal} mask={mask_kind} {size} grad={grad}: {name}", tol)


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("mask_kind", MASKS, ids=lambda k: k or "nomask")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_attend_matches_cpu(variant, causal, mask_kind, size):
    check_attend(variant, causal, mask_kind, size)


# ----------------------------------------------------------------------------------------------
# (b) return_weights: the materialized pipeline, weights and gradients
# ----------------------------------------------------------------------------------------------


def check_weights(variant, causal, mask_kind, size, device="cuda", dtype=torch.float32, tol=TOL):
    m, n = SIZES[size]
    inputs = _qkv(m, n, seed=2)
    mask = _mask(mask_kind, m, n, seed=3)
    kw = dict(causal=causal, iters=2 if variant == "sinkhorn" and not causal else 1, return_weights=True)
    if variant == "hnas":
        kw["u"] = 0.3  # a float u (the tensor case is covered by check_attend)
    want = _run_attend(inputs, variant, mask, "cpu", torch.float32, True, **kw)
    got = _run_attend(inputs, variant, mask, device, dtype, True, **kw)
    for name, a, b in zip(["out", "weights", "grad q", "grad k", "grad v"], got, want, strict=True):
        _close(a, b, f"{variant} causal={causal} mask={mask_kind} {size} return_weights: {name}", tol)
    # on the device, the fused output equals weights @ v
    fused = _run_attend(inputs, variant, mask, device, dtype, False,
                        **{**kw, "return_weights": False})[0]
    _close(fused, want[0], f"{variant} causal={causal} mask={mask_kind} {size}: fused vs weights @ v", tol)


@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize("mask_kind", [None, "padding", "arbitrary"], ids=lambda k: k or "nomask")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_return_weights_match_cpu(variant, causal, mask_kind, size):
    check_weights(variant, causal, mask_kind, size)


# ----------------------------------------------------------------------------------------------
# (c) half precision on the device: finite, close to float32 on the same rounded inputs
# ----------------------------------------------------------------------------------------------

HALF_TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3}


def check_half(variant, causal, dtype, device="cuda"):
    m, n = SIZES["large"]
    q, k, v, grad_out, u = _qkv(m, n, seed=4)
    # round the inputs to the half type once: the reference sees exactly what the half run sees
    rounded = [t.to(dtype).float() for t in (q, k, v, grad_out, u)]
    mask = _mask("arbitrary", m, n, seed=5)
    kw = dict(causal=causal, iters=_iters(variant, causal))
    for grad in (False, True):
        want = _run_attend(rounded, variant, mask, device, torch.float32, grad, **kw)
        got = _run_attend(rounded, variant, mask, device, dtype, grad, **kw)
        assert got[0].dtype == dtype
        for name, a, b in zip(["out", "grad q", "grad k", "grad v", "grad u"], got, want, strict=False):
            _close(a, b, f"{variant} causal={causal} {dtype} grad={grad}: {name}", HALF_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_half_precision_close_to_float32(variant, causal, dtype):
    check_half(variant, causal, dtype)


# ----------------------------------------------------------------------------------------------
# (d) GAM modules
# ----------------------------------------------------------------------------------------------

GAM_CASES = {
    "power2-full-hnas-rel-linear": dict(n_brains=2, rank=None, f="power", power=2.0, brain_weights="learned",
                                        variant="hnas", relative_position=True, combine="linear", c1=None),
    "poly3-rank4-dnas-rel-geometric": dict(n_brains=1, rank=4, f="poly", degree=3, variant="dnas",
                                           relative_position=True, combine="geometric"),
    "power1-rank8-sinkhorn2": dict(n_brains=2, rank=8, variant="sinkhorn", iters=2),
    "power3-rank8-unas": dict(power=3.0, rank=8, variant="unas"),
}


def _device_copy(module, device, dtype):
    return copy.deepcopy(module).to(device=device, dtype=dtype)


def check_gam(case, T, causal, device="cuda", dtype=torch.float32, tol=TOL):
    opts = dict(GAM_CASES[case])
    if causal and opts.get("iters", 1) > 1:
        opts["iters"] = 1  # causal sinkhorn allows iters=1 only
    torch.manual_seed(0)
    cpu = GAMAttention(GAMConfig(d_model=24, n_heads=3, **opts))
    dev = _device_copy(cpu, device, dtype)
    g = _gen(6)
    x = torch.randn(B, T, 24, generator=g)
    grad_out = torch.randn(B, T, 24, generator=g)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, -(T // 4):] = False
    mask = valid[:, None, :, None] & valid[:, None, None, :]
    positions = torch.cumsum(torch.randint(1, 3, (B, T), generator=g), dim=1) - 1  # corpus positions, gaps

    def run(module, dev_, dt):
        xx = x.to(dev_, dt, copy=True).requires_grad_(True)
        out = module(xx, mask=mask.to(dev_), causal=causal, positions=positions.to(dev_))
        (out * grad_out.to(dev_, dt)).sum().backward()
        with torch.no_grad():
            w = module(x.to(dev_, dt), mask=mask.to(dev_), causal=causal, positions=positions.to(dev_),
                       return_weights=True)[1]
        grads = {name: p.grad for name, p in module.named_parameters()}
        return out, xx.grad, w, grads

    want, got = run(cpu, "cpu", torch.float32), run(dev, device, dtype)
    label = f"GAM {case} T={T} causal={causal}"
    if opts.get("combine") == "geometric":
        tol *= 5  # rows of sqrt(Phi o Theta): d sqrt(x) = 1 / (2 sqrt x) amplifies rounding of small weights
    _close(got[0], want[0], f"{label}: out", tol)
    _close(got[1], want[1], f"{label}: grad x", tol)
    _close(got[2], want[2], f"{label}: weights", tol)
    _close_grads(got[3], want[3], label, tol)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("T", [40, 150])
@pytest.mark.parametrize("case", list(GAM_CASES))
def test_gam_matches_cpu(case, T, causal):
    check_gam(case, T, causal)


# ----------------------------------------------------------------------------------------------
# (e) TransformerLM: a few optimizer steps, mixed variants per layer incl. HNAS and an HNAS GAM layer
# ----------------------------------------------------------------------------------------------

GAM_OPTS = {"n_brains": 2, "rank": 8, "brain_weights": "learned", "relative_position": True, "c1": None}
MODELS = {
    "encoder": dict(kind="encoder", variant=["hnas", "dnas", "sinkhorn", "hnas"], iters=2),
    "decoder": dict(kind="decoder", variant=["dnas", "sinkhorn", "unas", "hnas"], iters=1),
}


def _tiny_lm(kind: str, T: int):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, max_len=T, d_model=32, n_layers=4, n_heads=4, d_ff=64,
                      gam=[False, False, False, True], gam_options=GAM_OPTS, **MODELS[kind])
    return TransformerLM(cfg)


def _lm_batch(kind: str, T: int, n: int = 3):
    g = _gen(7)
    ids = torch.randint(5, 97, (n, T), generator=g)
    ids[1, -(T // 4):] = 0  # padding (pad_id 0): the key/query padding mask path
    if kind == "encoder":
        labels = torch.where(torch.rand(n, T, generator=g) < 0.3, ids, torch.full_like(ids, IGNORE_INDEX))
    else:
        labels = torch.cat([ids[:, 1:], torch.full((n, 1), IGNORE_INDEX)], dim=1)
    labels[ids == 0] = IGNORE_INDEX
    return ids, labels


def _train_steps(model, ids, labels, steps: int, device):
    """AdamW steps as the trainer takes them: per-step losses and the gradients of the first step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, labels = ids.to(device), labels.to(device)
    losses, first_grads = [], None
    for _ in range(steps):
        out = model(ids, labels=labels)
        out.loss.backward()
        if first_grads is None:
            first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                           if p.grad is not None}
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(out.loss.detach()))
    return losses, first_grads


def check_lm(kind, T, device="cuda", dtype=torch.float32, steps=4):
    cpu = _tiny_lm(kind, T)
    dev = _device_copy(cpu, device, dtype)
    ids, labels = _lm_batch(kind, T)
    want_loss, want_grads = _train_steps(cpu, ids, labels, steps, "cpu")
    got_loss, got_grads = _train_steps(dev, ids, labels, steps, device)
    assert all(math.isfinite(x) for x in got_loss), got_loss
    assert got_loss[0] == pytest.approx(want_loss[0], rel=TOL), "loss before any step"
    # AdamW's first updates are ~lr * sign(grad): rounding-level gradient differences near 0 flip a
    # few of them, so later losses agree less tightly than the first
    assert got_loss == pytest.approx(want_loss, rel=1e-3), (got_loss, want_loss)
    _close_grads(got_grads, want_grads, f"{kind} T={T} first step", TOL)
    # u per layer and head after the steps (NaN for the sinkhorn layer with iters > 1)
    torch.testing.assert_close(dev.hybrid_weights(), cpu.hybrid_weights(), rtol=0, atol=1e-3, equal_nan=True)


# T=48: every attention takes the small fused path; T=160 (M*N > SMALL_SCORES): the blocked LSE path
@pytest.mark.parametrize("T", [48, 160])
@pytest.mark.parametrize("kind", list(MODELS))
def test_transformer_lm_steps_match_cpu(kind, T):
    check_lm(kind, T)


def check_autocast(kind, device="cuda", dtype=torch.bfloat16):
    """Mixed precision: attend gets half inputs from the projections and computes in float32."""
    model = _tiny_lm(kind, 64).to(device)
    ids, labels = (t.to(device) for t in _lm_batch(kind, 64))
    with torch.no_grad():
        ref = float(model(ids, labels=labels).loss)
    with torch.autocast(device_type=torch.device(device).type, dtype=dtype):
        out = model(ids, labels=labels)
    out.loss.backward()
    assert math.isfinite(float(out.loss)) and float(out.loss) == pytest.approx(ref, rel=3e-2)
    for name, p in model.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), name
    theta = model.blocks[3].attn.hybrid.theta  # the HNAS GAM layer's u
    assert theta.grad is not None and float(theta.grad.abs().sum()) > 0


@pytest.mark.parametrize("kind", list(MODELS))
def test_autocast_bfloat16_model(kind):
    check_autocast(kind)


# ----------------------------------------------------------------------------------------------
# (f) attnlab.train.train on the device: metrics match a CPU run; the checkpoint loads; resume
# ----------------------------------------------------------------------------------------------


def _text(n_chars: int = 20_000) -> str:
    """Seeded pseudo-English (no corpus package needed)."""
    words = ("the attention of every word falls on some key and a query may explain away another "
             "while doubly normalized heads keep a share for each token in the sentence").split()
    g = _gen(8)
    idx = torch.randint(0, len(words), (n_chars // 4,), generator=g).tolist()
    out, line = [], []
    for i, w in enumerate(idx):
        line.append(words[w])
        if i % 13 == 12:
            out.append(" ".join(line).capitalize() + ".")
            line = []
    return "\n".join(out)[:n_chars]


def _tiny_run_config(steps: int = 6):
    from attnlab.train import RunConfig

    return RunConfig.from_dict({
        "name": "tiny-cuda",
        "model": {"kind": "encoder", "d_model": 16, "n_layers": 2, "n_heads": 2, "d_ff": 32,
                  "variant": ["hnas", "hnas"], "gam": [False, True],
                  "gam_options": {"n_brains": 2, "rank": 4, "relative_position": True}},
        "data": {"tokenizer": "byte", "seq_len": 16},
        "train": {"steps": steps, "batch_size": 8, "warmup": 2, "eval_every": 3, "eval_batches": 1,
                  "log_every": 1, "save_every": 3, "seed": 0},
    })


def check_train(tmp_path, device="cuda"):
    from attnlab.train import read_metrics, train

    text = _text()
    cfg = _tiny_run_config()
    res_dev = train(cfg, tmp_path / "dev", text=text, device=device, progress=False)
    res_cpu = train(cfg, tmp_path / "cpu", text=text, device="cpu", progress=False)
    assert res_dev.step == res_cpu.step == 6
    dev_m = read_metrics(tmp_path / "dev" / "metrics.jsonl")
    cpu_m = read_metrics(tmp_path / "cpu" / "metrics.jsonl")
    assert [r["step"] for r in dev_m] == [r["step"] for r in cpu_m] == list(range(7))
    for key in ("loss", "eval_loss"):
        got = [r[key] for r in dev_m if key in r]
        want = [r[key] for r in cpu_m if key in r]
        assert len(got) == len(want) > 0 and all(math.isfinite(x) for x in got)
        assert got == pytest.approx(want, rel=2e-3), key
    # the checkpoint written from the device loads on the CPU and on the device, with equal outputs
    on_cpu, on_dev = load(tmp_path / "dev"), load(tmp_path / "dev", device=device)
    assert all(t.device.type == "cpu" for t in on_cpu.state_dict().values())
    assert on_cpu.hybrid_weights().shape == (2, 2)
    ids = torch.randint(5, on_cpu.config.vocab_size, (2, 16), generator=_gen(9))
    with torch.no_grad():
        _close(on_dev(ids.to(device)).logits, on_cpu(ids).logits, "loaded checkpoint logits", TOL)
    # stop after step 3 and resume on the device (optimizer state back onto the device): same run
    train(cfg, tmp_path / "resumed", text=text, device=device, progress=False, stop_after=3)
    res = train(cfg, tmp_path / "resumed", text=text, device=device, progress=False, resume=True)
    assert res.step == 6
    resumed = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(7))
    assert [r["loss"] for r in resumed[1:]] == pytest.approx([r["loss"] for r in dev_m[1:]], rel=1e-4)


def test_train_on_device_writes_loadable_checkpoint(tmp_path):
    check_train(tmp_path)
