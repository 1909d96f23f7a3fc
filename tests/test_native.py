"""Native attnlab checkpoints (checkpoints/enc-*, ``attnlab train`` runs) through ``attnlab.hf``: the
same load / analyze / CLI path as Hugging Face models, the learned HNAS u, GAM's maps (Phi, Theta,
brains), swap mode, padded batches, a causal byte-level checkpoint, and the capture's clean-up.
References are the checkpoints' own forward passes (``TransformerLM(..., return_weights=True)``)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import attnlab
from attnlab import hf, models
from attnlab.checkpoint_io import is_checkpoint
from attnlab.cli import main
from attnlab.hf.load.native import NativeModel, capture_attention_inputs, learned_u

REPO = Path(__file__).resolve().parents[1]
CKPT = REPO / "checkpoints"
TEXT = "In the beginning God created the heaven and the earth. And the earth was without form, and void."
SHIPPED = sorted(p.name for p in CKPT.glob("enc*") if (p / "latest.json").is_file())  # enc-*, enc8-*-s<k>
pytestmark = pytest.mark.skipif(not SHIPPED, reason="no shipped checkpoints in checkpoints/")


def own_weights(model, input_ids, attention_mask=None) -> torch.Tensor:
    """(L, B, H, N, N): the weights the checkpoint's own forward pass uses."""
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask, return_weights=True)
    return torch.stack(out.weights)


def swapped(directory, variant: str, u: torch.Tensor | None = None) -> models.TransformerLM:
    """The checkpoint's weights with ``variant`` in every layer (the reference for swap mode)."""
    base = models.load(directory)
    model = models.TransformerLM(models.ModelConfig.from_dict({**base.config.to_dict(), "variant": variant}))
    model.load_state_dict(base.state_dict(), strict=False)
    if u is not None:
        for layer, block in enumerate(model.blocks):
            block.attn.hybrid.theta.data.copy_(torch.logit(u[layer]))
    return model.eval()


def test_load_model_detects_a_native_checkpoint_by_its_files(minilm):
    loaded = hf.load_model(CKPT / "enc-hnas")
    assert isinstance(loaded, NativeModel) and isinstance(loaded, hf.LoadedModel)
    assert loaded.info.n_layers == 4 and loaded.info.n_heads == 4 and loaded.info.max_length == 64
    assert loaded.info.causal is False and loaded.info.model_type == "attnlab-encoder"
    assert loaded.step_dir.endswith("step-00001200")
    assert hf.load_model(CKPT / "enc-hnas") is loaded  # cached
    assert is_checkpoint(CKPT / "enc-hnas") and is_checkpoint(Path(loaded.step_dir))
    assert not is_checkpoint(minilm.info.path) and not is_checkpoint(CKPT / "nowhere")
    assert not isinstance(minilm, NativeModel)


@pytest.mark.parametrize("name", SHIPPED)
def test_recompute_of_the_checkpoints_own_variant_is_its_forward(name):
    """Each checkpoint's own variant, recomputed from the captured attention inputs, is the weights of
    its forward pass (for HNAS with the learned u, for GAM the combination of both branches)."""
    result = hf.analyze(TEXT, CKPT / name)
    model = models.load(CKPT / name)
    own_variant = model.config.layer_variants()[0]
    ids = torch.tensor([result.windows[0].window.input_ids])
    assert result.tokens[0] == "[CLS]" and result.tokens[-1] == "[SEP]"
    torch.testing.assert_close(result.weights[own_variant], own_weights(model, ids)[:, 0], atol=2e-6, rtol=0)
    for w in result.weights.values():
        torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]), atol=1e-5, rtol=0)
    table = result.table()
    assert set(table.variant) == set(result.variants) and table["value"].notna().all()


