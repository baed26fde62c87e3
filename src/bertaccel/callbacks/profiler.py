"""`ProfilerCallback`: a torch.profiler trace of a few steps of any stage, labelled by BERT region,
plus per-kernel and per-operator statistics and a category breakdown.

Outputs, in `<log_dir>/profiler/` (named in the log when written):
- `<host>_<pid>.<stage>.<time>.pt.trace.json.gz`: Chrome trace; opens in Perfetto, chrome://tracing,
  Holistic Trace Analysis and TensorBoard's profiler plugin (`pip install torch-tb-profiler`;
  `tensorboard --logdir runs`), which finds it under the run's folder;
- `kernel_statistics.json`: every GPU kernel: total ms, exposed ms, calls, mean us, share of GPU busy time,
  category;
- `operator_statistics.json`: every aten op: self CPU ms, self device ms, calls, mean, device memory;
- `profile_summary.json`: GPU busy time by category and by labelled region, and `step_ms`: the median time per step
  of the recorded steps and of the unrecorded ones before them (the profiler slows what it traces: its per-step
  times are of the slowed steps - the line printed says by how much).
The top kernels, top operators and category shares are printed at the end of the stage.

Kernels overlap: a kernel launched by programmatic dependent launch (our row kernels and GEMM, after
the kernel before them) starts while its predecessor still runs and waits inside its own time, and
kernels of different streams run side by side. Summed, kernel times then exceed the time the GPU was
busy (BERT-base 32x512 graphed step on an H200: 28.2 ms of kernel time in a 23.8 ms step). So each
kernel's *exposed* time is counted too: the part of it during which no kernel that began earlier on
the same GPU was still running (`exposed_us`). Exposed times add up to the GPU's busy time; the shares
and categories are of exposed time, and `total_ms` keeps each kernel's own duration.

Labelled regions are `record_function` ranges opened by module hooks (HF code is not edited):
`embeddings`, `layer{i}.attention`, `layer{i}.ffn` (intermediate + output, or the ffn family's fused block), `head` (pooler,
classifier or MLM head), and in training `backward` and `optimizer_step`.
"""

from __future__ import annotations

import json
import math
import re
import socket
from collections import defaultdict
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.autograd import DeviceType
from typing_extensions import override

# Checked in order; the first pattern that matches a kernel's name gives its category.
CATEGORIES: list[tuple[str, str]] = [
    ("memcpy/memset", r"memcpy|memset|Memcpy|Memset"),
    # (not a bare "lamb": demangled names are full of "{lambda()#1}")
    ("optimizer", r"adam|Adam|multi_tensor|_foreach|fused_sgd|\bLAMB|lamb_"),
    ("attention", r"flash|fmha|attention|Attention|sdpa|efficient_attention|cutlassF|cutlassB|attn_fwd|attn_bwd"),
    ("softmax", r"softmax|Softmax|SoftMax"),
    ("layernorm", r"layer_norm|layernorm|LayerNorm|ln_fwd|ln_bwd|rms_norm"),
    ("gelu/activation", r"gelu|Gelu|GELU|relu|tanh|silu|erf_kernel|\berf\b"),
    ("gemm", r"gemm|GEMM|cutlass|cublas|nvjet|xmma|sm90|sm80|wgmma|matmul|Kernel2"),
    ("reduction", r"reduce|Reduce|sum_|norm_kernel|column_sum|argmax|cross_entropy|nll_loss|log_softmax"),
    ("elementwise", r"elementwise|vectorized|unrolled|CatArray|copy|fill|index|dropout|where|add|mul|cast"),
]
CATEGORY_NAMES = [c for c, _ in CATEGORIES] + ["other"]
_COMPILED = [(c, re.compile(p)) for c, p in CATEGORIES]


def categorize(kernel: str) -> str:
    """The category of a GPU kernel by its (mangled or demangled) name."""
    for cat, pat in _COMPILED:
        if pat.search(kernel):
            return cat
    return "other"


def device_activities(events) -> list:
    """The GPU kernels, memcpys and memsets among torch.profiler FunctionEvents (not the GPU-side copies of
    record_function ranges, which span the kernels they label)."""
    return [e for e in events if getattr(e, "device_type", None) == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]


