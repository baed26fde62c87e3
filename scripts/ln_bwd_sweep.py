"""LayerNorm-family backward time against the row count (bf16, fp32 weights), for one setting of the
backward kernels: where the time of a BERT-sized backward goes - a per-call fixed cost (launches,
the first loads, the block epilogue, the column sums) or the rows' bytes. Per op and width, the
backward is graph-timed at several row counts and a line time = fixed + bytes / rate is fitted to
the counts >= 8,192: `fixed_us` and `rate` (GB/s) say which part a change moved. The kernels of one
16384-row backward are listed with their GPU times (torch.profiler). Settings are environment
variables read once per process, so run once per setting:
`for s in "" BERTACCEL_LN_BWD_PREFETCH=0; do env $s python scripts/ln_bwd_sweep.py; done`"""
import argparse
import os

import torch

from benchmarks.common import copy_bandwidth_gbs, graph_time_ms, kernel_times_us
from bertaccel.ops.layer_norm import layer_norm
from bertaccel.ops.residual_layer_norm import bias_dropout_add_layer_norm
from bertaccel.ops.rms_norm import rms_norm

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--ops", nargs="+", default=["layer_norm", "rms_norm", "residual_layer_norm"])
ap.add_argument("--widths", nargs="+", type=int, default=[384, 768, 1024])
ap.add_argument("--rows", nargs="+", type=int, default=[2048, 8192, 16384, 32768, 65536])
args = ap.parse_args()
setting = " ".join(f"{k}={v}" for k, v in os.environ.items() if k.startswith("BERTACCEL_")) or "default"
ceil = copy_bandwidth_gbs()
print(f"copy ceiling {ceil:.0f} GB/s; setting: {setting}")
bf = dict(device="cuda", dtype=torch.bfloat16)


def backward_call(op: str, n: int, h: int):
    w, b = (torch.randn(h, device="cuda", requires_grad=True) for _ in range(2))
    x, r = (torch.randn(n, h, **bf, requires_grad=True) for _ in range(2))
    lb = torch.randn(h, **bf, requires_grad=True)
    y, leaves, tensors = {
        "layer_norm": lambda: (layer_norm(x, w, b, 1e-12), (x, w, b), 3),
        "rms_norm": lambda: (rms_norm(x, w, 1e-6), (x, w), 3),
        "residual_layer_norm": lambda: (bias_dropout_add_layer_norm(x, lb, r, w, b, 0.1, 1e-12), (x, r, lb, w, b), 4),
    }[op]()
    dy = torch.randn_like(y)
    # bytes: dy and the saved input read, dx written (+ dh for the residual form)
    return (lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True)), tensors * n * h * 2


for op in args.ops:
    for h in args.widths:
        points = []
        for n in args.rows:
            calls = [backward_call(op, n, h) for _ in range(2)]
            us = graph_time_ms(lambda c, _: c(), [(c, None) for c, _ in calls]) * 1e3
            nbytes = calls[0][1]
            points.append((n, nbytes, us))
            print(f"BWD {op} {n}x{h}: {us:.1f} us  {nbytes / us / 1e3:.0f} GB/s ({100 * nbytes / us / 1e3 / ceil:.0f}%)")
            if n == 16384:
                first = calls[0][0]
                per = kernel_times_us(lambda: [first() for _ in range(5)], 5)
                print("  kernels: " + "; ".join(f"{k[:60]} {v:.1f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1])))
            calls = first = None  # free before the next size
        fit = [(b, t) for n, b, t in points if n >= 8192]
        if len(fit) >= 2:
            mb = sum(b for b, _ in fit) / len(fit)
            mt = sum(t for _, t in fit) / len(fit)
            slope = sum((b - mb) * (t - mt) for b, t in fit) / sum((b - mb) ** 2 for b, _ in fit)
            fixed = mt - slope * mb
            print(f"FIT {setting} {op} x{h}: fixed {fixed:.1f} us, rate {1 / slope / 1e3:.0f} GB/s "
                  f"({100 / slope / 1e3 / ceil:.0f}% of copy)")
