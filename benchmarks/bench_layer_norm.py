"""LayerNorm forward/backward: PyTorch eager vs torch.compile vs bertaccel, effective GB/s.

bertaccel reads fp32 weights (a bf16-mixed model's LayerNorm parameters) as they are; PyTorch and
compile get bf16 copies made once, outside the timing (their best case). Bytes: forward reads x and writes y; backward reads dy and x and writes dx (weights negligible)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.common import compile_static, measure_op
from bertaccel.ops.layer_norm import layer_norm

SHAPES = [(2048, 384), (2048, 768), (2048, 1024), (16384, 384), (16384, 768), (16384, 1024)]


def run(ceiling_gbs: float, dtype=torch.bfloat16) -> list[dict]:
    # PyTorch's layer_norm refuses fp32 weights beside bf16 input outside autocast (under autocast it
    # would cast x to fp32 and normalise in fp32): its best case is weights pre-cast to bf16, once.
    eager = lambda x, w, b, w16, b16: F.layer_norm(x, (x.shape[-1],), w16, b16, 1e-12)  # noqa: E731
    impls = {"pytorch": eager, "compile": compile_static(eager),
             "bertaccel": lambda x, w, b, w16, b16: layer_norm(x, w, b, 1e-12)}
    rows = []
    for n, h in SHAPES:
        s = torch.finfo(dtype).bits // 8
        def make():  # fp32 weights, as a bf16-mixed model has, and their bf16 copies for PyTorch
            w, b = torch.randn(h, device="cuda"), torch.randn(h, device="cuda")
            return torch.randn(n, h, device="cuda", dtype=dtype), w, b, w.to(dtype), b.to(dtype)

        rows += measure_op("layer_norm", f"{n}x{h} {str(dtype)[6:]}", impls, make, (0, 1, 2, 3, 4),
                           2 * n * h * s, 3 * n * h * s, ceiling_gbs)
    return rows
