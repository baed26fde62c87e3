"""`BertMLM`: masked-LM pretraining of BERT (from scratch or continued from a checkpoint)."""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from transformers import BertForMaskedLM

from bertaccel.data.masking import IGNORE_INDEX
from bertaccel.modules.base import BertModule
from bertaccel.modules.bert import build_bert
from bertaccel.modules.fp8 import AmaxHistory, fp8_linear
from bertaccel.modules.metrics import WeightedMean


def _static_budget(tokens: int, p: float, multiple: int) -> int:
    """The expected count of `tokens` positions masked with probability `p` plus a wide margin (25% and six standard
    deviations, for whole-word masking's larger spread), rounded up to `multiple`, at most `tokens`."""
    budget = tokens * p * 1.25 + 6 * math.sqrt(tokens * p * (1 - p))
    return int(min(tokens, multiple * math.ceil(budget / multiple)))


def mask_budget(tokens: int, p: float) -> int:
    """The static number of masked positions a batch of `tokens` tokens masked with probability `p` gets (CUDA graphs),
    rounded up to 64. Masked positions beyond it (not seen in practice) are left out of the loss and counted in
    `dropped_masked`, reported per epoch."""
    return _static_budget(tokens, p, 64)


def row_mask_budget(seq: int, p: float) -> int:
    """`mask_budget`'s margin for one sequence of `seq` tokens, rounded up to 8: the static rows per sequence of the
    last layer with `last_layer_masked_only`."""
    return _static_budget(seq, p, 8)