def test_native_hnas_uses_its_learned_u_unless_told_otherwise():
    result = hf.analyze(TEXT, CKPT / "enc-hnas")
    learned = models.load(CKPT / "enc-hnas").hybrid_weights()  # (L, H), not 0.5
    assert not torch.allclose(learned, torch.full_like(learned, 0.5), atol=1e-3)
    torch.testing.assert_close(result.u, learned)
    assert any("learned" in n for n in result.notes)
    w = result.weights
    torch.testing.assert_close(w["hnas"], torch.lerp(w["unas"], w["dnas"], learned[:, :, None, None]),
                               atol=1e-6, rtol=0)
    # the statistics' u/N bound is the learned u: every HNAS column keeps at least u/N
    table = result.table()
    bound = table[(table.variant == "hnas") & (table.statistic == "column_mass_min_over_bound")]
    assert len(bound) == 16 and (bound.value >= 1 - 1e-4).all()
    # an explicit u wins; a checkpoint without HNAS layers uses 0.5
    given = hf.analyze(TEXT, CKPT / "enc-hnas", variants=("unas", "dnas", "hnas"), u=1.0)
    assert given.u == 1.0 and not given.notes
    torch.testing.assert_close(given.weights["hnas"], given.weights["dnas"])
    assert learned_u(hf.load_model(CKPT / "enc-unas")) is None
    assert hf.analyze(TEXT, CKPT / "enc-unas", variants="hnas").u == 0.5


def test_swap_mode_runs_each_variant_through_every_layer():
    result = hf.analyze(TEXT, CKPT / "enc-unas", variants=("dnas", "hnas"), mode="swap", u=0.25)
    ids = torch.tensor([result.windows[0].window.input_ids])
    ref = own_weights(swapped(CKPT / "enc-unas", "dnas"), ids)[:, 0]
    torch.testing.assert_close(result.weights["dnas"], ref, atol=2e-6, rtol=0)
    ref = own_weights(swapped(CKPT / "enc-unas", "hnas", torch.full((4, 4), 0.25)), ids)[:, 0]
    torch.testing.assert_close(result.weights["hnas"], ref, atol=2e-6, rtol=0)
    recomputed = hf.analyze(TEXT, CKPT / "enc-unas", variants=("dnas",)).weights["dnas"]
    assert (recomputed - result.weights["dnas"]).abs().max() > 1e-3  # later layers saw other inputs


def test_gam_checkpoint_maps_phi_theta_brains_and_their_combination():
    """Eqs. 14, 20, 22 of the GAM paper on the shipped GAM checkpoint (2 brains, relative position,
    learned c1): Phi = sum_b W^P_b Psi_b, Theta = sum_b W^S_b Psi^pos_b, weights = c1 Phi + (1-c1) Theta;
    every brain map is the variant applied to that brain's scores (a literal recomputation)."""
    result = hf.analyze(TEXT, CKPT / "enc-gam", variants=("unas", "dnas"))
    model = models.load(CKPT / "enc-gam")
    ids = torch.tensor([result.windows[0].window.input_ids])
    N = ids.shape[1]
    with capture_attention_inputs(model) as captured, torch.no_grad():
        model(ids)
    for variant in ("unas", "dnas"):
        maps = result.components[variant]
        assert set(maps) == {"phi", "theta", "brain_0", "brain_1", "position_brain_0", "position_brain_1"}
        for layer, (c, block) in enumerate(zip(captured, model.blocks, strict=True)):
            m = block.attn
            with torch.no_grad():
                eps = m.brain_scores(c.x)[0]  # (H, 2, N, N)
                delta = m.brain_scores(m.position_embedding(torch.arange(N)[None]), positional=True)[0]
                w_p, w_s = m.brain_weights(), m.brain_weights(m.position_brain_logits)
                c1 = float(m.c1())
            for b in range(2):
                torch.testing.assert_close(maps[f"brain_{b}"][layer],
                                           attnlab.attention_weights(eps[:, b], variant), atol=1e-6, rtol=0)
                torch.testing.assert_close(maps[f"position_brain_{b}"][layer],
                                           attnlab.attention_weights(delta[:, b], variant), atol=1e-6, rtol=0)
            phi = w_p[0] * maps["brain_0"][layer] + w_p[1] * maps["brain_1"][layer]
            theta = w_s[0] * maps["position_brain_0"][layer] + w_s[1] * maps["position_brain_1"][layer]
            torch.testing.assert_close(maps["phi"][layer], phi, atol=1e-6, rtol=0)
            torch.testing.assert_close(maps["theta"][layer], theta, atol=1e-6, rtol=0)
            torch.testing.assert_close(result.weights[variant][layer], c1 * phi + (1 - c1) * theta,
                                       atol=1e-6, rtol=0)
            assert 0.0 < c1 < 1.0
        assert (maps["phi"] - maps["theta"]).abs().max() > 0.05  # two different maps
    assert hf.analyze(TEXT, CKPT / "enc-hnas").components == {}