def exposed_us(intervals: list[tuple[int, float, float]]) -> list[float]:
    """For (device, start_us, end_us) intervals: each one's microseconds during which no interval that began
    earlier on the same device was still running (ties in start: the longer one counts as earlier). Their sum per
    device is the time that device was busy (the union of the intervals)."""
    order = sorted(range(len(intervals)), key=lambda i: (intervals[i][0], intervals[i][1], -intervals[i][2]))
    out = [0.0] * len(intervals)
    covered: dict[int, float] = {}
    for i in order:
        dev, start, end = intervals[i]
        until = covered.get(dev, float("-inf"))
        out[i] = max(0.0, end - max(start, until))
        covered[dev] = max(until, end)
    return out


def idle_gaps_us(intervals: list[tuple[int, float, float]]) -> list[float]:
    """For (device, start_us, end_us) intervals: the gaps inside their union on each device, between the first start
    and the last end - where that device ran nothing: between kernels (a launch's latency, a graph node's start) or
    waiting on the host."""
    by_dev: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for dev, start, end in intervals:
        by_dev[dev].append((start, end))
    gaps = []
    for ivs in by_dev.values():
        ivs.sort()
        reach = ivs[0][1]
        for start, end in ivs[1:]:
            if start > reach:
                gaps.append(start - reach)
            reach = max(reach, end)
    return gaps


def activity_exposed_us(acts) -> list[float]:
    """`exposed_us` of GPU activities (profiler FunctionEvents: device index and time range)."""
    return exposed_us([(e.device_index, e.time_range.start, e.time_range.end) for e in acts])


def exposed_by_launch(events) -> dict[int, list[tuple[str, float]]] | None:
    """(kernel name, exposed microseconds) of the GPU activities among `events`, in launch order, per launching CPU
    event (the device events' `linked_correlation_id`, the CPU event's `id`); None where this torch's events do not
    carry it."""
    acts = device_activities(events)
    if acts and not all(hasattr(e, "linked_correlation_id") for e in acts):
        return None
    out: dict[int, list[tuple[str, float]]] = {}
    for e, us in zip(acts, activity_exposed_us(acts)):
        if e.linked_correlation_id:
            out.setdefault(e.linked_correlation_id, []).append((e.name, us))
    return out


def region_exposed_us(events, names: re.Pattern) -> dict[str, float] | None:
    """For the CPU events whose name `names` matches (record_function regions): the exposed GPU microseconds of the
    kernels launched inside them (by them or by the CPU events nested in them), summed by name - what PyTorch's
    device_time_total sums, with overlapping kernels counted once. None where the events lack correlation ids."""
    by_launch = exposed_by_launch(events)
    if by_launch is None:
        return None
    out: dict[str, float] = defaultdict(float)
    for e in events:
        if getattr(e, "device_type", None) != DeviceType.CPU or not names.match(e.name):
            continue
        stack = [e]
        while stack:
            c = stack.pop()
            out[e.name] += sum(us for _, us in by_launch.get(c.id, ()))
            stack.extend(getattr(c, "cpu_children", None) or [])
    return dict(out)


def exposed_by_name(events) -> dict[str, float]:
    """Exposed microseconds (`exposed_us`) of the GPU activities among `events`, summed by name."""
    acts = device_activities(events)
    totals: dict[str, float] = defaultdict(float)
    for e, us in zip(acts, activity_exposed_us(acts)):
        totals[e.key] += us
    return dict(totals)



