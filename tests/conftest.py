"""Shared fixtures: the embedded MiniLM and tiny random Hugging Face models built from configs.

Everything is offline and seeded. Tiny models are written with ``save_pretrained`` (safetensors) into
session temporary directories, once per session; BPE tokenizers for them are trained on a few
sentences with the ``tokenizers`` library, BERT-style ones reuse MiniLM's WordPiece vocabulary.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# OpenMP threads that wait passively: on a shared 2-core machine (and with pytest -n 2) spinning
# threads make small torch ops up to ~50x slower. Read when torch first loads, hence before it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton decides "interpreted or compiled" when a @triton.jit function is defined -- its own
    # standard library's too, at `import triton`, which torch._dynamo triggers early (transformers,
    # torch.compiler). Without a GPU attnlab.gpu's kernels can only run interpreted, so the whole
    # session interprets; attnlab.gpu.loader reads the variable per call (tests/test_triton.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")

CORPUS = [
    "Attention lets every word look at every other word.",
    "A key that no query wants can be explained away.",
    "Doubly normalized attention keeps a minimum share for every key.",
    "The quick brown fox jumps over the lazy dog, twice!",
    "Numbers like 3.14 and 42 appear; so do commas, colons: and dashes - too.",
]
TINY_POSITIONS = 64  # max length of the tiny models (windows of 64 tokens)
TINY_ARCHS = ("bert", "roberta", "distilbert", "gpt2", "llama")
CAUSAL_ARCHS = ("gpt2", "llama")


def _bpe_tokenizer(kind: str):
    """Byte-level BPE trained on CORPUS; RoBERTa-, GPT-2- or LLaMA-style special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = {
        "roberta": ["<s>", "<pad>", "</s>", "<unk>"],
        "gpt2": ["<|endoftext|>"],
        "llama": ["<s>", "</s>", "<unk>"],
    }[kind]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator(CORPUS, trainer)
    if kind == "roberta":
        tk.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
        names = dict(bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    elif kind == "llama":
        tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
        names = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    else:
        names = dict(bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    return PreTrainedTokenizerFast(tokenizer_object=tk, model_max_length=TINY_POSITIONS, **names)


_LAYERS = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
_P = TINY_POSITIONS
# arch -> (transformers config class, its fields): 2 layers x 4 heads, width 32, 64 positions
TINY_CONFIGS = {
    "bert": ("BertConfig", dict(**_LAYERS, max_position_embeddings=_P)),
    # RoBERTa's learned positions start after the padding index: 2 more positions
    "roberta": ("RobertaConfig", dict(**_LAYERS, max_position_embeddings=_P + 2, pad_token_id=1)),
    "distilbert": (
        "DistilBertConfig",
        dict(dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=_P),
    ),
    "gpt2": (
        "GPT2Config",
        dict(n_embd=32, n_layer=2, n_head=4, n_positions=_P, bos_token_id=0, eos_token_id=0),
    ),
    # grouped-query attention (2 kv heads for 4 query heads) and rotary positions
    "llama": (
        "LlamaConfig",
        dict(**_LAYERS, num_key_value_heads=2, max_position_embeddings=_P, bos_token_id=0),
    ),
    # sliding-window attention (8 keys) with grouped-query heads; not in TINY_ARCHS (tests name them)
    "mistral": (
        "MistralConfig",
        dict(**_LAYERS, num_key_value_heads=2, max_position_embeddings=_P, bos_token_id=0, sliding_window=8),
    ),
    # logit softcapping, sliding layers alternating with global ones, head_dim != hidden / heads
    "gemma2": (
        "Gemma2Config",
        dict(**_LAYERS, num_key_value_heads=2, max_position_embeddings=_P, bos_token_id=0, head_dim=16,
             sliding_window=8, attn_logit_softcapping=2.0, final_logit_softcapping=None,
             query_pre_attn_scalar=16),
    ),
}
# tests/test_architectures.py's tiny models: 2 layers, width 64, 4 heads (2 key/value heads where the
# architecture has grouped-query attention), 64 positions
_W = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
_GQA = dict(**_W, num_key_value_heads=2, max_position_embeddings=_P, bos_token_id=0, eos_token_id=2,
            pad_token_id=1)
TINY_CONFIGS.update({
    "albert": ("AlbertConfig", dict(**_W, embedding_size=32, max_position_embeddings=_P)),
    "electra": ("ElectraConfig", dict(**_W, embedding_size=32, max_position_embeddings=_P)),
    "xlm-roberta": ("XLMRobertaConfig", dict(**_W, max_position_embeddings=_P + 2, pad_token_id=1)),
    # local layers (a window of 8 keys) alternating with global ones
    "modernbert": ("ModernBertConfig", dict(**_W, max_position_embeddings=_P, local_attention=8,
                                            global_attn_every_n_layers=2, pad_token_id=1, bos_token_id=0,
                                            eos_token_id=2, cls_token_id=0, sep_token_id=2)),
    "gpt_neox": ("GPTNeoXConfig", dict(**_W, max_position_embeddings=_P, bos_token_id=0, eos_token_id=0)),
    "gptj": ("GPTJConfig", dict(n_embd=64, n_layer=2, n_head=4, n_positions=_P, rotary_dim=8,
                                bos_token_id=0, eos_token_id=0)),
    "opt": ("OPTConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
                              word_embed_proj_dim=64, max_position_embeddings=_P, pad_token_id=1,
                              bos_token_id=0, eos_token_id=2)),
    "codegen": ("CodeGenConfig", dict(n_embd=64, n_layer=2, n_head=4, n_positions=_P, n_ctx=_P,
                                      rotary_dim=8, bos_token_id=0, eos_token_id=0)),
    "qwen2": ("Qwen2Config", dict(_GQA)),
    "phi": ("PhiConfig", dict(_GQA)),
    "phi3": ("Phi3Config", dict(_GQA)),
    "gemma": ("GemmaConfig", dict(_GQA, head_dim=16)),
    "starcoder2": ("Starcoder2Config", dict(_GQA, sliding_window=8)),
    "granite": ("GraniteConfig", dict(_GQA)),
    # attention outside the AttentionInterface (score-level capture); refused: encoder-decoder, vision
    "mpnet": ("MPNetConfig", dict(**_W, max_position_embeddings=_P + 2, pad_token_id=1)),
    # DeBERTa-v3's disentangled attention: relative positions in buckets, c2p and p2c terms
    "deberta-v2": ("DebertaV2Config", dict(**_W, max_position_embeddings=_P, relative_attention=True,
                                           pos_att_type=["p2c", "c2p"], position_biased_input=False,
                                           position_buckets=16, max_relative_positions=-1,
                                           norm_rel_ebd="layer_norm", share_att_key=True)),
    "gpt_neo": ("GPTNeoConfig", dict(hidden_size=64, num_layers=2, num_heads=4, max_position_embeddings=_P,
                                     attention_types=[[["global", "local"], 1]], window_size=8)),
    "bloom": ("BloomConfig", dict(hidden_size=64, n_layer=2, n_head=4)),
    "falcon": ("FalconConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)),
    # encoder-decoders (tests/test_encoder_decoder.py): the RoBERTa-style BPE's ids (<s> 0, <pad> 1, </s> 2)
    "t5": ("T5Config", dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)),
    **{key: (cls, dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                       decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                       max_position_embeddings=_P, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                       decoder_start_token_id=2, forced_eos_token_id=2))
       for key, cls in (("bart", "BartConfig"), ("mbart", "MBartConfig"), ("pegasus", "PegasusConfig"),
                        ("marian", "MarianConfig"))},
    "vit": ("ViTConfig", dict(**_W, image_size=16, patch_size=8)),
})


