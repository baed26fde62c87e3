"""Where the host's time goes in steady-state training steps of `bertaccel fit` (GPU host).

    python scripts/host_steps.py fit -c configs/imdb_minilm.yaml -c configs/presets/graphs.yaml ...

Runs the CLI in this process with one extra callback that, between training steps `START` and
`STOP` (env, default 60 and 260), profiles the main thread with cProfile and times the window; with `PLAIN=N`,
the N steps before `START` are timed without the profiler too (wall and the main thread's CPU time per step), and
split into the loop's phases (the next batch's fetch, Lightning's batch transfer, every callback's and the module's
batch hooks, the training step, the logger connector, the LR schedulers; the rest is Lightning's loop between them)
by timers wrapped around those calls for the window only. With `TRACE=N`, the N steps after `STOP` run under
torch.profiler (CPU and CUDA activity) and `$OUT/host_steps_gpu.txt` gets the GPU's timeline: busy and idle time per
step, and the kernels the CUDA graph replays ran against those launched outside them (by name).
Writes `$OUT/host_steps.txt` (under DDP one `host_steps_rank<R>.txt` per rank): ms per step (wall), host ms per step spent inside Lightning's hooks,
and the functions taking the host's time, by own and cumulative time.
"""
import cProfile
import functools
import io
import os
import pstats
import statistics
import sys
import time

import lightning.pytorch as pl
import torch

sys.path[:0] = ["src", "."]
START, STOP = int(os.environ.get("START", 60)), int(os.environ.get("STOP", 260))
# PLAIN > 0: also time the PLAIN steps before START without the profiler - wall per step, and the main thread's own
# CPU time per step (`time.thread_time`: the host's work, waits excluded; a CUDA sync that spins counts, and the
# window's only syncs are Lightning's every log_every_n_steps)
PLAIN = int(os.environ.get("PLAIN", 0))
TRACE = int(os.environ.get("TRACE", 0))
OUT = os.environ.get("OUT", ".")


def _sync() -> None:
    if torch.cuda.is_available():  # on a CPU-only machine there is no queue to drain
        torch.cuda.synchronize()


