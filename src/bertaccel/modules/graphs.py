"""Whole-step CUDA graphs: capture a step function once per input shape, then replay it.

A BERT step launches about a thousand small kernels; issued one by one through Lightning, HF and
Python dispatch, the host cannot keep the GPU busy. `StepGraphs` records the whole step (forward,
backward and optimizer step for training; forward and loss for evaluation) into a CUDA graph the
first time a shape ("key") is seen and afterwards copies each batch into the graph's input buffers
and replays it: one launch per step.

How it is done (the recipe of `torch.cuda.graphs`' whole-network example):

- The first batches of a key run eagerly on the capture stream (real steps, not thrown away):
  they create the optimizer state, cuBLAS workspaces and autotuned kernels outside the graph.
  The very first key gets `warmup` such steps, later keys `later_warmup` (1 by default; 0 captures
  a new shape at once - its eager step costs as much as the capture - and if that capture fails,
  the key gets its eager step and is captured on its next batch instead of turning graphs off).
- Then the step is captured with the next batch's data in static input buffers, and replayed once
  to run that batch. RNG (dropout) is drawn from PyTorch's Philox generator, whose offset a replay
  advances, so every replay draws new masks.
- All graphs share one memory pool (a new one after a failed capture). This is safe because a
  caller reads a graph's outputs before it replays another one (outputs of a graph are only valid
  until the next replay of *any* graph of the same `StepGraphs`); memory stays flat once every key
  is captured.
- Inputs must keep their shapes, dtypes and devices per key; the key is built from the shapes.

If capture fails (an op that synchronises with the host, say), the step falls back to eager for
the rest of the run, with one line saying why. The same object runs eagerly, with identical
semantics, when `capture=False` (CPU, or a caller that asked for no graphs), which is how the
Lightning integration is tested on machines without a GPU.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

StepFn = Callable[..., dict[str, torch.Tensor]]


def recover_from_failed_capture(stream: torch.cuda.Stream | None = None) -> None:
    """Call after a CUDA-graph capture raised. The failed capture skipped PyTorch's end-of-capture
    bookkeeping: the CUDA RNG generator still counts itself as capturing, and the next random op
    outside a graph (dropout in the eager step that follows) raises "Offset increment outside graph
    capture". An empty capture (on `stream`, or a new side stream) runs that bookkeeping (the
    generator's capture epilogue)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "The CUDA Graph is empty"
        with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream or torch.cuda.Stream()):
            pass


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]
    replays: int = 0


@dataclass
class GraphStats:
    """What a `StepGraphs` did: captures per key, eager steps, replays."""

    captured: list[Hashable] = field(default_factory=list)
    eager_steps: int = 0
    replays: int = 0
    capture_s: float = 0.0
    # where each capture's time went, in captured order: (recording the step on the host, ending the
    # capture - CUDA's graph instantiation included -, the first replay up to the host's return) in seconds
    capture_parts_s: list[tuple[float, float, float]] = field(default_factory=list)


