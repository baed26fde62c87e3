"""RMSNorm forward/backward: PyTorch eager (F.rms_norm) vs torch.compile vs bertaccel, effective GB/s.
The weight is in the activation dtype (bf16-true): F.rms_norm would promote to fp32 beside an fp32 weight.

Bytes: forward reads x and writes y; backward reads dy and x and writes dx (weights negligible)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.common import compile_static, measure_op
from bertaccel.ops.rms_norm import rms_norm

SHAPES = [(2048, 768), (16384, 768), (16384, 1024), (16384, 4096)]


def run(ceiling_gbs: float, dtype=torch.bfloat16) -> list[dict]:
    eager = lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6)  # noqa: E731
    impls = {"pytorch": eager, "compile": compile_static(eager), "bertaccel": lambda x, w: rms_norm(x, w, 1e-6)}
    rows = []
    for n, h in SHAPES:
        s = torch.finfo(dtype).bits // 8
        make = lambda: (torch.randn(n, h, device="cuda", dtype=dtype), torch.randn(h, device="cuda", dtype=dtype))  # noqa: E731
        rows += measure_op("rms_norm", f"{n}x{h} {str(dtype)[6:]}", impls, make, (0, 1), 2 * n * h * s, 3 * n * h * s,
                           ceiling_gbs)
    return rows
