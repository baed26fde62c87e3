"""RMSNorm over the last dimension (csrc/layer_norm_*.cu, the LayerNorm kernels without centring):
y = x * rsqrt(mean(x^2) + eps) * weight, fp32 statistics, backward without atomics."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bertaccel.ops import library
from bertaccel.ops._dispatch import note_fallback, why_not


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Plain PyTorch, for tests: RMSNorm in float64."""
    return F.rms_norm(x.double(), (x.shape[-1],), weight.double(), eps)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float | None = None) -> Tensor:
    """`F.rms_norm(x, (H,), weight, eps)` through the kernel when it can run (CUDA, bf16/fp32,
    H <= 8192, with a weight); PyTorch's own op otherwise. eps None: the dtype's machine epsilon,
    as in `F.rms_norm`."""
    reason = why_not(x) if weight is not None else "no weight"
    if reason is not None:
        note_fallback("rms_norm", reason)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    shape = x.shape
    y = library.rms_norm_fwd(x.contiguous().view(-1, shape[-1]), weight.float(), eps)[0]
    return y.view(shape)


class FusedRMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` whose forward runs the kernel; same parameters and state_dict keys."""

    @classmethod
    def from_module(cls, m: nn.RMSNorm) -> FusedRMSNorm:
        if len(m.normalized_shape) != 1:
            raise ValueError("FusedRMSNorm normalises over the last dimension only")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.normalized_shape, new.eps, new.elementwise_affine = m.normalized_shape, m.eps, m.elementwise_affine
        new.weight = m.weight  # the same Parameter object
        new.train(m.training)
        return new

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)
