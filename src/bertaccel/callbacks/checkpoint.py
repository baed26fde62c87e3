"""Checkpoints that never lie about "last" and are never half-written.

- `AtomicCheckpointIO` writes each checkpoint to a temporary file in the target's own directory,
  flushes it to disk, and renames it over the target: a crash (kill -9, full disk) leaves the
  previous file intact, never a truncated one (a temporary file elsewhere, e.g. in $TMPDIR on
  another filesystem, could not be renamed atomically). A process killed mid-save leaves only its
  hidden `.<name>.partial`; `LatestCheckpoint` removes such leftovers when the next fit starts.
- `LatestCheckpoint` is Lightning's `ModelCheckpoint` whose `last.ckpt` always holds the latest
  state: written at every validation and epoch end (and every `every_n_train_steps` steps when set)
  whether or not the monitored metric improved, and at the end of training (the steps after the last validation are not lost). With
  `enable_version_counter: false` (the CLI's default) a second fit of the same experiment replaces
  `last.ckpt` instead of writing `last-v1.ckpt` beside it, so "last" and "best" mean the same for
  every subcommand.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

PARTIAL_SUFFIX = ".partial"


def remove_partial_checkpoints(dirpath) -> list[Path]:
    """Delete the `.<name>.partial` files a killed save left in `dirpath`; returns what it removed."""
    dirpath = Path(dirpath)
    removed = sorted(dirpath.glob(f".*{PARTIAL_SUFFIX}")) if dirpath.is_dir() else []
    for p in removed:
        p.unlink(missing_ok=True)
    return removed


class AtomicCheckpointIO(TorchCheckpointIO):
    """`torch.save` to `<dir>/.<name>.partial`, fsync, then `os.replace` onto `<dir>/<name>`."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}{PARTIAL_SUFFIX}")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


class _SavesAsAutomaticOptimization:
    """Stands in for a module whose manual optimization is only its graphed step's (the optimizer runs inside the
    captured step: `BertModule.optimizer_in_step`) when ModelCheckpoint decides on a mid-epoch save: Lightning's
    manual-optimization branch ignores `train_time_interval`, defers differently and warns about a
    pre-optimization state at every save; the same fit without graphs takes the automatic branch, which reads
    nothing of the module but this flag (the trainer's `global_step` still reads the real module)."""

    automatic_optimization = True


class LatestCheckpoint(ModelCheckpoint):
    """`ModelCheckpoint` whose `last.ckpt` is always the latest state (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._last_written_step: int | None = None

    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit" and trainer.is_global_zero and self.dirpath is not None:
            removed = remove_partial_checkpoints(self.dirpath)
            if removed:
                rank_zero_warn(f"removed {len(removed)} partial checkpoint file(s) left by a save that was killed "
                               f"({', '.join(p.name for p in removed)}); the checkpoints themselves are intact.")

    @override
    def _save_last_checkpoint(self, trainer, monitor_candidates) -> None:
        super()._save_last_checkpoint(trainer, monitor_candidates)
        self._last_written_step = trainer.global_step

    def _refresh_last(self, trainer) -> None:
        if not self.save_last or trainer.sanity_checking or trainer.fast_dev_run or self.dirpath is None:
            return
        if self._last_written_step == trainer.global_step or trainer.global_step == 0:
            return
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    @override
    def on_validation_end(self, trainer, pl_module) -> None:
        super().on_validation_end(trainer, pl_module)
        # when the parent saves at the epoch's end instead, refreshing here would make it skip that save
        if trainer.state.fn == "fit" and not self._should_save_on_train_epoch_end(trainer):
            self._refresh_last(trainer)

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        module = _SavesAsAutomaticOptimization() if getattr(pl_module, "optimizer_in_step", False) else pl_module
        super().on_train_batch_end(trainer, module, outputs, batch, batch_idx)
        every = self._every_n_train_steps
        if every and every > 0 and trainer.global_step % every == 0:
            # a mid-epoch save point: last.ckpt follows it even when the monitored metric is not there yet
            self._refresh_last(trainer)

    @override
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        self._refresh_last(trainer)

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        self._refresh_last(trainer)
