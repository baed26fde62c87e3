"""RMSNorm over the last dimension (csrc/layer_norm_*.cu, the LayerNorm kernels without centring,
instantiated as their own template): y = x * rsqrt(mean(x^2) + eps) * weight, fp32 statistics,
backward without atomics."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bertaccel.ops.eligibility import direct_entry, note_fallback, why_not
from bertaccel.ops.registration import NS, SwapEntry, define_public, lib

CUDA_SOURCES = ["layer_norm_fwd.cu", "rms_norm_bwd.cu"]

# ------------------------------------------------------------------------------------ schemas
lib.define("rms_norm_fwd(Tensor x, Tensor weight, float eps) -> (Tensor y, Tensor rstd)")
lib.define("rms_norm_bwd(Tensor dy, Tensor x, Tensor weight, Tensor rstd) -> (Tensor dx, Tensor dweight)")


# ------------------------------------------------------------------------------ CPU reference
@torch.library.impl(lib, "rms_norm_fwd", "CPU")
def _fwd_cpu(x, weight, eps):
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    return (xf * rstd[..., None] * weight.float()).to(x.dtype), rstd.reshape(-1)


@torch.library.impl(lib, "rms_norm_bwd", "CPU")
def _bwd_cpu(dy, x, weight, rstd):
    H = x.shape[-1]
    xf, dyf = x.float().reshape(-1, H), dy.float().reshape(-1, H)
    xhat = xf * rstd[:, None]
    g = dyf * weight.float()
    dx = rstd[:, None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx.to(x.dtype).reshape(x.shape), (dyf * xhat).sum(0)


# ----------------------------------------------------------------------------------------- fake
@torch.library.register_fake(f"{NS}::rms_norm_fwd")
def _fwd_fake(x, weight, eps):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return torch.empty_like(x), x.new_empty(rows, dtype=torch.float32)


@torch.library.register_fake(f"{NS}::rms_norm_bwd")
def _bwd_fake(dy, x, weight, rstd):
    return torch.empty_like(x), x.new_empty(x.shape[-1], dtype=torch.float32)


# ------------------------------------------------------------------------------------ autograd
def _setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight, output[1])


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dweight = torch.ops.bertaccel.rms_norm_bwd(dy, x, weight, rstd)
    return dx, dweight.to(weight.dtype), None


torch.library.register_autograd(f"{NS}::rms_norm_fwd", _backward, setup_context=_setup)
define_public("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", "rms_norm_fwd")


# ------------------------------------------------------------------------------ public function
# the overload itself: calling it skips the packet's overload resolution on every eager call
_RMS_NORM = torch.ops.bertaccel.rms_norm.default


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Plain PyTorch, for tests: RMSNorm in float64."""
    return F.rms_norm(x.double(), (x.shape[-1],), weight.double(), eps)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float | None = None) -> Tensor:
    """`F.rms_norm(x, (H,), weight, eps)` through the kernel when it can run (CUDA, bf16/fp32,
    H <= 8192, with a weight of fp32 or x's dtype); PyTorch's own op otherwise. eps None: the dtype's
    machine epsilon, as in `F.rms_norm`."""
    entry = direct_entry(x, weight)  # (the check and the call in C++: csrc/eager.cpp)
    if entry is not None and (y := entry.rms_norm(x, weight, eps)) is not None:
        return y
    reason = why_not(x, params=(weight,)) if weight is not None else "no weight"
    if reason is not None:
        note_fallback("rms_norm", reason)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    return _RMS_NORM(x.contiguous(), weight, eps)  # (any leading dimensions, as layer_norm)


# ---------------------------------------------------------------------------------------- module
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


def _skip_reason(m: nn.Module) -> str | None:
    if type(m) is not nn.RMSNorm:
        return ""
    return None if len(m.normalized_shape) == 1 and m.weight is not None else "not an RMSNorm with a weight over the last dimension"


SWAP = SwapEntry("rms_norm", _skip_reason, FusedRMSNorm.from_module, "nn.RMSNorm -> FusedRMSNorm")
