"""The streamed analysis of masked windows (attnlab/hf/compute/streamed.py) against the materialized
reference: every variant's row sums and per-head weights for causal, sliding-window, softcapped,
grouped-query, masked and padded layers, and through hf.analyze on tiny causal models. Seeded, offline."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.hf.compute import causal_kernel, streamed, tiles
from attnlab.hf.compute.head_maps import HeadMaps
from attnlab.normalizers import check_params
from attnlab.stats.engine import row_sums_dict

ALL = ("unas", "dnas", "hnas", "sinkhorn", "sparsemax", "softmax1")


def _layer(seed=0, H=4, Hkv=2, N=37, D=8, causal=True, mask=None, softcap=None, window=None, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(H, N, D, generator=g) * 2
    k = torch.randn(Hkv, N, D, generator=g) * 2
    return tiles.LayerInputs(query=q, key=k, mask=mask, causal=causal, scale=scale, softcap=softcap,
                                sliding_window=window)


def _reference(inputs: tiles.LayerInputs, variant, params):
    """(H, N, N) by attnlab.attention_weights on the whole materialized score matrix."""
    R = inputs.group
    k = inputs.key.repeat_interleave(R, 0)  # (H, N, D)
    s = inputs.query @ k.transpose(-1, -2) * inputs.scale
    if inputs.softcap is not None:
        s = inputs.softcap * torch.tanh(s / inputs.softcap)
    N = s.shape[-1]
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    allowed = torch.ones(N, N, dtype=torch.bool)
    if inputs.mask is not None:
        allowed = inputs.mask.expand(N, N).clone()
    else:
        if inputs.causal:
            allowed &= j <= i
        if inputs.sliding_window:
            allowed &= i - j < inputs.sliding_window
    return attnlab.attention_weights(s[None], variant, mask=allowed[None, None], causal=inputs.causal,
                                     **params)[0]


def _check(inputs_list, variants, given, specials, atol=2e-5):
    causal = any(x.causal for x in inputs_list)
    params = {v: check_params(v, given, causal=causal) for v in variants}
    got = streamed.stream_sums(inputs_list, variants, params, specials)
    N = inputs_list[0].key.shape[1]
    pos = torch.arange(N, dtype=torch.float32)
    dist = (pos[:, None] - pos[None, :]).abs()
    spec = torch.stack([m.float() for m in specials], -1)
    refs = {v: torch.cat([_reference(x, v, {**params[v], **({"u": _u(params[v], li)} if v == "hnas" else {})})
                          for li, x in enumerate(inputs_list)])
            for v in variants}
    for v in variants:
        reference = refs["unas"] if v != "unas" and "unas" in variants else None
        want = row_sums_dict(refs[v], spec, dist, reference)
        for name, t in want.items():
            if t is None:
                assert got[v][name] is None, (v, name)
                continue
            gap = (got[v][name] - t).abs().max()
            assert torch.allclose(got[v][name], t, atol=atol, rtol=1e-4), (v, name, gap)
    return params, refs


def _u(p, layer):
    u = p["u"]
    if isinstance(u, torch.Tensor):
        return u[layer][None, :, None, None]
    return u


@pytest.mark.parametrize("case", ["causal", "sliding", "softcap", "mqa", "mha", "bidirectional_mask",
                                  "bidirectional_sliding", "padded_queries"])
def test_streamed_sums_equal_the_materialized_reference(case, monkeypatch):
    monkeypatch.setattr(tiles, "TILE_BYTES", 4 * 4 * 37 * 9)  # tiles of 16 rows: several per head
    N = 37
    kw = {}
    if case == "sliding":
        kw = dict(window=7)
    elif case == "softcap":
        kw = dict(softcap=3.0, window=11, scale=2.0)
    elif case == "mqa":
        kw = dict(Hkv=1)
    elif case == "mha":
        kw = dict(Hkv=4)
    elif case == "bidirectional_mask":
        g = torch.Generator().manual_seed(3)
        kw = dict(causal=False, mask=torch.rand(N, N, generator=g) > 0.3)
    elif case == "bidirectional_sliding":
        i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
        kw = dict(causal=False, mask=(i - j).abs() < 5)
    elif case == "padded_queries":  # the last 6 tokens are padding: neither keys nor queries
        valid = torch.arange(N) < N - 6
        i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
        kw = dict(mask=(j <= i) & valid[None, :] & valid[:, None])
    layers = [_layer(seed=s, **kw) for s in range(2)]
    variants = ALL if layers[0].causal else ALL
    given = {"u": torch.tensor([[0.0, 0.25, 0.5, 1.0], [0.9, 0.1, 0.3, 0.7]])}
    special = torch.zeros(N, dtype=torch.bool)
    special[[0, 5]] = True
    _check(layers, variants, given, [special, ~special])


def test_sinkhorn_rounds_and_plugins_stream_one_head_at_a_time(monkeypatch):
    """Bidirectional masked Sinkhorn(3) and a registered plugin take the per-head reference path."""
    def tempered(logits, ctx):
        return torch.softmax(logits / ctx.t, dim=-1).nan_to_num(0.0)

    from attnlab.normalizers import specs

    attnlab.register_variant("tempered_stream_test", tempered, replace=True,
                             params=(attnlab.Param("t", float, 2.0, 0.01, 100.0, "temperature"),))
    try:
        _check_plugin()
    finally:  # later tests in this worker see the registry as it was
        specs.unregister_variant("tempered_stream_test")


def _check_plugin():
    N = 29
    g = torch.Generator().manual_seed(5)
    mask = torch.rand(N, N, generator=g) > 0.2
    layers = [_layer(seed=s, N=N, causal=False, mask=mask) for s in range(2)]
    assert tiles.stream_rule("sinkhorn", {"iters": 3, "tol": 0.0}, False) == "head"
    assert tiles.stream_rule("tempered_stream_test", {"t": 2.0}, True) == "head"
    special = torch.zeros(N, dtype=torch.bool)
    special[0] = True
    _check(layers, ("unas", "sinkhorn", "tempered_stream_test"), {"iters": 3, "t": 3.0}, [special])


@pytest.mark.parametrize("variant", ALL)
def test_head_weights_equal_the_reference(variant, monkeypatch):
    monkeypatch.setattr(tiles, "TILE_BYTES", 4 * 4 * 37 * 9)
    inputs = _layer(seed=2, window=9, softcap=5.0)
    params = {variant: check_params(variant, {"u": 0.3}, causal=True)}
    ref = _reference(inputs, variant, params[variant])
    for h in range(4):
        assert torch.allclose(tiles.head_weights(inputs, 0, h, variant, params), ref[h], atol=2e-6)



@pytest.mark.parametrize("variant", ALL)
@pytest.mark.parametrize("window", [None, 9])
def test_head_block_is_the_heads_slice_bit_for_bit(variant, window, monkeypatch):
    """tiles.head_block (the app's head view over a long text) equals head_weights' slice exactly, for
    spans inside one tile, across tiles and at the ends, and never computes a tile below the span."""
    monkeypatch.setattr(tiles, "TILE_BYTES", 1)  # the fewest rows a tile has (16)
    N = 101
    inputs = _layer(seed=3, N=N, window=window, softcap=5.0)
    params = {variant: check_params(variant, {"u": 0.3}, causal=True)}
    rows = tiles._tile_rows(inputs, 1, tiles._LIVE + 1)
    assert N > 5 * rows  # several tiles
    whole = tiles.head_weights(inputs, 0, 2, variant, params)
    seen = []
    logits = tiles.LayerInputs.logits
    monkeypatch.setattr(tiles.LayerInputs, "logits",
                        lambda self, heads, i0, *a: seen.append(i0) or logits(self, heads, i0, *a))
    for lo, hi in ((0, N), (1, 3), (rows - 1, rows + 2), (rows + 1, 3 * rows + 3), (N - 7, N), (5, 5)):
        seen.clear()
        got = tiles.head_block(inputs, 0, 2, variant, params, lo, hi)
        assert got.shape == (hi - lo, hi - lo) and torch.equal(got, whole[lo:hi, lo:hi]), (lo, hi)
        if tiles.stream_rule(variant, params[variant], True) != "head":
            assert all(i0 < max(hi, 1) for i0 in seen), (lo, hi, seen)


def test_head_maps_compute_one_head_on_access_and_refuse_huge_materialization(monkeypatch):
    calls = []

    def head(layer, h):
        calls.append((layer, h))
        return torch.full((5, 5), float(layer * 10 + h))

    maps = HeadMaps("dnas", (3, 2, 5, 5), head)
    assert maps[1, 0][0, 0].item() == 10.0 and calls == [(1, 0)]
    assert maps[-1, -1].shape == (5, 5) and calls[-1] == (2, 1)
    assert maps[2].shape == (2, 5, 5)
    assert maps[0, 1, 2].shape == (5,)
    with pytest.raises(ValueError, match="layer must be an integer in \\[-3, 2\\], got 3"):
        maps[3, 0]
    with pytest.raises(ValueError, match="head"):
        maps[0, 2.5]
    assert torch.equal(maps.sum(-1)[1, 1], torch.full((5,), 55.0))  # a tensor method: the whole, kept
    assert torch.stack([maps, maps]).shape == (2, 3, 2, 5, 5)
    from attnlab.hf.compute import head_maps

    monkeypatch.setattr(head_maps, "MATERIALIZE_LIMIT", 100)
    big = HeadMaps("unas", (3, 2, 5, 5), head)
    with pytest.raises(ValueError, match="over the 0 MiB limit .* Read one head"):
        big.sum()
    assert big[0, 0].shape == (5, 5)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_analyze_on_causal_models_streams_and_matches_the_materialized_table(arch, tiny_model_dir,
                                                                             english_text):
    from attnlab import hf, stats

    loaded = hf.load_model(tiny_model_dir(arch))
    res = hf.analyze(english_text[:300], loaded, variants=ALL, u=0.3)
    win = res.windows[0]
    assert all(isinstance(w, HeadMaps) for w in win.weights.values())
    ids = torch.tensor([win.window.input_ids])
    ref = hf.batch_weights(loaded, ids, variants=ALL, u=0.3)  # materialized (L, 1, H, N, N)
    for v in ALL:
        L, _, H, N, _ = ref[v].shape
        for layer in range(L):
            assert torch.allclose(win.weights[v][layer], ref[v][layer, 0], atol=1e-5), v
    want = stats.tidy_table({v: ref[v][:, 0] for v in ALL}, special=win.special, punctuation=win.punctuation,
                            u=0.3)
    got = win.table().drop(columns="window")
    keys = ["variant", "layer", "head", "statistic"]
    both = got.merge(want, on=keys, suffixes=("", "_ref"))
    assert len(both) == len(want) == len(got)
    diff = (both.value - both.value_ref).abs()
    assert bool((diff.fillna(0) <= 1e-4).all()), both[diff > 1e-4].head()


def test_a_streamed_windows_column_masses_come_from_its_row_sums(tiny_model_dir, english_text, monkeypatch):
    """After an analysis with statistics, the streamed window's column_masses() (what the app's
    Explaining away and NaN note read) are the analysis' row sums: no second pass over the tiles, and
    the values of the weights' own column sums."""
    from attnlab import hf

    loaded = hf.load_model(tiny_model_dir("llama"))
    win = hf.analyze(english_text[:300], loaded, variants=("unas", "dnas", "sparsemax"), u=0.3).windows[0]
    window = win.weights["unas"].window
    passes = []
    monkeypatch.setattr(streamed, "stream_sums", lambda *a, **k: passes.append(1))
    masses = window.column_masses()
    assert passes == []
    for v, m in masses.items():
        L, H, N = m.shape
        want = torch.stack([torch.stack([win.weights[v][layer, h].sum(0) for h in range(H)])
                            for layer in range(L)])
        assert torch.allclose(m, want, atol=1e-5), v


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_sliding_window_and_softcap_models_equal_eager_attention(arch, tiny_model_dir, english_text):
    """Mistral's sliding window and Gemma 2's softcap with alternating sliding/global layers: the
    streamed UNAS equals the model's own eager attention, and every variant the materialized path."""
    from transformers import AutoModel

    from attnlab import hf

    directory = tiny_model_dir(arch)
    loaded = hf.load_model(directory)
    res = hf.analyze(english_text[:300], loaded, variants=ALL)
    win = res.windows[0]
    ids = torch.tensor([win.window.input_ids])
    assert ids.shape[1] > 8  # longer than the 8-token window
    eager = AutoModel.from_pretrained(directory, attn_implementation="eager")
    with torch.no_grad():
        attentions = eager(ids, output_attentions=True).attentions
    for layer, a in enumerate(attentions):
        assert torch.allclose(win.weights["unas"][layer], a[0], atol=1e-5), layer
    ref = hf.batch_weights(loaded, ids, variants=ALL)
    for v in ALL:
        for layer in range(len(attentions)):
            assert torch.allclose(win.weights[v][layer], ref[v][layer, 0], atol=1e-5), (v, layer)


