"""LayerNorm-family backward time against the row count (bf16, fp32 weights), for one setting of the
backward kernels: where the time of a BERT-sized backward goes - a per-call fixed cost (launches,
the first loads, the block epilogue, the column sums) or the rows' bytes. Per op and width, the
backward is graph-timed at several row counts and a line time = fixed + bytes / rate is fitted to
the counts >= 8,192: `fixed_us` and `rate` (GB/s) say which part a change moved. The kernels of one
16384-row backward are listed with their GPU times (torch.profiler). Settings are environment
variables read once per process, so run once per setting:
`for s in "" BERTACCEL_LN_BWD_PREFETCH=0; do env $s python scripts/ln_bwd_sweep.py; done > sweep.log`, then
`python scripts/sweep_table.py sweep.log` for one table with a column per setting."""
import argparse
import os

import torch

from benchmarks.common import copy_bandwidth_gbs, graph_time_ms, kernel_times_us
from bertaccel.ops import build, embeddings, layer_norm, rms_norm  # noqa: F401 - the modules define the ops

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--ops", nargs="+", default=["layer_norm", "rms_norm", "residual_layer_norm"],
                choices=["layer_norm", "rms_norm", "residual_layer_norm", "residual_layer_norm2", "embeddings"],
                help="residual_layer_norm2: the fused residual form with the output's gradient in two parts (dy + dy2, "
                     "layer_norm_bwd2), as BERT's blocks run it")
ap.add_argument("--widths", nargs="+", type=int, default=[384, 768, 1024])
ap.add_argument("--rows", nargs="+", type=int, default=[2048, 8192, 16384, 32768, 65536])
ap.add_argument("--p", type=float, default=0.1, help="dropout of the residual and embeddings forms (their backward "
                "regenerates the mask); a value other than 0.1 is named in the setting")
ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
               help="the activations' dtype (the weights float32 either way); float32 is named in the setting")
args = ap.parse_args()
if not build.load():
    raise SystemExit(f"the CUDA ops are unavailable: {build.unavailable_reason()}")
setting = " ".join([f"{k}={v}" for k, v in os.environ.items() if k.startswith("BERTACCEL_") and k not in ("BERTACCEL_CACHE", "BERTACCEL_COMMIT")]
                   + ([f"p={args.p}"] if args.p != 0.1 else [])
                   + ([args.dtype] if args.dtype != "bfloat16" else [])) or "default"
ceil = copy_bandwidth_gbs()
print(f"copy ceiling {ceil:.0f} GB/s; setting: {setting}")
bf = dict(device="cuda", dtype=getattr(torch, args.dtype))  # the activations (named for the usual bf16)
S = bf["dtype"].itemsize  # bytes an element


def backward_call(op: str, n: int, h: int):
    """The op's backward custom op on saved tensors from its forward (no autograd engine: only the
    backward's own kernels), and the bytes it must move."""
    ops = torch.ops.bertaccel
    w, b = torch.randn(h, device="cuda"), torch.randn(h, device="cuda")
    x, r, dy = (torch.randn(n, h, **bf) for _ in range(3))
    lb = torch.randn(h, **bf)
    if op == "rms_norm":
        _, rstd = ops.rms_norm_fwd(x, w, 1e-6)
        return (lambda: ops.rms_norm_bwd(dy, x, w, rstd)), 3 * n * h * S
    if op == "embeddings":  # the LayerNorm part of the embeddings' backward (dropout --p; the tables' scatter not timed)
        seq = min(n, 512)
        ids = torch.randint(0, 30522, (n // seq, seq), device="cuda")
        pos = torch.arange(seq, device="cuda").expand(n // seq, seq).contiguous()
        tables = [torch.randn(rows, h, device="cuda") for rows in (30522, 512, 2)]
        _, z, mean, rstd, rng = ops.embedding_layer_norm_fwd(ids, pos, torch.zeros_like(ids), *tables, w, b, args.p, 1e-12,
                                                             True, 0)
        dy = dy.view(z.shape)
        return (lambda: ops.embedding_layer_norm_bwd(dy, z, w, mean, rstd, rng, args.p)), 3 * n * h * S
    fused = op.startswith("residual_layer_norm")
    p = args.p if fused else 0.0
    _, z, mean, rstd, rng = ops.layer_norm_fwd(x, lb if fused else None, r if fused else None, w, b, p, 1e-12)
    z = z if z.numel() else x  # the plain form saves its input
    if op == "residual_layer_norm2":  # dy2 read too
        dy2 = torch.randn(n, h, **bf)
        return (lambda: ops.layer_norm_bwd2(dy, dy2, z, w, mean, rstd, rng, p)), 5 * n * h * S
    # bytes: dy and the saved input read, dx written (+ dh for the residual form)
    return (lambda: ops.layer_norm_bwd(dy, z, w, mean, rstd, rng, p, fused)), (4 if fused else 3) * n * h * S


for op in args.ops:
    for h in args.widths:
        points = []
        for n in args.rows:
            calls = [backward_call(op, n, h) for _ in range(2)]
            us = graph_time_ms(lambda c, _: c(), [(c, None) for c, _ in calls]) * 1e3
            nbytes = calls[0][1]
            points.append((n, nbytes, us))
            print(f"BWD {op} {n}x{h}: {us:.1f} us  {nbytes / us / 1e3:.0f} GB/s ({100 * nbytes / us / 1e3 / ceil:.0f}%)")
            if n == 16384:
                first = calls[0][0]
                per = kernel_times_us(lambda: [first() for _ in range(5)], 5)
                print("  kernels: " + "; ".join(f"{k[:60]} {v:.1f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1])))
            calls = first = None  # free before the next size
        fit = [(b, t) for n, b, t in points if n >= 8192]
        if len(fit) >= 2:
            mb = sum(b for b, _ in fit) / len(fit)
            mt = sum(t for _, t in fit) / len(fit)
            slope = sum((b - mb) * (t - mt) for b, t in fit) / sum((b - mb) ** 2 for b, _ in fit)
            fixed = mt - slope * mb
            print(f"FIT {setting} {op} x{h}: fixed {fixed:.1f} us, rate {1 / slope / 1e3:.0f} GB/s "
                  f"({100 / slope / 1e3 / ceil:.0f}% of copy)")
