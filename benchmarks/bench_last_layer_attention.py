"""The attention of a last layer at some rows only (bertaccel.modules.last_layer): Q query rows per sequence over all S
keys, forward + backward, by our query-rows kernel (up to 4 queries), SDPA's backends and plain fp32 matmuls, at the
shapes the product runs.

    python -m benchmarks.bench_last_layer_attention --out bench_results/last_layer_attention.json
    python -m benchmarks.bench_last_layer_attention --device cpu --shapes 2x1x16   # the harness only

Shapes are batch x queries x keys (BERT-base heads, 12 x 64; `--head-dim 32`: MiniLM's 12 x 32): 32x1x512 is a classifier's [CLS] row at max_length 512,
64x56x128 and 16x152x512 the masked-LM's static rows per sequence at blocks of 128 and 512. Inputs as the layer
has them: q [B, Q, H] and the K / V projections [B, S, 2H] in bf16, a key-padding mask (every fourth row a quarter
shorter). The unpadded encoder's form (`model.unpadded`) reads the K / V projections of the packed real rows
[T, 2H]: `bertaccel-varlen` (query_rows_attention_varlen, in place) against `bertaccel-repad` (put back in the padded
layout, then the padded kernel - the path before the varlen form), their dK / dV at the packed rows. Time: CUDA-graph replays of forward + backward and of the forward alone (no grad; dropout `--dropout`, 0.1 as
BERT trains), median; with the bytes every implementation must move at least (forward: K / V read; forward +
backward: K / V read twice and dK / dV written; the query rows are a sliver) as GB/s. Error: the output and the
three input gradients against float64 from the same bf16 inputs (dropout 0), relative norm.
"""

from __future__ import annotations

import argparse
import contextlib
import math

import torch
import torch.nn.functional as F

from benchmarks.common import environment, graph_time_ms, print_table, write_json

HEADS, D = 12, 64


def make_inputs(B: int, Q: int, S: int, device: str, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, Q, HEADS * D, generator=g).to(device, torch.bfloat16)
    kv = torch.randn(B, S, 2 * HEADS * D, generator=g).to(device, torch.bfloat16)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[::4, S - S // 4:] = False
    dout = torch.randn(B, Q, HEADS * D, generator=g).to(device, torch.bfloat16)
    return q, kv, mask.to(device), dout


def _split(q, kv):
    B, S = kv.shape[:2]
    k, v = kv.view(B, S, 2, HEADS, D).unbind(2)
    return q.view(B, q.shape[1], HEADS, D).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def sdpa(backend=None):
    def attend(q, kv, mask, p):
        qh, k, v = _split(q, kv)
        with torch.nn.attention.sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask[:, None, None, :], dropout_p=p,
                                                 scale=1 / math.sqrt(D))
        return out.transpose(1, 2).reshape(q.shape)
    return attend


def fp32_matmuls(q, kv, mask, p):
    """Scores, softmax, dropout and the weighted sum in fp32 (autocast off), the output in the inputs' dtype."""
    qh, k, v = _split(q, kv)
    ct = torch.promote_types(q.dtype, torch.float32)
    s = torch.matmul(qh.to(ct), k.to(ct).transpose(-1, -2)) / math.sqrt(D)
    s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    probs = F.dropout(torch.softmax(s, -1), p)
    out = torch.matmul(probs, v.to(ct)).to(q.dtype)
    return out.transpose(1, 2).reshape(q.shape)


def ours(q, kv, mask, p):
    """bertaccel.ops.attention.query_rows_attention (up to 4 queries; the CPU reference off a GPU)."""
    from bertaccel.ops.attention import QUERY_ROWS_MAX, query_rows_attention, query_rows_unavailable

    if q.shape[1] > QUERY_ROWS_MAX or (q.is_cuda and query_rows_unavailable(q, kv, HEADS)):
        raise ValueError(f"query_rows_attention does not take this: {query_rows_unavailable(q, kv, HEADS)}")
    return query_rows_attention(q, kv, mask, HEADS, p, 1 / math.sqrt(D))


class Packed:
    """The K / V rows packed (the unpadded encoder's layout): `fn(q, packed [T, 2H], layout, p)`; the harness hands
    it the real rows of kv and compares dK / dV at them."""

    def __init__(self, fn):
        self.fn = fn

    @staticmethod
    def layout(mask):
        indices = mask.flatten().nonzero().squeeze(1)
        cu = F.pad(mask.sum(1).cumsum(0), (1, 0)).to(torch.int32)
        return indices, cu, mask.shape


def ours_varlen(q, packed, layout, p):
    """query_rows_attention_varlen: the packed rows read in place."""
    from bertaccel.ops.attention import query_rows_attention_varlen

    _, cu, (B, S) = layout
    return query_rows_attention_varlen(q, packed, cu, S, HEADS, p, 1 / math.sqrt(D))


