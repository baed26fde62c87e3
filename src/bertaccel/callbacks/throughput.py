"""`ThroughputMeter`: samples/s, real and padded tokens/s, step-time percentiles, data wait, peak
memory and MFU, per stage, logged every N steps and written to `benchmark_stats.json`.

How it stays honest:
- step times come from CUDA events recorded around each step (no host sync per step, so the CPU
  keeps running ahead as in a normal run); events are read at the end of each logging window (the start of the
  batch where Lightning logs, before its step is queued);
- wall-clock rates are taken between synchronized points (window boundaries), and count only the
  time a stage's loop runs: the training clock stops (synchronized) when validation starts or an
  epoch ends, so validation, checkpoint saving and epoch-end work are not charged to training;
- real tokens are the attention mask's ones (padding excluded): the collator's count (`num_tokens`, a host
  int), else summed on the device and read lazily;
- the host's time between steps (`data_wait_ms_mean`: the step's remaining hooks, Lightning's bookkeeping and
  the next batch's fetch) is not the GPU's: with steps queued on the GPU the host may wait without the GPU
  waiting. `gpu_step_fraction` (the steps' GPU time over the wall time) says whether the GPU waited: ~1.0, it
  did not;
- the first `warmup_steps` of every stage (compilation, cuDNN autotune, allocator growth, graph captures) are
  excluded - `eval_warmup_steps` of validate / test / predict where set (an evaluation of fewer batches than the
  training warm-up would measure nothing);
- under DDP the numbers are global: samples, tokens and FLOPs summed over ranks, over the slowest
  rank's time; step times are each rank's own (`step_ms_p50_per_rank`);
- MFU = the model's matmul FLOPs (src/bertaccel/modules/flops.py; the executed shape: padded, or the
  packed rows and sequences of `model.unpadded`) / time / peak; backward counts as 2x forward.
  Lightning's sanity-check batches are skipped;
- the host's garbage collection is timed (`gc.callbacks`): `host_gc_ms_total` since warm-up and, for
  the slowest steps, `slowest_steps_gc_ms`, so a stall can be told apart from a collection.
"""

from __future__ import annotations

import gc
import heapq
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from bertaccel.step_logging import logs_step_metrics

log = logging.getLogger(__name__)

# Dense peak FLOP/s by device name fragment: (bf16/fp16 tensor cores, fp32 without TF32).
PEAK_FLOPS = {
    "H200": (989.4e12, 66.9e12),
    "H100 PCIe": (756.5e12, 51.2e12),
    "H100": (989.4e12, 66.9e12),
    "A100": (312e12, 19.5e12),
    "L40S": (362e12, 91.6e12),
    "A10G": (70e12, 31.2e12),
}


def peak_flops(device: torch.device, precision: str, override: float | None = None) -> float | None:
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, (half, single) in PEAK_FLOPS.items():
        if key in name:
            return half if ("bf16" in precision or "16" in precision) else single
    return None


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


class _Stage:
    """Accumulators of one stage (train, validate, test, predict)."""

    def __init__(self) -> None:
        self.steps = 0  # batches seen, warm-up included
        self.samples = 0
        self.padded = 0
        self.real: torch.Tensor | int = 0
        self.flops: torch.Tensor | int = 0
        self.step_ms: list[float] = []
        self.step_gc_ms: list[float] = []  # the host's garbage-collection time within each counted step
        self.gc_at_start = 0.0  # the meter's GC total (s) when the current step started
        self.gc_at_t0 = 0.0  # ... and at the end of warm-up
        self.wait_s = 0.0
        self.pending: list[tuple[Any, Any]] = []  # CUDA event pairs not yet read
        self.t0: float | None = None  # wall clock at the end of warm-up
        self.t_last_end: float | None = None
        self.t_start: float | None = None
        self.paused_at: float | None = None  # wall clock when the stage's clock was stopped
        self.paused_s = 0.0  # stopped time since t0 (validation inside fit, epoch ends)
        self.window: dict[str, float] = {}  # the numbers read at this step's start, written at its end