def _kernel_ops():
    from attnlab import kernels

    ops = kernels.analysis_ops()
    return getattr(ops, "causal_heads", None) if ops is not None else None


@pytest.mark.parametrize("case", ["gqa", "mha", "mqa", "sliding", "softcap_sliding", "mask_tensor",
                                  "long_rows", "wide_later", "wide_first"])
def test_causal_kernel_equals_the_pytorch_tiles(case, monkeypatch):
    """attnlab's causal analysis kernel (analysis_causal.h) against the PyTorch tiles it replaces,
    which the tests above hold to the materialized reference: every row sum of unas, dnas, hnas (u per
    head, 0 and 1 included) and one-round Sinkhorn. wide_later / wide_first: scores beyond the kernel's
    reference band (a head's largest score of its first 32 rows, M: [M - 80, M + 30]) from row 40 on /
    from the first block on, so its heads leave the one-exponential reference form for the per-column
    maxima midway / at once."""
    if _kernel_ops() is None:
        pytest.skip("attnlab's causal analysis kernel is not built here (needs AVX-512)")
    N = 301 if case == "long_rows" else 67
    kw = {"gqa": {}, "mha": dict(Hkv=4), "mqa": dict(Hkv=1), "sliding": dict(window=9),
          "softcap_sliding": dict(softcap=2.5, window=20, scale=1.5), "long_rows": {}}.get(case, {})
    if case == "mask_tensor":  # transformers' own causal mask tensor: the kernel checks it is plain
        i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
        kw = dict(mask=(j <= i)[None], window=None)
    layers = [_layer(seed=s, N=N, **kw) for s in range(2)]
    if case == "mask_tensor":
        assert causal_kernel.plain_causal(layers[0])
    if case.startswith("wide"):
        first = 0 if case == "wide_first" else 40
        for x in layers:
            x.query[:, first:] *= 12.0
            s = x.query @ x.key.repeat_interleave(x.group, 0).transpose(-1, -2) * x.scale
            s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("nan"))
            M = s[:, :32].nan_to_num(-1e30).amax(dim=(1, 2))  # per head
            rest = s[:, first:]
            above = rest.nan_to_num(-1e30).amax(dim=(1, 2)) > M + 30
            below = rest.nan_to_num(1e30).amin(dim=(1, 2)) < M - 80
            assert bool((above | below).all()), "every head leaves the band"
    variants = ("unas", "dnas", "hnas", "sinkhorn", "softmax1")
    u = torch.tensor([[0.0, 0.3, 0.7, 1.0], [0.5, 0.5, 0.2, 0.9]])
    params = {v: check_params(v, {"u": u}, causal=True) for v in variants}
    special = torch.zeros(N, dtype=torch.bool)
    special[[0, 3, N - 1]] = True
    first = torch.zeros(N, dtype=torch.bool)
    first[0] = True
    # masks that cover every key between them and masks of a few keys only (the first token)
    for specials in ([special, ~special], [special, first]):
        monkeypatch.setattr(causal_kernel, "_USE_KERNEL", True)
        got = streamed.stream_sums(layers, variants, params, specials)
        monkeypatch.setattr(causal_kernel, "_USE_KERNEL", False)
        want = streamed.stream_sums(layers, variants, params, specials)
        for v in variants:
            for name, t in want[v].items():
                if t is None:
                    assert got[v][name] is None
                    continue
                gap = (got[v][name] - t).abs().max()
                assert torch.allclose(got[v][name], t, atol=3e-5, rtol=1e-4), (v, name, gap)


