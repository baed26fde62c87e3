"""Timing and reporting helpers shared by the benchmarks (CUDA events, medians, rotating inputs)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch


def environment() -> dict:
    """What a result was measured with: date, versions, GPU, and the commit of this repository."""
    env = {"date": str(date.today()), "torch": torch.__version__, "python": platform.python_version()}
    try:  # BERTACCEL_COMMIT: for a checkout copied without its .git (the GPU host)
        env["commit"] = os.environ.get("BERTACCEL_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        env["commit"] = "unknown"
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    return env


def cuda_time_ms(fn, inputs: list, warmup: int = 10, repeats: int = 50) -> float:
    """Median time of fn(*inputs[i % len(inputs)]) in ms, measured with CUDA events per call.
    Rotating over several input sets keeps repeated calls from being served by L2."""
    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    torch.cuda.synchronize()
    times = []
    for i in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        args = inputs[i % len(inputs)]
        start.record()
        fn(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def step_times_ms(step, steps: int, cuda: bool, before=None) -> list[float]:
    """The time of each of `steps` calls of `step()` in ms: CUDA events around each call on a GPU (after one
    synchronize), the host clock on CPU. `before()`, if given, runs before each call, outside its time (a
    barrier between ranks)."""
    times = []
    if cuda:
        torch.cuda.synchronize()
    for _ in range(steps):
        if before is not None:
            before()
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def compile_static(fn):
    """torch.compile for a baseline timed at several shapes: one static kernel per shape, as a model of fixed
    shapes gets. Plain torch.compile marks a dimension dynamic once a second shape arrives (automatic dynamic
    shapes), so a benchmark looping over shapes times its later shapes on shape-generic kernels: bench_ops'
    RMSNorm at 16384 x 1024 measured compile at 34.5 us there (session 75), where the 768-wide row, whose width
    had not yet changed, ran at 95% of copy. Shapes compile one by one: the recompile limit is raised to fit."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(fn, dynamic=False)


def run_tag(*switches: str) -> str:
    """A sweep line's tag: the tree (BERTACCEL_AB, as scripts/ab_runs.sh sets it) and each of `switches` that is set."""
    return " ".join([os.environ.get("BERTACCEL_AB", "")] + [f"{k}={os.environ[k]}" for k in switches if k in os.environ])


