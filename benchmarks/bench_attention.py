"""Attention forward + backward on padded batches: SDPA's backends with the key-padding mask against
the varlen kernels on the packed real tokens (what `model.unpadded` runs): ours (bertaccel,
csrc/attention.cu; on a Hopper its warpgroup-MMA kernels, and again with the mma.sync ones,
VARIANTS below) and PyTorch's FlashAttention-2 varlen; and ours on the padded batch as
`attn_implementation: bertaccel` runs it (read in place: slots of seq rows, the lengths as seqused).

    python -m benchmarks.bench_attention --out bench_results/attention.json

Each cell: bf16 q/k/v of a [batch, seq] batch whose row lengths are given (`full`: every row seq;
`imdb256`: the staged IMDB subset's lengths at max_length 256, 81% real; `uniform`: lengths uniform
in [0.2, 1] x seq, ByteTransformer's setting; `uniform-sorted`: the same lengths, longest row first - the order
`group_by_length` batches come in, and the longest sequences' CTAs first in the kernels' batch-major grids). FLOPs count real tokens only: forward 4 * sum(len^2)
* heads * d, backward 2.5x that. Times: GPU time per forward + backward from CUDA-graph replays.
`sdpa-flash` cannot take a mask: it runs only on `full` cells. `fwd_ms`: the forward alone (no grad).
The first four cells are issue 11's targets (16k tokens, seq 128 / 512, head dim 64 / 32).
`--dropout P`: every implementation with attention dropout P (as training runs BERT: 0.1), each drawing its
own mask (the FLOP count is unchanged). With dropout every row is timed as the sum of its kernels' GPU times
per call (torch.profiler; `timing` says "kernels"), not from graph replays: SDPA's cuDNN backend with dropout
fails to capture (torch 2.11 on the H100), so its rows would fall back to eager events (launch gaps included)
while the others came from graphs; timed one way, every row is comparable. (graph_time_ms recovers PyTorch's
CUDA generator after a failed capture; before it did, the first such failure broke every later draw.)
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.common import cuda_time_ms, environment, graph_time_ms, kernel_env, kernel_times_us, print_table, write_json
from bertaccel.modules.hf_attention import attention_forward
from bertaccel.modules.unpadded import Unpadded, _FlashVarlen
from bertaccel.ops import attention, build

CELLS = ["128x128x12x64:full", "128x128x12x32:full", "32x512x12x64:full", "32x512x12x32:full",
         "32x256x12x32:imdb256", "32x512x12x64:uniform", "32x512x12x32:uniform"]
# Our op with other kernels, timed beside the default on a Hopper (BERTACCEL_ATTENTION_FWD / _BWD, read
# per call, set around the forward and the backward alike): the mma.sync kernels, the warpgroup-MMA
# forward with 128 queries per CTA, with 128 or 64 keys per block (the default takes 128 on batches of
# full sequences), and the Hopper backward without clusters (one dQ buffer add per CTA)
VARIANTS = {"fwd mma, bwd mma": {"BERTACCEL_ATTENTION_FWD": "mma", "BERTACCEL_ATTENTION_BWD": "mma"},
            "bwd mma": {"BERTACCEL_ATTENTION_BWD": "mma"},
            "fwd wg2": {"BERTACCEL_ATTENTION_FWD": "wg2"},
            "fwd 128 keys": {"BERTACCEL_ATTENTION_FWD": "n128"},
            "fwd 64 keys": {"BERTACCEL_ATTENTION_FWD": "n64"},
            "bwd bulk": {"BERTACCEL_ATTENTION_BWD": "bulk"}}


BACKENDS = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
            "sdpa-flash": SDPBackend.FLASH_ATTENTION}


def lengths_for(kind: str, batch: int, seq: int, g: torch.Generator) -> torch.Tensor:
    if kind == "full":
        return torch.full((batch,), seq)
    if kind in ("uniform", "uniform-sorted"):
        n = (torch.rand(batch, generator=g) * 0.8 * seq + 0.2 * seq).long().clamp(1, seq)
        return n.sort(descending=True).values if kind == "uniform-sorted" else n
    if kind == "imdb256":  # 62% of rows fill 256 tokens, the rest spread below (81% real overall)
        full = torch.rand(batch, generator=g) < 0.62
        return torch.where(full, torch.full((batch,), seq), torch.randint(40, seq, (batch,), generator=g))
    raise ValueError(kind)


def time_ms(fn, kernels: bool = False, calls: int = 10) -> tuple[float, str]:
    """GPU time per call and how it was taken: from CUDA-graph replays ("graph"; a small attention
    call is otherwise host-bound), or CUDA events around eager calls ("events", launch overhead
    included) if the call cannot be captured - said on stdout, with the reason. `kernels`: the sum of
    the GPU times of every kernel (and memset / copy) a call launches, from torch.profiler after three
    warm-up calls ("kernels": no launch gaps, as in a graph; no capture attempted)."""
    if kernels:
        for _ in range(3):
            fn()
        per = kernel_times_us(lambda: [fn() for _ in range(calls)], calls)
        return sum(per.values()) / 1000, "kernels"
    try:
        return graph_time_ms(fn, [()]), "graph"
    except RuntimeError as e:
        torch.cuda.synchronize()
        print(f"capture failed, timed eagerly with events: {str(e).splitlines()[0][:160]}")
    return cuda_time_ms(fn, [()], warmup=5, repeats=20), "events"


def run_cell(cell: str, variants: bool = True, dropout: float = 0.0) -> list[dict]:
    """Every implementation's rows for one cell; `variants`: also our op with the VARIANTS kernels;
    `dropout`: attention dropout probability for every implementation."""
    shape, kind = cell.split(":")
    batch, seq, heads, d = (int(x) for x in shape.split("x"))
    g = torch.Generator().manual_seed(0)
    lengths = lengths_for(kind, batch, seq, g)
    mask = (torch.arange(seq)[None] < lengths[:, None]).cuda()
    layout = Unpadded.from_mask(mask.long())
    flops = 3.5 * 4 * float((lengths.double() ** 2).sum()) * heads * d
    rows = []
    # padded q, k, v as HF's BERT hands them to attention: [B, H, S, D] views of [B, S, H, D] projections
    qs, ks, vs = (torch.randn(batch, seq, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    qp, kp, vp = (t.transpose(1, 2) for t in (qs, ks, vs))
    # the output's gradient as the model hands it back: HF reshapes attention's [B, S, H, D] output to [B, S, H * D]
    # before the output projection, so the gradient arrives as a contiguous [B, S, H, D] (SDPA's [B, H, S, D] output
    # gets it as a transposed view of that; until session 49 ours got a transposed view instead, and copied it to
    # contiguous rows - 25 MB each way at 32x512x12x64 - which the model never does)
    dp = torch.randn(batch, seq, heads, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    key_padding = None if kind == "full" else mask[:, None, None, :]

    def add(name, fwd, step):
        try:
            (ms, how), (fwd_ms, fwd_how) = time_ms(step, dropout > 0), time_ms(fwd, dropout > 0)
        except RuntimeError as e:
            print(f"{cell} {name}: {str(e).splitlines()[0][:120]}")
            return
        rows.append({"cell": cell, "impl": name, "fwd_ms": round(fwd_ms, 4), "ms": round(ms, 4),
                     "timing": how if how == fwd_how else f"{how} (fwd {fwd_how})",
                     "TFLOP/s": round(flops / ms / 1e9, 1), "fwd TFLOP/s": round(flops / 3.5 / fwd_ms / 1e9, 1)})

    for name, backend in BACKENDS.items():
        if name == "sdpa-flash" and key_padding is not None:
            continue

        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qp, kp, vp, attn_mask=key_padding, dropout_p=dropout)

        def sdpa_fwd(sdpa=sdpa):
            with torch.no_grad():
                sdpa()

        add(name, sdpa_fwd, lambda sdpa=sdpa: torch.autograd.grad(sdpa(), (qs, ks, vs), dp))
    if build.load_attention():  # attn_implementation: bertaccel (the mask's in-place layout, every call)
        padding = None if kind == "full" else mask

        def padded():
            return attention_forward(None, qp, kp, vp, padding, dropout=dropout, scaling=d ** -0.5)[0]

        def padded_fwd():
            with torch.no_grad():
                padded()

        add("bertaccel (padded, hf interface)", padded_fwd,
            lambda: torch.autograd.grad(padded(), (qs, ks, vs), dp.transpose(1, 2)))  # (contiguous [B, S, H, D])
    q, k, v = (torch.randn(layout.tokens, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(layout.tokens, heads, d, device="cuda", dtype=torch.bfloat16)
    cu, scale = layout.cu_seqlens, d ** -0.5
    varlen = {"flash-varlen (packed)": (lambda: _FlashVarlen.apply(q, k, v, cu, layout.max_seqlen, dropout, scale), {})}
    if build.load_attention():
        ours = lambda: attention.varlen_attention(q, k, v, cu, layout.max_seqlen, dropout, scale)  # noqa: E731
        varlen["bertaccel-varlen (packed)"] = (ours, {})
        if torch.cuda.get_device_capability() == (9, 0) and variants:  # the same op with other kernels, same run
            for label, env in VARIANTS.items():
                varlen[f"bertaccel-varlen (packed, {label})"] = (ours, env)
    else:
        print(f"bertaccel attention off: {build.attention_reason()}")
    for name, (fn, env) in varlen.items():
        def fwd(fn=fn, env=env):
            with torch.no_grad(), kernel_env(env):
                fn()

        def step(fn=fn, env=env):
            with kernel_env(env):
                return torch.autograd.grad(fn(), (q, k, v), do)

        add(name, fwd, step)
    best_sdpa = min((r["ms"] for r in rows if r["impl"].startswith("sdpa")), default=None)
    for r in rows:
        r["real_fraction"] = round(float(lengths.sum()) / (batch * seq), 3)
        r["x_best_sdpa"] = round(best_sdpa / r["ms"], 3) if best_sdpa else None
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", nargs="+", default=CELLS)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-variants", action="store_true", help="time our op with its default kernels only")
    ap.add_argument("--dropout", type=float, default=0.0, help="attention dropout probability (training: 0.1)")
    args = ap.parse_args()
    # One untimed pass over the first cell: at 9a2dc35 the first cell's padded fwd+bwd rows (every SDPA
    # backend and ours) came out 3-4x the same rows of an earlier run while the later cells matched it;
    # the `timing` column says whether each row came from graph replays or eager events.
    print(f"untimed warm-up pass over {args.cells[0]} (a capture failing here is the reason for the pass)")
    run_cell(args.cells[0], not args.no_variants, args.dropout)
    print("timed passes" + (f", attention dropout {args.dropout}" if args.dropout else ""))
    rows = []
    for cell in args.cells:
        rows += [dict(r, dropout=args.dropout) for r in run_cell(cell, not args.no_variants, args.dropout)]
    print_table(rows, ["cell", "impl", "real_fraction", "fwd_ms", "fwd TFLOP/s", "ms", "TFLOP/s", "x_best_sdpa", "timing"])
    if args.out:
        write_json(args.out, {"environment": environment(), "dropout": args.dropout, "rows": rows})


if __name__ == "__main__":
    main()