@dataclass(frozen=True)
class Arch:
    """One architecture of tests/test_architectures.py and of the table in docs/ANALYSIS.md
    (scripts/architecture_table.py prints the table from ``ARCHITECTURES``)."""

    key: str  # TINY_CONFIGS key and config.model_type
    name: str  # as the table shows it
    masks: str = "padding"  # what the attention masks beyond padding: "causal", "sliding window", ...
    values: str = "named"  # contributions' value path: "named" (VALUE_PATHS), "traced" (value_trace),
    # "declared" (attnlab/hf/capture/score_adapters.py)
    swap: str = "yes"  # whether swap-mode UNAS reproduces the eager model, else what is missing
    family: str = ""  # hand-built contribution reference of tests/test_architectures.py ("" = none)
    refused: str = ""  # why attnlab refuses it, the words its error uses ("" = analysed)
    scores: bool = False  # attention outside the AttentionInterface: captured at its softmax (scores.py)
    seq2seq: bool = False  # an encoder-decoder: three kinds of attention (tests/test_encoder_decoder.py)
    interface_from: str = ""  # the transformers release from which a ``scores`` family routes through
    # the AttentionInterface (then q and k are captured and its projections traced); "" = none yet

    def at_scores(self) -> bool:
        """Captured at its softmax with the installed transformers (``scores``, until ``interface_from``)."""
        if not (self.scores and self.interface_from):
            return self.scores
        import transformers
        from packaging.version import Version

        return Version(transformers.__version__) < Version(self.interface_from)

    def value_path(self) -> str:
        """Contributions' value path with the installed transformers (``values``, traced on the interface)."""
        return "traced" if self.scores and not self.at_scores() else self.values


