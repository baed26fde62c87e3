"""Where do clusters of two blocks go? For a few BERT GEMMs: the grid each launch really had (from the
profiler's kernel records), and the time of the model's tile in single blocks and in clusters of two
with the clusters capped at several counts (BERTACCEL_GEMM_MAX_CLUSTERS).

    python scripts/gemm_cluster_probe.py [--shapes 16384x3072x3072 2048x768x768] [--caps 0 66 64 60 33]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
from benchmarks.bench_gemm import parse_shape  # noqa: E402


def graph_ms(fn, reps: int = 20) -> float:
    fn()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) / reps)
    return statistics.median(times)


def kernel_grids(fn) -> list[tuple[object, float]]:
    """(grid, cluster dims if recorded, us) of each gemm_kernel launch of fn, from the profiler's trace."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    out = []
    for ev in trace.get("traceEvents", []):
        if ev.get("cat") == "kernel" and "gemm_kernel" in ev.get("name", ""):
            a = ev.get("args", {})
            out.append((a.get("grid"), a.get("cluster", a.get("cluster size")), round(ev.get("dur", 0), 1)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", type=parse_shape, default=[(16384, 3072, 3072), (2048, 768, 768)])
    ap.add_argument("--caps", nargs="+", type=int, default=[0, 66, 64, 62, 60, 48, 33])
    args = ap.parse_args()
    from bertaccel.ops import build

    assert build.load_gemm(), build.gemm_reason()
    GEMM = torch.ops.bertaccel.gemm.default
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}: {props.multi_processor_count} SMs")
    for m, n, k in args.shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        cfg = torch.ops.bertaccel.gemm_config(x, w, 0, False, False, False, False)
        tile, splits, schedule = cfg[1], cfg[2], cfg[3]

        def call():
            return GEMM(x, w, None, None, 0, False, False, False, False, tile, splits, schedule)[0]

        flops = 2 * m * n * k
        cub = graph_ms(lambda: x @ w.t())
        print(f"{m}x{n}x{k} fwd, tile n{tile} s{splits} schedule {schedule}: cuBLAS {cub * 1e3:.1f} us ({flops / cub / 1e9:.0f} TFLOP/s)")
        for cluster, cap in [(1, 0)] + [(2, c) for c in args.caps]:
            os.environ["BERTACCEL_GEMM_CLUSTER"] = str(cluster)
            if cap:
                os.environ["BERTACCEL_GEMM_MAX_CLUSTERS"] = str(cap)
            else:
                os.environ.pop("BERTACCEL_GEMM_MAX_CLUSTERS", None)
            ms = graph_ms(call)
            print(f"  cluster {cluster} cap {cap or '-':>3}: {ms * 1e3:7.1f} us ({flops / ms / 1e9:4.0f} TFLOP/s)"
                  f"  profiled: {kernel_grids(call)}", flush=True)
        os.environ.pop("BERTACCEL_GEMM_CLUSTER", None)
        os.environ.pop("BERTACCEL_GEMM_MAX_CLUSTERS", None)


if __name__ == "__main__":
    main()
