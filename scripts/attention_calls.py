"""Run the varlen attention forward (or forward + backward) on one cell a few times: a target for
Nsight Compute (`ncu --kernel-name regex:attn_ ... python scripts/attention_calls.py --cell 32x512x12x64`;
`--impl cudnn` runs SDPA's cuDNN backend on the same batch instead, for `--kernel-name regex:bprop`).
With `--kernels`: each kernel's GPU time per call (torch.profiler, after warm-up), ours beside cuDNN's
SDPA on the same full batch, one `KERNELS` line per (implementation, kernel) - which launches a
forward + backward is made of (e.g. the backward's main kernel against its dsum and dq-cast passes).

BERTACCEL_ATTENTION_FWD / _BWD pick the kernels as in the op (mma / wg1 / wg2; mma / bulk). `--dropout P`: both
implementations with attention dropout (training, as a fine-tune runs them)."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.common import kernel_times_us
from bertaccel.ops import attention, build


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cell", nargs="+", default=["32x512x12x64"], help="batch x seq x heads x head_dim, every row full")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--kernels", action="store_true", help="print each kernel's time per call (implies --backward)")
    ap.add_argument("--dropout", type=float, default=0.0, help="attention dropout probability (both implementations)")
    ap.add_argument("--impl", choices=["ours", "cudnn"], default="ours",
                    help="whose attention the plain calls run (cudnn: SDPA's cuDNN backend on the same batch, "
                         "e.g. for `ncu --kernel-name regex:bprop`)")
    args = ap.parse_args()
    assert build.load_attention(), build.attention_reason()
    for cell in args.cell:
        batch, seq, heads, d = (int(x) for x in cell.split("x"))
        T = batch * seq
        backward = args.backward or args.kernels
        cu = torch.arange(0, T + 1, seq, device="cuda", dtype=torch.int32)
        q, k, v = (torch.randn(T, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=backward) for _ in range(3))
        do = torch.randn_like(q)

        def ours():
            out = attention.varlen_attention(q, k, v, cu, seq, args.dropout, d ** -0.5)
            if backward:
                torch.autograd.grad(out, (q, k, v), do)

        qp, kp, vp = (t.detach().view(batch, seq, heads, d).transpose(1, 2).requires_grad_(backward) for t in (q, k, v))
        dop = do.view(batch, seq, heads, d).transpose(1, 2)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out = F.scaled_dot_product_attention(qp, kp, vp, dropout_p=args.dropout)
            if backward:
                torch.autograd.grad(out, (qp, kp, vp), dop)

        if not args.kernels:
            for _ in range(args.calls):
                (ours if args.impl == "ours" else cudnn)()
            torch.cuda.synchronize()
            print(f"{args.calls} calls on {cell} ({args.impl})")
            continue

        for name, fn in (("ours", ours), ("sdpa-cudnn", cudnn)):
            for _ in range(3):
                fn()
            per = kernel_times_us(lambda fn=fn: [fn() for _ in range(args.calls)], args.calls)
            for kname, us in sorted(per.items(), key=lambda kv: -kv[1]):
                print(f"KERNELS {cell} {name:10s} {us:8.1f} us  {kname[:110]}")
            print(f"KERNELS {cell} {name:10s} {sum(per.values()):8.1f} us  (sum)")


if __name__ == "__main__":
    main()
