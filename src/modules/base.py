"""What the classifier and the masked LM share: the HF model, AdamW with decoupled weight decay,
the linear warm-up/decay schedule, checkpoint/architecture checks."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from transformers import get_linear_schedule_with_warmup

from src.errors import CheckpointError, ConfigError
from src.modules.bert import architecture_of


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW parameter groups: no weight decay on biases and LayerNorm weights (BERT's recipe)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_norm = "LayerNorm" in name or "layer_norm" in name or name.endswith("norm.weight")
        (no_decay if p.ndim < 2 or is_norm or name.endswith(".bias") else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


class BertModule(pl.LightningModule):
    """Base LightningModule. Subclasses set `self.model` (an HF model) in `__init__`."""

    model: torch.nn.Module

    def __init__(
        self,
        lr: float,
        weight_decay: float,
        warmup_ratio: float,
        warmup_steps: int | None,
        adam_betas: tuple[float, float],
        adam_eps: float,
    ) -> None:
        super().__init__()
        if not 0.0 <= warmup_ratio < 1.0:
            raise ConfigError(f"warmup_ratio must be in [0, 1), got {warmup_ratio}.")
        self.lr = lr
        self.weight_decay = weight_decay
        self.warmup_ratio = warmup_ratio
        self.warmup_steps = warmup_steps
        self.adam_betas = tuple(adam_betas)
        self.adam_eps = adam_eps

    # ----------------------------------------------------------------------------------- setup
    def setup(self, stage: str) -> None:
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if dm is None:
            return
        max_pos = self.model.config.max_position_embeddings
        max_length = getattr(dm, "max_length", None) or getattr(dm, "block_size", None)
        if max_length is not None and max_length > max_pos:
            raise ConfigError(
                f"data max_length/block_size {max_length} is above the model's {max_pos} positions; "
                f"set `data.max_length` (or `data.block_size`) to at most {max_pos}."
            )
        vocab = getattr(dm, "vocab_size", None)
        emb = self.model.get_input_embeddings().num_embeddings
        if vocab is not None and vocab > emb:
            raise ConfigError(
                f"the tokenizer has {vocab} tokens but the model's embedding table has {emb}; "
                "use the tokenizer that belongs to the model (`data.tokenizer`)."
            )

    # ------------------------------------------------------------------------------- optimizer
    def configure_optimizers(self):
        groups = decay_groups(self.model, self.weight_decay)
        # Fused AdamW unscales gradients inside its kernel, so Lightning cannot clip them first.
        clipping = bool(self._trainer is not None and self.trainer.gradient_clip_val)
        fused = self.device.type == "cuda" and not clipping
        optimizer = torch.optim.AdamW(groups, lr=self.lr, betas=self.adam_betas, eps=self.adam_eps, fused=fused)
        total = int(self.trainer.estimated_stepping_batches)
        warmup = self.warmup_steps if self.warmup_steps is not None else int(self.warmup_ratio * total)
        scheduler = get_linear_schedule_with_warmup(optimizer, warmup, max(total, 1))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ----------------------------------------------------------------------------------- FLOPs
    flops_head = "classifier"

    def flops_per_batch(self, batch: dict[str, torch.Tensor], training: bool):
        """Matmul FLOPs this batch costs (src/modules/flops.py); an int, or a 0-d tensor when it
        depends on device values (masked-LM: the number of predicted tokens), read lazily."""
        from src.modules.flops import bert_step_flops

        B, T = batch["input_ids"].shape
        if self.flops_head == "mlm" and "labels" in batch:
            n = (batch["labels"] != -100).sum()
            cfg = self.model.config
            per_token = 2 * cfg.hidden_size * cfg.hidden_size + 2 * cfg.hidden_size * cfg.vocab_size
            body = bert_step_flops(cfg, B, T, head="none", training=training)
            return body + n * per_token * (3 if training else 1)
        return bert_step_flops(self.model.config, B, T, head=self.flops_head, training=training)

    # ------------------------------------------------------------------------------ checkpoint
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["bertaccel"] = {"architecture": architecture_of(self.model), "class": type(self).__name__}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("bertaccel", {})
        if saved.get("class") not in (None, type(self).__name__):
            raise CheckpointError(
                f"the checkpoint holds a {saved['class']} but the config builds a {type(self).__name__}; "
                "use the config the checkpoint was trained with."
            )
        want = architecture_of(self.model)
        have = saved.get("architecture", {})
        diffs = {k: (have[k], v) for k, v in want.items() if k in have and have[k] != v}
        if diffs:
            detail = ", ".join(f"{k}: checkpoint {a} vs config {b}" for k, (a, b) in diffs.items())
            hint = " (num_labels comes from the data: is this the dataset it was trained on?)" if "num_labels" in diffs else ""
            raise CheckpointError(f"the checkpoint does not match the model: {detail}{hint}.")
        state = checkpoint.get("state_dict", {})
        own = self.state_dict()
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        shapes = [k for k in own.keys() & state.keys() if own[k].shape != state[k].shape]
        if missing or unexpected or shapes:
            raise CheckpointError(
                "the checkpoint's weights do not fit this model: "
                f"{len(missing)} missing (e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]}), "
                f"{len(shapes)} with other shapes (e.g. {shapes[:3]}). Use the config it was trained with."
            )
