"""Small transformers whose attention is any variant, per layer: a BERT-like encoder (masked LM) and a
GPT-like decoder (causal LM), plus the one-layer model of the multi-view task.

    config = ModelConfig(kind="encoder", variant=["dnas", "dnas", "hnas", "unas"], gam=[False] * 3 + [True])
    model = TransformerLM(config)
    out = model(input_ids, labels=labels)          # out.loss, out.logits, out.weights
    model.hybrid_weights()                         # (L, H): u per layer and head
    save(model, "runs/x/step-000100")              # config.json + model.safetensors (atomic)
    model = load("runs/x")                         # follows runs/x/latest.json

The checkpoint files themselves (atomic writes, layout, safetensors + JSON) are
``attnlab.checkpoint_io``'s; its names are re-exported here for older imports.

Blocks are pre-LayerNorm (x + attn(ln(x)); x + mlp(ln(x))) over ``attnlab.modules.MultiHeadAttention`` or
``GAMAttention``. Token embeddings are tied to the output layer. Checkpoints are safetensors + JSON;
nothing is ever unpickled.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from attnlab.checkpoint_io import (  # noqa: F401 -- re-exported: the names' old home
    CHECKPOINT_FORMAT,
    CONFIG_FILE,
    LATEST_FILE,
    WEIGHTS_FILE,
    atomic_write_bytes,
    atomic_write_json,
    check_weight_shapes,
    checked_step_name,
    fsync_dir,
    load_config,
    read_checkpoint,
    read_config,
    resolve_checkpoint,
    write_checkpoint,
)
from attnlab.data import IGNORE_INDEX
from attnlab.modules import AttentionConfig, GAMAttention, GAMConfig, MultiHeadAttention
from attnlab.normalizers import VARIANTS, check_params
from attnlab.schema import SchemaError, contained_file

__all__ = [
    "ModelConfig",
    "ModelOutput",
    "Block",
    "TransformerLM",
    "MultiViewModel",
    "save",
    "load",
    "load_config",
    "model_config_from_checkpoint",
    "resolve_checkpoint",
    "atomic_write_bytes",
    "atomic_write_json",
    "CHECKPOINT_FORMAT",
]

# ----------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    kind: str = "encoder"  # "encoder" (bidirectional, masked LM) or "decoder" (causal LM)
    vocab_size: int = 4096  # token ids 0..vocab_size-1 (ids 0..4 are [PAD] [UNK] [CLS] [SEP] [MASK])
    max_len: int = 128  # longest sequence (learned absolute positions)
    d_model: int = 128  # width
    n_layers: int = 4  # transformer blocks L
    n_heads: int = 4  # heads H per layer
    d_ff: int = 256  # hidden width of the MLP
    variant: str | list[str] = "unas"  # normalizer: one for all layers or one per layer
    gam: bool | list[bool] = False  # GAM scores instead of q.k: for all layers or per layer
    gam_options: dict = field(default_factory=dict)  # extra GAMConfig fields for GAM layers
    iters: int = 1  # sinkhorn iterations
    u: float = 0.5  # initial HNAS hybrid weight (theta_0 = logit(u); the paper: 0.5)
    learn_u: bool = True  # learn theta (False keeps u fixed)
    dropout: float = 0.0  # dropout on embeddings, attention output and MLP output
    pad_id: int = 0  # padding token (ignored as key and query when attention_mask is not given)

    def __post_init__(self):
        def check(name, ok, expected):
            if not ok:
                raise ValueError(f"ModelConfig.{name} must be {expected}, got {getattr(self, name)!r}")

        check("kind", self.kind in ("encoder", "decoder"), "'encoder' or 'decoder'")
        for name, lo in (("vocab_size", 6), ("max_len", 2), ("d_model", 1), ("n_layers", 1),
                         ("n_heads", 1), ("d_ff", 1), ("iters", 1)):
            value = getattr(self, name)
            check(name, isinstance(value, int) and not isinstance(value, bool) and value >= lo,
                  f"an integer >= {lo}")
        check("d_model", self.d_model % self.n_heads == 0, f"divisible by n_heads={self.n_heads}")
        check("u", 0.0 < self.u < 1.0, "in (0, 1)")
        check("dropout", 0.0 <= self.dropout < 1.0, "in [0, 1)")
        check("pad_id", 0 <= self.pad_id < self.vocab_size, f"in [0, vocab_size={self.vocab_size})")
        check("gam_options", isinstance(self.gam_options, dict), "a dict of GAMConfig fields")
        for name in ("variant", "gam"):
            value = getattr(self, name)
            if isinstance(value, list | tuple):
                check(name, len(value) == self.n_layers, f"one value or a list of n_layers={self.n_layers}")
                setattr(self, name, list(value))
        for v in self.layer_variants():
            check("variant", v in VARIANTS, f"one of {tuple(VARIANTS)} (or a list of them)")
            if self.kind == "decoder":  # the variant's own causal rule (its spec)
                try:
                    check_params(v, {"iters": self.iters}, causal=True)
                except ValueError as e:
                    raise ValueError(f"ModelConfig.{e}") from None
        bad = set(self.gam_options) - {f.name for f in fields(GAMConfig)} | (
            set(self.gam_options) & {"d_model", "n_heads", "variant", "iters", "u", "dropout"}
        )
        if bad:
            raise ValueError(f"ModelConfig.gam_options has unknown or reserved keys {sorted(bad)}")
        if any(self.layer_gam()):
            # the overflow guard is recorded explicitly, so that every checkpoint says whether it used it
            self.gam_options = {"rescale": GAMConfig.rescale, **self.gam_options}
            self.gam_config(0)  # validates the options now, not at the first forward

    def layer_variants(self) -> list[str]:
        """The normalizer of each layer, a list of length n_layers."""
        v = self.variant
        return list(v) if isinstance(v, list) else [v] * self.n_layers

    def layer_gam(self) -> list[bool]:
        """Whether each layer uses GAM scores, a list of length n_layers."""
        g = self.gam
        return [bool(x) for x in g] if isinstance(g, list) else [bool(g)] * self.n_layers

    def attention_config(self, layer: int) -> AttentionConfig:
        return AttentionConfig(d_model=self.d_model, n_heads=self.n_heads,
                               variant=self.layer_variants()[layer], iters=self.iters, u=self.u,
                               learn_u=self.learn_u, dropout=self.dropout)

    def gam_config(self, layer: int) -> GAMConfig:
        opts = {"max_len": self.max_len, **self.gam_options}
        return GAMConfig(d_model=self.d_model, n_heads=self.n_heads, variant=self.layer_variants()[layer],
                         iters=self.iters, u=self.u, dropout=self.dropout, **opts)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            known = [f.name for f in fields(cls)]
            raise ValueError(f"unknown model config keys {sorted(unknown)}; known: {known}")
        return cls(**d)


# Checkpoints written before GAMConfig.rescale defaulted to False (their gam_options have no "rescale"
# key) were trained with the overflow guard on, and load with it.
LEGACY_GAM_RESCALE = True


def model_config_from_checkpoint(model: dict) -> ModelConfig:
    """ModelConfig of a checkpoint's ``config.json["model"]``, old checkpoints with their old behaviour
    (GAM layers without a recorded ``rescale`` get ``LEGACY_GAM_RESCALE``)."""
    if not isinstance(model, dict):
        raise ValueError(f"a checkpoint's model config must be a JSON object, got {type(model).__name__}")
    gam = model.get("gam", False)
    uses_gam = any(gam) if isinstance(gam, list) else bool(gam)
    options = model.get("gam_options", {})
    if uses_gam and isinstance(options, dict) and "rescale" not in options:
        model = {**model, "gam_options": {**options, "rescale": LEGACY_GAM_RESCALE}}
    return ModelConfig.from_dict(model)


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # (B, T, V); with labels: (K, V) at the K labelled positions
    loss: torch.Tensor | None = None  # cross entropy over labelled positions ("mean" or "sum")
    n_targets: int = 0  # K, the number of labelled positions
    weights: list[torch.Tensor] | None = None  # per layer (B, H, T, T) when return_weights
    hidden: torch.Tensor | None = None  # (B, T, C) final hidden states (after the last LayerNorm)


# ----------------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.is_gam = config.layer_gam()[layer]
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = (GAMAttention(config.gam_config(layer)) if self.is_gam
                     else MultiHeadAttention(config.attention_config(layer)))
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, config.d_ff), nn.GELU(), nn.Linear(config.d_ff, config.d_model),
            nn.Dropout(config.dropout),
        )

    def forward(self, x, mask, causal, positions, return_weights):
        kw = {"positions": positions} if self.is_gam else {}
        res = self.attn(self.ln1(x), mask=mask, causal=causal, return_weights=return_weights, **kw)
        a, w = res if return_weights else (res, None)
        x = x + a
        return x + self.mlp(self.ln2(x)), w


class TransformerLM(nn.Module):
    """Encoder (masked LM, ``kind="encoder"``) or decoder (causal LM, ``kind="decoder"``)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.max_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_bias = nn.Parameter(torch.zeros(config.vocab_size))  # output layer = tok_emb^T + bias
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear | nn.Embedding):  # attention-owned raw parameters keep their own init
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    @property
    def causal(self) -> bool:
        return self.config.kind == "decoder"

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding (transformers' name: callers check token ids against its size)."""
        return self.tok_emb

    def hybrid_weights(self) -> torch.Tensor:
        """u per layer and head, (L, H), detached: sigmoid(theta) for HNAS layers; the equivalent
        mixing weight elsewhere: 0 for UNAS, 1 for DNAS (and Sinkhorn with iters=1), NaN for every
        other variant (Sinkhorn with more rounds, sparsemax, softmax1, ...: not a UNAS/DNAS mixture)."""
        rows = []
        for block, variant in zip(self.blocks, self.config.layer_variants(), strict=True):
            u = block.attn.hybrid_weight()
            if u is None:
                one_round = variant == "sinkhorn" and self.config.iters == 1
                fill = {"unas": 0.0, "dnas": 1.0}.get(variant, 1.0 if one_round else math.nan)
                u = torch.full((self.config.n_heads,), fill)
            rows.append(u.detach().float().cpu())
        return torch.stack(rows)

    def _attention_mask(self, input_ids, attention_mask):
        """bool (B, 1, T, T): padded keys and padded queries excluded (None when nothing is padded)."""
        valid = input_ids != self.config.pad_id if attention_mask is None else attention_mask.bool()
        if bool(valid.all()):
            return None
        return valid[:, None, :, None] & valid[:, None, None, :]

    def forward(self, input_ids, attention_mask=None, labels=None, positions=None, return_weights=False,
                loss_reduction: str = "mean") -> ModelOutput:
        """input_ids (B, T) int; attention_mask (B, T) (1 = real token; default: ids != pad_id);
        labels (B, T) with IGNORE_INDEX (-100) where no loss is taken; positions (B, T) or (T,) corpus
        positions for GAM's relative-position branch. With labels, logits are computed only at the
        K labelled positions and returned as (K, V)."""
        B, T = input_ids.shape
        if T > self.config.max_len:
            raise ValueError(
                f"input_ids has length {T}, longer than ModelConfig.max_len={self.config.max_len}"
            )
        mask = self._attention_mask(input_ids, attention_mask)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(torch.arange(T, device=input_ids.device)))
        weights = [] if return_weights else None
        for block in self.blocks:
            x, w = block(x, mask, self.causal, positions, return_weights)  # (B, T, C)
            if return_weights:
                weights.append(w)
        h = self.ln_f(x)
        if labels is None:
            return ModelOutput(self._logits(h), weights=weights, hidden=h)
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        sel = labels != IGNORE_INDEX  # (B, T)
        logits = self._logits(h[sel])  # (K, V)
        upcast = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        loss = F.cross_entropy(upcast, labels[sel], reduction="sum")
        k = int(sel.sum())
        if loss_reduction == "mean":
            loss = loss / max(k, 1)
        return ModelOutput(logits, loss, k, weights, h)

    def _logits(self, h):
        return F.linear(h, self.tok_emb.weight, self.lm_bias)


