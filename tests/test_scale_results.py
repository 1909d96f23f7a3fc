"""Issue 29's statistics (attnlab/train/scale_results.py) against literal computations: the t-interval,
u per layer over seeds, the trend test over layers, per-window held-out losses and the bootstrap."""

import json

import numpy as np
import pytest
import torch
from scipy import stats

from attnlab.train import scale_results as sr


def test_t_interval_is_the_textbook_one():
    x = [0.61, 0.58, 0.66]
    got = sr.t_interval(x)
    half = stats.t.ppf(0.975, 2) * np.std(x, ddof=1) / np.sqrt(3)
    assert got["mean"] == pytest.approx(np.mean(x)) and got["n"] == 3
    assert got["low"] == pytest.approx(np.mean(x) - half) and got["high"] == pytest.approx(np.mean(x) + half)
    one = sr.t_interval(np.float32(0.7)[None])
    assert one["n"] == 1 and np.isnan(one["low"]) and np.isnan(one["high"])
    with pytest.raises(ValueError, match="values must be a non-empty 1-D sequence, got shape"):
        sr.t_interval([])


def test_u_per_layer_over_seeds():
    a = np.array([[0.6, 0.7], [0.52, 0.54], [0.49, 0.53]])  # (L=3, H=2): layer means 0.65, 0.53, 0.51
    b = a + 0.02
    got = sr.u_per_layer({"s0": a, "s1": b})
    assert [r["mean"] for r in got["layers"]] == pytest.approx([0.66, 0.54, 0.52])
    assert got["layers"][0]["seeds"] == pytest.approx({"s0": 0.65, "s1": 0.67})
    assert got["every_seed_above_half"] is True
    # two seeds 0.02 apart: t(1) interval half-width 12.71 * 0.01414 / 1.414 = 0.127: lower ends below 0.5
    assert got["interval_above_half"] is False
    assert sr.u_per_layer({"s0": a})["interval_above_half"] is False  # one seed: no interval
    with pytest.raises(ValueError, match=r"\(L, H\) arrays of one shape"):
        sr.u_per_layer({"s0": a, "s1": a[:2]})
    with pytest.raises(ValueError, match="at least one HNAS run"):
        sr.u_per_layer({})


def test_trend_test_finds_a_falling_u_and_not_a_flat_one():
    rng = np.random.default_rng(0)
    falling = 0.65 - 0.01 * np.arange(8) + rng.normal(0, 0.002, (3, 8))
    got = sr.trend_test(falling)
    for row, slope in zip(falling, got["slopes"], strict=True):
        assert slope == pytest.approx(stats.linregress(np.arange(8), row).slope)
    assert got["p_lower_near_output"] < 0.01 and got["p_two_sided"] < 0.02
    assert got["spearman_rho"] == pytest.approx(-1.0, abs=0.05) and got["spearman_p"] < 0.01
    flat = 0.6 + rng.normal(0, 0.01, (3, 8))
    assert sr.trend_test(flat)["p_lower_near_output"] > 0.05
    single = sr.trend_test(falling[:1])
    assert np.isnan(single["p_two_sided"]) and len(single["slopes"]) == 1
    with pytest.raises(ValueError, match="at least 3 layers"):
        sr.trend_test(falling[:, :2])


def test_bootstrap_ratio_and_its_paired_difference():
    rng = np.random.default_rng(1)
    counts = rng.integers(5, 20, 200).astype(float)
    sums = counts * rng.normal(3.0, 0.3, 200)
    got = sr.bootstrap_ratio(sums, counts)
    assert got["value"] == pytest.approx(sums.sum() / counts.sum())
    assert got["low"] < got["value"] < got["high"] and got["n_windows"] == 200
    same = sr.bootstrap_ratio(sums, counts, minus=(sums, counts))
    assert same["value"] == 0 and same["low"] == 0 and same["high"] == 0  # paired: no spread at all
    worse = sr.bootstrap_ratio(sums + counts * 0.1, counts, minus=(sums, counts))
    assert worse["value"] == pytest.approx(0.1) and worse["low"] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="sums and counts must be equal non-empty 1-D arrays"):
        sr.bootstrap_ratio(sums, counts[:10])
    with pytest.raises(ValueError, match="minus must hold the same windows"):
        sr.bootstrap_ratio(sums, counts, minus=(sums[:5], counts[:5]))


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    """A tiny HNAS and UNAS encoder trained 3 steps on a short text, as scale runs in a checkpoints folder."""
    from attnlab.train import RunConfig, train

    root = tmp_path_factory.mktemp("scale")
    text = ("In the beginning God created the heaven and the earth. And the earth was without form, and "
            "void; and darkness was upon the face of the deep. ") * 150
    corpus = root / "corpus.txt"
    corpus.write_text(text)
    for name, variant in (("enc8-unas-s0", "unas"), ("enc8-hnas-s0", "hnas"), ("enc8-hnas-s1", "hnas")):
        cfg = RunConfig.from_dict({
            "name": name,
            "model": {"kind": "encoder", "d_model": 16, "n_layers": 3, "n_heads": 2, "d_ff": 32,
                      "variant": variant},
            "data": {"tokenizer": "byte", "seq_len": 32, "corpus": str(corpus)},
            "train": {"steps": 3, "batch_size": 4, "warmup": 1, "eval_every": 3, "eval_batches": 1,
                      "save_every": 3, "seed": int(name[-1])},
        })
        train(cfg, root / name, progress=False)
    return root


