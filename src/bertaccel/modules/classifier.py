"""`BertClassifier`: sequence classification with an HF BERT (IMDB, AG News, any text/label set)."""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from transformers import BertForSequenceClassification

from bertaccel.data.masking import IGNORE_INDEX
from bertaccel.errors import ConfigError
from bertaccel.modules.base import BertModule
from bertaccel.modules.bert import build_bert
from bertaccel.modules.flops import bert_step_flops, bert_step_flops_unpadded
from bertaccel.modules.metrics import ClassificationStats, confusion_counts
from bertaccel.modules.unpadded import Unpadded, classifier_logits


class BertClassifier(BertModule):
    """Fine-tune (or train from scratch) a BERT sequence classifier.

    Args:
        pretrained: Hub name or local directory of a BERT checkpoint. None: random init from `config`.
        config: `BertConfig` fields for random init (e.g. hidden_size, num_hidden_layers), or
            overrides such as dropout probabilities for a pretrained model.
        num_labels: Number of classes; linked from the data module, no need to set it.
        vocab_size: Tokenizer size; linked from the data module, used for random init.
        attn_implementation: "sdpa" (PyTorch scaled_dot_product_attention), "eager", or "bertaccel"
            (our fused attention kernel on padded batches; bertaccel.modules.hf_attention).
        lr: Peak AdamW learning rate.
        weight_decay: AdamW weight decay (not applied to biases and LayerNorm weights).
        warmup_ratio: Fraction of the training steps spent warming the learning rate up linearly.
        warmup_steps: Warm-up steps; overrides `warmup_ratio` when set.
        adam_betas: AdamW betas.
        adam_eps: AdamW epsilon.
        cuda_graphs: On a GPU, run each training, evaluation and prediction step as a replayed
            CUDA graph (captured once per batch shape; batches get static shapes, see
            `data.static_shapes`). Falls back to eager steps, saying why, on CPU, under FSDP, with
            fp16 or with the profiler on.
        compile: `torch.compile` the HF model in place with this mode (default, reduce-overhead,
            max-autotune, max-autotune-no-cudagraphs). With `cuda_graphs`, default or
            max-autotune-no-cudagraphs: the compiled kernels run inside the whole-step graph.
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
        unpadded: Run the embeddings, projections, feed-forward blocks and LayerNorms on the real
            tokens only (`bertaccel.modules.unpadded`); attention within each packed sequence (our
            varlen kernel on a GPU; SDPA on the re-padded rows on CPU). Same
            parameters and results as the padded model. The data module packs each batch on the CPU
            (where the real tokens are), so the step reads nothing back to the host; with cuda_graphs
            the token count is rounded up to a few buckets per length bucket (fillers: padding tokens).
        last_layer_cls_only: Compute the last encoder layer at the [CLS] position only - all the pooler and
            the classifier read (`bertaccel.modules.last_layer`): its K / V projections on every token, the rest
            on one row per sequence. The same logits and gradients up to rounding, about 1/L of the step's
            work saved (L layers); the FLOP count (MFU) counts what runs. With `unpadded` too.
    """

    def __init__(
        self,
        pretrained: str | None = None,
        config: dict[str, Any] | None = None,
        num_labels: int = 2,
        vocab_size: int | None = None,
        attn_implementation: Literal["eager", "sdpa", "bertaccel"] = "sdpa",
        lr: float = 2e-5,
        weight_decay: float = 0.01,
        warmup_ratio: float = 0.06,
        warmup_steps: int | None = None,
        adam_betas: tuple[float, float] = (0.9, 0.999),
        adam_eps: float = 1e-8,
        cuda_graphs: bool = False,
        compile: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] | None = None,
        optimizer: Literal["adamw", "muon", "normuon"] = "adamw",
        muon_lr: float = 0.02,
        muon_orthogonalizer: Literal["newton-schulz", "polar-express"] = "newton-schulz",
        bf16_weight_copies: bool = True,
        log_grad_norm: bool = False,
        qk_norm: Literal["layernorm", "rmsnorm"] | None = None,
        unpadded: bool = False,
        last_layer_cls_only: bool = False,
    ) -> None:
        super().__init__(lr, weight_decay, warmup_ratio, warmup_steps, adam_betas, adam_eps, cuda_graphs, compile,
                         optimizer, muon_lr, muon_orthogonalizer, bf16_weight_copies, log_grad_norm)
        # num_labels and vocab_size are filled in from the data: keep them out of the hyperparameters
        # the CLI restores from a checkpoint (a link target cannot be overridden), and check them on
        # load instead (`BertModule.on_load_checkpoint`).
        self.save_hyperparameters(ignore=["num_labels", "vocab_size"])
        self.unpadded = unpadded
        self.num_labels = num_labels
        self.model = build_bert(
            BertForSequenceClassification,
            pretrained,
            config,
            attn_implementation,
            qk_norm=qk_norm,
            num_labels=num_labels,
            vocab_size=vocab_size if pretrained is None else None,
        )
        # from_pretrained returns the model in eval mode, and Lightning keeps each submodule's mode:
        # without this, fine-tuning a pretrained model would silently run without dropout.
        self.model.train()
        if last_layer_cls_only:
            from bertaccel.modules.last_layer import last_layer_cls_only as cls_only

            cls_only(self.model)
        self.last_layer_cls_only = last_layer_cls_only
        # ("train" cannot be a ModuleDict key: it would shadow nn.Module.train)
        self.metrics = torch.nn.ModuleDict({f"{s}_metrics": ClassificationStats(num_labels) for s in ("train", "val", "test")})

    def forward(self, input_ids, attention_mask, token_type_ids=None, packed_indices=None, cu_seqlens=None) -> torch.Tensor:
        """Logits, (B, num_labels). With `model.unpadded`, the batch's `packed_indices` / `cu_seqlens`
        (from the data module) say where the real tokens are."""
        if self.unpadded:
            layout = Unpadded.from_packed(packed_indices, cu_seqlens, attention_mask) if packed_indices is not None else None
            return classifier_logits(self.model, input_ids, attention_mask, token_type_ids, layout)
        return self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).logits

    def setup(self, stage: str) -> None:
        super().setup(stage)
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if self.unpadded and dm is not None:
            if hasattr(dm, "use_packed_layout"):
                # the collator says where the real tokens are: no host read per step; the hidden size sets what a
                # graph capture is worth in padding tokens (TextClassificationDataModule's token_buckets "auto")
                dm.use_packed_layout(hidden_size=self.model.config.hidden_size)
            elif self.cuda_graphs:
                raise ConfigError(
                    f"model.unpadded with model.cuda_graphs needs a data module that packs batches "
                    f"(a `use_packed_layout(hidden_size)` method, as TextClassificationDataModule has); {type(dm).__name__} "
                    f"does not. Use one of the two options."
                )

    def flops_per_batch(self, batch: dict[str, torch.Tensor], training: bool):
        B, S = batch["input_ids"].shape
        if not self.unpadded:
            return bert_step_flops(self.model.config, B, S, training=training, cls_only_last_layer=self.last_layer_cls_only)
        # the rows the encoder runs on: the packed token count (fillers included), else the real tokens
        packed = batch.get("packed_indices")
        rows = packed.numel() if isinstance(packed, torch.Tensor) else batch["attention_mask"].sum()
        # attention within each sequence on a GPU (the varlen kernels), on the re-padded batch on CPU;
        # the lengths' squares: the collator's host count, else summed on the device (a 0-d tensor: no host read)
        pairs = None
        if batch["input_ids"].is_cuda:
            pairs = batch.get("attention_pairs")  # the collator's count (a host int)
            if not isinstance(pairs, int):
                cu = batch.get("cu_seqlens")
                lengths = cu.diff() if isinstance(cu, torch.Tensor) else batch["attention_mask"].sum(1)
                pairs = lengths.double().square().sum()
        return bert_step_flops_unpadded(self.model.config, B, S, rows, training, pairs, self.last_layer_cls_only)

    def step_outputs(self, input_ids, attention_mask, token_type_ids=None, labels=None, packed_indices=None,
                     cu_seqlens=None) -> dict[str, torch.Tensor]:
        logits = self(input_ids, attention_mask, token_type_ids, packed_indices, cu_seqlens)
        if labels is None:
            return {"logits": logits}
        # summed over the labelled rows (padding rows carry -100), then the mean for backward
        loss_sum = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
        rows = (labels != IGNORE_INDEX).sum().clamp(min=1)
        # the metrics' counts here, in the step (a CUDA graph's part when graphed), not from the host after it
        return {"loss": loss_sum / rows, "loss_sum": loss_sum.detach(), "logits": logits,
                "confusion": confusion_counts(logits.detach(), labels, self.num_labels)}

    def update_metrics(self, stage: str, batch, out) -> None:
        self.metrics[f"{stage}_metrics"].update(out["logits"], batch["labels"], out["loss_sum"],
                                                counts=out.get("confusion"))

    def _log_epoch(self, stage: str) -> None:
        metric = self.metrics[f"{stage}_metrics"]
        values = metric.compute()  # one host read per epoch (and the DDP reduction)
        metric.reset()
        loss_name = "train/loss_epoch" if stage == "train" else f"{stage}/loss"
        # `compute()` already reduced over DDP ranks, so every rank holds the global value; sync_dist
        # averages identical numbers (exact) and keeps Lightning's epoch-level DDP check satisfied
        for name, key in ((loss_name, "loss"), (f"{stage}/acc", "acc"), (f"{stage}/f1", "f1")):
            self.log(name, values[key], prog_bar=stage != "train", sync_dist=True)

    def validation_step(self, batch, batch_idx):
        self.update_metrics("val", batch, self.eval_outputs(batch))

    def test_step(self, batch, batch_idx):
        self.update_metrics("test", batch, self.eval_outputs(batch))

    def on_train_epoch_end(self) -> None:
        self._log_epoch("train")

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            self.metrics["val_metrics"].reset()
            return
        self._log_epoch("val")

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test")

    def predict_step(self, batch, batch_idx, dataloader_idx: int = 0) -> dict[str, torch.Tensor]:
        logits = self.eval_outputs(batch)["logits"]
        n = batch.get("num_rows", logits.shape[0])  # padding rows of static-shape batches are dropped
        probs = logits[:n].float().softmax(-1)
        out = {"index": batch["index"][:n], "prediction": probs.argmax(-1), "probs": probs}
        if isinstance(batch.get("labels"), torch.Tensor):
            out["label"] = batch["labels"][:n]  # the true class (-100 where the split has none)
        return out