def test_causal_kernel_leaves_other_masks_and_nan_to_the_exact_path(monkeypatch):
    """A mask that is not plain causal is never given to the kernel; NaN scores make it hand the layer
    back (redo), so the NaN rule of docs/DESIGN.md §4 holds on the kernel path too."""
    if _kernel_ops() is None:
        pytest.skip("attnlab's causal analysis kernel is not built here (needs AVX-512)")
    N = 40
    g = torch.Generator().manual_seed(1)
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    odd = (j <= i) & (torch.rand(N, N, generator=g) > 0.2) | (i == j)
    assert not causal_kernel.plain_causal(_layer(N=N, mask=odd[None]))
    assert not causal_kernel.plain_causal(_layer(N=N, causal=False))
    layer = _layer(N=N)
    layer.query[1, 7, 0] = float("nan")  # one NaN query row in head 1
    params = {v: check_params(v, {}, causal=True) for v in ("unas", "dnas")}
    got = streamed.stream_sums([layer], ("unas", "dnas"), params, None)
    assert torch.isnan(got["unas"]["entropy"][1, 7]) and torch.isnan(got["dnas"]["cols"][1]).any()
    assert torch.isfinite(got["unas"]["entropy"][0]).all()


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_the_causal_kernel_runs_inside_the_capture_forward(arch, tiny_model_dir, english_text, monkeypatch):
    """Every layer of a causal window goes through the kernel during the capture forward (its attention
    output in place of SDPA's), and the statistics equal those of a forward without the hook."""
    if _kernel_ops() is None:
        pytest.skip("attnlab's causal analysis kernel is not built here (needs AVX-512)")
    from attnlab import hf
    from attnlab.hf.compute import causal_forward, weights

    taken = []
    original = causal_forward.CausalLayerwise.__call__

    def spy(self, layer, *args):
        out = original(self, layer, *args)
        taken.append((layer, out is not None or args[-2]))  # (layer, took it: an output, or the last layer)
        return out

    monkeypatch.setattr(causal_forward.CausalLayerwise, "__call__", spy)
    loaded = hf.load_model(tiny_model_dir(arch))
    got = hf.analyze(english_text[:300], loaded).windows[0].table()
    assert taken and all(ok for _, ok in taken), taken
    monkeypatch.setattr(weights, "_causal_layerwise", lambda *a, **k: None)  # SDPA, then the kernel after
    want = hf.analyze(english_text[:300], loaded).windows[0].table()
    both = got.merge(want, on=["variant", "layer", "head", "statistic"], suffixes=("", "_ref"))
    assert len(both) == len(want)
    gap = (both.value - both.value_ref).abs()
    assert (gap <= 1e-4).all(), both[gap > 1e-4]


@pytest.mark.parametrize(("config", "kind"), [("ViTConfig", "a vision"), ("Wav2Vec2Config", "an audio")])
def test_non_text_models_are_refused_at_load_with_words(config, kind, tmp_path):
    """A vision or audio model directory: a worded ModelLoadError naming the architecture (was an
    AttributeError from a text probe fed to a vision model)."""
    import transformers

    from attnlab import hf

    cfg = getattr(transformers, config)(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=64)
    transformers.AutoModel.from_config(cfg).save_pretrained(tmp_path)
    with pytest.raises(hf.ModelLoadError, match=f"is {kind} model; attnlab analyses text models"):
        hf.load_model(tmp_path)
