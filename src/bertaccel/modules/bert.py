"""Build Hugging Face BERT models for this project: from pretrained weights or from `BertConfig`
fields, always with fp32 master weights and a chosen attention implementation."""

from __future__ import annotations

from typing import Any

import torch
from transformers import BertConfig, PreTrainedModel

from bertaccel.errors import ConfigError
from bertaccel.pretrained import _offline_advice, resolve_model_path

ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa")


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
    fields = {**(config or {}), **{k: v for k, v in config_overrides.items() if v is not None}}
    if pretrained is None:
        try:
            bert_config = BertConfig(**fields)
        except TypeError as e:
            raise ConfigError(f"bad BertConfig field in `model.config`: {e}") from None
        bert_config._attn_implementation = attn_implementation
        return model_class(bert_config)
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
    if hasattr(c, "num_labels") and model.__class__.__name__.endswith("SequenceClassification"):
        arch["num_labels"] = c.num_labels
    return arch