def test_padded_batch_gives_each_text_its_own_weights():
    loaded = hf.load_model(CKPT / "enc-dnas")
    a = hf.analyze(TEXT, loaded, variants=("unas", "sinkhorn"))
    b = hf.analyze("The earth was void.", loaded, variants=("unas", "sinkhorn"))
    ia, ib = a.windows[0].window.input_ids, b.windows[0].window.input_ids
    ids = torch.zeros(2, len(ia), dtype=torch.long)
    mask = torch.zeros(2, len(ia), dtype=torch.long)
    ids[0], mask[0] = torch.tensor(ia), 1
    ids[1, : len(ib)], mask[1, : len(ib)] = torch.tensor(ib), 1
    batch = hf.batch_weights(loaded, ids, mask, ("unas", "sinkhorn"))
    n = len(ib)
    for v in ("unas", "sinkhorn"):
        torch.testing.assert_close(batch[v][:, 0], a.weights[v], atol=1e-5, rtol=0)
        torch.testing.assert_close(batch[v][:, 1, :, :n, :n], b.weights[v], atol=1e-5, rtol=0)
        assert batch[v][:, 1, :, n:].abs().max() == 0 and batch[v][:, 1, :, :, n:].abs().max() == 0
    with pytest.raises(ValueError, match=r"token ids in \[0, 4095\]"):  # the same checks as for HF models
        hf.batch_weights(loaded, torch.tensor([[2, 4096, 3]]))
    with pytest.raises(ValueError, match="attention_mask must match"):
        hf.batch_weights(loaded, ids, mask[:, :3])


def test_windows_of_a_long_text_and_one_window_alone():
    stream = hf.stream_analysis(" ".join([TEXT] * 8), CKPT / "enc-unas", variants="unas")
    assert len(stream) > 2 and stream.windowing.window == 64
    third = stream.window(2)
    every = list(stream)
    assert third.tokens == every[2].tokens
    torch.testing.assert_close(third.weights["unas"], every[2].weights["unas"])
    with pytest.raises(ValueError, match="index"):
        stream.window(len(stream))


def test_causal_byte_level_checkpoint(tmp_path):
    """A decoder with the byte tokenizer: no special tokens, causal weights, sinkhorn at iters=1."""
    torch.manual_seed(0)
    config = models.ModelConfig(kind="decoder", vocab_size=261, max_len=48, d_model=16, n_layers=2,
                                n_heads=2, d_ff=32, variant=["unas", "hnas"])
    lm = models.TransformerLM(config).eval()
    models.save(lm, tmp_path / "dec", extra_config={"tokenizer": {"kind": "byte"}})
    result = hf.analyze("héllo wörld", tmp_path / "dec")
    assert result.model.causal and result.iters == 1 and any("iters=1" in n for n in result.notes)
    with pytest.raises(ValueError, match="iters must be 1 for causal sinkhorn"):
        hf.analyze("héllo wörld", tmp_path / "dec", iters=5)
    assert result.tokens[:2] == ["h", "<0xC3>"] and not result.special.any()
    spans = result.windows[0].window.char_spans
    assert spans[1] == spans[2] == (1, 2)  # both bytes of é belong to character 1
    ids = torch.tensor([result.windows[0].window.input_ids])
    own = own_weights(lm, ids)[:, 0]  # layer 0 unas, layer 1 hnas with its own u
    torch.testing.assert_close(result.weights["unas"][0], own[0], atol=2e-6, rtol=0)
    torch.testing.assert_close(result.weights["hnas"][1], own[1], atol=2e-6, rtol=0)
    torch.testing.assert_close(result.u[1], lm.hybrid_weights()[1])
    w = result.weights["dnas"]
    assert torch.triu(w, diagonal=1).abs().max() == 0  # j <= i
    torch.testing.assert_close(result.weights["sinkhorn"], w)


