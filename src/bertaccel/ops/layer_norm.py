"""LayerNorm over the last dimension (csrc/layer_norm.cu): Welford statistics in fp32, the row read
once into registers and written once, 16-byte vector accesses; backward without atomics."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bertaccel.ops import library
from bertaccel.ops._dispatch import note_fallback, why_not


def layer_norm_reference(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """Plain PyTorch, for tests: LayerNorm in float64."""
    return F.layer_norm(x.double(), (x.shape[-1],), weight.double(), bias.double(), eps)


def layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float = 1e-5) -> Tensor:
    """`F.layer_norm(x, (H,), weight, bias, eps)` through the fused kernel when it can run
    (CUDA, bf16/fp32, H <= 8192, affine); PyTorch's own op otherwise, with the same result."""
    reason = why_not(x) if weight is not None and bias is not None else "no affine weight/bias"
    if reason is not None:
        note_fallback("layer_norm", reason)
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    shape = x.shape
    y = library.layer_norm_fwd(
        x.contiguous().view(-1, shape[-1]), None, None, weight.float(), bias.float(), 0.0, eps
    )[0]
    return y.view(shape)


class FusedLayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` whose forward runs the fused kernel; same parameters and state_dict keys."""

    @classmethod
    def from_module(cls, ln: nn.LayerNorm) -> FusedLayerNorm:
        if len(ln.normalized_shape) != 1:
            raise ValueError("FusedLayerNorm normalises over the last dimension only")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.normalized_shape, new.eps, new.elementwise_affine = ln.normalized_shape, ln.eps, ln.elementwise_affine
        new.weight, new.bias = ln.weight, ln.bias  # the same Parameter objects
        new.train(ln.training)
        return new

    def forward(self, x: Tensor) -> Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)