class MultiViewModel(nn.Module):
    """One single-head attention layer over multi-view features (the paper's VQA set-up in small):
    queries from the primary view, keys and values from the secondary views (plus a view embedding).
    Heads: each query's attribute from [x_i, o_i], and the global target from the mean over queries."""

    def __init__(self, d_feature: int, n_views: int, n_classes: int, variant: str = "unas",
                 d_model: int = 64, u: float = 0.5):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {tuple(VARIANTS)}, got {variant!r}")
        self.variant = variant
        self.q = nn.Linear(d_feature, d_model)
        self.k = nn.Linear(d_feature, d_model)
        self.v = nn.Linear(d_feature, d_model)
        self.view_emb = nn.Embedding(n_views, d_feature)
        self.theta = nn.Parameter(torch.full((1,), math.log(u / (1 - u)))) if variant == "hnas" else None
        self.query_head = nn.Sequential(nn.Linear(d_feature + d_model, d_model), nn.GELU(),
                                        nn.Linear(d_model, n_classes))
        self.pool = nn.Sequential(nn.Linear(d_feature + d_model, d_model), nn.GELU())
        self.head = nn.Linear(d_model, n_classes)

    def hybrid_weight(self) -> torch.Tensor | None:
        return None if self.theta is None else torch.sigmoid(self.theta)

    def forward(self, queries, keys, key_view, return_weights=False):
        """queries (B, M, F), keys (B, N, F), key_view (B, N) -> (query logits (B, M, C),
        target logits (B, C)[, weights (B, 1, M, N)])."""
        from attnlab.normalizers import attend

        kin = keys + self.view_emb(key_view)
        q, k, v = self.q(queries)[:, None], self.k(kin)[:, None], self.v(kin)[:, None]  # (B, 1, ., D)
        u = None if self.theta is None else torch.sigmoid(self.theta).view(1, 1, 1, 1)
        res = attend(q, k, v, self.variant, u=u, return_weights=return_weights)
        out, w = res if return_weights else (res, None)
        z = torch.cat([queries, out[:, 0]], dim=-1)  # (B, M, F + D)
        pooled = self.pool(z).mean(1)  # (B, D)
        result = (self.query_head(z), self.head(pooled))
        return (*result, w) if return_weights else result