def plot_summary(summary: dict, path: Path, on_gpu: bool) -> Path | None:
    """A PNG next to `profile_summary.json`: time by kernel category (GPU runs) and by labelled region
    (device time on a GPU, CPU time otherwise). None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = []
    if on_gpu and summary["categories"]:
        cats = sorted(summary["categories"].items(), key=lambda kv: kv[1]["ms"])
        panels.append(("GPU busy time by kernel category (ms, overlaps counted once)", [c for c, _ in cats], [v["ms"] for _, v in cats]))
    if summary["regions"]:
        key = "device_ms" if on_gpu else "cpu_ms"
        regs = sorted(summary["regions"].items(), key=lambda kv: kv[1][key])
        panels.append((f"{'GPU' if on_gpu else 'CPU'} time by labelled region (ms)", [r for r, _ in regs], [v[key] for _, v in regs]))
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 0.3 * max(len(p[1]) for p in panels) + 1.6),
                             squeeze=False)
    for ax, (title, labels, values) in zip(axes[0], panels):
        ax.barh(labels, values, color="#4c72b0")
        ax.set_title(title, fontsize=10)
        ax.tick_params(labelsize=8)
    fig.suptitle(f"{summary['stage']}: {summary['active_steps']} profiled steps", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _enter_range(name: str) -> torch.profiler.record_function:
    """Open a labelled profiler range that a later hook closes (`.__exit__(None, None, None)`)."""
    rf = torch.profiler.record_function(name)
    rf.__enter__()
    return rf

class _RegionHooks:
    """Forward pre/post hooks that open and close profiler ranges around BERT's submodules."""

    def __init__(self) -> None:
        self.handles: list = []
        self.open: dict[int, list] = defaultdict(list)

    def add(self, module: torch.nn.Module, label: str) -> None:
        def pre(mod, args):
            self.open[id(mod)].append(_enter_range(label))

        def post(mod, args, out):
            if self.open[id(mod)]:
                self.open[id(mod)].pop().__exit__(None, None, None)

        self.handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def attach(self, root: torch.nn.Module) -> None:
        modules = dict(root.named_modules())
        for name, m in modules.items():
            leaf = name.rsplit(".", 1)[-1]
            tname = type(m).__name__
            if tname == "BertEmbeddings":
                self.add(m, "embeddings")
            elif re.search(r"encoder\.layer\.\d+\.attention$", name):
                self.add(m, f"layer{name.split('.')[-2]}.attention")
            elif re.search(r"encoder\.layer\.\d+\.(intermediate|output|feed_forward)$", name):
                # a layer with the ffn family's fused block: one region around the block (its fallback
                # calls intermediate and output inside it)
                if leaf == "feed_forward" or name.rsplit(".", 1)[0] + ".feed_forward" not in modules:
                    self.add(m, f"layer{name.split('.')[-2]}.ffn")
            elif leaf in ("pooler", "classifier", "cls") and tname != "Dropout":
                self.add(m, "head")

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


