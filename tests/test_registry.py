"""The variant registry: specs, parameters, register_variant, entry points, and a contract test that
drives a toy variant through every layer (attend, attention_weights, hf.analyze, the table, a figure,
the CLI through an installed entry point)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import attnlab
from attnlab.normalizers import specs

ROOT = Path(__file__).resolve().parents[1]


def test_every_builtin_spec_is_complete():
    names = [s.name for s in attnlab.variant_specs()]
    assert names[:6] == ["unas", "dnas", "hnas", "sinkhorn", "sparsemax", "softmax1"]
    assert tuple(attnlab.DEFAULT_VARIANTS) == ("unas", "dnas", "hnas", "sinkhorn")
    for spec in attnlab.variant_specs():
        assert spec.summary and spec.reference and spec.display
        for p in spec.params:
            assert p.check(p.default) == p.default and p.help
    assert attnlab.variant_spec("hnas").column_floor({"u": 0.3}) == 0.3
    assert attnlab.variant_spec("dnas").column_floor({}) == 1.0
    assert attnlab.variant_spec("unas").column_floor is None
    assert not attnlab.variant_spec("softmax1").rows_sum_to_one


def test_one_check_per_parameter_and_numpy_scalars():
    assert attnlab.check_params("hnas", {"u": np.float32(0.25)}) == {"u": 0.25}
    assert attnlab.check_params("sinkhorn", {"iters": np.int64(4)}) == {"iters": 4, "tol": 0.0}
    assert attnlab.check_params("sinkhorn", {}, causal=True)["iters"] == 1  # the causal rule's default
    with pytest.raises(ValueError, match=r"iters must be 1 for causal sinkhorn \(got iters=2\)"):
        attnlab.check_params("sinkhorn", {"iters": 2}, causal=True)
    bad = [({"u": float("nan")}, "u must be a number in [0, 1], got NaN"),
           ({"u": 1.5}, "u must be a number in [0, 1], got 1.5"),
           ({"u": True}, "u must be a number in [0, 1], got True"),
           ({"iters": 2.5}, "iters must be an integer in [1, 10000], got 2.5"),
           ({"iters": 10**9}, "iters must be an integer in [1, 10000], got 1000000000"),
           ({"tol": -1.0}, "tol must be a number in [0, 1], got -1.0"),
           ({"beta": 1.0}, "beta is not a parameter of any variant")]
    for params, message in bad:
        with pytest.raises(ValueError) as err:
            attnlab.check_params("sinkhorn" if "u" not in params else "hnas", params)
        assert message in str(err.value)
    # a parameter of another variant is checked by its own declaration, then ignored
    assert attnlab.check_params("dnas", {"u": 0.3}) == {}
    with pytest.raises(ValueError, match="u must be"):
        attnlab.check_params("dnas", {"u": 3.0})


def test_register_refuses_bad_names_and_builtin_replacement():
    with pytest.raises(ValueError, match="name must be a lowercase identifier"):
        attnlab.register_variant("Bad Name", attnlab.normalizers.unas)
    with pytest.raises(ValueError, match="'unas' is already registered"):
        attnlab.register_variant("unas", attnlab.normalizers.unas, replace=True)
    with pytest.raises(ValueError, match="normalizer must be a callable"):
        attnlab.register_variant("nothing", None)
    with pytest.raises(ValueError, match="built-in variant and cannot be removed"):
        specs.unregister_variant("dnas")
    with pytest.raises(TypeError, match="read-only"):
        attnlab.VARIANTS.append("x")


# A toy variant: softmax at temperature t (a parameter), written as the brief asks: one function,
# one declaration. Registered in-process here and, for the CLI, through an entry point.
TOY = textwrap.dedent('''
    import torch

    from attnlab import Param, register_variant


    def tempered(logits, ctx):
        """softmax_j(s_ij / t): rows sum to 1."""
        out = torch.softmax(logits / ctx.t, dim=-1)
        return torch.nan_to_num(out, nan=0.0) if logits.shape[-1] else out


    def register():
        register_variant("tempered", tempered, summary="softmax at temperature t",
                         reference="a test", params=(Param("t", float, 2.0, 0.01, 100.0, "temperature"),))
''')


@pytest.fixture()
def toy(tmp_path, monkeypatch):
    """The toy variant registered in this process (removed again afterwards)."""
    (tmp_path / "toy_variant.py").write_text(TOY, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    import toy_variant

    toy_variant.register()
    yield toy_variant
    specs.unregister_variant("tempered")
    assert "tempered" not in attnlab.VARIANTS
    sys.modules.pop("toy_variant", None)


def test_toy_variant_through_attend_weights_hf_table_and_figure(toy, minilm):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    s = q @ k.transpose(-1, -2) / 2
    ref = torch.softmax(s / 3.0, dim=-1)
    assert "tempered" in attnlab.VARIANTS
    torch.testing.assert_close(attnlab.attention_weights(s, "tempered", t=3.0), ref)
    with pytest.warns(UserWarning, match="no fused attend path"):
        out = attnlab.attend(q, k, v, "tempered", t=3.0)
    torch.testing.assert_close(out, ref @ v)
    with pytest.raises(ValueError, match=r"t must be a number in \[0.01, 100\], got 0.0"):
        attnlab.attend(q, k, v, "tempered", t=0.0)

    from attnlab import figures, hf

    result = hf.analyze("The cat sat on the mat.", minilm, variants=("unas", "tempered"), t=4.0)
    w = result.weights["tempered"]
    torch.testing.assert_close(w.sum(-1), torch.ones_like(w.sum(-1)), atol=1e-5, rtol=0)
    table = result.table()
    assert set(table.variant) == {"unas", "tempered"} and not table.value.isna().any()
    fig = figures.attention_heatmap(w[0, 0].numpy(), result.tokens, title="tempered")
    np.testing.assert_allclose(np.asarray(fig.data[0].z, dtype=float), w[0, 0].numpy(), atol=1e-6)


def test_causal_rules_note_what_they_change_on_a_causal_model(tiny_model_dir):
    """The note comes from each spec's causal_rule (its docstring says why), not a name list."""
    from attnlab import hf

    def sharp_when_causal(params, given):
        """causal use sharpens t."""
        return {**params, "t": 0.5}

    def tempered(logits, ctx):
        return torch.softmax(logits / ctx.t, dim=-1)

    attnlab.register_variant("tempered", tempered, params=(attnlab.Param("t", float, 2.0, 0.01, 100.0, "t"),),
                             causal_rule=sharp_when_causal)
    try:
        model = hf.load_model(tiny_model_dir("gpt2"))
        result = hf.analyze("a b c d e f", model, variants=("unas", "sinkhorn", "tempered"))
        causal = [n for n in result.notes if " is causal: " in n and " uses " in n]
        assert len(causal) == 2, result.notes
        assert [n for n in result.notes if "tokens are analysed in one window (the whole context" in n]
        assert "sinkhorn uses iters=1 (Causal Sinkhorn with more rounds degenerates" in causal[0]
        assert causal[1].endswith("tempered uses t=0.5 (causal use sharpens t.)")
        again = hf.analyze("a b c d e f", model, variants=("sinkhorn",), iters=1)
        assert not [n for n in again.notes if " uses " in n]  # nothing changed, nothing said
    finally:
        specs.unregister_variant("tempered")