# ----------------------------------------------------------------------------------------------
# Checkpoints (the files themselves: attnlab.checkpoint_io)
# ----------------------------------------------------------------------------------------------


def save(model: TransformerLM, directory: str | os.PathLike, extra_config: dict | None = None,
         metadata: dict | None = None) -> Path:
    """Write ``config.json`` (``{"format", "model": ModelConfig, **extra_config}``) and
    ``model.safetensors`` into ``directory`` (created), each atomically."""
    config = {**(extra_config or {}), "model": model.config.to_dict()}
    return write_checkpoint(directory, model.state_dict(), config, metadata)


def load(directory: str | os.PathLike, device: str | torch.device = "cpu") -> TransformerLM:
    """Rebuild a model from a checkpoint directory (a run directory or a step directory), in eval
    mode. Reads JSON and safetensors only.

    Before anything is allocated, ``config.json`` is validated (``attnlab.schema``: types, the bounds
    of ``MODEL_LIMITS``, a size estimate) and the shapes in ``model.safetensors``' header are compared
    with what the config builds (on the meta device); a mismatch is a ValueError naming both files."""
    step_dir = resolve_checkpoint(directory)
    config = read_config(step_dir)
    config_file = step_dir / CONFIG_FILE
    try:
        model_config = model_config_from_checkpoint(config["model"])  # old configs: old GAM default
    except ValueError as e:
        raise SchemaError(f"{config_file}: {e}") from None
    with torch.device("meta"):  # shapes only: nothing is allocated
        expected = {k: tuple(v.shape) for k, v in TransformerLM(model_config).state_dict().items()}
    weights_file = contained_file(step_dir, WEIGHTS_FILE, config_file)
    check_weight_shapes(weights_file, expected, config_file)
    _, state, _ = read_checkpoint(step_dir)
    model = TransformerLM(model_config)
    model.load_state_dict(state, strict=True)
    return model.to(device).eval()