ARCHITECTURES = (
    Arch("bert", "BERT", family="bert"),
    Arch("roberta", "RoBERTa"),
    Arch("distilbert", "DistilBERT", family="distilbert"),
    Arch("albert", "ALBERT (layers share weights)", values="traced", family="albert"),
    Arch("electra", "ELECTRA", family="bert"),
    Arch("xlm-roberta", "XLM-RoBERTa"),
    Arch("modernbert", "ModernBERT (fused qkv)", masks="local layers (window)", values="traced",
         family="modernbert"),
    Arch("gpt2", "GPT-2", masks="causal", family="gpt2"),
    Arch("gpt_neox", "GPT-NeoX (fused qkv, heads interleaved)", masks="causal", values="traced",
         family="gpt_neox"),
    Arch("gptj", "GPT-J", masks="causal", values="traced", family="gptj"),
    Arch("opt", "OPT", masks="causal", values="traced", family="opt"),
    Arch("codegen", "CodeGen (fused qkv, q v k order)", masks="causal", values="traced", family="codegen"),
    Arch("llama", "LLaMA (GQA)", masks="causal", family="llama"),
    Arch("mistral", "Mistral (GQA)", masks="causal, sliding window"),
    Arch("qwen2", "Qwen2 (GQA)", masks="causal"),
    Arch("phi", "Phi (GQA)", masks="causal", values="traced", family="phi"),
    Arch("phi3", "Phi-3 (GQA, fused qkv)", masks="causal", values="traced", family="phi3"),
    Arch("gemma", "Gemma (GQA)", masks="causal"),
    Arch("gemma2", "Gemma 2 (GQA, softcap)", masks="causal, sliding window, softcap"),
    Arch("starcoder2", "Starcoder2 (GQA)", masks="causal, sliding window"),
    Arch("granite", "Granite (GQA)", masks="causal", family="llama"),
    # attention outside the AttentionInterface: scores captured at the module's softmax (score_adapters.py)
    Arch("mpnet", "MPNet", masks="padding, relative position bias", values="declared", family="mpnet",
         scores=True),
    Arch("deberta-v2", "DeBERTa-v2", masks="padding, disentangled c2p/p2c", values="declared",
         family="deberta-v2", scores=True),
    Arch("gpt_neo", "GPT-Neo", masks="causal, local layers (window), unscaled", values="declared",
         family="gpt_neo", scores=True),
    Arch("bloom", "BLOOM", masks="causal, ALiBi", values="declared", family="bloom", scores=True),
    Arch("falcon", "Falcon (multi-query)", masks="causal", values="declared", family="falcon", scores=True,
         interface_from="5.25"),
    # encoder-decoders: encoder, decoder (causal) and cross attention (attnlab/hf/capture/seq2seq.py)
    Arch("t5", "T5", masks="relative position bias; decoder causal", swap="no (position bias)", seq2seq=True),
    Arch("bart", "BART", masks="padding; decoder causal", seq2seq=True),
    Arch("mbart", "mBART", masks="padding; decoder causal", seq2seq=True),
    Arch("pegasus", "Pegasus", masks="padding; decoder causal", seq2seq=True),
    Arch("marian", "Marian", masks="padding; decoder causal", seq2seq=True),
    Arch("vit", "ViT", refused="vision model"),
)
# the BPE tokenizer style of each arch (_bpe_tokenizer's kinds); the others use MiniLM's WordPiece
_TOKENIZER_KIND = {"gpt2": "gpt2", "roberta": "roberta", "llama": "llama", "mistral": "llama",
                   "gemma2": "llama",
                   **dict.fromkeys(("albert", "electra", "xlm-roberta", "modernbert", "mpnet", "deberta-v2",
                                    "t5", "bart", "mbart", "pegasus", "marian", "vit"), "roberta"),
                   **dict.fromkeys(("gpt_neox", "gptj", "opt", "codegen", "qwen2", "phi", "phi3", "gemma",
                                    "starcoder2", "granite", "gpt_neo", "bloom", "falcon"), "llama")}


