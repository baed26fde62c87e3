"""The rich progress bar's host cost (CPU; no GPU needed).

    python scripts/progress_bar_cost.py [--rates 0 4 100] [--rounds 3] [--steps 1500]

Lightning's RichProgressBar redraws from a background thread up to `refresh_rate` times per second
(Lightning's default: 100), whenever a batch has ended since the last redraw: each redraw renders the
bars' table and the logged metrics in Python, holding the GIL the training loop's thread needs to launch
the next step. This fits Lightning's BoringModel with a host-bound step (60 small tensor ops, ~2 ms)
under each refresh rate (0: no bar), alternating, and prints per run: steps/s after 50 warm-up steps, the
number of redraws and their mean time (rich.live.Live.refresh timed).
"""

from __future__ import annotations

import argparse
import json
import time

import lightning.pytorch as pl
import rich.live
from lightning.pytorch.callbacks import Callback, RichProgressBar
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch.utils.data import DataLoader

_refresh = rich.live.Live.refresh
_renders = {"n": 0, "s": 0.0}


def _timed_refresh(self) -> None:
    t = time.perf_counter()
    _refresh(self)
    _renders["s"] += time.perf_counter() - t
    _renders["n"] += 1


WARMUP = 50


class _Rate(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == WARMUP:
            self.t0 = time.perf_counter()

    def on_train_end(self, trainer, pl_module) -> None:
        self.steps_per_s = (trainer.global_step - WARMUP) / (time.perf_counter() - self.t0)


class _HostBound(BoringModel):
    def training_step(self, batch, batch_idx):
        x = batch
        for _ in range(60):
            x = x * 1.0001
        out = super().training_step(batch, batch_idx)
        self.log("train/loss", out["loss"], prog_bar=True)
        return out

    def train_dataloader(self):
        return DataLoader(RandomDataset(32, 100_000), batch_size=2)


def run(rate: int, steps: int) -> dict:
    _renders.update(n=0, s=0.0)
    meter = _Rate()
    callbacks = [meter] + ([RichProgressBar(refresh_rate=rate)] if rate > 0 else [])
    trainer = pl.Trainer(max_steps=steps, limit_val_batches=0, logger=False, enable_checkpointing=False,
                         callbacks=callbacks, enable_progress_bar=rate > 0, enable_model_summary=False,
                         accelerator="cpu")
    trainer.fit(_HostBound())
    return {"refresh_rate": rate, "steps_per_s": round(meter.steps_per_s, 1), "redraws": _renders["n"],
            "redraw_ms_mean": round(1e3 * _renders["s"] / max(_renders["n"], 1), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", type=int, nargs="+", default=[0, 4, 100])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=1500)
    args = ap.parse_args()
    rich.live.Live.refresh = _timed_refresh  # count and time every redraw
    results = [run(rate, args.steps) for _ in range(args.rounds) for rate in args.rates]
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