class ThroughputMeter(pl.Callback):
    """Measure throughput and efficiency of every stage.

    Args:
        enabled: Turn the meter on (off by default: it adds a little bookkeeping per step).
        warmup_steps: Steps at the start of each stage left out of every number.
        eval_warmup_steps: The same for validate, test and predict (default: `warmup_steps`). An evaluation's first
            batches hold its compile or graph capture; a test set of eight batches measures nothing at the default 10.
        log_every_n_steps: Write the running numbers (`throughput/...`) to the trainer's loggers every N training steps
            (0: only the file at the end of each stage), on the batches where Lightning would log with the same
            interval (its step count, so a resumed fit keeps them), past the warm-up.
        peak_tflops: Peak TFLOP/s for MFU; default from a table (H100/H200/A100/... bf16 or fp32).
        output_file: File name written in the run's log folder at the end of each stage.
    """

    def __init__(self, enabled: bool = False, warmup_steps: int = 10, log_every_n_steps: int = 50,
                 peak_tflops: float | None = None, output_file: str = "benchmark_stats.json",
                 eval_warmup_steps: int | None = None) -> None:
        for name, value in (("warmup_steps", warmup_steps), ("eval_warmup_steps", eval_warmup_steps)):
            if value is not None and value < 0:
                raise ValueError(f"throughput.{name} must be at least 0, got {value}")
        self.enabled = enabled
        self.warmup_steps = warmup_steps
        self.eval_warmup_steps = eval_warmup_steps
        self.log_every_n_steps = log_every_n_steps
        self.peak_tflops = peak_tflops
        self.output_file = output_file
        self.stages: dict[str, _Stage] = {}
        self._root: Path | None = None
        self.results: dict[str, dict[str, float]] = {}
        self._gc_s = 0.0  # the host's time in Python's garbage collector since setup
        self._gc_t: float | None = None

    def _on_gc(self, phase: str, info: dict) -> None:
        """gc.callbacks hook: the main process's collections, timed (a full collection of a large heap
        stops the host for tens to hundreds of ms, and with it the queue of GPU work)."""
        if phase == "start":
            self._gc_t = time.perf_counter()
        elif self._gc_t is not None:
            self._gc_s += time.perf_counter() - self._gc_t
            self._gc_t = None

    # -------------------------------------------------------------------------------- helpers
    def _warmup_setting(self, stage: str) -> tuple[str, int]:
        """The setting that leaves steps at the start of `stage` out of its numbers: its name and value."""
        if stage != "train" and self.eval_warmup_steps is not None:
            return "eval_warmup_steps", self.eval_warmup_steps
        return "warmup_steps", self.warmup_steps

    def _warmup(self, stage: str) -> int:
        """The steps at the start of `stage` left out of its numbers."""
        return self._warmup_setting(stage)[1]

    def _cuda(self, trainer) -> bool:
        return trainer.strategy.root_device.type == "cuda"

    def _sync(self, trainer) -> None:
        if self._cuda(trainer):
            torch.cuda.synchronize(trainer.strategy.root_device)

    def _start(self, trainer, pl_module, stage: str, batch) -> None:
        if not self.enabled or trainer.sanity_checking:
            return
        st = self.stages.setdefault(stage, _Stage())
        if st.paused_at is not None:  # restart the clock once the work in between has finished
            self._sync(trainer)
            st.paused_s += time.perf_counter() - st.paused_at
            st.paused_at = None
        now = time.perf_counter()
        warmup = self._warmup(stage)
        if st.steps == warmup:
            self._sync(trainer)
            now = time.perf_counter()
            st.t0 = now
            st.gc_at_t0 = self._gc_s
            if self._cuda(trainer):
                torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)
        if st.steps >= warmup and st.t_last_end is not None:
            st.wait_s += now - st.t_last_end
        if stage == "train" and st.steps > warmup and logs_step_metrics(trainer, self.log_every_n_steps):
            # the running numbers of the steps before this one, read (synchronized) before this step is queued - on
            # the batch where Lightning's own step logging reads the device too, so the GPU's queue drains once
            # there and idles only while this step launches; written to the loggers at this step's end
            st.window = self._summary(trainer, stage)  # every rank (its collectives under DDP)
        st.t_start = now
        st.gc_at_start = self._gc_s
        if self._cuda(trainer) and st.steps >= warmup:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            st.pending.append((ev, None))

    def _end(self, trainer, pl_module, stage: str, batch) -> None:
        if not self.enabled or trainer.sanity_checking or stage not in self.stages:
            return
        st = self.stages[stage]
        counted = st.steps >= self._warmup(stage)
        st.steps += 1
        if counted and isinstance(batch, dict) and "input_ids" in batch:
            ids = batch["input_ids"]
            rows = int(batch.get("num_rows", ids.shape[0]))  # static-shape batches: padding rows excluded
            st.samples += rows
            st.padded += ids.numel()
            tokens = batch.get("num_tokens")  # counted by the collator on the host: no device work per step
            if not isinstance(tokens, int):
                mask = batch.get("attention_mask")
                tokens = mask[:rows].sum() if mask is not None else ids[:rows].numel()
            st.real = st.real + tokens
            if hasattr(pl_module, "flops_per_batch"):
                st.flops = st.flops + pl_module.flops_per_batch(batch, training=stage == "train")
            st.step_gc_ms.append((self._gc_s - st.gc_at_start) * 1e3)
            if self._cuda(trainer):
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                st.pending[-1] = (st.pending[-1][0], ev)
            else:
                st.step_ms.append((time.perf_counter() - st.t_start) * 1e3)
        st.t_last_end = time.perf_counter()
        if st.window:
            # straight to the loggers (rank 0 writes; as Lightning's LearningRateMonitor and ThroughputMonitor do),
            # not through `self.log`: a logged key stays in the epoch's results, which Lightning walks after every
            # batch (twice, with the progress bar) - 16 keys added 0.15-0.2 ms a step to the loop's host time
            step = trainer.fit_loop.epoch_loop._batches_that_stepped  # the step `self.log` here would write at
            metrics = {f"throughput/{k}": v for k, v in st.window.items() if isinstance(v, (int, float))}
            st.window = {}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def _pause(self, trainer, stage: str) -> None:
        """Stop the stage's clock (synchronized) until its next batch starts."""
        st = self.stages.get(stage)
        if not self.enabled or st is None or st.t0 is None or st.paused_at is not None:
            return
        self._sync(trainer)
        st.paused_at = time.perf_counter()
        st.t_last_end = None  # the pause is not data wait

    def _elapsed(self, st: _Stage) -> float:
        end = st.paused_at if st.paused_at is not None else time.perf_counter()
        return end - st.t0 - st.paused_s

    def _read_events(self, st: _Stage) -> None:
        for a, b in st.pending:
            if b is not None:
                st.step_ms.append(a.elapsed_time(b))
        st.pending = [p for p in st.pending if p[1] is None]

    def _summary(self, trainer, stage: str) -> dict[str, float]:
        st = self.stages[stage]
        if st.t0 is None or st.samples == 0:
            return {}
        self._sync(trainer)
        self._read_events(st)
        elapsed = elapsed_own = self._elapsed(st)
        samples, real, padded, flops = float(st.samples), float(st.real), float(st.padded), float(st.flops)
        p50 = percentile(st.step_ms, 0.5)
        world = trainer.world_size
        per_rank_p50 = [p50]
        if world > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            # every rank reaches this point at the same step (same batch counts under DDP)
            dev = trainer.strategy.root_device
            totals = torch.tensor([samples, real, padded, flops], dtype=torch.float64, device=dev)
            torch.distributed.all_reduce(totals)
            slowest = torch.tensor([elapsed], dtype=torch.float64, device=dev)
            torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
            mine = torch.tensor([p50], dtype=torch.float64, device=dev)
            gathered = [torch.zeros_like(mine) for _ in range(world)]
            torch.distributed.all_gather(gathered, mine)
            samples, real, padded, flops = totals.tolist()
            elapsed = float(slowest)
            per_rank_p50 = [float(t) for t in gathered]
        out = {
            "steps": float(st.steps - self._warmup(stage)),
            "samples_per_s": samples / elapsed,
            "real_tokens_per_s": real / elapsed,
            "padded_tokens_per_s": padded / elapsed,
            "padding_fraction": 1 - real / padded if padded else 0.0,
            "step_ms_mean": statistics.fmean(st.step_ms) if st.step_ms else float("nan"),
            "step_ms_p50": p50,
            "step_ms_p90": percentile(st.step_ms, 0.9),
            "data_wait_ms_mean": 1e3 * st.wait_s / max(st.steps - self._warmup(stage), 1),
            # this rank's steps' GPU time (events) over the wall time: ~1 when the GPU sets the pace (the
            # host's data wait was hidden behind queued steps), lower when the GPU waited for the host
            "gpu_step_fraction": 1e-3 * sum(st.step_ms) / elapsed_own if self._cuda(trainer) else float("nan"),
            "tflops_per_s": flops / elapsed / 1e12,
            "world_size": float(world),
            # the host's time in Python's garbage collector since warm-up (this rank)
            "host_gc_ms_total": (self._gc_s - st.gc_at_t0) * 1e3,
        }
        if st.step_ms:  # where the time of a mean far above the median went: the 8 slowest steps
            slowest = heapq.nlargest(8, range(len(st.step_ms)), key=st.step_ms.__getitem__)
            out["slowest_steps_ms"] = [st.step_ms[i] for i in slowest]
            out["slowest_steps_at"] = [float(i + self._warmup(stage)) for i in slowest]  # steps of the stage
            # the host's garbage collection inside those steps (a stall the GPU felt when its queue ran dry)
            if len(st.step_gc_ms) == len(st.step_ms):
                out["slowest_steps_gc_ms"] = [st.step_gc_ms[i] for i in slowest]
        if world > 1:
            out["step_ms_p50_per_rank"] = per_rank_p50
        device = trainer.strategy.root_device
        if device.type == "cuda":
            out["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
        peak = peak_flops(device, str(trainer.precision), self.peak_tflops * 1e12 if self.peak_tflops else None)
        if peak:
            out["mfu"] = flops / elapsed / peak / world  # of the peak of all the ranks' GPUs
        return out

    def _finish(self, trainer, stage: str) -> None:
        if not self.enabled or stage not in self.stages:
            return
        stats = self._summary(trainer, stage)
        del self.stages[stage]
        if not stats:
            if trainer.state.fn != "fit":
                name, warmup = self._warmup_setting(stage)
                rank_zero_info(f"throughput ({stage}): fewer steps than {name}={warmup}; nothing measured")
            return
        stats.update(self._graph_fields(trainer.lightning_module, stage))
        self.results[stage] = stats
        if trainer.is_global_zero:
            root = self._root or Path(trainer.default_root_dir)
            root.mkdir(parents=True, exist_ok=True)
            path = root / self.output_file
            old = json.loads(path.read_text()) if path.is_file() else {}
            old[stage] = {k: [round(x, 6) for x in v] if isinstance(v, list) else round(v, 6) for k, v in stats.items()}
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(old, indent=2))
            tmp.replace(path)
            shown = ", ".join(f"{k}={v:.4g}" for k, v in stats.items() if not isinstance(v, list))
            rank_zero_info(f"throughput ({stage}): {shown}  -> {path}")

    @staticmethod
    def _graph_fields(pl_module, stage: str) -> dict[str, Any]:
        """The stage's CUDA-graph captures (`BertModule.graph_stats`), warm-up included: how many, their
        seconds in all, and each one's parts (recording the step, ending the capture, first replay)."""
        stats = pl_module.graph_stats().get("train" if stage == "train" else "eval") if hasattr(pl_module, "graph_stats") else None
        if not isinstance(stats, dict) or not stats.get("captured"):
            return {}
        return {"graph_captures": float(len(stats["captured"])), "graph_capture_s_total": stats["capture_s"],
                "graph_capture_parts_s": [round(x, 6) for parts in stats.get("capture_parts_s", []) for x in parts]}

    # -------------------------------------------------------------------------------- hooks
    @override
    def setup(self, trainer, pl_module, stage):
        # every rank: `trainer.log_dir` broadcasts under DDP, so rank 0 alone must not ask for it later
        self._root = Path(trainer.log_dir or trainer.default_root_dir) if self.enabled else None
        if self.enabled and self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    @override
    def teardown(self, trainer, pl_module, stage):
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start(trainer, pl_module, "train", batch)

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._end(trainer, pl_module, "train", batch)

    @override
    def on_train_epoch_end(self, trainer, pl_module):
        self._pause(trainer, "train")

    @override
    def on_train_end(self, trainer, pl_module):
        self._pause(trainer, "train")
        self._finish(trainer, "train")

    @override
    def on_validation_start(self, trainer, pl_module):
        self._pause(trainer, "train")

    @override
    def on_validation_epoch_end(self, trainer, pl_module):
        self._pause(trainer, "validate")

    @override
    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._start(trainer, pl_module, "validate", batch)

    @override
    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._end(trainer, pl_module, "validate", batch)

    @override
    def on_validation_end(self, trainer, pl_module):
        if trainer.state.fn == "validate" or not trainer.training:
            self._finish(trainer, "validate")

    @override
    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._start(trainer, pl_module, "test", batch)

    @override
    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._end(trainer, pl_module, "test", batch)

    @override
    def on_test_end(self, trainer, pl_module):
        self._finish(trainer, "test")

    @override
    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._start(trainer, pl_module, "predict", batch)

    @override
    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._end(trainer, pl_module, "predict", batch)

    @override
    def on_predict_end(self, trainer, pl_module):
        self._finish(trainer, "predict")