class Phases:
    """Wall and main-thread CPU seconds inside wrapped calls, summed by name while `on`."""

    def __init__(self):
        self.on = False
        self.acc: dict[str, list[float]] = {}
        self.inner: list[list[float]] = []  # per open call: the time of the wrapped calls inside it

    def wrap(self, obj, attr: str, name: str) -> None:
        """Time `obj.attr` under `name`, exclusive of the wrapped calls it makes (automatic optimization runs
        training_step and backward inside the optimizer step)."""
        fn = getattr(obj, attr)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            w, c = time.perf_counter(), time.thread_time()
            self.inner.append([0.0, 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                dw, dc = time.perf_counter() - w, time.thread_time() - c
                inner = self.inner.pop()
                acc = self.acc.setdefault(name, [0.0, 0.0])
                acc[0] += dw - inner[0]
                acc[1] += dc - inner[1]
                if self.inner:
                    self.inner[-1][0] += dw
                    self.inner[-1][1] += dc

        setattr(obj, attr, timed)

    def install(self, trainer, pl_module) -> None:
        loop = trainer.fit_loop
        fetcher = type(loop._data_fetcher)
        self.wrap(fetcher, "__next__", "fetch the next batch (DataLoader, copy ahead)")
        self.wrap(trainer.strategy, "batch_to_device", "strategy.batch_to_device (transfer hooks)")
        self.wrap(trainer.strategy, "training_step", "training_step")
        self.wrap(trainer.strategy, "backward", "strategy.backward (automatic optimization)")
        self.wrap(trainer.strategy, "optimizer_step", "strategy.optimizer_step (automatic optimization)")
        for cb in trainer.callbacks:
            if cb is self.owner:
                continue
            for hook in ("on_train_batch_start", "on_train_batch_end"):
                if getattr(type(cb), hook) is not getattr(pl.Callback, hook):  # the callback has this hook
                    self.wrap(cb, hook, f"{type(cb).__name__}.{hook}")
        for hook in ("on_train_batch_start", "on_train_batch_end"):
            self.wrap(pl_module, hook, f"module.{hook}")
        self.wrap(trainer._logger_connector, "on_batch_end", "logger_connector.on_batch_end")
        self.wrap(trainer._logger_connector, "update_train_step_metrics", "logger_connector.update_train_step_metrics")
        self.wrap(loop.epoch_loop, "update_lr_schedulers", "update_lr_schedulers")

    def table(self, steps: int, wall: float, cpu: float) -> str:
        rows = sorted(self.acc.items(), key=lambda kv: -kv[1][0])
        lines = [f"  {'phase':<58} {'wall ms':>8} {'cpu ms':>8}  (per step, mean of {steps})"]
        for name, (w, c) in rows:
            lines.append(f"  {name:<58} {1e3 * w / steps:8.3f} {1e3 * c / steps:8.3f}")
        w_in = sum(w for w, _ in self.acc.values())
        c_in = sum(c for _, c in self.acc.values())
        lines.append(f"  {'the rest (Lightning between them, this script)':<58} {1e3 * (wall - w_in) / steps:8.3f} "
                     f"{1e3 * (cpu - c_in) / steps:8.3f}")
        return "\n".join(lines) + "\n"


def gpu_timeline(events, wall_us: float, steps: int) -> str:
    """The GPU's time in a profiled window of `steps` steps lasting `wall_us` (synchronized at both ends), from
    torch.profiler `events`: busy (the union of its kernels, copies and sets) and idle per step, and the activities
    launched by CUDA graph replays (`cudaGraphLaunch`) against those launched one by one outside the graphs, with their
    exposed time (each activity's time no earlier one overlaps: the busy time, shared out)."""
    from torch.autograd import DeviceType

    from bertaccel.callbacks.profiler import activity_exposed_us, device_activities

    acts = device_activities(events)
    exposed = activity_exposed_us(acts)
    # the CPU events that launched them: the CUDA runtime / driver calls, which share the activity's (CUPTI)
    # correlation id - its `id` here. (`linked_correlation_id` names the PyTorch op around the launch, none around a
    # graph replay; and the ops' ids come from another counter, so only the runtime calls are looked up.)
    launcher = {e.id: e.name for e in events
                if getattr(e, "device_type", None) == DeviceType.CPU and e.name.startswith("cu")}
    graph_n = graph_us = 0.0
    outside: dict[str, list[float]] = {}
    replays: dict[int, list[tuple[float, float]]] = {}  # a replay's activities share its launch's id
    for e, us in zip(acts, exposed):
        if "GraphLaunch" in launcher.get(e.id, ""):
            graph_n += 1
            graph_us += us
            replays.setdefault(e.id, []).append((e.time_range.start, e.time_range.end))
        else:
            row = outside.setdefault(e.name, [0.0, 0.0])
            row[0] += 1
            row[1] += us
    busy = sum(exposed)
    per = 1.0 / steps
    lines = [f"GPU timeline over {steps} steps (torch.profiler, which adds host time): wall {wall_us * per / 1e3:.3f} ms "
             f"a step, GPU busy {busy * per / 1e3:.3f} ms ({100 * busy / wall_us if wall_us else 0:.1f}%), idle "
             f"{(wall_us - busy) * per / 1e3:.3f} ms",
             f"  in CUDA graph replays: {graph_n * per:.1f} activities a step, {graph_us * per:.1f} us a step",
             replay_gaps(replays, steps),
             f"  launched outside the graphs: {sum(r[0] for r in outside.values()) * per:.1f} a step, "
             f"{sum(r[1] for r in outside.values()) * per:.1f} us a step:"]
    for name, (n, us) in sorted(outside.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"    {n * per:5.2f} x {us / n if n else 0:7.2f} us  {name[:110]}")
    return "\n".join(lines) + "\n"


def replay_gaps(replays: dict[int, list[tuple[float, float]]], steps: int) -> str:
    """Inside each graph replay (its activities' (start, end) us), the time between its first start and last end
    that none of its activities covers: the gaps between consecutive kernels, where the GPU front end launches the
    next node. Summed per step, with the gaps' count and median (a gap a kernel waits at, not its own start-up)."""
    from bertaccel.callbacks.profiler import idle_gaps_us

    # each replay its own timeline: the holes in the union of its activities
    gaps = idle_gaps_us([(replay, start, end) for replay, ivs in replays.items() for start, end in ivs])
    span = sum(max(e for _, e in ivs) - min(s for s, _ in ivs) for ivs in replays.values())
    per = 1.0 / steps
    med = statistics.median(gaps) if gaps else 0.0
    return (f"    replays span {span * per:.1f} us a step, {sum(gaps) * per:.1f} us of it between their activities "
            f"({len(gaps) * per:.1f} gaps a step, median {med:.2f} us, {sum(g > 5 for g in gaps) * per:.1f} over 5 us)")


class HostSteps(pl.Callback):
    def __init__(self):
        self.prof = cProfile.Profile()
        self.t0 = None
        self.plain = None  # (wall, main thread's CPU time) at PLAIN steps before START
        self.plain_line = ""
        self.phases = Phases()
        self.phases.owner = self

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if PLAIN and trainer.global_step == START - PLAIN and self.plain is None:
            _sync()
            self.phases.install(trainer, pl_module)
            self.phases.on = True
            self.plain = (time.perf_counter(), time.thread_time())
        if trainer.global_step == START and self.plain is not None and not self.plain_line:
            _sync()
            wall, cpu = time.perf_counter() - self.plain[0], time.thread_time() - self.plain[1]
            self.phases.on = False
            self.plain_line = (f"steps {START - PLAIN}..{START} without the profiler: {1e3 * wall / PLAIN:.3f} ms per step "
                               f"wall, {1e3 * cpu / PLAIN:.3f} ms of the main thread's CPU time per step\n"
                               + self.phases.table(PLAIN, wall, cpu))
        if trainer.global_step == START and self.t0 is None:
            _sync()
            self.t0 = time.perf_counter()
            self.prof.enable()
        elif trainer.global_step == STOP and self.t0 is not None and self.prof is not None:
            self.prof.disable()
            _sync()
            wall = time.perf_counter() - self.t0
            s = io.StringIO()
            st = pstats.Stats(self.prof, stream=s)
            st.sort_stats("tottime").print_stats(30)
            st.sort_stats("cumulative").print_stats(70)
            n = STOP - START
            head = f"steps {START}..{STOP}: {1e3 * wall / n:.2f} ms per step wall (profiled; cProfile adds overhead)\n"
            name = "host_steps.txt" if trainer.world_size == 1 else f"host_steps_rank{trainer.global_rank}.txt"
            with open(os.path.join(OUT, name), "w") as f:
                f.write(self.plain_line + head + s.getvalue())
            print(self.plain_line + head, flush=True)
            self.prof = None
            if TRACE and torch.cuda.is_available() and trainer.world_size == 1:
                activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                self.trace = torch.profiler.profile(activities=activities)
                self.trace.__enter__()
                self.trace_t0 = time.perf_counter()
        elif TRACE and trainer.global_step == STOP + TRACE and getattr(self, "trace", None) is not None:
            _sync()
            wall = time.perf_counter() - self.trace_t0
            self.trace.__exit__(None, None, None)
            text = gpu_timeline(self.trace.events(), wall * 1e6, TRACE)
            with open(os.path.join(OUT, "host_steps_gpu.txt"), "w") as f:
                f.write(text)
            print(text, flush=True)
            self.trace = None


if __name__ == "__main__":
    from lightning.pytorch.cli import LightningCLI

    _instantiate = LightningCLI._instantiate_trainer

    def instantiate(self, config, callbacks):
        return _instantiate(self, config, [*callbacks, HostSteps()])

    LightningCLI._instantiate_trainer = instantiate
    from bertaccel.cli import main

    main(sys.argv[1:])
