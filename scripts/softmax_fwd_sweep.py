"""Attention softmax forward time, softmax(scores * scale + mask), at BERT shapes (no grad, HF's additive
[batch, 1, 1, keys] mask in the scores' dtype, a fifth of the keys masked), beside a clone of the same bytes: the
kernel alone, for comparing kernel versions in one process each (trees through scripts/ab_runs.sh, or a switch).
The share of copy counts the scores read and the probabilities written (the mask is a sliver).
`python scripts/softmax_fwd_sweep.py [--dtype float32] [--tag NAME]`"""
import argparse

import torch

from benchmarks.common import copy_bandwidth_gbs, graph_time_ms, rotations
from bertaccel.ops.softmax import softmax

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
ap.add_argument("--tag", default="default", help="names this run's rows (the tree or setting)")
args = ap.parse_args()
dtype = getattr(torch, args.dtype)
esize = torch.finfo(dtype).bits // 8
ceil = copy_bandwidth_gbs()
for b, h, s in [(16, 12, 128), (64, 12, 256), (32, 12, 512), (8, 12, 1024)]:
    n = b * h * s * s

    def make():
        keep = torch.rand(b, 1, 1, s, device="cuda") > 0.2
        mask = torch.zeros(b, 1, 1, s, device="cuda", dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)
        return torch.randn(b, h, s, s, device="cuda", dtype=dtype), mask

    sets = [make() for _ in range(rotations(n * esize))]
    copy_us = graph_time_ms(lambda x, m: x.clone(), sets) * 1e3
    with torch.no_grad():
        us = graph_time_ms(lambda x, m: softmax(x, m, 0.125), sets) * 1e3
    pct = lambda t: 100 * 2 * n * esize / t / 1e3 / ceil  # noqa: E731 - scores read, probabilities written
    print(f"SOFTMAX {args.tag} {str(dtype)[6:]} {b}x{h}x{s}x{s}: clone {copy_us:.1f}us ({pct(copy_us):.0f}%) | "
          f"softmax {us:.1f}us {pct(us):.0f}%", flush=True)
