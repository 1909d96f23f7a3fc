"""attnlab.hf on a GPU: every analysis on CUDA against the same analysis on the CPU.

The CUDA tests (marked ``cuda``, skipped without a CUDA device) use tiny random models built here from
conftest's configs: a BERT with a WordPiece tokenizer trained on the test corpus, GPT-2 and LLaMA
(grouped-query attention, rotary positions) with conftest's byte-level BPE tokenizers. So they need
neither the embedded MiniLM nor plotly, streamlit or pandas (tables are compared as tensors, and as
DataFrames too where pandas is installed). Weights start larger than transformers' default
(``initializer_range``) so that the variants differ clearly and the Jensen-Shannon statistics are not
rounding noise.

Compared, for every variant, recompute and swap modes, u per layer and head: ``hf.analyze`` (two
windows of 64 tokens: weights, statistics) and ``hf.batch_weights`` (a padded batch of two texts),
within TOL; results come back on the CPU. One test runs everywhere: a device that cannot be used is
refused with a ValueError naming ``device``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import CORPUS, TINY_CONFIGS, TINY_POSITIONS, _bpe_tokenizer

from attnlab import VARIANTS, hf

HAS_CUDA = torch.cuda.is_available()

TOL = 1e-4  # float32 on the device against float32 on the CPU
ARCHS = ("bert", "gpt2", "llama")  # bidirectional (the CPU's fused path) and causal, GQA + rotary
TEXT = " ".join(CORPUS)  # ~80 tokens: two windows of TINY_POSITIONS
BATCH = (CORPUS[0], CORPUS[3])


def _wordpiece_tokenizer():
    """BERT-style WordPiece ([CLS] ... [SEP]) trained on CORPUS (no MiniLM vocabulary needed)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tk = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tk.normalizer = normalizers.BertNormalizer(lowercase=True)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.decoder = decoders.WordPiece()
    tk.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=300, special_tokens=specials))
    tk.post_processor = processors.BertProcessing(
        ("[SEP]", tk.token_to_id("[SEP]")), ("[CLS]", tk.token_to_id("[CLS]"))
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, model_max_length=TINY_POSITIONS, unk_token="[UNK]", pad_token="[PAD]",
        cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
    )


def build_model(arch: str, directory, seed: int = 0):
    """A tiny random ``arch`` model (2 layers x 4 heads) and its tokenizer, written to ``directory``."""
    import transformers
    from transformers import AutoModel

    tokenizer = _wordpiece_tokenizer() if arch == "bert" else _bpe_tokenizer(arch)
    cls, fields = TINY_CONFIGS[arch]
    config = getattr(transformers, cls)(vocab_size=len(tokenizer), initializer_range=0.2, **fields)
    torch.manual_seed(seed)
    AutoModel.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Factory: arch -> directory of its tiny model (built once per module). Not conftest's
    tiny_model_dir: its BERT tokenizers take MiniLM's vocabulary, which GPU machines may not have."""
    built = {}

    def make(arch: str):
        if arch not in built:
            built[arch] = build_model(arch, tmp_path_factory.mktemp(f"cuda-{arch}"))
        return built[arch]

    return make


@pytest.fixture(autouse=True)
def _ieee_float32_matmul(ieee_float32_matmul):
    """Full float32 matmuls on the device for every test here (conftest.ieee_float32_matmul)."""


# ----------------------------------------------------------------------------------------------
# Helpers (device-agnostic: on the CPU they compare the CPU with itself)
# ----------------------------------------------------------------------------------------------


def _close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = TOL) -> None:
    """max |got - want| <= tol (1 + max |want|); both on the CPU."""
    assert got.device.type == "cpu", f"{what}: on {got.device}, expected the CPU"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert bool(torch.isfinite(got).all()), f"{what}: non-finite values"
    err = float((got.double() - want.double()).abs().max()) if want.numel() else 0.0
    scale = float(want.abs().max()) if want.numel() else 0.0
    assert err <= tol * (1.0 + scale), f"{what}: max |diff| {err:.3g} > {tol:g} x (1 + {scale:.3g})"


def _statistics(w: hf.WindowResult) -> dict[str, dict[str, torch.Tensor]]:
    """{variant: {statistic: (L, H)}}: the window's tidy table (special tokens and punctuation as
    special keys, reference unas) as tensors, from the row sums computed with the weights when there
    are some, else from the weights."""
    from attnlab import stats
    from attnlab.hf.analysis.pipeline import _u_for_stats
    from attnlab.hf.compute.weights import _row_sums_of

    special = w.special | w.punctuation
    cached = w._cached_sums(special, "unas")
    if cached is None:
        cached = _row_sums_of({v: t[:, None] for v, t in w.weights.items()}, [special]), 0
    sums, index = cached
    shape = tuple(next(iter(w.weights.values())).shape)
    return stats._statistics_from_row_sums(sums, shape, special_index=index, u=_u_for_stats(w.u), eps=0.01,
                                           eps_relative=0.1, reference="unas")