class BertMLM(BertModule):
    """BertForMaskedLM trained on masked positions only.

    The LM head (a hidden x vocab matmul) runs only on the selected ~15% of positions, which saves
    most of its cost; the loss is the mean cross-entropy over those positions, and validation
    perplexity is exp(mean loss over every masked token of the split).

    Args:
        pretrained: Hub name or local directory of a BERT checkpoint; None: random init from `config`.
        config: `BertConfig` fields for random init (BERT-base when empty).
        vocab_size: Tokenizer size; linked from the data module.
        attn_implementation: "sdpa" (PyTorch scaled_dot_product_attention), "eager", or "bertaccel"
            (our fused attention kernel on padded batches; bertaccel.modules.hf_attention).
        lr: Peak AdamW learning rate.
        weight_decay: AdamW weight decay (not on biases and LayerNorm weights).
        warmup_ratio: Fraction of steps for linear warm-up.
        warmup_steps: Warm-up steps; overrides `warmup_ratio`.
        adam_betas: AdamW betas.
        adam_eps: AdamW epsilon.
        cuda_graphs: Run steps as CUDA graphs: the LM head then runs on a fixed budget of masked
            positions per batch shape (`mask_budget`), so shapes are static.
        compile: `torch.compile` the HF model in place with this mode.
        optimizer: "adamw", or "muon" / "normuon": Muon (NorMuon: with per-neuron second-moment
            normalisation) on the encoder's weight matrices at `muon_lr`, AdamW on the rest at `lr`.
        muon_lr: Learning rate of the Muon matrices (the schedule scales it like `lr`).
        muon_orthogonalizer: "newton-schulz" (Muon's quintic) or "polar-express" (Amsel et al. 2025).
        bf16_weight_copies: In graphed bf16-mixed steps, keep a bf16 copy of each Linear weight
            beside its fp32 master, refreshed after each optimizer step, so the step casts nothing
            (the same values autocast computes; fewer kernels). false: autocast casts each weight
            in every forward and backward.
        log_grad_norm: Log `train/grad_norm` at the logging steps: the mean over the optimizer steps since the
            previous log of the total gradient norm the update reads (after accumulation, before clipping). Graphed
            steps compute it inside the captured step and read it with the loss (no extra host sync); eager steps
            in `on_before_optimizer_step`.
        qk_norm: "layernorm" or "rmsnorm" on each head's queries and keys (QK-norm), for models
            trained from scratch (it adds parameters a pretrained model lacks); null: none.
        lm_head_fp8: The LM head's vocabulary projection (forward and both backward matmuls) in FP8
            with delayed per-tensor scaling (`bertaccel.modules.fp8`); plain precision where FP8 cannot
            run (GPUs before compute capability 8.9, hidden sizes not a multiple of 16).
        last_layer_masked_only: Compute the last encoder layer at the masked positions only - all the head
            reads (`bertaccel.modules.last_layer`): its K / V projections on every token, its attention for
            each sequence's masked positions, its GEMMs and LayerNorms on the masked rows the head takes.
            The same loss and gradients; under CUDA graphs each sequence gets a static number of queries
            (`row_mask_budget`; masked tokens past it are left out of the loss and counted in
            `dropped_masked`, as the head's budget's are).
    """

    def __init__(
        self,
        pretrained: str | None = None,
        config: dict[str, Any] | None = None,
        vocab_size: int | None = None,
        attn_implementation: Literal["eager", "sdpa", "bertaccel"] = "sdpa",
        lr: float = 1e-4,
        weight_decay: float = 0.01,
        warmup_ratio: float = 0.06,
        warmup_steps: int | None = None,
        adam_betas: tuple[float, float] = (0.9, 0.999),
        adam_eps: float = 1e-6,
        cuda_graphs: bool = False,
        compile: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] | None = None,
        optimizer: Literal["adamw", "muon", "normuon"] = "adamw",
        muon_lr: float = 0.02,
        muon_orthogonalizer: Literal["newton-schulz", "polar-express"] = "newton-schulz",
        bf16_weight_copies: bool = True,
        log_grad_norm: bool = False,
        qk_norm: Literal["layernorm", "rmsnorm"] | None = None,
        lm_head_fp8: bool = False,
        last_layer_masked_only: bool = False,
    ) -> None:
        super().__init__(lr, weight_decay, warmup_ratio, warmup_steps, adam_betas, adam_eps, cuda_graphs, compile,
                         optimizer, muon_lr, muon_orthogonalizer, bf16_weight_copies, log_grad_norm)
        self.save_hyperparameters(ignore=["vocab_size"])
        self.model = build_bert(
            BertForMaskedLM, pretrained, config, attn_implementation,
            vocab_size=vocab_size if pretrained is None else None, qk_norm=qk_norm,
        )
        # from_pretrained returns the model in eval mode, and Lightning keeps each submodule's mode:
        # without this, fine-tuning a pretrained model would silently run without dropout.
        self.model.train()
        self.last_layer_masked_only = last_layer_masked_only
        self._last_layer = None
        if last_layer_masked_only:
            from bertaccel.modules.last_layer import last_layer_at_rows

            self._last_layer = last_layer_at_rows(self.model)
        self.lm_head_fp8 = lm_head_fp8
        self.fp8_history = AmaxHistory() if lm_head_fp8 else None
        self.val_loss = WeightedMean()
        self.val_correct = WeightedMean()
        self._dropped: torch.Tensor | None = None  # masked tokens over the static budget, this epoch
        self._mask_probability = 0.15  # the data module's mlm_probability, read in setup

    flops_head = "mlm"

    def setup(self, stage: str) -> None:
        super().setup(stage)
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        self._mask_probability = float(getattr(dm, "mlm_probability", self._mask_probability))

    def mask_budget(self, tokens: int) -> int:
        """How many masked positions a batch of `tokens` tokens is given a slot for when steps have static
        shapes (CUDA graphs): `mask_budget(tokens, mlm_probability)`."""
        return mask_budget(tokens, self._mask_probability)

    def row_mask_budget(self, seq: int) -> int:
        """How many positions of each sequence of `seq` tokens the last layer computes with `last_layer_masked_only`
        under static shapes: `row_mask_budget(seq, mlm_probability)`."""
        return row_mask_budget(seq, self._mask_probability)

    def masked_logits(self, batch: dict[str, torch.Tensor], static: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (M, V) at the M selected positions, and their labels (M,). With `static`, M is the
        fixed `mask_budget` of the batch shape (unused slots labelled -100): no host read, no
        data-dependent shape, so the step can be captured."""
        labels = batch["labels"]
        selected = labels != IGNORE_INDEX  # (B, T)
        if self._last_layer is not None:  # the encoder's output at the masked positions only, in the head's order
            from bertaccel.modules.last_layer import masked_kept_rows

            kept, real = masked_kept_rows(selected, self.row_mask_budget(labels.shape[1]) if static else None,
                                          self.mask_budget(labels.numel()) if static else None)
            with self._last_layer.at(kept):
                hidden = self.model.bert(input_ids=batch["input_ids"],
                                         attention_mask=batch.get("attention_mask")).last_hidden_state  # (M, H)
            return self.lm_head(hidden), torch.where(real, labels.flatten().index_select(0, kept.flat), IGNORE_INDEX)
        hidden = self.model.bert(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).last_hidden_state
        if not static:
            return self.lm_head(hidden[selected]), labels[selected]
        budget = self.mask_budget(labels.numel())
        slots = torch.nonzero_static(selected.flatten(), size=budget, fill_value=-1).squeeze(1)
        used = slots >= 0
        index = slots.clamp(min=0)
        logits = self.lm_head(hidden.flatten(0, 1).index_select(0, index))  # (budget, V)
        y = torch.where(used, labels.flatten().index_select(0, index), IGNORE_INDEX)
        return logits, y

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """HF's MLM head on (M, H) hidden states: transform, then the vocabulary projection (FP8 with
        `lm_head_fp8`, through the same tied weight and bias)."""
        if not self.lm_head_fp8:
            return self.model.cls(hidden)
        head = self.model.cls.predictions
        return fp8_linear(head.transform(hidden), head.decoder.weight, head.decoder.bias, self.fp8_history)

    def flops_per_batch(self, batch: dict[str, torch.Tensor], training: bool):
        """The encoder's matmuls as they run (the last layer at the masked rows with `last_layer_masked_only`: the
        static rows per sequence under CUDA graphs, the largest count otherwise) and the head's on the predicted
        tokens (a 0-d tensor: device values, read lazily)."""
        from bertaccel.modules.flops import bert_step_flops

        B, T = batch["input_ids"].shape
        if "labels" not in batch:
            return bert_step_flops(self.model.config, B, T, head="none", training=training)
        selected = batch["labels"] != IGNORE_INDEX
        rows = queries = None
        if self._last_layer is not None:  # its GEMMs on the flat rows, its attention on B x Q queries
            rows = self.mask_budget(B * T) if self.cuda_graphs else selected.sum()
            queries = B * (self.row_mask_budget(T) if self.cuda_graphs else selected.sum(1).max().clamp(min=1))
        cfg = self.model.config
        per_token = 2 * cfg.hidden_size * cfg.hidden_size + 2 * cfg.hidden_size * cfg.vocab_size
        body = bert_step_flops(cfg, B, T, head="none", training=training, last_layer_rows=rows,
                               last_layer_queries=queries)
        return body + selected.sum() * per_token * (3 if training else 1)

    def step_outputs(self, input_ids, attention_mask=None, labels=None, token_type_ids=None) -> dict[str, torch.Tensor]:
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        static = self.cuda_graphs  # static shapes whenever graphs are asked for (same numbers either way)
        logits, y = self.masked_logits(batch, static=static)
        loss_sum = F.cross_entropy(logits.float(), y, ignore_index=IGNORE_INDEX, reduction="sum")
        counted = y != IGNORE_INDEX
        n = counted.sum().float()
        out = {
            "loss": loss_sum / n.clamp(min=1),
            "count": n,
            "correct": ((logits.argmax(-1) == y) & counted).sum().float(),
        }
        if static:  # past the head's budget, and past a sequence's rows of the last layer (last_layer_masked_only)
            out["dropped_masked"] = ((labels != IGNORE_INDEX).sum() - counted.sum()).float()
        return out

    def update_metrics(self, stage: str, batch, out) -> None:
        dropped = out.get("dropped_masked")
        if dropped is not None:  # on the device; read once per epoch
            self._dropped = dropped if self._dropped is None else self._dropped + dropped

    def _report_dropped(self, stage: str) -> None:
        dropped, self._dropped = self._dropped, None
        if dropped is not None and float(dropped) > 0:
            rank_zero_warn(f"bertaccel: {int(dropped)} masked tokens in this {stage} epoch exceeded the static "
                           "mask budget (CUDA graphs) and were left out of the loss.")

    def on_train_epoch_end(self) -> None:
        self._report_dropped("training")

    def validation_step(self, batch, batch_idx):
        out = self.eval_outputs(batch)
        self.update_metrics("val", batch, out)
        # weighted by the number of masked tokens: the epoch value is the per-token mean
        self.val_loss.update(out["loss"], weight=out["count"])
        self.val_correct.update(out["correct"] / out["count"].clamp(min=1), weight=out["count"])

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self._report_dropped("validation")
        loss = self.val_loss.compute()
        # global values already (WeightedMean reduces over DDP ranks); sync_dist averages identical numbers
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        self.log("val/ppl", torch.exp(loss).clamp(max=math.exp(30)), prog_bar=True, sync_dist=True)
        self.log("val/acc", self.val_correct.compute(), sync_dist=True)
        self.val_loss.reset()
        self.val_correct.reset()
