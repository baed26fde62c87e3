"""What an epilogue costs on each configuration of our GEMM: every schedule and tile width (one K split: the
GELU epilogues do not split K) timed with no epilogue and with each epilogue, in turn, at the feed-forward
block's shapes (and two K = 3072 shapes, where the model's ping-pong term was off). The cost model's
epilogue terms (csrc/gemm.cu, estimate_us) are fitted to these rows.

    python scripts/gemm_epilogue_sweep.py --out bench_results/gemm_epilogue_sweep.json

Epilogues: none / bias (forward layout), gelu (bias + erf GELU), gelu-pre (that, also writing the
pre-activation), dgelu (the dgrad layout times gelu'(saved pre-activation), as the FFN's backward runs it),
wgrad / wgrad-f32 (the weight gradient dy^T x with a bf16 or an fp32 output: GemmLinear writes fp32 weights'
gradients in fp32).
Each row: shape, epilogue, schedule (1 cooperative, 2 ping-pong, 4 cooperative 192-row), tile width, ms, and
whether it is the cost model's pick for that call.
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.bench_gemm import config_label, interleaved_ms, parse_shape
from benchmarks.common import environment, write_json

# name: (epilogue id, layout, fp32 output, save pre); layouts as benchmarks/bench_gemm.py's cases
EPILOGUES = {"none": (0, "fwd", False, False), "bias": (1, "fwd", False, False), "gelu": (2, "fwd", False, False),
             "gelu-pre": (2, "fwd", False, True), "dgelu": (5, "dgrad", False, False),
             "wgrad": (0, "wgrad", False, False), "wgrad-f32": (0, "wgrad", True, False)}
LAYOUTS = {"fwd": (False, False), "dgrad": (False, True), "wgrad": (True, True)}
CONFIGS = [(1, 96), (1, 128), (1, 192), (1, 256), (2, 64), (2, 128), (4, 64), (4, 128), (4, 192)]


def sweep(shapes, epilogues, rounds: int, splits=(1,)) -> list[dict]:
    from bertaccel.ops import build

    assert build.load_gemm(), build.gemm_reason()
    GEMM = torch.ops.bertaccel.gemm.default
    rows = []
    for m, n, k in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
        w_dgrad = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) * k**-0.5  # dgrad: x[m, k] @ W[k, n]
        bias = torch.randn(n, device="cuda", dtype=torch.float32)
        pre = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        operands = {"fwd": (x, w), "dgrad": (x, w_dgrad), "wgrad": (dy, x)}  # wgrad: dy^T x, [n, k]
        for schedule, tile in CONFIGS:
            for s in splits:
                fns, labels = [], []
                for name in epilogues:
                    e, layout, f32, save_pre = EPILOGUES[name]
                    ta, tb = LAYOUTS[layout]
                    if (tb and tile == 96) or (s > 1 and e not in (0, 1)):
                        continue  # 96-wide tiles take a K-major B only; K splits: no / bias epilogues only

                    def f(a, b, e=e, ta=ta, tb=tb, f32=f32, save_pre=save_pre):
                        return GEMM(a, b, bias if 1 <= e <= 4 else None, pre if e >= 4 else None, e, ta, tb, f32,
                                    save_pre, tile, s, schedule)[0]
                    fns.append((f, operands[layout]))
                    labels.append(name)
                if not fns:
                    continue
                times = [interleaved_ms([f], args, "cuda", rounds)[0] for f, args in fns]
                for name, ms, (f, args) in zip(labels, times, fns):
                    e, layout, f32, save_pre = EPILOGUES[name]
                    ta, tb = LAYOUTS[layout]
                    pick = config_label(torch.ops.bertaccel.gemm_config(args[0], args[1], e, ta, tb, f32, save_pre))
                    label = config_label([128 if schedule != 4 else 192, tile, s, schedule, 0, 0])
                    row = {"shape": f"{m}x{n}x{k}", "epilogue": name, "schedule": schedule, "tile": tile, "splits": s,
                           "config": label, "ms": round(ms, 4), "TFLOP/s": round(2 * m * n * k / ms / 1e9, 1),
                           "model_pick": pick == label}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", type=parse_shape,
                    default=[(2048, 3072, 768), (4096, 3072, 768), (16384, 3072, 768), (2048, 1536, 384),
                             (16384, 1536, 384), (16384, 3072, 3072), (16384, 768, 3072), (16384, 2304, 3072)])
    ap.add_argument("--epilogues", nargs="+", default=list(EPILOGUES), choices=list(EPILOGUES))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--splits", nargs="+", type=int, default=[1], help="K splits to time (none / bias epilogues)")
    ap.add_argument("--out", default="bench_results/gemm_epilogue_sweep.json")
    args = ap.parse_args(argv)
    rows = sweep(args.shapes, args.epilogues, args.rounds, args.splits)
    write_json(args.out, {"environment": environment(), "rows": rows})
    by = {}
    for r in rows:
        by.setdefault((r["shape"], r["epilogue"]), []).append(r)
    print("EPI shape            epilogue  best config      best ms   model's pick ms")
    for (shape, epi), rs in by.items():
        best = min(rs, key=lambda r: r["ms"])
        pick = next((r for r in rs if r["model_pick"]), None)
        print(f"EPI {shape:16s} {epi:9s} {best['config']:16s} {best['ms']:8.4f}  "
              f"{(pick['config'] + ' ' + str(pick['ms'])) if pick else '-'}")


if __name__ == "__main__":
    main()
