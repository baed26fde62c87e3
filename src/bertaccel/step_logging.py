"""When the training loop writes step metrics: one predicate for every writer, so they read the device on the same
batches (each read waits for the GPU's queued steps; two writers on different batches would drain it twice)."""
from __future__ import annotations

import lightning.pytorch as pl
import torch


def logs_step_metrics(trainer: pl.Trainer, every: int) -> bool:
    """Whether the training batch about to run (or running) is one where step metrics are written every `every`
    steps: Lightning's own test (`_LoggerConnector.should_update_logs`: its count of batches that stepped, plus one,
    a multiple of the interval) with `every` for `trainer.log_every_n_steps`. The count is Lightning's, not a
    writer's own: a fit resumed mid-epoch restores it from the checkpoint, so every writer and Lightning's logging
    agree on the batch. `every <= 0` writes nothing. (Lightning also writes on the batch where `trainer.should_stop`
    was set; the writers here skip that one: their window ends at the stage's end, written then.)"""
    if every <= 0:
        return False
    return (trainer.fit_loop.epoch_loop._batches_that_stepped + 1) % every == 0


class DeviceWindow:
    """A sum of per-step values kept on the device (fp64; one add a step, no host read) and their count on the
    host; `take` reads the mean once and starts the window again. The training loss and gradient-norm windows."""

    def __init__(self) -> None:
        self.sum: torch.Tensor | None = None
        self.count = 0

    def add(self, value: torch.Tensor) -> None:
        value = value.detach()
        if self.sum is None or self.sum.device != value.device:
            self.sum = torch.zeros((), dtype=torch.float64, device=value.device)
            self.count = 0
        self.sum += value
        self.count += 1

    def take(self) -> float | None:
        """The mean since the last take (None when empty; a host read of the sum, which waits for the queued
        steps), and the window zeroed."""
        if not self.count:
            return None
        mean = self.sum.item() / self.count
        self.sum.zero_()
        self.count = 0
        return mean
