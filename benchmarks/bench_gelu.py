"""GELU(x + bias) (exact erf): PyTorch eager vs torch.compile vs bertaccel, at BERT's FFN widths.
Bytes: forward reads x, writes y; backward reads dy and x, writes dx."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.common import compile_static, measure_op
from bertaccel.ops.gelu import bias_gelu

SHAPES = [(2048, 1536), (2048, 3072), (2048, 4096), (16384, 1536), (16384, 3072), (16384, 4096)]


def reference(x, bias):
    return F.gelu(x + bias)


def run(ceiling_gbs: float, dtype=torch.bfloat16) -> list[dict]:
    impls = {"pytorch": reference, "compile": compile_static(reference), "bertaccel": bias_gelu}
    rows = []
    for n, f in SHAPES:
        s = torch.finfo(dtype).bits // 8
        make = lambda: (torch.randn(n, f, device="cuda", dtype=dtype), torch.randn(f, device="cuda", dtype=dtype))  # noqa: E731
        rows += measure_op("bias_gelu", f"{n}x{f} {str(dtype)[6:]}", impls, make, (0, 1), 2 * n * f * s, 3 * n * f * s, ceiling_gbs)
    return rows
