"""Classification metrics that update without a host synchronisation.

torchmetrics' `MulticlassAccuracy` / `MulticlassF1Score` validate their inputs and count with
`torch.bincount`, both of which read device values on the host: one stall per step, which keeps
the CPU from queueing the next CUDA-graph replay while the GPU works. `ClassificationStats` keeps a
confusion matrix updated with `scatter_add_` (device only) plus the summed loss; accuracy, macro-F1
and the mean loss are computed from it once per epoch (`compute`, synced across DDP ranks by
torchmetrics). Rows labelled -100 (the padding rows of static-shape batches) are not counted.

A batch's cells of the matrix (`confusion_counts`) can be counted inside the step itself - the classifier's
`step_outputs` does, so under CUDA graphs they are part of the replayed graph - and handed to `update` as
`counts`: the update is then one add into the matrix instead of ~10 small kernel launches from the host each step.
"""

from __future__ import annotations

import torch
from torchmetrics import Metric

from bertaccel.data.masking import IGNORE_INDEX


def confusion_counts(logits: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """A batch's confusion matrix, (num_classes, num_classes) int64, labels by rows and predictions by columns;
    rows labelled -100 are not counted. Device ops only (no host read), so it can run inside a CUDA graph."""
    c = num_classes
    preds = logits.argmax(-1)
    valid = labels != IGNORE_INDEX
    cell = torch.where(valid, labels.clamp(0, c - 1) * c + preds, c * c)  # skipped rows: a spare cell
    counts = torch.zeros(c * c + 1, dtype=torch.long, device=logits.device)
    counts.scatter_add_(0, cell, torch.ones_like(cell))
    return counts[:-1].view(c, c)


class ClassificationStats(Metric):
    """Confusion matrix, row count and summed loss of a classifier over an epoch.

    `compute()` returns `{"loss": mean loss per row, "acc": accuracy, "f1": macro-F1}`; macro-F1
    averages over the classes that occur in the labels or the predictions (torchmetrics' rule).
    """

    full_state_update = False
    higher_is_better = True

    def __init__(self, num_classes: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_classes = num_classes
        self.add_state("confmat", torch.zeros(num_classes, num_classes, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("loss_sum", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, labels: torch.Tensor, loss_sum: torch.Tensor | None = None,
               counts: torch.Tensor | None = None) -> None:
        """`logits` (B, C), `labels` (B,) with -100 for rows to skip, `loss_sum`: the summed loss of
        the counted rows (optional); `counts`: the batch's `confusion_counts`, when the step already counted them."""
        if counts is None:
            counts = confusion_counts(logits, labels, self.num_classes)
        # out of place: a `reset()` inside `trainer.validate` / `test` (inference mode) leaves inference tensors,
        # which an in-place add outside inference mode refuses (a fit after a validate raised at its first
        # validation step)
        self.confmat = self.confmat + counts
        if loss_sum is not None:
            self.loss_sum = self.loss_sum + loss_sum.detach()

    def compute(self) -> dict[str, torch.Tensor]:
        cm = self.confmat.double()
        n = cm.sum()
        tp = cm.diagonal()
        support, predicted = cm.sum(1), cm.sum(0)
        denom = support + predicted
        present = denom > 0
        f1 = torch.where(present, 2 * tp / denom.clamp(min=1), torch.zeros_like(tp))
        n_safe = n.clamp(min=1)
        return {
            "loss": (self.loss_sum / n_safe).float(),
            "acc": (tp.sum() / n_safe).float(),
            "f1": (f1.sum() / present.sum().clamp(min=1)).float(),
        }


class WeightedMean(Metric):
    """Weighted mean of per-batch values, updated without host reads (torchmetrics' `MeanMetric`
    checks for NaN on the host, and with that check disabled it drops the weights)."""

    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("total", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("weight", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, value: torch.Tensor, weight: torch.Tensor | float = 1.0) -> None:
        value = value.detach().to(torch.float64)
        weight = torch.as_tensor(weight, dtype=torch.float64, device=value.device)
        self.total = self.total + (value * weight).sum()  # out of place, as in ClassificationStats.update
        self.weight = self.weight + weight.sum()

    def compute(self) -> torch.Tensor:
        return (self.total / self.weight.clamp(min=1e-12)).float()
