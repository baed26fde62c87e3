"""Build Hugging Face BERT models for this project: from pretrained weights or from `BertConfig`
fields, always with fp32 master weights and a chosen attention implementation."""

from __future__ import annotations

from typing import Any

import torch
from transformers import BertConfig, PreTrainedModel

from bertaccel.errors import ConfigError
from bertaccel.pretrained import _offline_advice, resolve_model_path

ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa", "bertaccel")
QK_NORMS = (None, "layernorm", "rmsnorm")


class QKNormLinear(torch.nn.Module):
    """A query or key projection followed by a norm over each head's vector (QK-norm).

    Wraps the attention's `nn.Linear` in place: the output keeps its (..., heads * head_dim) layout,
    so every attention implementation (eager, SDPA, the fused ops) works unchanged. The norm's weight
    (and bias, for LayerNorm) has head_dim entries shared by all heads.
    """

    def __init__(self, linear: torch.nn.Linear, num_heads: int, kind: str, eps: float) -> None:
        super().__init__()
        self.linear, self.num_heads = linear, num_heads
        head_dim = linear.out_features // num_heads
        self.norm = torch.nn.LayerNorm(head_dim, eps=eps) if kind == "layernorm" else torch.nn.RMSNorm(head_dim, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        shape = y.shape
        return self.norm(y.view(*shape[:-1], self.num_heads, -1)).view(shape)


def add_qk_norm(model: PreTrainedModel, kind: str) -> None:
    """Put `QKNormLinear` around every self-attention's query and key projections."""
    eps = getattr(model.config, "layer_norm_eps", 1e-12)
    heads = model.config.num_attention_heads
    found = 0
    for module in model.modules():
        if module.__class__.__name__ == "BertSelfAttention":
            module.query = QKNormLinear(module.query, heads, kind, eps)
            module.key = QKNormLinear(module.key, heads, kind, eps)
            found += 1
    if not found:
        raise ConfigError("model.qk_norm: no BertSelfAttention modules found in this model.")
    model.config.qk_norm = kind  # recorded in the architecture (checkpoint checks)


def build_bert(
    model_class: type[PreTrainedModel],
    pretrained: str | None,
    config: dict[str, Any] | None,
    attn_implementation: str,
    **config_overrides: Any,
) -> PreTrainedModel:
    """`model_class` from `pretrained` (name or path) or, when it is None, randomly initialised
    from `BertConfig(**config)`. `config_overrides` (num_labels, vocab_size, ...) apply to both."""
    if attn_implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ConfigError(
            f"attn_implementation '{attn_implementation}' is not one of {ATTENTION_IMPLEMENTATIONS}."
        )
    if attn_implementation == "bertaccel":
        from bertaccel.modules.hf_attention import register

        register()
    fields = {**(config or {}), **{k: v for k, v in config_overrides.items() if v is not None}}
    qk_norm = fields.pop("qk_norm", None)
    if qk_norm not in QK_NORMS:
        raise ConfigError(f"model.qk_norm must be one of {QK_NORMS[1:]} or null, got {qk_norm!r}.")
    if pretrained is None:
        try:
            bert_config = BertConfig(**fields)
        except TypeError as e:
            raise ConfigError(f"bad BertConfig field in `model.config`: {e}") from None
        bert_config._attn_implementation = attn_implementation
        model = model_class(bert_config)
        if qk_norm:
            add_qk_norm(model, qk_norm)
        return model
    if qk_norm:
        raise ConfigError(
            "model.qk_norm adds norm parameters that a pretrained model does not have; use it for a model "
            "trained from scratch (model.pretrained: null)."
        )
    path = resolve_model_path(pretrained)
    try:
        # dtype=float32: transformers 5 keeps a checkpoint's stored dtype otherwise, and an fp16
        # checkpoint fine-tuned in fp16 master weights silently stays at chance accuracy.
        model = model_class.from_pretrained(
            path, dtype=torch.float32, attn_implementation=attn_implementation, **fields
        )
    except OSError as e:
        raise _offline_advice("model", pretrained, e) from None
    if model.config.model_type != "bert":
        raise ConfigError(f"model '{pretrained}' is a {model.config.model_type!r} model; bertaccel trains BERT models.")
    return model


def architecture_of(model: PreTrainedModel) -> dict[str, Any]:
    """The config fields a checkpoint's weights depend on: stored in checkpoints and compared on load."""
    c = model.config
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
            "max_position_embeddings", "type_vocab_size")
    arch = {k: getattr(c, k) for k in keys}
    arch["qk_norm"] = getattr(c, "qk_norm", None)
    if hasattr(c, "num_labels") and model.__class__.__name__.endswith("SequenceClassification"):
        arch["num_labels"] = c.num_labels
    return arch
