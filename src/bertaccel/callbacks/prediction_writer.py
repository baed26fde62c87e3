"""Write `predict` results as JSON Lines: one row per input with its predicted label and class probabilities."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BasePredictionWriter
from typing_extensions import override

log = logging.getLogger(__name__)


class JsonlPredictionWriter(BasePredictionWriter):
    """Writes `{"index", "text", "label", "label_name", "probs"}` per input to a .jsonl file.

    Rows are streamed to `<path>.partial` and renamed when prediction ends, so an interrupted run
    never leaves a truncated file under the final name.

    Args:
        output_path: Where to write; default `<log_dir>/predictions.jsonl`.
    """

    def __init__(self, output_path: str | None = None) -> None:
        super().__init__(write_interval="batch")
        self.output_path = output_path
        self._file = None
        self._path: Path | None = None

    def _target(self, trainer: pl.Trainer) -> Path:
        if self.output_path:
            return Path(self.output_path)
        root = trainer.log_dir or trainer.default_root_dir
        return Path(root) / "predictions.jsonl"

    @override
    def on_predict_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero and trainer.world_size > 1:
            return
        self._path = self._target(trainer)
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self._path.with_name(self._path.name + ".partial"), "w", encoding="utf-8")

    @override
    def write_on_batch_end(self, trainer, pl_module, prediction: Any, batch_indices, batch, batch_idx, dataloader_idx=0):
        if self._file is None or not isinstance(prediction, dict) or "probs" not in prediction:
            return
        dm = trainer.datamodule
        names = getattr(dm, "class_names", None)
        split = getattr(dm, "predict_split", None)
        for idx, label, probs in zip(prediction["index"].tolist(), prediction["label"].tolist(), prediction["probs"].tolist()):
            row = {"index": idx}
            if split is not None and hasattr(dm, "text_of"):
                row["text"] = dm.text_of(split, idx)
            row["label"] = label
            if names:
                row["label_name"] = names[label]
            row["probs"] = [round(p, 6) for p in probs]
            self._file.write(json.dumps(row, ensure_ascii=False) + "\n")

    @override
    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._file is None:
            return
        self._file.close()
        self._file = None
        os.replace(self._path.with_name(self._path.name + ".partial"), self._path)
        log.info("predictions written to %s", self._path)
        print(f"predictions written to {self._path}")
