"""One forward and one backward call of each LayerNorm-family op at the given shapes, after warm-up,
inside cudaProfilerStart/Stop: the driver for reading the kernels' hardware counters with Nsight
Compute (gpu_check stage `ncu_rows`):
`ncu --profile-from-start off --clock-control none --section SpeedOfLight ... python scripts/row_op_calls.py`
`--ops layer_norm residual_layer_norm rms_norm --shapes 16384x384 16384x768` (bf16, fp32 weights and linear bias)."""
import argparse

import torch

from bertaccel.ops.layer_norm import layer_norm
from bertaccel.ops.residual_layer_norm import bias_dropout_add_layer_norm
from bertaccel.ops.rms_norm import rms_norm

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--ops", nargs="+", default=["layer_norm"], choices=["layer_norm", "residual_layer_norm", "rms_norm"])
ap.add_argument("--shapes", nargs="+", default=["16384x384", "16384x768", "16384x1024"])
ap.add_argument("--p", type=float, default=0.1, help="dropout of the residual form")
args = ap.parse_args()
bf = dict(device="cuda", dtype=torch.bfloat16)
for shape in args.shapes:
    n, h = (int(v) for v in shape.split("x"))
    w, b = (torch.randn(h, device="cuda", requires_grad=True) for _ in range(2))
    x, r = (torch.randn(n, h, **bf, requires_grad=True) for _ in range(2))
    lb = torch.randn(h, device="cuda", requires_grad=True)  # the fp32 master linear bias, as the swap passes it
    dy = torch.randn(n, h, **bf)
    for op in args.ops:
        call, leaves = {
            "layer_norm": (lambda: layer_norm(x, w, b, 1e-12), (x, w, b)),
            "rms_norm": (lambda: rms_norm(x, w, 1e-6), (x, w)),
            "residual_layer_norm": (lambda: bias_dropout_add_layer_norm(x, lb, r, w, b, args.p, 1e-12), (x, r, lb, w, b)),
        }[op]
        for _ in range(3):
            torch.autograd.grad(call(), leaves, dy)
        out = call()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        with torch.no_grad():
            call()
        torch.autograd.grad(out, leaves, dy)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print(f"CALLS {op} {shape}: forward, backward", flush=True)