@pytest.mark.slow
def test_toy_variant_through_the_cli_via_an_installed_entry_point(tmp_path):
    """A separate 'package' (a dist-info with an attnlab.variants entry point on sys.path) ships
    the variant; `attnlab analyze --variants tempered --t 4` picks it up."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "toy_variant.py").write_text(TOY, encoding="utf-8")
    info = site / "toy_variant-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-variant\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[attnlab.variants]\ntempered = toy_variant:register\n")
    text = tmp_path / "t.txt"
    text.write_text("The cat sat on the mat because it was tired.", encoding="utf-8")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    cmd = [sys.executable, "-m", "attnlab.cli", "analyze", str(text), "--variants", "unas,tempered",
           "--t", "4", "--out", str(out), "--no-figures"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["settings"]["variants"] == ["unas", "tempered"]
    assert manifest["settings"]["params"] == {"t": 4.0}
    help_text = subprocess.run([sys.executable, "-m", "attnlab.cli", "analyze", "--help"], env=env,
                               capture_output=True, text=True, timeout=120).stdout
    assert "--t T" in help_text and "temperature" in help_text


def test_docs_table_lists_every_builtin_with_its_parameters():
    """docs/VARIANTS.md's table is written from the specs: one row per built-in variant, naming each
    parameter with its default and range (this test keeps the two in step)."""
    rows = [line for line in (ROOT / "docs" / "VARIANTS.md").read_text(encoding="utf-8").splitlines()
            if line.startswith("| `")]
    table = {line.split("`")[1]: line for line in rows}
    for spec in attnlab.variant_specs():
        if not spec.builtin:
            continue
        assert spec.name in table, spec.name
        for p in spec.params:
            assert f"`{p.name}`" in table[spec.name] and f"({p.default:g})" in table[spec.name], p


@pytest.mark.slow
def test_toy_variant_in_the_app(toy, monkeypatch, tmp_path):
    """The app offers a variant registered in the server's process, with its parameter's widget, and
    analyses the text with it (AppTest runs the app in this process)."""
    pytest.importorskip("streamlit.testing.v1")
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("ATTNLAB_DEBUG", "1")
    monkeypatch.setenv("ATTNLAB_UMAP", "off")
    monkeypatch.setenv("ATTNLAB_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("ATTNLAB_UPLOADS_DIR", str(tmp_path / "uploads"))
    at = AppTest.from_file(str(ROOT / "app" / "streamlit_app.py"), default_timeout=240).run()
    assert not at.exception, [e.message for e in at.exception]
    picker = at.multiselect(key="inspect_variants")
    assert "tempered" in picker.options
    at = picker.set_value(["unas", "tempered"]).run()
    assert not at.exception, [e.message for e in at.exception]
    widget = next(w for w in at.get("slider") + at.get("number_input") if w.key == "inspect_tempered_t")
    assert widget.value == 2.0 and widget.help == "temperature"
    widget.set_value(4.0).run()
    assert not at.exception, [e.message for e in at.exception]
    at.session_state["inspect_heatmap_export"] = True  # the heatmap's Export menu opened: its snippet
    at.run()
    snippet = next(c.value for c in at.code if "attnlab analyze" in c.value)
    assert "--variants unas,tempered" in snippet and "--t 4" in snippet