def test_window_losses_sum_to_the_models_own_loss(tiny_runs):
    from attnlab.data import LMData, load_corpus, load_tokenizer
    from attnlab.models import load, load_config

    d = tiny_runs / "enc8-hnas-s0"
    sums, counts = sr.window_losses(d, n_windows=6, batch_size=4)
    assert sums.shape == counts.shape == (6,) and (counts >= 1).all()
    model, cfg, tok = load(d), load_config(d), load_tokenizer(d)
    ids = torch.tensor(tok.encode_corpus(load_corpus(cfg["data"]["corpus"])), dtype=torch.long)
    data = LMData(ids, seq_len=32, kind="encoder", vocab_size=tok.vocab_size, seed=0)
    with torch.no_grad():  # the same windows and masks (batches of 4), the last batch's first two windows
        outs = [model(b["input_ids"][:n], labels=b["labels"][:n], loss_reduction="sum")
                for b, n in zip(data.eval_batches(4, 2), (4, 2), strict=True)]
    assert sums.sum() == pytest.approx(sum(float(o.loss) for o in outs), rel=1e-5)
    assert counts.sum() == sum(o.n_targets for o in outs)


def test_build_scale_results_writes_numbers_and_figures(tiny_runs, tmp_path):
    res = sr.build_scale_results(tiny_runs, tmp_path, runs=None, n_windows=8)
    assert set(res["runs"]) == {"enc8-unas-s0", "enc8-hnas-s0", "enc8-hnas-s1"}
    assert all(r["finished"] for r in res["runs"].values())
    assert len(res["u"]["layers"]) == 3 and res["trend"]["slopes"] and len(res["trend"]["slopes"]) == 2
    assert res["loss"]["enc8-unas-s0"]["minus_unas"] is None
    assert res["loss"]["enc8-hnas-s0"]["minus_unas"]["n_windows"] == 8
    assert res["loss_hnas_over_seeds"]["n"] == 2
    mass = res["column_mass"]["enc8-unas-s0"]
    assert len(mass) == 3 and "explained_away" in mass[0]
    for name in ("scale_u.png", "scale_loss.png", "scale_column_mass.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "scale_results.json").read_text())["u"] == res["u"]
    with pytest.raises(FileNotFoundError, match="no scale run"):
        sr.build_scale_results(tmp_path / "none", tmp_path, runs=None)


def test_unfinished_runs_are_listed_not_counted(tiny_runs, tmp_path):
    """A run short of its steps (here: its recipe asks for more) is listed with its step and left out of
    u, the trend, the losses and the column masses, unless an interim reading asks for it; a run at step
    0 never counts (its u is exactly 0.5 and would pass for a seed)."""
    import shutil

    root = tmp_path / "ck"
    shutil.copytree(tiny_runs, root)
    recipe = root / "enc8-hnas-s1" / "recipe.json"
    cfg = json.loads(recipe.read_text())
    cfg["train"]["steps"] = 10  # trained 3 of 10
    recipe.write_text(json.dumps(cfg))
    res = sr.build_scale_results(root, tmp_path / "f", runs=None, n_windows=4)
    assert res["runs"]["enc8-hnas-s1"] == {**res["runs"]["enc8-hnas-s1"], "finished": False, "used": False,
                                          "step": 3}
    assert res["u"]["layers"][0]["n"] == 1 and set(res["u"]["layers"][0]["seeds"]) == {"enc8-hnas-s0"}
    assert set(res["loss"]) == set(res["column_mass"]) == {"enc8-unas-s0", "enc8-hnas-s0"}
    interim = sr.build_scale_results(root, tmp_path / "g", runs=None, n_windows=4, include_unfinished=True)
    assert interim["runs"]["enc8-hnas-s1"]["used"] and interim["u"]["layers"][0]["n"] == 2
    (root / "enc8-hnas-s1" / "latest.json").write_text(json.dumps({"step": 0}))
    at_zero = sr.build_scale_results(root, tmp_path / "h", runs=None, n_windows=4, include_unfinished=True)
    assert not at_zero["runs"]["enc8-hnas-s1"]["used"] and at_zero["u"]["layers"][0]["n"] == 1
    for name in ("enc8-unas-s0", "enc8-hnas-s0"):
        cfg = json.loads((root / name / "recipe.json").read_text())
        cfg["train"]["steps"] = 10
        (root / name / "recipe.json").write_text(json.dumps(cfg))
    with pytest.raises(FileNotFoundError, match="no finished scale run yet .*enc8-hnas-s0 at step 3 of 10"):
        sr.build_scale_results(root, tmp_path / "i", runs=None)
