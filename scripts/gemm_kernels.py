"""Per-kernel GPU time of our GEMM's launches (the GEMM kernel, split-K's reduce, anything else) for
chosen schedules at BERT shapes, from torch.profiler over eager calls after warm-up, beside the same
calls' time from CUDA-graph replays: whether a configuration's time is in its kernel or around it.
`python scripts/gemm_kernels.py [--shapes 2048x768x3072 ...] [--schedules 1 3]`
`python scripts/gemm_kernels.py --fp32 --configs 0:0 2:2 1:-3` (fp32 SIMT kernel; tile:splits, 0:0 the plan's
pick, a negative split a tail split)."""
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
ap.add_argument("--fp32", action="store_true", help="fp32 operands: the SIMT kernel (cuBLAS without TF32 beside it)")
ap.add_argument("--configs", nargs="+", default=["0:0"], help="--fp32: tile:splits pairs (0:0 = the plan's pick)")
ap.add_argument("--cublas-names", action="store_true",
                help="also list cuBLAS's kernels for each call (their names carry its tile, cluster and split choices)")
args = ap.parse_args()
torch.backends.cuda.matmul.allow_tf32 = False
assert build.load() and build.load_gemm(), build.gemm_reason()
GEMM = torch.ops.bertaccel.gemm.default
LAYOUT = {"fwd": (False, False), "dgrad": (False, True), "wgrad": (True, True)}
for m, n, k in args.shapes:
    dtype = torch.float32 if args.fp32 else torch.bfloat16
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype) * k**-0.5
    dy = torch.randn(m, n, device="cuda", dtype=dtype)
    operands = {"fwd": (x, w), "dgrad": (dy, w), "wgrad": (dy, x)}
    for g in args.gemms:
        a, b = operands[g]
        ta, tb = LAYOUT[g]
        cub = {"fwd": lambda x, w: x @ w.t(), "dgrad": lambda dy, w: dy @ w, "wgrad": lambda dy, x: dy.t() @ x}[g]
        cub_ms = graph_time_ms(cub, [(a, b)], calls=10, replays=10)
        if args.cublas_names:
            names = kernel_times_us(lambda: [cub(a, b) for _ in range(args.calls)], args.calls)
            listed = "; ".join(f"{name} {us:.1f} us" for name, us in sorted(names.items(), key=lambda kv: -kv[1]))
            print(f"CUBLAS {m}x{n}x{k} {g:5s}: graph {cub_ms * 1e3:.1f} us; {listed}", flush=True)
        configs = [tuple(int(v) for v in c.split(":")) for c in args.configs] if args.fp32 else args.schedules
        for sched in configs:
            def call(a, b, sched=sched):
                if args.fp32:  # (tile, splits)
                    return GEMM(a, b, None, None, 0, ta, tb, True, False, sched[0], sched[1])[0]
                return GEMM(a, b, None, None, 0, ta, tb, False, False, 0, 0, sched)[0]
            for _ in range(3):
                call(a, b)
            per = defaultdict(float)
            for kernel, us in kernel_times_us(lambda: [call(a, b) for _ in range(args.calls)], args.calls).items():
                per["gemm_kernel" if "gemm_kernel" in kernel else kernel[:48]] += us
            ms = graph_time_ms(call, [(a, b)], calls=10, replays=10)
            parts = ", ".join(f"{k} {v:.1f} us" for k, v in sorted(per.items(), key=lambda kv: -kv[1]))
            print(f"KERNELS {m}x{n}x{k} {g:5s} schedule {sched}: graph {ms * 1e3:.1f} us ({cub_ms / ms:.3f} of cuBLAS "
                  f"{cub_ms * 1e3:.1f}); profiler: {parts}", flush=True)
