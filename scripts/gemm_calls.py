"""GEMM calls for Nsight Compute: our GEMM and/or cuBLAS (torch.matmul) at chosen BERT shapes, each warmed
up first and then called inside cudaProfilerStart/Stop, so `ncu --profile-from-start off` sees only the
measured calls.
`ncu --profile-from-start off --section SpeedOfLight ... python scripts/gemm_calls.py --shapes 2048x768x768
--gemms fwd --impls ours cublas`"""
import argparse

import torch

from benchmarks.bench_gemm import parse_shape
import bertaccel.ops.gemm  # noqa: F401 - defines torch.ops.bertaccel.gemm
from bertaccel.ops import build

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--shapes", nargs="+", type=parse_shape, default=[(2048, 768, 768)])
ap.add_argument("--gemms", nargs="+", default=["fwd"], choices=["fwd", "dgrad", "wgrad"])
ap.add_argument("--impls", nargs="+", default=["ours", "cublas"], choices=["ours", "cublas"])
ap.add_argument("--schedule", type=int, default=0, help="our schedule (0: the model picks)")
ap.add_argument("--calls", type=int, default=1)
ap.add_argument("--epilogue", default="none", choices=["none", "bias", "gelu", "gelu-pre"],
                help="ours, fwd only: bias, bias + erf GELU, or that saving the pre-activation (cuBLAS: F.linear + F.gelu)")
args = ap.parse_args()
if "ours" in args.impls:
    assert build.load() and build.load_gemm(), build.gemm_reason()
GEMM = torch.ops.bertaccel.gemm.default if "ours" in args.impls else None
LAYOUT = {"fwd": (False, False), "dgrad": (False, True), "wgrad": (True, True)}
CUBLAS = {"fwd": lambda x, w: x @ w.t(), "dgrad": lambda dy, w: dy @ w, "wgrad": lambda dy, x: dy.t() @ x}
for m, n, k in args.shapes:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.float32) if args.epilogue != "none" else None
    bias_bf16 = bias.to(torch.bfloat16) if bias is not None else None  # cuBLAS's, as autocast hands it (cast outside the calls)
    epi = {"none": 0, "bias": 1, "gelu": 2, "gelu-pre": 2}[args.epilogue]
    operands = {"fwd": (x, w), "dgrad": (dy, w), "wgrad": (dy, x)}
    for g in args.gemms:
        a, b = operands[g]
        ta, tb = LAYOUT[g]
        for impl in args.impls:
            if impl == "ours":
                def call(a=a, b=b, ta=ta, tb=tb):
                    e = epi if g == "fwd" else 0
                    return GEMM(a, b, bias if e else None, None, e, ta, tb, False, args.epilogue == "gelu-pre" and e == 2,
                                0, 0, args.schedule)[0]
            elif g == "fwd" and args.epilogue != "none":
                def call(a=a, b=b):
                    y = torch.nn.functional.linear(a, b, bias_bf16)
                    return torch.nn.functional.gelu(y) if args.epilogue.startswith("gelu") else y
            else:
                def call(a=a, b=b, g=g):
                    return CUBLAS[g](a, b)
            for _ in range(3):
                call()
            torch.cuda.synchronize()
            print(f"CALLS {m}x{n}x{k} {g} {impl} epilogue={args.epilogue if g == 'fwd' else 'none'}", flush=True)
            torch.cuda.cudart().cudaProfilerStart()
            for _ in range(args.calls):
                call()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
