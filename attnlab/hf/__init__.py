"""attnlab on real models: local Hugging Face checkpoints, variants inside them, text analysis.

Public surface::

    from attnlab import hf
    loaded = hf.load_model(None)            # embedded MiniLM-L6 (or a save_pretrained directory)
    on_gpu = hf.load_model(None, device="cuda")  # a copy on a GPU (device="auto": CUDA if available)
    result = hf.analyze("Some text.", loaded, variants=("unas", "dnas"), mode="recompute")
    result.tokens                           # list[str]
    result.weights["dnas"]                  # (L, H, N, N) for a single-window text
    result.table()                          # tidy statistics (attnlab.stats.tidy_table)
    hf.analyze("Some text.", "checkpoints/enc-hnas")  # a native attnlab checkpoint (its learned u)
    hf.analyze("Some text.", "checkpoints/enc-gam").components["unas"]["theta"]  # GAM's maps
    hf.analyze("Some text.", on_gpu)        # runs on the GPU; weights and tables come back on the CPU
    for w in hf.stream_analysis(long_text): # one WindowResult at a time, bounded memory
        ...
    with hf.use_variant(loaded.model, "dnas"):  # swap a variant into any supported HF model
        loaded.model(**batch, output_attentions=True)
    lm = hf.load_language_model("models/gpt2")  # with its causal or masked LM head
    hf.language_model_loss(texts, lm, "dnas", layers=[3])  # nats per token, DNAS in layer 3

Corpus-scale analysis lives one level up, in ``attnlab.corpus.analyze_corpus`` (it calls this package's
``load_model`` and ``stream_analysis``; ``hf.analyze_corpus``, its old re-export here, is gone so that
nothing here imports the corpus atlas).

Importing this package registers ``attnlab_<variant>`` (and ``attnlab_capture``) with transformers'
``AttentionInterface`` and ``AttentionMaskInterface``. Nothing here reaches a model hub.
"""

import os

# Never reach a model hub: read by huggingface_hub when transformers first imports it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from attnlab.hf.analysis.benchmark import benchmark_analysis  # noqa: E402
from attnlab.hf.analysis.pipeline import (  # noqa: E402
    AnalysisResult,
    AnalysisStream,
    WindowResult,
    analyze,
    hnas_u_from_checkpoint,
    stream_analysis,
)
from attnlab.hf.analysis.seq2seq_result import Seq2SeqResult  # noqa: E402
from attnlab.hf.beyond.activations import massive_activations  # noqa: E402
from attnlab.hf.beyond.lm_loss import language_model_loss  # noqa: E402
from attnlab.hf.capture.interface import (  # noqa: E402
    CAPTURE,
    CapturedLayer,
    UnsupportedModelError,
    capture_qk,
    implementation_name,
    register_attention_functions,
    use_variant,
)
from attnlab.hf.capture.windows import Window, Windowing  # noqa: E402
from attnlab.hf.compute.weights import MODES, batch_weights  # noqa: E402
from attnlab.hf.load.loading import (  # noqa: E402
    LoadedModel,
    ModelInfo,
    ModelLoadError,
    clear_model_cache,
    default_model_path,
    load_language_model,
    load_model,
    model_on,
    resolve_device,
)
from attnlab.hf.load.native import NativeModel, capture_attention_inputs, load_native  # noqa: E402

REGISTERED = register_attention_functions()


__all__ = [
    "MODES",
    "CAPTURE",
    "REGISTERED",
    "AnalysisResult",
    "AnalysisStream",
    "Seq2SeqResult",
    "CapturedLayer",
    "LoadedModel",
    "ModelInfo",
    "ModelLoadError",
    "NativeModel",
    "UnsupportedModelError",
    "Window",
    "WindowResult",
    "Windowing",
    "analyze",
    "batch_weights",
    "benchmark_analysis",
    "capture_attention_inputs",
    "capture_qk",
    "clear_model_cache",
    "default_model_path",
    "hnas_u_from_checkpoint",
    "implementation_name",
    "language_model_loss",
    "load_language_model",
    "load_model",
    "load_native",
    "massive_activations",
    "model_on",
    "register_attention_functions",
    "resolve_device",
    "stream_analysis",
    "use_variant",
]
