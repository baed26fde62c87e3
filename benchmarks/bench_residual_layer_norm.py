"""LayerNorm(dropout(x + bias) + residual), training mode, p = 0.1: PyTorch eager vs torch.compile
vs bertaccel's one kernel. Bytes: forward reads x and residual, writes y; the training forward (grad
on, `train_fwd_*`) also writes what the backward reads (bertaccel: the sum, one more tensor of x's
size); backward reads dy and the saved sum, writes d(residual) and dx."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.common import compile_static, measure_op
from bertaccel.ops.residual_layer_norm import bias_dropout_add_layer_norm

SHAPES = [(2048, 384), (2048, 768), (2048, 1024), (16384, 384), (16384, 768), (16384, 1024)]
P = 0.1


def reference(x, bias, r, w, b, bias16, w16, b16):
    """PyTorch with the linear bias and the LayerNorm weights pre-cast to the activation dtype (its best case)."""
    return F.layer_norm(F.dropout(x + bias16, P, True) + r, (x.shape[-1],), w16, b16, 1e-12)


def run(ceiling_gbs: float, dtype=torch.bfloat16) -> list[dict]:
    def ours(x, bias, r, w, b, bias16, w16, b16):  # the fp32 master bias and weights, as the swapped model passes them
        return bias_dropout_add_layer_norm(x, bias, r, w, b, P, 1e-12)

    impls = {"pytorch": reference, "compile": compile_static(reference), "bertaccel": ours}
    rows = []
    for n, h in SHAPES:
        s = torch.finfo(dtype).bits // 8
        def make():  # fp32 linear bias and LayerNorm weights, as a bf16-mixed model has, and bf16 copies for PyTorch
            # (until session 73 the linear bias was bf16 for all three: ours widened it per call, a cast kernel in
            # its forward and another for its gradient that the model, whose master bias is fp32, does not run)
            bias, w, b = (torch.randn(h, device="cuda") for _ in range(3))
            return (torch.randn(n, h, device="cuda", dtype=dtype), bias, torch.randn(n, h, device="cuda", dtype=dtype),
                    w, b, bias.to(dtype), w.to(dtype), b.to(dtype))

        rows += measure_op("residual_layer_norm", f"{n}x{h} {str(dtype)[6:]}", impls, make, (0, 1, 2, 3, 4, 5, 6, 7),
                           3 * n * h * s, 4 * n * h * s, ceiling_gbs, train_fwd_bytes=4 * n * h * s)
    return rows