def ours_repad(q, packed, layout, p):
    """The packed rows put back in the padded layout (zeros at the padding, as `Unpadded.unpack`), then
    query_rows_attention with the key-padding mask."""
    indices, _, (B, S) = layout
    kv = packed.new_zeros(B * S, packed.shape[1]).index_copy(0, indices, packed).view(B, S, -1)
    mask = torch.zeros(B * S, dtype=torch.bool, device=packed.device).index_fill(0, indices, True).view(B, S)
    return ours(q, kv, mask, p)


def implementations(device: str) -> dict:
    from torch.nn.attention import SDPBackend

    impls = {"sdpa": sdpa(), "bertaccel": ours, "fp32-matmuls": fp32_matmuls,
             "bertaccel-varlen": Packed(ours_varlen), "bertaccel-repad": Packed(ours_repad)}
    if device == "cuda":
        impls |= {"sdpa-efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION), "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
                  "sdpa-math": sdpa(SDPBackend.MATH)}
    return impls


def bind(fn, kv, mask):
    """fn as (q, kv', p) -> out, and kv' (kv, or its packed real rows for a `Packed` implementation)."""
    if isinstance(fn, Packed):
        layout = Packed.layout(mask)
        return (lambda q, kv, p: fn.fn(q, kv, layout, p)), kv[mask]
    return (lambda q, kv, p: fn(q, kv, mask, p)), kv


def errors(fn, q, kv, mask, dout) -> dict:
    def run(q, kv, dout, fn):
        q, kv = q.detach().requires_grad_(), kv.detach().requires_grad_()
        out = fn(q, kv, 0.0)
        out.backward(dout)
        return out.detach(), q.grad, kv.grad

    # float64 math from the same bf16 inputs
    ref = run(q.double(), kv.double(), dout.double(), lambda q, kv, p: fp32_matmuls(q, kv, mask, p))
    bound, kv_in = bind(fn, kv, mask)
    got = run(q, kv_in, dout, bound)
    if isinstance(fn, Packed):
        ref = (ref[0], ref[1], ref[2][mask])

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()

    return {"err_out": rel(got[0], ref[0]), "err_dq": rel(got[1], ref[1]), "err_dkv": rel(got[2], ref[2])}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", nargs="+", default=["32x1x512", "64x56x128", "16x152x512"], help="batch x queries x keys")
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--head-dim", type=int, default=64, help="64: BERT-base's 12 x 64; 32: MiniLM's 12 x 32")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: errors only (the harness)")
    ap.add_argument("--out", default="bench_results/last_layer_attention.json")
    args = ap.parse_args(argv)
    global D
    D = args.head_dim
    rows = []
    for shape in args.shapes:
        B, Q, S = (int(x) for x in shape.split("x"))
        q, kv, mask, dout = make_inputs(B, Q, S, args.device)
        for name, fn in implementations(args.device).items():
            row = {"shape": shape, "impl": name}
            try:
                row |= {k: round(v, 5) for k, v in errors(fn, q, kv, mask, dout).items()}
                if args.device == "cuda":
                    bound, kv_in = bind(fn, kv, mask)
                    qg, kvg = q.detach().requires_grad_(), kv_in.detach().requires_grad_()

                    def step(bound=bound, qg=qg, kvg=kvg):
                        out = bound(qg, kvg, args.dropout)
                        qg.grad = kvg.grad = None
                        out.backward(dout)

                    def forward(bound=bound, kv_in=kv_in):
                        with torch.no_grad():
                            bound(q, kv_in, args.dropout)

                    kv_bytes = kv.numel() * kv.element_size()  # the padded K / V: the bytes of the real rows differ
                    # by the mask's quarter of every fourth row only
                    us = graph_time_ms(step, [()], calls=10) * 1e3
                    row |= {"fwd_bwd_us": round(us, 1), "fwd_bwd_GBps": round(3 * kv_bytes / us / 1e3)}
                    us = graph_time_ms(forward, [()], calls=10) * 1e3
                    row |= {"fwd_us": round(us, 1), "fwd_GBps": round(kv_bytes / us / 1e3)}
            except Exception as e:  # a backend that does not take the shape, the mask or dropout under capture
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            rows.append(row)
            print(row)
    write_json(args.out, {"environment": environment(), "dropout": args.dropout, "heads": HEADS, "head_dim": D,
                          "rows": rows})
    print()
    print_table(rows, ["shape", "impl", "fwd_bwd_us", "fwd_bwd_GBps", "fwd_us", "fwd_GBps", "err_out", "err_dq", "err_dkv",
                       "error"])


if __name__ == "__main__":
    main()
