"""Run every op benchmark in one process: a table of forward/backward effective bandwidth for
PyTorch eager, torch.compile and bertaccel, and the share of the measured copy ceiling. GPU times
come from CUDA-graph replays; `eager_fwd_us` is one eager call with its launch overhead.

    python -m benchmarks.bench_ops --out bench_results/ops.json [--ops layer_norm gelu] [--fp32]
"""

from __future__ import annotations

import argparse
import importlib

import torch
import torch._functorch.config

from benchmarks.plots import plot_file
from benchmarks.common import copy_bandwidth_gbs, environment, prime_backward_capture, print_table, write_json
from bertaccel.ops import build, registry

# one benchmarks/bench_<family>.py per op family of the registry, and the ops other ops call
OPS = registry.FAMILY_MODULES + ["bias_grad"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ops", nargs="+", default=OPS, choices=OPS)
    ap.add_argument("--fp32", action="store_true", help="also run float32")
    ap.add_argument("--out", default="bench_results/ops.json")
    args = ap.parse_args()
    # Backward is timed by re-running one graph (retain_graph=True), which compile's donated
    # buffers forbid; donation only saves memory, not time.
    torch._functorch.config.donated_buffer = False
    if not build.load():
        raise SystemExit(f"the CUDA ops are unavailable: {build.unavailable_reason()}")
    ceiling = copy_bandwidth_gbs()
    print(f"device-to-device copy ceiling: {ceiling:.0f} GB/s")
    print(f"priming backward capture: {'captured' if prime_backward_capture() else 'failed, as the first one does'}")
    rows = []
    dtypes = [torch.bfloat16] + ([torch.float32] if args.fp32 else [])
    for op in args.ops:
        mod = importlib.import_module(f"benchmarks.bench_{op}")
        for dt in dtypes:
            rows += mod.run(ceiling, dt)
    write_json(args.out, {"environment": environment(), "copy_ceiling_GBs": round(ceiling), "rows": rows})
    picture = plot_file(args.out)  # PNG next to the JSON (with matplotlib)
    if picture:
        print(f"picture: {picture}")
    print_table(rows, ["op", "shape", "impl", "eager_fwd_us", "fwd_us", "fwd_GB/s", "fwd_%copy", "bwd_us", "bwd_GB/s",
                       "bwd_%copy", "bwd_timing", "train_fwd_us", "train_fwd_%copy", "fwd_TFLOP/s", "path"])


if __name__ == "__main__":
    main()