def _compare_analyses(got: hf.AnalysisResult, want: hf.AnalysisResult) -> None:
    assert (got.n_windows, got.iters, got.notes, got.variants) == (want.n_windows, want.iters, want.notes,
                                                                 want.variants)
    for wg, ww in zip(got.windows, want.windows, strict=True):
        assert wg.tokens == ww.tokens
        for v in want.variants:
            _close(wg.weights[v], ww.weights[v], f"window {ww.index} {v} weights")
        sg, sw = _statistics(wg), _statistics(ww)
        for v in want.variants:
            assert list(sg[v]) == list(sw[v])
            for name, value in sw[v].items():
                _close(sg[v][name].cpu(), value.cpu(), f"window {ww.index} {v} {name}")
    try:
        import pandas  # noqa: F401
    except ImportError:
        return
    tg, tw = got.table(), want.table()
    assert tg.drop(columns="value").equals(tw.drop(columns="value"))
    _close(torch.tensor(tg["value"].values), torch.tensor(tw["value"].values), "table values")


def _u(loaded: hf.LoadedModel) -> torch.Tensor:
    """A different HNAS u for every layer and head, (L, H) on the CPU."""
    L, H = loaded.info.n_layers, loaded.info.n_heads
    return torch.linspace(0.1, 0.9, L * H).reshape(L, H)


def _padded_batch(tokenizer, texts) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) (2, N), right-padded with id 0 (no pad token needed)."""
    ids = [tokenizer(t)["input_ids"][:TINY_POSITIONS] for t in texts]
    n = max(len(x) for x in ids)
    input_ids = torch.tensor([x + [0] * (n - len(x)) for x in ids])
    mask = torch.tensor([[1] * len(x) + [0] * (n - len(x)) for x in ids])
    assert int(mask.sum()) < mask.numel()  # one text is padded
    return input_ids, mask


# ----------------------------------------------------------------------------------------------
# CUDA against the CPU
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", hf.MODES)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_analysis_on_cuda_matches_the_cpu(model_dir, arch, mode):
    cpu = hf.load_model(model_dir(arch))
    u = _u(cpu)
    want = hf.analyze(TEXT, cpu, mode=mode, u=u)
    got = hf.analyze(TEXT, cpu, mode=mode, u=u, device="cuda")  # the same model, copied to the GPU
    assert want.device == "cpu" and got.device.startswith("cuda")
    assert got.n_windows == 2
    _compare_analyses(got, want)


@pytest.mark.parametrize("mode", hf.MODES)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_batch_weights_on_cuda_match_the_cpu(model_dir, arch, mode):
    cpu = hf.load_model(model_dir(arch))
    gpu = hf.load_model(model_dir(arch), device="cuda")
    ids, mask = _padded_batch(cpu.tokenizer, BATCH)
    want = hf.batch_weights(cpu, ids, mask, mode=mode, u=_u(cpu))
    got = hf.batch_weights(gpu, ids, mask, mode=mode, u=_u(cpu))
    for v in VARIANTS:
        _close(got[v], want[v], f"{v} weights")


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_load_model_on_cuda_keeps_one_copy_per_device(model_dir):
    path = model_dir("gpt2")
    gpu = hf.load_model(path, device="cuda")
    assert gpu.device.type == "cuda"
    assert hf.load_model(path, device=f"cuda:{torch.cuda.current_device()}") is gpu
    assert hf.load_model(path, device=torch.device("cuda")) is gpu
    cpu = hf.load_model(path)
    assert cpu is not gpu and cpu.device.type == "cpu"
    assert hf.model_on(cpu, "cuda") is gpu and hf.model_on(gpu, None) is gpu
    assert hf.model_on(gpu, "cpu") is cpu
    assert hf.load_model(path, device="auto") is gpu
    result = hf.analyze("A key can be explained away.", path, variants=("dnas",), device="cuda")
    assert result.device == str(gpu.device) and result.weights["dnas"].device.type == "cpu"


# ----------------------------------------------------------------------------------------------
# Everywhere
# ----------------------------------------------------------------------------------------------


def test_unusable_device_is_refused_naming_the_argument(model_dir):
    path = model_dir("gpt2")
    missing = "cuda" if not HAS_CUDA else f"cuda:{torch.cuda.device_count()}"  # no such device here
    loaded = hf.load_model(path)
    ids = torch.tensor([loaded.tokenizer(CORPUS[0])["input_ids"]])
    calls = {
        "load_model": lambda d: hf.load_model(path, device=d),
        "analyze": lambda d: hf.analyze(TEXT, path, device=d),
        "analyze LoadedModel": lambda d: hf.analyze(TEXT, loaded, device=d),
        "batch_weights": lambda d: hf.batch_weights(loaded, ids, device=d),
        "stream_analysis": lambda d: hf.stream_analysis(TEXT, loaded, device=d),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=r"device='cuda(:\d+)?'") as e:
            call(missing)
        assert "CUDA" in str(e.value), name
        for bad in ("tpu", "gpu", 1.5):
            with pytest.raises(ValueError, match="device must be 'cpu', 'cuda'"):
                call(bad)
    assert hf.analyze("A key.", path, device="cpu").device == "cpu"
    assert hf.resolve_device("auto") == torch.device("cuda" if HAS_CUDA else "cpu", 0 if HAS_CUDA else None)
