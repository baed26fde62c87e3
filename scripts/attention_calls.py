"""Run the varlen attention forward (or forward + backward) on one cell a few times: a target for
Nsight Compute (`ncu --kernel-name regex:attn_ ... python scripts/attention_calls.py --cell 32x512x12x64`).

BERTACCEL_ATTENTION_FWD picks the forward kernel as in the op (mma / wg1 / wg2)."""

from __future__ import annotations

import argparse

import torch

from bertaccel.ops import attention, build


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cell", default="32x512x12x64", help="batch x seq x heads x head_dim, every row full")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--backward", action="store_true")
    args = ap.parse_args()
    batch, seq, heads, d = (int(x) for x in args.cell.split("x"))
    assert build.load_attention(), build.attention_reason()
    T = batch * seq
    cu = torch.arange(0, T + 1, seq, device="cuda", dtype=torch.int32)
    q, k, v = (torch.randn(T, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=args.backward) for _ in range(3))
    for _ in range(args.calls):
        out = attention.varlen_attention(q, k, v, cu, seq, 0.0, d ** -0.5)
        if args.backward:
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    torch.cuda.synchronize()
    print(f"{args.calls} calls on {args.cell}")


if __name__ == "__main__":
    main()