def test_capture_removes_its_hooks_even_on_error():
    model = models.load(CKPT / "enc-unas")
    with pytest.raises(RuntimeError, match="boom"), capture_attention_inputs(model) as captured:
        model(torch.tensor([[2, 10, 3]]))
        raise RuntimeError("boom")
    assert len(captured) == 4 and captured[0].x.shape == (1, 3, 128)
    assert all(not block.attn._forward_pre_hooks for block in model.blocks)
    with capture_attention_inputs(model) as captured, torch.no_grad():
        own = own_weights(model, torch.tensor([[2, 10, 11, 3]]))[:, 0]  # (L, H, 4, 4)
        for layer, c in enumerate(captured):
            q, k = c.query_key()  # (1, H, 4, D): the scores' q k^T / sqrt(D) give the layer's softmax
            assert q.shape == k.shape == (1, 4, 4, 32) and c.causal is False and c.mask is None
            torch.testing.assert_close(torch.softmax(q @ k.transpose(-1, -2) / 32**0.5, -1)[0], own[layer],
                                       atol=1e-6, rtol=0)
    gam = models.load(CKPT / "enc-gam")
    with capture_attention_inputs(gam) as captured, torch.no_grad():
        gam(torch.tensor([[2, 10, 3]]))
    with pytest.raises(ValueError, match="GAM layer"):
        captured[0].query_key()


