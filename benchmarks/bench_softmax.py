"""Attention softmax forward/backward: softmax(scores * scale + key-padding mask) as HF's eager
attention computes it (three kernels: mul, add, softmax) vs torch.compile vs bertaccel (one).

Shapes: BERT-base scores [batch, 12 heads, seq, seq] at 16x128 and 32x512, bf16; the mask is HF's
additive [batch, 1, 1, seq]. Bytes: forward reads the scores and writes the probabilities;
backward reads dy and y and writes dx."""

from __future__ import annotations

import torch

from benchmarks.common import compile_static, measure_op
from bertaccel.ops.softmax import softmax

SHAPES = [(16, 12, 128), (32, 12, 512), (8, 12, 1024)]
SCALE = 0.125


def run(ceiling_gbs: float, dtype=torch.bfloat16) -> list[dict]:
    eager = lambda x, m: torch.softmax(x * SCALE + m, dim=-1)  # noqa: E731
    impls = {"pytorch": eager, "compile": compile_static(eager), "bertaccel": lambda x, m: softmax(x, m, SCALE)}
    rows = []
    for b, h, s in SHAPES:
        e = torch.finfo(dtype).bits // 8
        n = b * h * s * s

        def make():
            keep = torch.rand(b, 1, 1, s, device="cuda") > 0.2
            mask = torch.zeros(b, 1, 1, s, device="cuda", dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)
            return torch.randn(b, h, s, s, device="cuda", dtype=dtype), mask

        rows += measure_op("softmax", f"{b}x{h}x{s}x{s} {str(dtype)[6:]}", impls, make, (0,), 2 * n * e, 3 * n * e,
                           ceiling_gbs)
    return rows
