"""`BertClassifier`: sequence classification with an HF BERT (IMDB, AG News, any text/label set)."""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score
from transformers import BertForSequenceClassification

from src.modules.base import BertModule
from src.modules.bert import build_bert


class BertClassifier(BertModule):
    """Fine-tune (or train from scratch) a BERT sequence classifier.

    Args:
        pretrained: Hub name or local directory of a BERT checkpoint. None: random init from `config`.
        config: `BertConfig` fields for random init (e.g. hidden_size, num_hidden_layers), or
            overrides such as dropout probabilities for a pretrained model.
        num_labels: Number of classes; linked from the data module, no need to set it.
        vocab_size: Tokenizer size; linked from the data module, used for random init.
        attn_implementation: "sdpa" (PyTorch scaled_dot_product_attention) or "eager".
        lr: Peak AdamW learning rate.
        weight_decay: AdamW weight decay (not applied to biases and LayerNorm weights).
        warmup_ratio: Fraction of the training steps spent warming the learning rate up linearly.
        warmup_steps: Warm-up steps; overrides `warmup_ratio` when set.
        adam_betas: AdamW betas.
        adam_eps: AdamW epsilon.
    """

    def __init__(
        self,
        pretrained: str | None = None,
        config: dict[str, Any] | None = None,
        num_labels: int = 2,
        vocab_size: int | None = None,
        attn_implementation: Literal["eager", "sdpa"] = "sdpa",
        lr: float = 2e-5,
        weight_decay: float = 0.01,
        warmup_ratio: float = 0.06,
        warmup_steps: int | None = None,
        adam_betas: tuple[float, float] = (0.9, 0.999),
        adam_eps: float = 1e-8,
    ) -> None:
        super().__init__(lr, weight_decay, warmup_ratio, warmup_steps, adam_betas, adam_eps)
        # num_labels and vocab_size are filled in from the data: keep them out of the hyperparameters
        # the CLI restores from a checkpoint (a link target cannot be overridden), and check them on
        # load instead (`BertModule.on_load_checkpoint`).
        self.save_hyperparameters(ignore=["num_labels", "vocab_size"])
        self.num_labels = num_labels
        self.model = build_bert(
            BertForSequenceClassification,
            pretrained,
            config,
            attn_implementation,
            num_labels=num_labels,
            vocab_size=vocab_size if pretrained is None else None,
        )
        # from_pretrained returns the model in eval mode, and Lightning keeps each submodule's mode:
        # without this, fine-tuning a pretrained model would silently run without dropout.
        self.model.train()
        metrics = MetricCollection(
            {
                "acc": MulticlassAccuracy(num_labels, average="micro"),
                "f1": MulticlassF1Score(num_labels, average="macro"),
            }
        )
        # ("train" cannot be a ModuleDict key: it would shadow nn.Module.train)
        self.metrics = torch.nn.ModuleDict({f"{s}_metrics": metrics.clone(prefix=f"{s}/") for s in ("train", "val", "test")})

    def forward(self, input_ids, attention_mask, token_type_ids=None) -> torch.Tensor:
        """Logits, (B, num_labels)."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).logits

    def model_step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        logits = self(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"))
        loss = F.cross_entropy(logits.float(), batch["labels"])
        metrics = self.metrics[f"{stage}_metrics"]
        metrics.update(logits.detach(), batch["labels"])
        bs = batch["labels"].shape[0]
        on_step = stage == "train"
        self.log(f"{stage}/loss", loss, on_step=on_step, on_epoch=True, prog_bar=True, batch_size=bs)
        self.log_dict(metrics, on_step=False, on_epoch=True, prog_bar=stage != "train", batch_size=bs)
        return loss

    def training_step(self, batch, batch_idx):
        return self.model_step(batch, "train")

    def validation_step(self, batch, batch_idx):
        self.model_step(batch, "val")

    def test_step(self, batch, batch_idx):
        self.model_step(batch, "test")

    def predict_step(self, batch, batch_idx, dataloader_idx: int = 0) -> dict[str, torch.Tensor]:
        logits = self(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"))
        probs = logits.float().softmax(-1)
        return {"index": batch["index"], "label": probs.argmax(-1), "probs": probs}
