"""When the training loop writes step metrics: one predicate for every writer, so they read the device on the same
batches (each read waits for the GPU's queued steps; two writers on different batches would drain it twice)."""
from __future__ import annotations

import lightning.pytorch as pl


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
