"""LayerNorm forward/backward: PyTorch eager vs torch.compile vs bertaccel, effective GB/s.

Weights are fp32 (a bf16-mixed model's LayerNorm parameters); every implementation reads them as
they are. Bytes: forward reads x and writes y; backward reads dy and x and writes dx (weights negligible)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.common import measure_op
from bertaccel.ops.layer_norm import layer_norm

SHAPES = [(2048, 384), (2048, 768), (2048, 1024), (16384, 384), (16384, 768), (16384, 1024)]


def run(ceiling_gbs: float, dtype=torch.bfloat16) -> list[dict]:
    eager = lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-12)  # noqa: E731
    impls = {"pytorch": eager, "compile": torch.compile(eager), "bertaccel": lambda x, w, b: layer_norm(x, w, b, 1e-12)}
    rows = []
    for n, h in SHAPES:
        s = torch.finfo(dtype).bits // 8
        make = lambda: (torch.randn(n, h, device="cuda", dtype=dtype),  # noqa: E731
                        torch.randn(h, device="cuda"), torch.randn(h, device="cuda"))  # fp32 weights, as a bf16-mixed model has
        rows += measure_op("layer_norm", f"{n}x{h} {str(dtype)[6:]}", impls, make, (0, 1, 2),
                           2 * n * h * s, 3 * n * h * s, ceiling_gbs)
    return rows
