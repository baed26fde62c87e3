"""LayerNorm / RMSNorm / residual LayerNorm forward time at BERT shapes (bf16, fp32 weights, no grad; the residual
form's training forward too - y, the saved sum, mean and rstd, as a step with gradients runs it)
for one setting of the forward kernel, beside a clone of the same bytes. The linear bias of the residual form is
fp32, as the model's master bias is (a bf16 one is widened per call, a cast kernel the model does not run: until
session 73 this script passed one). Settings are environment
variables read once per process, so run once per setting:
  BERTACCEL_LN_RING=0  the one-row-per-thread-group kernel for every width (the ring off)
  BERTACCEL_LN_ROWS=2  two rows per thread group in that kernel (turns the ring off too)
  BERTACCEL_LN_RING_HALF_WARP=0|1  the ring gives every row a whole warp / the residual form half-warp rows at every
                       row count (by default a 384-wide bf16 row has half a warp, the residual form's from 4,096 rows)
  BERTACCEL_RING_ROWS_PER_WARP=R  the ring's grid sized for R rows a warp, more blocks than fit (0: persistent)
  (neither)            the default: the persistent ring kernel for rows up to 1024 wide
`for s in "" BERTACCEL_LN_RING=0; do env $s python scripts/ln_fwd_sweep.py; done`
`--dtype float32` times float32 rows (the same shapes; the share of copy counts their 4-byte elements).
`--weights input` gives the weights and biases the rows' dtype (bf16-true, as benchmarks/bench_ops.py times them) instead
of float32; `--compile` adds torch.compile's F.layer_norm and F.rms_norm at the same inputs (with `--weights input`
only: beside float32 weights PyTorch promotes bf16 rows and writes float32)."""
import argparse
import os

import torch

from benchmarks.common import compile_static, copy_bandwidth_gbs, graph_time_ms, rotations
from bertaccel.ops.layer_norm import layer_norm
from bertaccel.ops.residual_layer_norm import bias_dropout_add_layer_norm
from bertaccel.ops.rms_norm import rms_norm

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
ap.add_argument("--weights", default="float32", choices=["float32", "input"])
ap.add_argument("--compile", action="store_true")
args = ap.parse_args()
if args.compile and args.weights != "input":
    ap.error("--compile needs --weights input (F.layer_norm / F.rms_norm promote bf16 rows beside float32 weights)")
dtype = getattr(torch, args.dtype)
wdtype = torch.float32 if args.weights == "float32" else dtype
esize = torch.finfo(dtype).bits // 8
ceil = copy_bandwidth_gbs()
SWITCHES = ("BERTACCEL_LN_RING", "BERTACCEL_LN_ROWS", "BERTACCEL_LN_RING_HALF_WARP", "BERTACCEL_RING_ROWS_PER_WARP",
            "BERTACCEL_LN_RING_FAST")
setting = " ".join(f"{k}={os.environ[k]}" for k in SWITCHES if k in os.environ) or "default"
if dtype != torch.bfloat16:
    setting += f" {str(dtype)[6:]}"
if args.weights == "input":
    setting += " input-dtype weights"
if args.compile:
    import torch.nn.functional as F

    compiled_ln = compile_static(lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-12))
    compiled_rms = compile_static(lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6))
for n, h in [(2048, 384), (4096, 384), (8192, 384), (2048, 768), (16384, 384), (16384, 768), (16384, 1024)]:
    sets = [(torch.randn(n, h, device="cuda", dtype=dtype), torch.randn(h, device="cuda", dtype=wdtype),
             torch.randn(h, device="cuda", dtype=wdtype), torch.randn(h, device="cuda", dtype=wdtype),
             torch.randn(n, h, device="cuda", dtype=dtype))
            for _ in range(rotations(5 * n * h * esize // 2))]
    copy_us = graph_time_ms(lambda x, w, b, lb, r: x.clone(), sets) * 1e3
    with torch.no_grad():
        ln = graph_time_ms(lambda x, w, b, lb, r: layer_norm(x, w, b, 1e-12), sets) * 1e3
        rms = graph_time_ms(lambda x, w, b, lb, r: rms_norm(x, w, 1e-6), sets) * 1e3
        res = graph_time_ms(lambda x, w, b, lb, r: bias_dropout_add_layer_norm(x, lb, r, w, b, 0.0, 1e-12), sets) * 1e3
        drop = graph_time_ms(lambda x, w, b, lb, r: bias_dropout_add_layer_norm(x, lb, r, w, b, 0.1, 1e-12), sets) * 1e3
        # the training forward the model runs (y, the saved sum z, mean, rstd): what a step's residual LayerNorms cost
        train = graph_time_ms(lambda x, w, b, lb, r: torch.ops.bertaccel.layer_norm_fwd(x, lb, r, w, b, 0.0, 1e-12),
                              sets) * 1e3
        train_drop = graph_time_ms(lambda x, w, b, lb, r: torch.ops.bertaccel.layer_norm_fwd(x, lb, r, w, b, 0.1, 1e-12),
                                   sets) * 1e3
        if args.compile:
            c_ln = graph_time_ms(lambda x, w, b, lb, r: compiled_ln(x, w, b), sets) * 1e3
            c_rms = graph_time_ms(lambda x, w, b, lb, r: compiled_rms(x, w), sets) * 1e3
    pct = lambda us, k: 100 * k * n * h * esize / us / 1e3 / ceil  # noqa: E731 - k tensors of n x h
    print(f"SWEEP {setting} {n}x{h}: clone {copy_us:.1f}us ({pct(copy_us, 2):.0f}%) | LN {ln:.1f}us {pct(ln, 2):.0f}% | "
          f"RMS {rms:.1f}us {pct(rms, 2):.0f}% | resLN {res:.1f}us {pct(res, 3):.0f}% | resLN p=0.1 {drop:.1f}us {pct(drop, 3):.0f}%"
          f" | resLN train {train:.1f}us {pct(train, 4):.0f}% | train p=0.1 {train_drop:.1f}us {pct(train_drop, 4):.0f}%"
          + (f" | compile LN {c_ln:.1f}us {pct(c_ln, 2):.0f}% RMS {c_rms:.1f}us {pct(c_rms, 2):.0f}%" if args.compile else ""),
          flush=True)
