"""Bias gradients: the column sums of a [tokens, N] output gradient (ops/bias_grad.py), against
PyTorch's `dy.sum(0)` (what autograd runs for nn.Linear: bf16 out), the same with an fp32 result,
cuBLAS (a ones-vector GEMV) and torch.compile; then a whole linear layer forward + backward,
`F.linear` under the casts autocast makes (fp32 bias cast to bf16) against `dense` (fp32 bias kept);
and a linear layer's weight + bias gradient (dy^T x and dy's column sums): cuBLAS's GEMM alone (the
floor), with PyTorch's sum, with our column sum (the separate form), torch.compile, and `dense_wgrad`
(one cuBLASLt matmul with the BGRADB epilogue). Bytes: the column sums read dy once (rows x N x 2); the
linear rows are not memory-bound (their GB/s columns mean nothing: read the times).

    python -m benchmarks.bench_ops --ops bias_grad --out bench_results/bias_grad.json
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.common import compile_static, graph_time_ms, measure_op, rotations
from bertaccel.ops.bias_grad import column_sum, dense, dense_wgrad_path

# tokens x N: 9,830 = 60% of 32 x 512 (packed IMDB at max_length 512); 384 / 1,152 MiniLM's bias and
# Q+K+V, 768 / 2,304 / 3,072 BERT-base's
SHAPES = [(2048, 768), (2048, 2304), (9830, 384), (9830, 1152), (16384, 384), (16384, 768), (16384, 1152),
          (16384, 2304), (16384, 3072)]
LINEAR_SHAPES = [(9830, 384, 1152), (16384, 384, 1152), (16384, 768, 2304)]  # tokens, in, out
# tokens, out, in: the Q/K/V projections' weight gradients (MiniLM, BERT-base) at 32 x 512 and 60% of it
WGRAD_SHAPES = [(9830, 1152, 384), (16384, 1152, 384), (9830, 2304, 768), (16384, 2304, 768)]


def wgrad_rows() -> list[dict]:
    """dw = dy^T x with db = dy summed over the tokens (fp32): GPU time per call from graph replays."""
    impls = {
        "cublas mm (no bias grad)": lambda dy, x: dy.t() @ x,
        "cublas mm + pytorch sum(0)": lambda dy, x: (dy.t() @ x, dy.sum(0)),
        "cublas mm + column_sum": lambda dy, x: (dy.t() @ x, column_sum(dy)),
        "compile": compile_static(lambda dy, x: (dy.t() @ x, dy.sum(0, dtype=torch.float32))),
        "bertaccel dense_wgrad": torch.ops.bertaccel.dense_wgrad,
    }
    rows = []
    for t, n, k in WGRAD_SHAPES:
        nbytes = 2 * (t * n + t * k + n * k)
        sets = [(torch.randn(t, n, device="cuda", dtype=torch.bfloat16), torch.randn(t, k, device="cuda", dtype=torch.bfloat16))
                for _ in range(rotations(nbytes))]
        path = dense_wgrad_path(*sets[0])
        for name, fn in impls.items():
            with torch.no_grad():
                us = graph_time_ms(fn, sets) * 1e3
            rows.append({"op": "dense_wgrad", "shape": f"{t}x{n}x{k} bf16", "impl": name, "fwd_us": round(us, 1),
                         "fwd_TFLOP/s": round(2 * t * n * k / us / 1e6), "path": path if name.startswith("bertaccel") else ""})
    return rows


def column_sum_rows(ceiling_gbs: float, dtype) -> list[dict]:
    impls = {
        "pytorch": lambda x: x.sum(0),  # what autograd runs for nn.Linear
        "pytorch sum(0, fp32)": lambda x: x.sum(0, dtype=torch.float32),
        "cublas ones @ x": lambda x: torch.ones(1, x.shape[0], device=x.device, dtype=x.dtype) @ x,
        "compile": compile_static(lambda x: x.sum(0, dtype=torch.float32)),
        "bertaccel": column_sum,
    }
    rows = []
    for n, c in SHAPES:
        nbytes = n * c * (torch.finfo(dtype).bits // 8)
        sets = [(torch.randn(n, c, device="cuda", dtype=dtype),) for _ in range(rotations(nbytes))]
        for name, fn in impls.items():
            with torch.no_grad():
                us = graph_time_ms(fn, sets) * 1e3
            gbs = nbytes / us / 1e3
            rows.append({"op": "column_sum", "shape": f"{n}x{c} {str(dtype)[6:]}", "impl": name, "fwd_us": round(us, 1),
                         "fwd_GB/s": round(gbs), "fwd_%copy": round(100 * gbs / ceiling_gbs)})
    return rows


def run(ceiling_gbs: float, dtype=torch.bfloat16) -> list[dict]:
    rows = column_sum_rows(ceiling_gbs, dtype)
    if dtype != torch.bfloat16:
        return rows
    rows += wgrad_rows()
    impls = {"pytorch": lambda x, w, b: F.linear(x, w, b.to(x.dtype)), "bertaccel": dense}  # F.linear: the bias cast as autocast does
    for t, k, n in LINEAR_SHAPES:
        make = lambda: (torch.randn(t, k, device="cuda", dtype=dtype), torch.randn(n, k, device="cuda", dtype=dtype) * 0.05,  # noqa: E731
                        torch.randn(n, device="cuda"))
        rows += measure_op("linear", f"{t}x{k}->{n} bf16, fp32 bias", impls, make, (0, 1, 2), 2 * (t * k + n * k + t * n),
                           2 * (2 * t * n + 2 * t * k + 2 * n * k), ceiling_gbs)
    return rows
