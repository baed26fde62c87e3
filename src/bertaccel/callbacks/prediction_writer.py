"""Write `predict` results as JSON Lines: one row per input with the predicted class, its
probabilities and, when the split is labelled, the true label.

Works under DDP: every rank streams its share to a shard next to the target, and rank 0 merges the
shards once all ranks are done (rows in dataset order, each exactly once: `DistributedSampler` pads
the last ranks' shares with repeated rows, which are dropped by their index).
"""

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
    """Writes `{"index", "text", "prediction", "prediction_name", "probs", "label", "label_name"}`
    per input to a .jsonl file (`label` / `label_name`: the true class, when the split has labels;
    `*_name` when the class names are known).

    Rows are streamed to `<path>.rank<N>.partial` and merged and renamed when prediction ends, so an
    interrupted run never leaves a truncated file under the final name.

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
        root = trainer.log_dir or trainer.default_root_dir  # collective under DDP: every rank calls it
        return Path(root) / "predictions.jsonl"

    def _shard(self, rank: int) -> Path:
        return self._path.with_name(f"{self._path.name}.rank{rank}.partial")

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "predict":
            self._path = self._target(trainer)

    @override
    def on_predict_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._path is None:
            self._path = self._target(trainer)
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self._shard(trainer.global_rank), "w", encoding="utf-8")

    @override
    def write_on_batch_end(self, trainer, pl_module, prediction: Any, batch_indices, batch, batch_idx, dataloader_idx=0):
        if self._file is None or not isinstance(prediction, dict) or "probs" not in prediction:
            return
        dm = trainer.datamodule
        names = getattr(dm, "class_names", None)
        split = getattr(dm, "predict_split", None)
        labels = prediction.get("label")
        labels = labels.tolist() if labels is not None else [None] * len(prediction["index"])
        for idx, pred, probs, label in zip(prediction["index"].tolist(), prediction["prediction"].tolist(),
                                           prediction["probs"].tolist(), labels):
            row: dict[str, Any] = {"index": idx}
            if split is not None and hasattr(dm, "text_of"):
                row["text"] = dm.text_of(split, idx)
            row["prediction"] = pred
            if names:
                row["prediction_name"] = names[pred]
            row["probs"] = [round(p, 6) for p in probs]
            if label is not None and label >= 0:
                row["label"] = label
                if names:
                    row["label_name"] = names[label]
            self._file.write(json.dumps(row, ensure_ascii=False) + "\n")

    @override
    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._file is None:
            return
        self._file.close()
        self._file = None
        trainer.strategy.barrier("predictions_written")
        if trainer.is_global_zero:
            rows: dict[int, str] = {}
            for rank in range(trainer.world_size):
                shard = self._shard(rank)
                with open(shard, encoding="utf-8") as f:
                    for line in f:
                        rows.setdefault(json.loads(line)["index"], line)  # padded repeats: first copy wins
            partial = self._path.with_name(self._path.name + ".partial")
            with open(partial, "w", encoding="utf-8") as f:
                f.writelines(rows[i] for i in sorted(rows))
            os.replace(partial, self._path)
            for rank in range(trainer.world_size):
                self._shard(rank).unlink(missing_ok=True)
            log.info("predictions written to %s", self._path)
            print(f"predictions written to {self._path} ({len(rows)} rows)")
        trainer.strategy.barrier("predictions_merged")