def _config(arch: str, vocab_size: int, **overrides):
    """The tiny config of ``arch``; ``overrides`` go to the constructor (fields derived from others, as
    Falcon's num_key_value_heads from its layout, stay consistent)."""
    import transformers

    cls, fields = TINY_CONFIGS[arch]
    fields = {**fields, **overrides}
    if arch == "vit":  # no vocabulary
        return getattr(transformers, cls)(**fields)
    return getattr(transformers, cls)(vocab_size=vocab_size, **fields)


def build_tiny_model(arch: str, directory, seed: int = 0, scale: float | None = None):
    """Write a tiny random ``arch`` model and its tokenizer to ``directory``; returns it. ``scale``:
    every parameter (biases and norms too) redrawn from N(0, scale^2), so that no bias is zero."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from attnlab.hf import default_model_path

    if arch in ("bert", "distilbert"):
        tokenizer = AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True)
        tokenizer.model_max_length = TINY_POSITIONS
    else:
        tokenizer = _bpe_tokenizer(_TOKENIZER_KIND[arch])
    torch.manual_seed(seed)
    model = AutoModel.from_config(_config(arch, len(tokenizer)))
    if scale is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, scale)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def minilm():
    """The embedded MiniLM-L6 (loaded once, cached by attnlab.hf)."""
    from attnlab import hf

    return hf.load_model(None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: arch -> directory of a tiny random model of that architecture (built once)."""
    built = {}

    def make(arch: str):
        if arch not in built:
            built[arch] = build_tiny_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}"))
        return built[arch]

    return make


@pytest.fixture(scope="session")
def english_text():
    """A few hundred characters of plain English."""
    return " ".join(CORPUS)


# ----------------------------------------------------------------------------------------------
# The table of docs/RELIABILITY.md: ``reliability(case, tried, happened)`` records one row; with
# ATTNLAB_WRITE_RELIABILITY=1 (one process) the table is written at the end of the session.
# ----------------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "RELIABILITY.md"
WRITE_ENV = "ATTNLAB_WRITE_RELIABILITY"


# ----------------------------------------------------------------------------------------------
# The table of docs/RELIABILITY.md
# ----------------------------------------------------------------------------------------------

