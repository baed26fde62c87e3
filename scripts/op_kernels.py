"""Per-kernel GPU time of each memory-bound op's forward and backward at one BERT shape (bf16, fp32
norm weights): which launches an op's time is made of (e.g. a backward's main kernel against its
column-sum kernel), from torch.profiler over CUDA-graph-free eager calls after warm-up. Prints one
`KERNELS` line per (op, pass) with each kernel's mean time per call, and the sum.
`python scripts/op_kernels.py [--rows 16384] [--hidden 768]`"""
import argparse
from collections import defaultdict

import torch

from benchmarks.common import kernel_times_us
from bertaccel.ops.gelu import bias_gelu
from bertaccel.ops.layer_norm import layer_norm
from bertaccel.ops.residual_layer_norm import bias_dropout_add_layer_norm
from bertaccel.ops.rms_norm import rms_norm

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--rows", type=int, default=16384)
ap.add_argument("--hidden", type=int, default=768)
ap.add_argument("--calls", type=int, default=20)
args = ap.parse_args()
n, h = args.rows, args.hidden
bf = dict(device="cuda", dtype=torch.bfloat16)
w, b = (torch.randn(h, device="cuda", requires_grad=True) for _ in range(2))
ops = {
    "layer_norm": lambda x, r, lb: layer_norm(x, w, b, 1e-12),
    "rms_norm": lambda x, r, lb: rms_norm(x, w, 1e-6),
    "residual_layer_norm p=0.1": lambda x, r, lb: bias_dropout_add_layer_norm(x, lb, r, w, b, 0.1, 1e-12),
    "bias_gelu (x4 wide)": None,
}
for name, fn in ops.items():
    wide = fn is None
    cols = 4 * h if wide else h
    x = torch.randn(n, cols, **bf, requires_grad=True)
    r = torch.randn(n, cols, **bf, requires_grad=True)
    lb = torch.randn(cols, device="cuda", requires_grad=True)  # the fp32 master linear bias, as the swap passes it
    call = (lambda: bias_gelu(x, lb)) if wide else (lambda: fn(x, r, lb))
    dy = torch.randn(n, cols, **bf)
    leaves = {"layer_norm": (x, w, b), "rms_norm": (x, w)}.get(name, (x, lb) if wide else (x, r, lb, w, b))
    for _ in range(3):
        torch.autograd.grad(call(), leaves, dy)
    torch.cuda.synchronize()
    for phase in ("fwd", "bwd"):
        outs = [call() for _ in range(args.calls)] if phase == "bwd" else None

        def work():
            for i in range(args.calls):
                if phase == "fwd":
                    with torch.no_grad():
                        call()
                else:
                    torch.autograd.grad(outs[i], leaves, dy)

        per = defaultdict(float)
        for kernel, us in kernel_times_us(work, args.calls).items():
            per[kernel[:60]] += us
        total = sum(per.values())
        parts = " | ".join(f"{k} {v:.1f}us" for k, v in sorted(per.items(), key=lambda kv: -kv[1]))
        print(f"KERNELS {name} {phase} {n}x{cols}: total {total:.1f}us = {parts}")