def test_broken_native_checkpoint_is_a_model_load_error(tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(CKPT / "enc-unas", run)
    (run / "step-00001200" / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(hf.ModelLoadError, match="does not load.*safetensors"):
        hf.load_model(run)
    with pytest.raises(ValueError, match=r"u must be .*broadcastable to \(L, H\) \(4, 4\)"):
        hf.analyze(TEXT, CKPT / "enc-unas", variants="hnas", u=torch.full((3, 4), 0.5))


def test_cli_analyses_native_checkpoints(tmp_path, capsys):
    src = tmp_path / "t.txt"
    src.write_text(TEXT)
    rc = main(["analyze", str(src), "--model", str(CKPT / "enc-hnas"), "--out", str(tmp_path / "h"),
               "--no-figures", "--quiet"])
    assert rc == 0, capsys.readouterr().err
    manifest = json.loads((tmp_path / "h" / "manifest.json").read_text())
    np.testing.assert_allclose(manifest["settings"]["u"], models.load(CKPT / "enc-hnas").hybrid_weights(),
                               atol=1e-6)
    assert manifest["model"]["model_type"] == "attnlab-encoder"
    rc = main(["analyze", str(src), "--model", str(CKPT / "enc-gam"), "--variants", "unas,dnas",
               "--out", str(tmp_path / "g"), "--formats", "none", "--quiet"])
    assert rc == 0, capsys.readouterr().err
    arrays = np.load(tmp_path / "g" / "weights.npz")
    expected = hf.analyze(TEXT, CKPT / "enc-gam", variants=("unas", "dnas"))
    np.testing.assert_allclose(arrays["dnas.theta"], expected.components["dnas"]["theta"].numpy(), atol=1e-6)
    np.testing.assert_allclose(arrays["unas"], expected.weights["unas"].numpy(), atol=1e-6)
    figures = {p.name for p in (tmp_path / "g" / "figures").iterdir()}
    assert {"heatmap_unas_phi_layer0_head0.html", "heatmap_unas_theta_layer0_head0.html"} <= figures


def _attnlab_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return {n for n in names if n.startswith("attnlab")}


def test_data_flows_one_way_between_data_models_and_checkpoint_io():
    lib = REPO / "attnlab"
    assert _attnlab_imports(lib / "schema.py") == set()  # the validated JSON schemas: the bottom layer
    assert _attnlab_imports(lib / "checkpoint_io.py") == {"attnlab.schema"}
    assert _attnlab_imports(lib / "text_tokenizers.py") == {"attnlab.checkpoint_io", "attnlab.schema"}
    assert _attnlab_imports(lib / "data.py") == {"attnlab.text_tokenizers"}
    assert "attnlab.data" in _attnlab_imports(lib / "models.py")
    # the old import names keep working
    from attnlab.checkpoint_io import atomic_write_json, resolve_checkpoint

    assert models.atomic_write_json is atomic_write_json and models.resolve_checkpoint is resolve_checkpoint


@pytest.mark.parametrize("name", ["enc-hnas", "enc-gam"])
def test_exported_figure_of_a_native_checkpoint_is_reproduced_by_its_command(name, tmp_path, monkeypatch):
    """An exported figure's manifest (as the app writes it) names an ``attnlab analyze`` command that
    reloads the native checkpoint; reproduce_figure gives the same numbers (learned u included)."""
    import shlex

    from attnlab.figures import app_views as av

    result = hf.analyze(TEXT, CKPT / name, variants=("unas", "hnas"))
    u = result.u.tolist() if isinstance(result.u, torch.Tensor) else result.u
    settings = {"variants": ["unas", "hnas"], "mode": "recompute", "u": u, "iters": 3,
                "window": result.windowing.window}
    source = {"label": name, "model": result.model.as_dict(), "settings": settings}
    params = {"variant": "hnas", "layer": 1, "head": 2}
    manifest = av.manifest("heatmap", params, [source], text_sha256=result.text_sha256,
                           characters=len(TEXT), window=0)
    command = shlex.split(manifest["reproduce"]["commands"][0])
    assert command[command.index("--model") + 1] == str(CKPT / name)
    assert ("--u" in command) == (name == "enc-gam")  # a learned u is the command's default
    monkeypatch.chdir(tmp_path)
    (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
    assert main(command[1:] + ["--quiet"]) == 0
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    again = av.reproduce_figure("manifest.json", ["attnlab-out"])
    shown = av.build("heatmap", {v: w.numpy() for v, w in result.weights.items()}, result.tokens, params)
    np.testing.assert_allclose(np.asarray(again.figure.data[0].z, dtype=float),
                               np.asarray(shown.figure.data[0].z, dtype=float), atol=1e-6)


@pytest.mark.parametrize("variant", list(attnlab.VARIANTS))
def test_every_registered_variant_on_native_checkpoints(variant):
    """Any registered variant, in both modes, on a standard and on the GAM checkpoint: the weights are
    that variant applied to the layer's own scores (recompute), rows as its spec promises."""
    spec = attnlab.variant_spec(variant)
    result = hf.analyze(TEXT, CKPT / "enc-unas", variants=(variant,))
    model = models.load(CKPT / "enc-unas")
    ids = torch.tensor([result.windows[0].window.input_ids])
    with capture_attention_inputs(model) as captured, torch.no_grad():
        model(ids)
        for layer, c in enumerate(captured):
            q, k = c.query_key()
            ref = attnlab.attention_weights(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, variant)[0]
            torch.testing.assert_close(result.weights[variant][layer], ref, atol=1e-6, rtol=0)
    rows = result.weights[variant].sum(-1)
    if spec.rows_sum_to_one:
        torch.testing.assert_close(rows, torch.ones_like(rows), atol=1e-5, rtol=0)
    else:
        assert (rows <= 1 + 1e-6).all()
    swapped_result = hf.analyze(TEXT, CKPT / "enc-unas", variants=(variant,), mode="swap")
    assert swapped_result.weights[variant].shape == result.weights[variant].shape
    gam = hf.analyze(TEXT, CKPT / "enc-gam", variants=(variant,))
    assert {"phi", "theta"} <= set(gam.components[variant])


def test_swap_mode_copies_every_declared_parameter_of_the_variant():
    """Swap mode builds the swapped-in model from every parameter the variant's spec declares (not a
    list of names): Sinkhorn's iters reaches the model; tol, which a native attention module has no
    field for, runs at its default (0) and any other value is refused, naming it."""
    ids = None
    for iters in (1, 2):
        result = hf.analyze(TEXT, CKPT / "enc-unas", variants=("sinkhorn",), mode="swap", iters=iters,
                            tol=0.0)
        ids = torch.tensor([result.windows[0].window.input_ids])
        base = models.load(CKPT / "enc-unas")
        cfg = models.ModelConfig.from_dict({**base.config.to_dict(), "variant": "sinkhorn", "iters": iters})
        ref_model = models.TransformerLM(cfg)
        ref_model.load_state_dict(base.state_dict(), strict=False)
        torch.testing.assert_close(result.weights["sinkhorn"], own_weights(ref_model.eval(), ids)[:, 0],
                                   atol=2e-6, rtol=0)
    one = hf.analyze(TEXT, CKPT / "enc-unas", variants=("sinkhorn", "dnas"), mode="swap", iters=1)
    torch.testing.assert_close(one.weights["sinkhorn"], one.weights["dnas"], atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match=r"tol cannot be swapped into a native attnlab checkpoint.*tol=0\.1"):
        hf.analyze(TEXT, CKPT / "enc-unas", variants=("sinkhorn",), mode="swap", tol=0.1)
    # recompute mode takes tol (the generic path: the fused analysis runs every round)
    rec = hf.analyze(TEXT, CKPT / "enc-unas", variants=("sinkhorn",), tol=0.1)
    assert rec.weights["sinkhorn"].shape[-1] == ids.shape[1]
