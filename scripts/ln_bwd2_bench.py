"""The residual LayerNorm backward with its output's gradient in two parts (BERTACCEL_RESIDUAL_FANOUT): autograd's
add then `layer_norm_bwd` against `layer_norm_bwd2` (the sum taken as the kernel loads the rows), bf16, fp32
weights, dropout 0.1, at BERT's row counts and widths; GPU time per call from CUDA-graph replays, rotating through
enough input sets to miss L2, beside a clone of the same bytes. Prints one line per shape:
  python scripts/ln_bwd2_bench.py [--rows 16384 2048] [--hidden 384 768]"""
from __future__ import annotations

import argparse

import torch

import bertaccel.ops.layer_norm  # noqa: F401 - the ops' schemas
from benchmarks.common import copy_bandwidth_gbs, graph_time_ms, rotations
from bertaccel.ops import build


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, nargs="+", default=[16384, 2048])
    ap.add_argument("--hidden", type=int, nargs="+", default=[384, 768])
    ap.add_argument("--p", type=float, default=0.1)
    args = ap.parse_args()
    assert build.load(), build.unavailable_reason()
    ceil = copy_bandwidth_gbs()
    bwd, bwd2 = torch.ops.bertaccel.layer_norm_bwd.default, torch.ops.bertaccel.layer_norm_bwd2.default
    for n in args.rows:
        for h in args.hidden:
            def one_set():
                x, res = (torch.randn(n, h, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                bias = torch.randn(h, device="cuda", dtype=torch.bfloat16)
                w, b = torch.randn(h, device="cuda"), torch.randn(h, device="cuda")
                _, z, mean, rstd, rng = torch.ops.bertaccel.layer_norm_fwd(x, bias, res, w, b, args.p, 1e-12)
                dy, dy2 = (torch.randn(n, h, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                return dy, dy2, z, w, mean, rstd, rng

            sets = [one_set() for _ in range(rotations(6 * n * h * 2))]
            add_then = graph_time_ms(lambda dy, dy2, z, w, m, r, g: bwd(dy + dy2, z, w, m, r, g, args.p, True), sets) * 1e3
            summed = graph_time_ms(lambda dy, dy2, z, w, m, r, g: bwd2(dy, dy2, z, w, m, r, g, args.p), sets) * 1e3
            one = graph_time_ms(lambda dy, dy2, z, w, m, r, g: bwd(dy, z, w, m, r, g, args.p, True), sets) * 1e3
            clone = graph_time_ms(lambda dy, *_: dy.clone(), sets) * 1e3
            nbytes = 5 * n * h * 2  # bwd2 reads dy, dy2, z and writes dz, dh (bf16)
            pct = 100 * nbytes / summed / 1e3 / ceil  # bytes per us = MB/s; / 1e3 -> GB/s
            print(f"LN_BWD2 {n}x{h} p={args.p}: add + bwd {add_then:.1f} us | bwd2 {summed:.1f} us ({pct:.0f}% of copy) "
                  f"| bwd alone {one:.1f} us | clone {clone:.1f} us")


if __name__ == "__main__":
    main()