_ROWS: list[tuple[str, str, str, str]] = []  # (section, case, tried, happened)
# Rows of the property-based fuzz suite (tests/test_fuzz*.py) go to a section of their own, so that
# each part of the document can be regenerated without running the other's (slow) tests.
FUZZ_HEADING = "## Property-based fuzz suite"


@pytest.fixture(scope="session")
def _reliability_table():
    if os.environ.get(WRITE_ENV) == "1" and os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.fail(f"{WRITE_ENV}=1 needs one process (python -m pytest -n 0 ...)")
    yield _ROWS
    if os.environ.get(WRITE_ENV) == "1":
        _write_doc(_ROWS)


@pytest.fixture
def reliability(_reliability_table, request):
    """record(case, tried, happened): one row of docs/RELIABILITY.md."""
    section = "fuzz" if request.node.module.__name__.startswith("test_fuzz") else "main"

    def record(case: str, tried: str, happened: str) -> None:
        _reliability_table.append((section, case, tried, " ".join(str(happened).split())))

    return record


def _cell(text: str) -> str:
    text = str(text).replace(str(REPO), "<repo>")
    text = re.sub(r"/tmp/pytest-of-[^/\s]+/pytest-\d+/[^/\s]+", "<tmp>", text)
    text = re.sub(r"(/tmp|/var/folders)[^\s'\"]*", "<tmp>", text)
    if len(text) > 260:
        text = text[:257] + "…"
    return text.replace("|", "\\|").replace("\n", " ")


def _table(rows) -> list[str]:
    return ["| Case | What was tried | What happened |", "| --- | --- | --- |",
            *(f"| {_cell(c)} | {_cell(t)} | {_cell(h)} |" for c, t, h in rows)]


def _write_doc(rows) -> None:
    """Rewrite the sections of docs/RELIABILITY.md that this session has rows for; keep the other."""
    old = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
    old_main, _, old_fuzz = old.partition(FUZZ_HEADING)
    main = [r[1:] for r in rows if r[0] == "main"]
    fuzz = [r[1:] for r in rows if r[0] == "fuzz"]
    lines = [
        "# Reliability: what was tried and what happened",
        "",
        "Generated by `tests/test_reliability.py` and `tests/test_app_concurrency.py`; do not edit by hand:",
        f"`{WRITE_ENV}=1 python -m pytest -q -n 0 tests/test_reliability.py tests/test_app_concurrency.py`.",
        "Each row is one test's attempt against a real entry point (the library, the `attnlab` command, the",
        "app's helpers) and the outcome the test asserts. Malicious pickles and `auto_map` modules would",
        "create a marker file if they ever ran; the tests assert that the marker never appears.",
        "Paths are shortened: `<repo>` is the checkout, `<tmp>` a test's temporary directory.",
        "",
    ]
    text = "\n".join(lines + _table(main)) + "\n" if main else old_main.rstrip("\n") + "\n"
    if fuzz:
        fuzz_lines = [
            "", FUZZ_HEADING, "",
            f"Generated by `{WRITE_ENV}=1 python -m pytest -q -n 0 tests/test_fuzz.py "
            "tests/test_fuzz_stats.py tests/test_fuzz_entry.py` (hypothesis, derandomized). Each row is "
            "one input class: the inputs drawn and the outcome every case asserts, the float64 contiguous "
            "reference's result within the stated tolerance or a ValueError naming the argument. Rows of "
            "tests marked xfail (behaviour being fixed) are not written; see the tests' reasons.",
            "",
        ]
        text += "\n".join(fuzz_lines + _table(fuzz)) + "\n"
    elif old_fuzz:
        text += "\n" + FUZZ_HEADING + old_fuzz.rstrip("\n") + "\n"
    DOC.write_text(text, encoding="utf-8")


@pytest.fixture
def ieee_float32_matmul():
    """Full float32 matmuls on a CUDA device (TF32 would differ from the CPU by ~1e-3); used by the
    CUDA test modules."""
    import torch

    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(old)