class StepGraphs:
    """Captures and replays one CUDA graph per key.

    Args:
        name: For messages ("train", "eval").
        capture: False runs every step eagerly (same code path, no graphs).
        warmup: Eager steps before the first capture.
        later_warmup: Eager steps before the capture of each later key (0 or 1).
        max_graphs: Keys beyond this many run eagerly (a data pipeline that makes too many shapes).
        pool: A memory pool handle to share with other `StepGraphs` (`torch.cuda.graph_pool_handle()`).
    """

    def __init__(self, name: str, capture: bool = True, warmup: int = 2, max_graphs: int = 32, pool=None,
                 later_warmup: int = 1) -> None:
        self.name, self.warmup, self.max_graphs, self.later_warmup = name, warmup, max_graphs, later_warmup
        self._retry: set[Hashable] = set()  # keys whose capture without an eager step failed
        self.disabled_reason: str | None = None if capture else "capture off"
        self.pool = pool
        self.stream: torch.cuda.Stream | None = None
        self.graphs: dict[Hashable, _Graph] = {}
        self.seen: Counter = Counter()
        self.stats = GraphStats()
        self._told_full = False

    @property
    def capturing(self) -> bool:
        return self.disabled_reason is None

    def disable(self, reason: str) -> None:
        if self.disabled_reason is None:
            self.disabled_reason = reason
            log.warning("bertaccel: CUDA graphs off for %s steps: %s; running them eagerly.", self.name, reason)
        self.graphs.clear()

    def summary(self) -> dict:
        """Captured keys, eager steps, replays, capture seconds, and why capture is off (if it is)."""
        return vars(self.stats) | {"disabled": self.disabled_reason}

    def reset(self) -> None:
        """Drop every graph (after the model's parameters or the optimizer's state were replaced)."""
        self.graphs.clear()
        self.seen.clear()

    # ----------------------------------------------------------------------------------- running
    def run(self, key: Hashable, fn: StepFn, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run `fn(**inputs)` for this key: replay its graph, capture it, or run eagerly."""
        entry = self.graphs.get(key)
        if entry is not None:
            for name, t in entry.inputs.items():
                t.copy_(inputs[name], non_blocking=True)
            entry.graph.replay()
            entry.replays += 1
            self.stats.replays += 1
            return entry.outputs
        if not self.capturing:
            return self._eager(fn, inputs, side_stream=False)
        if len(self.graphs) >= self.max_graphs:
            if not self._told_full:
                log.warning("bertaccel: %d %s graphs captured, the most allowed; new shapes run eagerly "
                            "(fewer `data.length_buckets` keep the count down).", self.max_graphs, self.name)
                self._told_full = True
            return self._eager(fn, inputs, side_stream=False)
        n = self.seen[key]
        self.seen[key] += 1
        if not self.stats.captured:
            warmup = self.warmup
        else:
            warmup = 1 if key in self._retry else self.later_warmup
        if n < warmup:
            return self._eager(fn, inputs, side_stream=True)
        return self._capture(key, fn, inputs, retry=n == 0 and bool(self.stats.captured))

    def _eager(self, fn: StepFn, inputs: dict[str, torch.Tensor], side_stream: bool) -> dict[str, torch.Tensor]:
        self.stats.eager_steps += 1
        if not side_stream:
            return fn(**inputs)
        stream = self._stream()
        here = torch.cuda.current_stream()
        stream.wait_stream(here)
        with torch.cuda.stream(stream):
            out = fn(**inputs)
        here.wait_stream(stream)
        for t in out.values():
            t.record_stream(here)
        return out

    def _stream(self) -> torch.cuda.Stream:
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        return self.stream

    def _capture(self, key: Hashable, fn: StepFn, inputs: dict[str, torch.Tensor], retry: bool = False) -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        static = {k: v.detach().clone() for k, v in inputs.items()}
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        t_recorded = None
        try:
            # thread_local: other threads (the DataLoader's pin-memory thread) may keep calling CUDA
            with torch.cuda.graph(graph, pool=self.pool, stream=self._stream(), capture_error_mode="thread_local"):
                outputs = fn(**static)
                t_recorded = time.perf_counter()
        except Exception as e:  # noqa: BLE001 - any capture failure means: this step cannot be graphed
            recover_from_failed_capture(self._stream())
            reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            if retry:  # a new shape captured without its eager step: give it one, capture it next time
                self._retry.add(key)
                # the failed capture also left PyTorch's allocator recording into the shared pool
                # ("beginAllocateToPool: already recording" on the next capture into it): later graphs
                # get a new pool; the graphs captured so far keep theirs
                self.pool = None
                log.info("bertaccel: %s graph %s not captured without an eager step (%s); warming it up first.",
                         self.name, key, reason)
                return self._eager(fn, inputs, side_stream=True)
            self.disable(f"capture failed ({reason})")
            return self._eager(fn, inputs, side_stream=False)
        t_ended = time.perf_counter()
        graph.replay()
        self.graphs[key] = _Graph(graph, static, outputs, replays=1)
        self.stats.replays += 1
        self.stats.captured.append(key)
        t_end = time.perf_counter()
        seconds = t_end - t0
        parts = (t_recorded - t0, t_ended - t_recorded, t_end - t_ended)
        self.stats.capture_s += seconds
        self.stats.capture_parts_s.append(parts)
        log.info("bertaccel: captured %s graph %s in %.3f s (recording %.3f, ending the capture %.3f, first replay "
                 "%.3f)", self.name, key, seconds, *parts)
        return outputs
