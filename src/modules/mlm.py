"""`BertMLM`: masked-LM pretraining of BERT (from scratch or continued from a checkpoint)."""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric
from transformers import BertForMaskedLM

from src.data.masking import IGNORE_INDEX
from src.modules.base import BertModule
from src.modules.bert import build_bert


class BertMLM(BertModule):
    """BertForMaskedLM trained on masked positions only.

    The LM head (a hidden x vocab matmul) runs only on the selected ~15% of positions, which saves
    most of its cost; the loss is the mean cross-entropy over those positions, and validation
    perplexity is exp(mean loss over every masked token of the split).

    Args:
        pretrained: Hub name or local directory of a BERT checkpoint; None: random init from `config`.
        config: `BertConfig` fields for random init (BERT-base when empty).
        vocab_size: Tokenizer size; linked from the data module.
        attn_implementation: "sdpa" or "eager".
        lr: Peak AdamW learning rate.
        weight_decay: AdamW weight decay (not on biases and LayerNorm weights).
        warmup_ratio: Fraction of steps for linear warm-up.
        warmup_steps: Warm-up steps; overrides `warmup_ratio`.
        adam_betas: AdamW betas.
        adam_eps: AdamW epsilon.
    """

    def __init__(
        self,
        pretrained: str | None = None,
        config: dict[str, Any] | None = None,
        vocab_size: int | None = None,
        attn_implementation: Literal["eager", "sdpa"] = "sdpa",
        lr: float = 1e-4,
        weight_decay: float = 0.01,
        warmup_ratio: float = 0.06,
        warmup_steps: int | None = None,
        adam_betas: tuple[float, float] = (0.9, 0.999),
        adam_eps: float = 1e-6,
    ) -> None:
        super().__init__(lr, weight_decay, warmup_ratio, warmup_steps, adam_betas, adam_eps)
        self.save_hyperparameters(ignore=["vocab_size"])
        self.model = build_bert(
            BertForMaskedLM, pretrained, config, attn_implementation,
            vocab_size=vocab_size if pretrained is None else None,
        )
        # from_pretrained returns the model in eval mode, and Lightning keeps each submodule's mode:
        # without this, fine-tuning a pretrained model would silently run without dropout.
        self.model.train()
        self.val_loss = MeanMetric()
        self.val_correct = MeanMetric()

    flops_head = "mlm"

    def masked_logits(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (M, V) at the M selected positions, and their labels (M,)."""
        hidden = self.model.bert(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).last_hidden_state
        selected = batch["labels"] != IGNORE_INDEX  # (B, T)
        logits = self.model.cls(hidden[selected])  # (M, V)
        return logits, batch["labels"][selected]

    def training_step(self, batch, batch_idx):
        logits, labels = self.masked_logits(batch)
        loss = F.cross_entropy(logits.float(), labels)
        self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def validation_step(self, batch, batch_idx):
        logits, labels = self.masked_logits(batch)
        loss = F.cross_entropy(logits.float(), labels)
        n = labels.numel()
        # weighted by the number of masked tokens: the epoch value is the per-token mean
        self.val_loss.update(loss, weight=n)
        self.val_correct.update((logits.argmax(-1) == labels).float().mean(), weight=n)

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.log("val/loss", loss, prog_bar=True)
        self.log("val/ppl", torch.exp(loss).clamp(max=math.exp(30)), prog_bar=True)
        self.log("val/acc", self.val_correct.compute())
        self.val_loss.reset()
        self.val_correct.reset()