class ProfilerCallback(pl.Callback):
    """Profile a few steps of each stage with torch.profiler.

    Args:
        enabled: Turn profiling on (off by default; `configs/profile.yaml` turns it on).
        stages: Stages to profile: any of "train", "validate", "test", "predict".
        skip_first: Steps ignored before the schedule starts (compilation, warm-up, allocator growth).
        wait: Steps the profiler idles at the start of each cycle.
        warmup: Steps traced but discarded (profiler start-up cost).
        active: Steps recorded per cycle; keep it at 1-3, traces grow fast.
        repeat: Cycles to record (0: until the stage ends).
        record_shapes: Record operator input shapes.
        profile_memory: Record tensor allocations (larger trace).
        with_stack: Record Python stacks (much larger trace).
        row_limit: Rows of the printed kernel and operator tables.
    """

    def __init__(self, enabled: bool = False, stages: list[str] | None = None, skip_first: int = 5, wait: int = 1,
                 warmup: int = 2, active: int = 3, repeat: int = 1, record_shapes: bool = True,
                 profile_memory: bool = False, with_stack: bool = False, row_limit: int = 30) -> None:
        self.enabled = enabled
        self.stages = stages or ["train", "validate", "test", "predict"]
        self.skip_first, self.wait, self.warmup, self.active, self.repeat = skip_first, wait, warmup, active, repeat
        self.record_shapes, self.profile_memory, self.with_stack = record_shapes, profile_memory, with_stack
        self.row_limit = row_limit
        self._prof: torch.profiler.profile | None = None
        self._stage: str | None = None
        self._hooks = _RegionHooks()
        self._ranges: dict[str, object] = {}
        self._marks: list[tuple[str, object]] = []  # ("none" / "warmup" / "record", end-of-step mark) per step
        self.outputs: dict[str, Path] = {}

    # ------------------------------------------------------------------------------- control
    @property
    def eager_steps_reason(self) -> str | None:
        """Why the model must run eager steps while this callback is on (read by `cuda_graphs`)."""
        return "is on (its labelled regions need eager steps)" if self.enabled else None

    def _dir(self, trainer) -> Path:
        return Path(trainer.log_dir or trainer.default_root_dir) / "profiler"

    def _begin(self, trainer, pl_module, stage: str) -> None:
        if not self.enabled or stage not in self.stages or self._prof is not None or trainer.sanity_checking:
            return
        out = self._out = self._dir(trainer)  # every rank: `trainer.log_dir` is a collective under DDP
        out.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if trainer.strategy.root_device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        worker = f"{socket.gethostname()}_{trainer.global_rank}.{stage}"
        skip_first, warmup = self._fit_schedule(trainer, stage)
        self._stage = stage
        self._prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(skip_first=skip_first, wait=self.wait, warmup=warmup,
                                             active=self.active, repeat=self.repeat),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(out), worker_name=worker, use_gzip=True),
            record_shapes=self.record_shapes, profile_memory=self.profile_memory, with_stack=self.with_stack,
            acc_events=True,
        )
        self._hooks.attach(pl_module)
        self._cuda = trainer.strategy.root_device.type == "cuda"
        self._marks = [("none", self._mark())]  # the stage's start
        self._prof.__enter__()

    def _fit_schedule(self, trainer, stage: str) -> tuple[int, int]:
        """(skip_first, warmup) for a stage with fewer batches than the schedule needs: the skipped
        steps give way first, then the warm-up (down to 1), so that the `active` steps are whole
        steps inside the stage; said in one line. A stage with too few batches even then is said too."""
        counts = {"train": trainer.num_training_batches, "validate": sum(trainer.num_val_batches or [0]),
                  "test": sum(trainer.num_test_batches or [0]), "predict": sum(trainer.num_predict_batches or [0])}
        available = counts.get(stage, float("inf"))
        need = self.skip_first + self.wait + self.warmup + self.active  # `step()` runs at every batch end
        skip_first, warmup = self.skip_first, self.warmup
        if not math.isfinite(available) or available >= need:
            return skip_first, warmup
        short = need - int(available)
        cut = min(short, skip_first)
        skip_first, short = skip_first - cut, short - cut
        cut = min(short, max(warmup - 1, 0))
        warmup, short = warmup - cut, short - cut
        if short > 0:
            rank_zero_info(f"profiler ({stage}): the stage has {int(available)} batches, fewer than the "
                           f"{self.wait + 1 + self.active} that wait={self.wait}, warmup>=1, active={self.active} "
                           "need; fewer steps will be recorded (lower profiler.active or raise the limit_*_batches).")
        else:
            rank_zero_info(f"profiler ({stage}): {int(available)} batches: skip_first {self.skip_first} -> {skip_first}, "
                           f"warmup {self.warmup} -> {warmup}, so that {self.active} whole steps are recorded.")
        return skip_first, warmup

    def _mark(self):
        """The end of a step: a CUDA event on the current stream (the GPU's timeline, no synchronization), or the host
        clock on CPU."""
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        import time

        return time.perf_counter()

    def _step(self, stage: str) -> None:
        if self._prof is not None and self._stage == stage:
            action = self._prof.current_action
            kind = ("record" if action in (torch.profiler.ProfilerAction.RECORD, torch.profiler.ProfilerAction.RECORD_AND_SAVE)
                    else "warmup" if action == torch.profiler.ProfilerAction.WARMUP else "none")
            if kind != "record" and self._marks[-1][0] != "record" and any(k == "record" for k, _ in self._marks):
                self._marks.pop()  # after a recorded step only the mark before the next recorded one is needed
            self._marks.append((kind, self._mark()))
            self._prof.step()

    def _step_times(self) -> dict[str, float | int | None]:
        """Median ms per step of the recorded steps and of the untraced ones before the first recorded step (the
        profiler's skipped and waiting steps; its warm-up steps are traced; the stage's first step left out:
        compilation, graph capture, caches)."""
        import statistics

        marks, self._marks = self._marks, []
        if self._cuda:
            torch.cuda.synchronize()
        times = []
        for (_, a), (kind, b) in zip(marks, marks[1:]):
            times.append((kind, a.elapsed_time(b) if self._cuda else (b - a) * 1e3))
        first = next((i for i, (k, _) in enumerate(times) if k == "record"), len(times))
        before = [t for k, t in times[1:first] if k == "none"]
        during = [t for k, t in times if k == "record"]
        return {"recorded": statistics.median(during) if during else None, "recorded_steps": len(during),
                "unrecorded": statistics.median(before) if before else None, "unrecorded_steps": len(before)}

    def _finish(self, trainer, stage: str) -> None:
        if self._prof is None or self._stage != stage:
            return
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self._step_ms = self._step_times()
        self._hooks.remove()
        for handle in self._ranges.values():
            handle.__exit__(None, None, None)
        self._ranges.clear()
        if trainer.is_global_zero:
            self._report(trainer, prof, stage)

    def _range(self, name: str, open_: bool) -> None:
        if self._prof is None or self._stage != "train":
            return
        if open_:
            self._ranges[name] = _enter_range(name)
        elif name in self._ranges:
            self._ranges.pop(name).__exit__(None, None, None)

    # -------------------------------------------------------------------------------- report
    def _report(self, trainer, prof, stage: str) -> None:
        out = self._out
        try:
            averages = prof.key_averages()
        except (AssertionError, RuntimeError):
            rank_zero_info(f"profiler ({stage}): no step was recorded (fewer steps than skip_first+wait+warmup+active)")
            return
        # GPU-side copies of record_function ranges (our region labels, Lightning's optimizer ranges)
        # also carry device_type CUDA: they are not kernels.
        kernels = device_activities(averages)
        exposed = exposed_by_name(prof.events())
        kernel_sum = sum(e.self_device_time_total for e in kernels)
        gpu_total = sum(exposed.values()) or kernel_sum or 1.0  # busy time: the exposed times' sum
        kernel_rows = sorted(
            ({"name": e.key, "category": categorize(e.key), "total_ms": e.self_device_time_total / 1e3,
              "exposed_ms": exposed.get(e.key, e.self_device_time_total) / 1e3,
              "calls": e.count, "mean_us": e.self_device_time_total / max(e.count, 1),
              "share": exposed.get(e.key, e.self_device_time_total) / gpu_total} for e in kernels),
            key=lambda r: -r["exposed_ms"],
        )
        ops = [e for e in averages if e.device_type == DeviceType.CPU]
        op_rows = sorted(
            ({"name": e.key, "self_cpu_ms": e.self_cpu_time_total / 1e3, "self_device_ms": e.self_device_time_total / 1e3,
              "calls": e.count, "mean_cpu_us": e.cpu_time_total / max(e.count, 1),
              "device_memory_mb": e.self_device_memory_usage / 2**20} for e in ops if e.key.startswith("aten::")
             or e.key.startswith("bertaccel::")),
            key=lambda r: (-r["self_device_ms"], -r["self_cpu_ms"]),
        )
        by_cat: dict[str, float] = defaultdict(float)
        for r in kernel_rows:
            by_cat[r["category"]] += r["exposed_ms"]
        region_names = re.compile(r"^(embeddings|layer\d+\.(attention|ffn)|head|backward|optimizer_step)$")
        region_exposed = region_exposed_us(prof.events(), region_names) or {}
        # device_ms: the kernels launched inside the region, overlapping ones counted once (exposed time) where the
        # profiler links kernels to their launches; device_own_ms: their own times summed (PyTorch's device total)
        def region_device_us(e) -> float:  # own time where the links gave nothing (they should give something)
            x = region_exposed.get(e.key, 0.0)
            return x if x > 0 or e.device_time_total == 0 else e.device_time_total

        regions = {e.key: {"device_ms": region_device_us(e) / 1e3,
                           "device_own_ms": e.device_time_total / 1e3, "cpu_ms": e.cpu_time_total / 1e3, "calls": e.count}
                   for e in ops if region_names.match(e.key)}
        summary = {
            "stage": stage, "active_steps": self.active * max(self.repeat, 1),
            "gpu_ms": gpu_total / 1e3,  # busy: kernels of one GPU counted once where they overlap
            "kernel_sum_ms": kernel_sum / 1e3,
            "categories": {c: {"ms": by_cat[c], "share": by_cat[c] * 1e3 / gpu_total} for c in CATEGORY_NAMES if by_cat[c]},
            "regions": regions,
            "step_ms": getattr(self, "_step_ms", None),
        }
        for name, rows in (("kernel_statistics.json", kernel_rows), ("operator_statistics.json", op_rows),
                           ("profile_summary.json", summary)):
            (out / f"{stage}_{name}" if stage != "train" else out / name).write_text(json.dumps(rows, indent=2))
        self.outputs[stage] = out
        on_gpu = bool(kernel_rows)
        picture = plot_summary(summary, out / (f"{stage}_profile_summary.png" if stage != "train" else "profile_summary.png"), on_gpu)
        traces = sorted(p.name for p in out.glob(f"*{stage}*.pt.trace.json.gz"))
        lines = [f"profiler ({stage}): trace {out}/{traces[-1] if traces else '?'}; statistics in {out}"
                 + (f"; picture {picture.name}" if picture else "")]
        if on_gpu:
            overlap = kernel_sum - gpu_total
            lines.append(f"  GPU busy {gpu_total / 1e3:.2f} ms over {summary['active_steps']} steps"
                         + (f" (kernel times sum to {kernel_sum / 1e3:.2f} ms: {overlap / 1e3:.2f} ms of it overlapped, counted"
                            " once, for the kernel that began first)" if overlap > 0.005 * gpu_total else "")
                         + "; by category: "
                         + ", ".join(f"{c} {v['share']:.1%}" for c, v in sorted(summary["categories"].items(), key=lambda kv: -kv[1]["ms"])))
            lines.append("  top kernels by exposed GPU time (own time in brackets where a kernel overlapped an earlier one):")
            for r in kernel_rows[: self.row_limit]:
                own = f" ({r['total_ms']:.3f})" if r["total_ms"] - r["exposed_ms"] > 0.0005 else ""
                lines.append(f"    {r['share']:6.1%} {r['exposed_ms']:8.3f} ms{own} {r['calls']:5d}x {r['mean_us']:8.1f} us  [{r['category']}] {r['name'][:90]}")
            lines.append("  top operators by self device time:")
            for r in op_rows[: self.row_limit]:
                lines.append(f"    {r['self_device_ms']:8.3f} ms dev {r['self_cpu_ms']:8.3f} ms cpu {r['calls']:5d}x  {r['name'][:80]}")
        else:  # CPU run: no kernels, so no device columns
            lines.append(f"  no GPU activity (CPU run); top operators by self CPU time over {summary['active_steps']} steps:")
            for r in sorted(op_rows, key=lambda r: -r["self_cpu_ms"])[: self.row_limit]:
                lines.append(f"    {r['self_cpu_ms']:8.3f} ms cpu {r['calls']:5d}x  {r['name'][:80]}")
        step_ms = summary["step_ms"] or {}
        if step_ms.get("recorded") and step_ms.get("unrecorded"):
            slower = step_ms["recorded"] / step_ms["unrecorded"] - 1
            lines.append(f"  recorded steps took {step_ms['recorded']:.2f} ms each, the {step_ms['unrecorded_steps']} "
                         f"untraced ones before them {step_ms['unrecorded']:.2f} ms: tracing changed the step time by "
                         f"{slower:+.1%} - the times above are of the traced steps")
        if regions:
            unit = "device ms / cpu ms" if on_gpu else "cpu ms"
            lines.append(f"  regions ({unit}): " + ", ".join(
                (f"{k} {v['device_ms']:.2f}/{v['cpu_ms']:.2f}" if on_gpu else f"{k} {v['cpu_ms']:.2f}")
                for k, v in sorted(regions.items())[:40]))
        rank_zero_info("\n".join(lines))

    # -------------------------------------------------------------------------------- hooks
    @override
    def on_train_start(self, trainer, pl_module):
        self._begin(trainer, pl_module, "train")

    @override
    def on_before_backward(self, trainer, pl_module, loss):
        self._range("backward", True)

    @override
    def on_after_backward(self, trainer, pl_module):
        self._range("backward", False)

    @override
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._range("optimizer_step", True)

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._range("optimizer_step", False)
        self._step("train")

    @override
    def on_train_end(self, trainer, pl_module):
        self._finish(trainer, "train")

    @override
    def on_validation_start(self, trainer, pl_module):
        if trainer.state.fn == "validate":
            self._begin(trainer, pl_module, "validate")

    @override
    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._step("validate")

    @override
    def on_validation_end(self, trainer, pl_module):
        self._finish(trainer, "validate")

    @override
    def on_test_start(self, trainer, pl_module):
        self._begin(trainer, pl_module, "test")

    @override
    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._step("test")

    @override
    def on_test_end(self, trainer, pl_module):
        self._finish(trainer, "test")

    @override
    def on_predict_start(self, trainer, pl_module):
        self._begin(trainer, pl_module, "predict")

    @override
    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._step("predict")

    @override
    def on_predict_end(self, trainer, pl_module):
        self._finish(trainer, "predict")
