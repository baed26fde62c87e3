"""Per-kernel GPU time of our GEMM's launches (the GEMM kernel, split-K's reduce, anything else) for
chosen schedules at BERT shapes, from torch.profiler over eager calls after warm-up, beside the same
calls' time from CUDA-graph replays: whether a configuration's time is in its kernel or around it.
`python scripts/gemm_kernels.py [--shapes 2048x768x3072 ...] [--schedules 1 3]`"""
import argparse
from collections import defaultdict

import torch

from benchmarks.bench_gemm import parse_shape
from benchmarks.common import graph_time_ms, kernel_times_us
import bertaccel.ops.gemm  # noqa: F401 - defines torch.ops.bertaccel.gemm
from bertaccel.ops import build

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--shapes", nargs="+", type=parse_shape, default=[(2048, 768, 3072), (2048, 768, 768)])
ap.add_argument("--gemms", nargs="+", default=["fwd", "wgrad"])
ap.add_argument("--schedules", nargs="+", type=int, default=[0, 1, 3])
ap.add_argument("--calls", type=int, default=20)
args = ap.parse_args()
assert build.load() and build.load_gemm(), build.gemm_reason()
GEMM = torch.ops.bertaccel.gemm.default
LAYOUT = {"fwd": (False, False), "dgrad": (False, True), "wgrad": (True, True)}
for m, n, k in args.shapes:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    operands = {"fwd": (x, w), "dgrad": (dy, w), "wgrad": (dy, x)}
    for g in args.gemms:
        a, b = operands[g]
        ta, tb = LAYOUT[g]
        cub = {"fwd": lambda x, w: x @ w.t(), "dgrad": lambda dy, w: dy @ w, "wgrad": lambda dy, x: dy.t() @ x}[g]
        cub_ms = graph_time_ms(cub, [(a, b)], calls=10, replays=10)
        for sched in args.schedules:
            def call(a, b, sched=sched):
                return GEMM(a, b, None, None, 0, ta, tb, False, False, 0, 0, sched)[0]
            for _ in range(3):
                call(a, b)
            per = defaultdict(float)
            for kernel, us in kernel_times_us(lambda: [call(a, b) for _ in range(args.calls)], args.calls).items():
                per["gemm_kernel" if "gemm_kernel" in kernel else kernel[:40]] += us
            ms = graph_time_ms(call, [(a, b)], calls=10, replays=10)
            parts = ", ".join(f"{k} {v:.1f} us" for k, v in sorted(per.items(), key=lambda kv: -kv[1]))
            print(f"KERNELS {m}x{n}x{k} {g:5s} schedule {sched}: graph {ms * 1e3:.1f} us ({cub_ms / ms:.3f} of cuBLAS "
                  f"{cub_ms * 1e3:.1f}); profiler: {parts}", flush=True)
