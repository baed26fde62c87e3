"""What BERTACCEL_GEMM_TUNE=1 does at BERT's GEMMs: per problem, the cost model's candidates (within 15% of
its best estimate), their estimates and measured times, and the kept pick beside the model's.

    BERTACCEL_GEMM_TUNE=verbose python scripts/gemm_tune_report.py [--shapes 2048x768x768 ...]

The measured times come from the tuner itself (CUDA events around three eager runs after a warm-up), on
stderr; this script prints one line per problem with the model's pick and the kept one (stdout).
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks.bench_gemm import SHAPES, config_label, parse_shape


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", type=parse_shape, default=SHAPES)
    args = ap.parse_args()
    os.environ.setdefault("BERTACCEL_GEMM_TUNE", "verbose")
    from bertaccel.ops import build

    assert build.load_gemm(), build.gemm_reason()
    from bertaccel.ops import gemm

    config = torch.ops.bertaccel.gemm_config
    for m, n, k in args.shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        for name, (a, b, ta, tb) in {"fwd": (x, w, False, False), "dgrad": (dy, w, False, True),
                                     "wgrad": (dy, x, True, True)}.items():
            tune = os.environ.pop("BERTACCEL_GEMM_TUNE")
            model = config(a, b, 0, ta, tb, False, False)
            os.environ["BERTACCEL_GEMM_TUNE"] = tune
            gemm.gemm_case(name)(a, b)
            torch.cuda.synchronize()
            kept = config(a, b, 0, ta, tb, False, False)
            print(f"PICK {m}x{n}x{k} {name:5s} model {config_label(model):24s} kept {config_label(kept):24s}"
                  f" {'(changed)' if list(model[:5]) != list(kept[:5]) else ''}", flush=True)


if __name__ == "__main__":
    main()