def rotations(bytes_per_set: int, l2_bytes: int = 50 * 2**20) -> int:
    """How many input sets to rotate through so that their total exceeds 4x the L2 cache."""
    return max(2, min(64, -(-4 * l2_bytes // max(bytes_per_set, 1))))


def copy_bandwidth_gbs(nbytes: int = 2**30) -> float:
    """Device-to-device copy: bytes read + written over the time, GB/s."""
    a = torch.empty(nbytes // 4, device="cuda", dtype=torch.float32).uniform_()
    b = torch.empty_like(a)
    ms = cuda_time_ms(lambda: b.copy_(a), [()], warmup=3, repeats=10)
    return 2 * nbytes / ms / 1e6


def write_json(path: str | Path, payload: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns]
    line = " | ".join(c.ljust(w) for c, w in zip(columns, widths))
    print(line)
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(str(r.get(c, "")).ljust(w) for c, w in zip(columns, widths)))


@contextlib.contextmanager
def kernel_env(env: dict[str, str] | None):
    """Set the environment variables `env` (kernel switches read per call) for the block, then put back
    what was there before."""
    old = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Stopwatch:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.s = time.perf_counter() - self.t0


def kernel_times_us(work, calls: int) -> dict[str, float]:
    """GPU time of each CUDA kernel (by name) that `work()` launches, per call, `work` making `calls`
    calls: from torch.profiler, synchronized before and after."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        work()
        torch.cuda.synchronize()
    per: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name] = per.get(e.name, 0.0) + e.device_time / calls
    return per


def graph_time_ms(fn, inputs: list, calls: int = 20, replays: int = 10, capture_error_mode: str = "global") -> float:
    """GPU time per call of fn(*inputs[i % len(inputs)]), from replays of a CUDA graph holding
    `calls` calls: launch and Python overhead are gone, only the kernels' time remains.
    `capture_error_mode`: torch.cuda.graph's (global / thread_local / relaxed)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (compilation, autotuning, lazy init) off the capture
        for i in range(3):
            fn(*inputs[i % len(inputs)])
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g, capture_error_mode=capture_error_mode):
            for i in range(calls):
                fn(*inputs[i % len(inputs)])
    except Exception:
        # a failed capture leaves PyTorch's CUDA generator counting itself as capturing: every later random op
        # of the process would raise ("Offset increment outside graph capture") - run its end-of-capture
        # bookkeeping before the caller falls back (e.g. SDPA's cuDNN backend with dropout does not capture)
        from bertaccel.modules.graphs import recover_from_failed_capture

        recover_from_failed_capture()
        raise
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    del g
    return statistics.median(times)


def prime_backward_capture() -> bool:
    """Capture one throwaway autograd backward, so that the benchmark's first real one captures: in a fresh process the
    first CUDA-graph capture of an autograd backward fails ("operation failed due to a previous error during capture",
    cudaErrorStreamCaptureInvalidated; H200, torch 2.11, global and thread-local capture modes alike, with or without
    the extension loaded) and the later ones capture (scripts/capture_probe.py, session 69:
    benchmarks/results/h200/capture_probe_030bdab.log). Without this, bench_ops' first PyTorch row was timed eagerly.
    Returns whether the priming capture itself went through."""
    x = torch.randn(256, 64, device="cuda", requires_grad=True)
    y = torch.nn.functional.layer_norm(x, (64,))
    dy = torch.randn_like(y)
    try:
        graph_time_ms(lambda: torch.autograd.grad(y, [x], dy, retain_graph=True), [()], calls=1, replays=1)
        return True
    except Exception:  # noqa: BLE001 - the failure this absorbs (graph_time_ms has reset the generator)
        torch.cuda.synchronize()
        return False


def measure_op(op: str, shape: str, impls: dict, make_args, grad_args: tuple[int, ...],
               fwd_bytes: int, bwd_bytes: int, ceiling_gbs: float, train_fwd_bytes: int | None = None) -> list[dict]:
    """Forward and backward of every implementation of one op on the same inputs.

    GPU time per call comes from CUDA-graph replays (kernels only); `eager_fwd_us` is one eager
    call timed with events, launch and Python overhead included. Effective bandwidth = the bytes
    the op must move at least once / GPU time. `make_args()` returns fresh random inputs;
    `grad_args` are the indices that need gradients. The forward is timed without grad (what
    inference runs); with `train_fwd_bytes` it is timed again with grad on (`train_fwd_*`: what a
    training step runs, which also writes what the backward needs, counted in those bytes)."""
    sets = [make_args() for _ in range(rotations(fwd_bytes))]

    def with_grad(args):  # the `grad_args` inputs as fresh leaves that require grad
        return [a.detach().requires_grad_(True) if torch.is_tensor(a) and i in grad_args else a
                for i, a in enumerate(args)]

    rows = []
    for name, fn in impls.items():
        with torch.no_grad():
            eager_ms = cuda_time_ms(fn, sets)
            fwd_ms = graph_time_ms(fn, sets)
        train = {}
        if train_fwd_bytes is not None:
            train_ms = graph_time_ms(fn, [with_grad(args) for args in sets])
            train_gbs = train_fwd_bytes / train_ms / 1e6
            train = {"train_fwd_us": round(train_ms * 1e3, 1), "train_fwd_GB/s": round(train_gbs),
                     "train_fwd_%copy": round(100 * train_gbs / ceiling_gbs)}
        graphs = []
        for args in sets[: max(2, len(sets) // 2)]:
            args = with_grad(args)
            y = fn(*args)
            graphs.append((y, [args[i] for i in grad_args], torch.randn_like(y)))
        # allow_unused: an implementation may read only some of the inputs (bf16 or fp32 weight copies)
        bwd = lambda y, leaves, dy: torch.autograd.grad(y, leaves, dy, retain_graph=True, allow_unused=True)  # noqa: E731
        bwd_ms, how = None, "graph"
        for attempt in range(2):
            try:
                bwd_ms = graph_time_ms(bwd, graphs)
                break
            except Exception as e:  # noqa: BLE001 - a backward that cannot be captured is timed eagerly
                # the failed capture left the CUDA RNG generator "capturing": without this, the next eager
                # dropout (the next implementation's forward) raises "Offset increment outside graph capture"
                from bertaccel.modules.graphs import recover_from_failed_capture
                recover_from_failed_capture()
                # once more before timing eagerly: the first capture of PyTorch's linear backward in a process
                # failed ("operation failed due to a previous error during capture", H100 and H200), the same
                # backward at other shapes captured; a one-time failure then costs the row its graph timing
                how = f"eager (capture failed: {type(e).__name__}: {str(e).splitlines()[0][:120]})"
                print(f"{op} {shape} {name}: backward capture {attempt + 1} failed: {how}", file=sys.stderr)
        if bwd_ms is None:
            bwd_ms = cuda_time_ms(bwd, graphs)
        elif how != "graph":
            how = "graph (second capture)"
        fwd_gbs, bwd_gbs = fwd_bytes / fwd_ms / 1e6, bwd_bytes / bwd_ms / 1e6
        rows.append({
            "op": op, "shape": shape, "impl": name, "eager_fwd_us": round(eager_ms * 1e3, 1),
            "fwd_us": round(fwd_ms * 1e3, 1), "fwd_GB/s": round(fwd_gbs), "fwd_%copy": round(100 * fwd_gbs / ceiling_gbs),
            "bwd_us": round(bwd_ms * 1e3, 1), "bwd_GB/s": round(bwd_gbs), "bwd_%copy": round(100 * bwd_gbs / ceiling_gbs),
            "bwd_timing": how, **train,
        })
        del graphs
    return rows
