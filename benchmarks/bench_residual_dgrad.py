"""Is the residual gradient's add worth folding into the input-gradient GEMM? (GPU host; cuBLAS, bf16.)

    python -m benchmarks.bench_residual_dgrad [--tokens 16384] [--hidden 768] [--out residual_dgrad.json]

In a BERT layer each block input x feeds a projection (Q/K/V: N = 3 x hidden; FFN1: N = 4 x hidden) and the
residual LayerNorm, so autograd adds two gradients for x: the projection's input gradient dY W and the
residual's d_res - an elementwise add over [tokens, hidden] after the GEMM (24 per BERT-base step). Folded into
the GEMM (C = d_res, beta 1: `torch.addmm(d_res, dY, W)`) the add's 3 passes over [tokens, hidden] become one
extra read in the GEMM's epilogue. Times, per shape, with CUDA events (median, input sets rotated past L2):
`mm + add` (what autograd runs today), `addmm` (folded), and `mm` alone (the floor); bytes and FLOPs printed.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import cuda_time_ms, environment, print_table, rotations, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_residual_dgrad needs a CUDA GPU")
    M, H, dt = args.tokens, args.hidden, torch.bfloat16
    rows = []
    for name, n in (("qkv", 3 * H), ("ffn1", 4 * H)):
        per_set = (M * n + n * H + 2 * M * H) * 2
        sets = [(torch.randn(M, n, device="cuda", dtype=dt), torch.randn(n, H, device="cuda", dtype=dt),
                 torch.randn(M, H, device="cuda", dtype=dt)) for _ in range(rotations(per_set))]
        dy, w, res = sets[0]
        ref = (dy.double() @ w.double()) + res.double()
        err_split = ((dy @ w) + res).double().sub(ref).abs().max().item()
        err_fold = torch.addmm(res, dy, w).double().sub(ref).abs().max().item()
        times = {
            "mm + add": cuda_time_ms(lambda a, b, c: torch.mm(a, b).add_(c), sets),
            "addmm": cuda_time_ms(lambda a, b, c: torch.addmm(c, a, b), sets),
            "mm": cuda_time_ms(lambda a, b, c: torch.mm(a, b), sets),
        }
        flops = 2 * M * n * H
        for variant, ms in times.items():
            rows.append({"gemm": f"{name} dgrad {M}x{H}x{n}", "variant": variant, "ms": round(ms, 4),
                         "TFLOP/s": round(flops / ms / 1e9, 1), "max err vs fp64": {"addmm": err_fold, "mm + add": err_split}.get(variant, "")})
    print_table(rows, ["gemm", "variant", "ms", "TFLOP/s", "max err vs fp64"])
    if args.out:
        write_json(args.out, {"environment": environment(), "rows": rows})


if __name__ == "__main__":
    main()
