"""Why the first backward capture of a bench_ops process fails ("operation failed due to a previous error during
capture", PyTorch's LayerNorm backward at 2048x384, both attempts; later shapes capture): capture PyTorch's LayerNorm
backward as benchmarks.common.measure_op does, three times, after a chosen amount of the benchmark's set-up, and in
both capture error modes; prints each attempt's outcome and the first error's text.

    python scripts/capture_probe.py --setup none|build|build+ceiling [--mode global|thread_local]
"""
import argparse

import torch
import torch.nn.functional as F

from benchmarks.common import graph_time_ms

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--setup", default="none", choices=["none", "build", "build+ceiling"])
ap.add_argument("--mode", default="global", choices=["global", "thread_local", "relaxed"])
args = ap.parse_args()
if args.setup != "none":
    from bertaccel.ops import build

    assert build.load(), build.unavailable_reason()
if args.setup == "build+ceiling":
    from benchmarks.common import copy_bandwidth_gbs

    copy_bandwidth_gbs()


def attempt(H: int) -> str:
    # as bench_layer_norm: fp32 weights (unused by PyTorch's call) and their bf16 copies, all five leaves; captured and
    # replayed by graph_time_ms as the benchmark does (three warm-up calls on a side stream, then four captured)
    x = torch.randn(2048, H, device="cuda", dtype=torch.bfloat16)
    w, b = torch.randn(H, device="cuda"), torch.randn(H, device="cuda")
    leaves = [t.detach().requires_grad_(True) for t in (x, w, b, w.bfloat16(), b.bfloat16())]
    y = F.layer_norm(leaves[0], (H,), leaves[3], leaves[4], 1e-12)
    dy = torch.randn_like(y)
    try:
        graph_time_ms(lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True, allow_unused=True), [()], calls=4,
                      replays=1, capture_error_mode=args.mode)
        return "captured"
    except Exception as e:  # noqa: BLE001 - the outcome is what is printed (graph_time_ms has recovered the generator)
        return f"failed: {type(e).__name__}: {' | '.join(str(e).splitlines()[:3])[:300]}"


for H in (384, 384, 384, 768):
    print(f"setup {args.setup}, mode {args.mode}, 2048x{H}: {attempt(H)}", flush=True)
