"""LayerNorm over the last dimension, and its fused form LayerNorm(dropout(x + bias) + residual)
(csrc/layer_norm_fwd.cu, csrc/layer_norm_bwd.cu): fp32 statistics, the row read once into
registers and written once, 16-byte vector accesses, dropout from PyTorch's CUDA generator
(Philox) regenerated in backward; backward without atomics. RMSNorm (rms_norm.py) and the fused
embeddings (embeddings.py) share these kernels. The public function and module of the fused form
are in residual_layer_norm.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bertaccel.ops.eligibility import direct_entry, note_fallback, why_not
from bertaccel.ops.registration import NS, SEEDED, SwapEntry, check_dropout, cpu_dropout_keep, define_public, lib

CUDA_SOURCES = ["layer_norm_fwd.cu", "layer_norm_bwd.cu"]

# ------------------------------------------------------------------------------------ schemas
# rng: the dropout (seed, offset) when p > 0, else empty; z: the pre-norm sum in the fused form, else empty
lib.define(
    "layer_norm_fwd(Tensor x, Tensor? bias, Tensor? residual, Tensor weight, Tensor ln_bias, float p, float eps)"
    " -> (Tensor y, Tensor z, Tensor mean, Tensor rstd, Tensor rng)",
    tags=SEEDED,
)
lib.define(
    "layer_norm_bwd(Tensor dy, Tensor z, Tensor weight, Tensor mean, Tensor rstd, Tensor rng, float p, bool want_dh)"
    " -> (Tensor dz, Tensor dh, Tensor dweight, Tensor dln_bias, Tensor dbias)"
)
# the fused form's backward with the output's gradient in two parts, dy + dy2 (the output's two consumers, as
# residual_layer_norm.py's fan-out hands them over): the kernel sums them as it loads the rows
lib.define(
    "layer_norm_bwd2(Tensor dy, Tensor dy2, Tensor z, Tensor weight, Tensor mean, Tensor rstd, Tensor rng, float p)"
    " -> (Tensor dz, Tensor dh, Tensor dweight, Tensor dln_bias, Tensor dbias)"
)


# ------------------------------------------------------------------------------ CPU reference
@torch.library.impl(lib, "layer_norm_fwd", "CPU")
def _fwd_cpu(x, bias, residual, weight, ln_bias, p, eps):
    check_dropout(p)
    fused = bias is not None or residual is not None or p > 0
    h = x.float()
    rng = torch.zeros(2 if p > 0 else 0, dtype=torch.long)  # (seed, offset) with dropout, else empty
    if bias is not None:
        h = h + bias.float()
    if p > 0:
        rng[0] = int(torch.randint(0, 2**62, (1,)))
        h = h * cpu_dropout_keep(h.shape, p, rng) / (1 - p)
    if residual is not None:
        h = h + residual.float()
    if fused:
        h = h.to(x.dtype).float()  # z is saved in the input dtype; normalise what is saved
    var, mean = torch.var_mean(h, dim=-1, correction=0)
    rstd = torch.rsqrt(var + eps)
    y = ((h - mean[..., None]) * rstd[..., None] * weight.float() + ln_bias.float()).to(x.dtype)
    z = h.to(x.dtype) if fused else x.new_empty(0)
    return y, z, mean.reshape(-1), rstd.reshape(-1), rng


def layer_norm_grads_cpu(dy: Tensor, z: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor):
    """The LayerNorm backward from the saved input z and row statistics, in fp32: dz (in z's dtype
    and shape), dweight, dln_bias. Shared with the embeddings' CPU reference."""
    H = z.shape[-1]
    zf, dyf = z.float().reshape(-1, H), dy.float().reshape(-1, H)
    xhat = (zf - mean[:, None]) * rstd[:, None]
    g = dyf * weight.float()
    dz = rstd[:, None] * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    return dz.to(z.dtype).reshape(z.shape), (dyf * xhat).sum(0), dyf.sum(0)


@torch.library.impl(lib, "layer_norm_bwd", "CPU")
def _bwd_cpu(dy, z, weight, mean, rstd, rng, p, want_dh):
    H = z.shape[-1]
    dz, dweight, dln_bias = layer_norm_grads_cpu(dy, z, weight, mean, rstd)
    if not want_dh:
        return dz, z.new_empty(0), dweight, dln_bias, dweight.new_empty(0)
    dh = dz.to(torch.float32, copy=True)  # (not dz itself: fp32 outputs must not alias)
    if p > 0:
        dh = dh * cpu_dropout_keep(z.shape, p, rng) / (1 - p)
    dh = dh.to(z.dtype)
    return dz, dh, dweight, dln_bias, dh.float().reshape(-1, H).sum(0)


@torch.library.impl(lib, "layer_norm_bwd2", "CPU")
def _bwd2_cpu(dy, dy2, z, weight, mean, rstd, rng, p):
    # the sum rounded to the gradient's dtype, as adding the two tensors first would hand it over
    return _bwd_cpu((dy.float() + dy2.float()).to(dy.dtype), z, weight, mean, rstd, rng, p, True)


# ----------------------------------------------------------------------------------------- fake
@torch.library.register_fake(f"{NS}::layer_norm_fwd")
def _fwd_fake(x, bias, residual, weight, ln_bias, p, eps):
    check_dropout(p)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    fused = bias is not None or residual is not None or p > 0
    f = x.new_empty(rows, dtype=torch.float32)
    return (torch.empty_like(x), torch.empty_like(x) if fused else x.new_empty(0), f, torch.empty_like(f),
            x.new_empty(2 if p > 0 else 0, dtype=torch.long))


@torch.library.register_fake(f"{NS}::layer_norm_bwd")
def _bwd_fake(dy, z, weight, mean, rstd, rng, p, want_dh):
    H = z.shape[-1]
    w = z.new_empty(H, dtype=torch.float32)
    if want_dh:
        return torch.empty_like(z), torch.empty_like(z), w, torch.empty_like(w), torch.empty_like(w)
    return torch.empty_like(z), z.new_empty(0), w, torch.empty_like(w), z.new_empty(0, dtype=torch.float32)


@torch.library.register_fake(f"{NS}::layer_norm_bwd2")
def _bwd2_fake(dy, dy2, z, weight, mean, rstd, rng, p):
    return _bwd_fake(dy, z, weight, mean, rstd, rng, p, True)


# ------------------------------------------------------------------------------------ autograd
# The Python formula (CPU, and what a GPU without the extension would reach); csrc/autograd.cpp
# is the same formula in C++ for CUDA.
def _setup(ctx, inputs, output):
    x, bias, residual, weight, ln_bias, p, eps = inputs
    y, z, mean, rstd, rng = output
    ctx.fused = bias is not None or residual is not None or p > 0
    ctx.has_bias, ctx.has_residual, ctx.p = bias is not None, residual is not None, p
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.param_dtype = weight.dtype
    ctx.save_for_backward(z if ctx.fused else x, weight, mean, rstd, rng)


def _backward(ctx, dy, _dz, _dmean, _drstd, _drng):
    z, weight, mean, rstd, rng = ctx.saved_tensors
    dz, dh, dweight, dln_bias, dbias = torch.ops.bertaccel.layer_norm_bwd(dy, z, weight, mean, rstd, rng, ctx.p, ctx.fused)
    return (
        dh if ctx.fused else dz,
        dbias.to(ctx.bias_dtype) if ctx.has_bias else None,
        dz if ctx.has_residual else None,
        dweight.to(ctx.param_dtype),
        dln_bias.to(ctx.param_dtype),
        None,
        None,
    )


torch.library.register_autograd(f"{NS}::layer_norm_fwd", _backward, setup_context=_setup)
define_public(
    "layer_norm(Tensor x, Tensor? bias, Tensor? residual, Tensor weight, Tensor ln_bias, float p, float eps) -> Tensor",
    "layer_norm_fwd", tags=SEEDED,
)


# ------------------------------------------------------------------------------ public function
# the overload itself: calling it skips the packet's overload resolution on every eager call
_LAYER_NORM = torch.ops.bertaccel.layer_norm.default


def layer_norm_reference(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """Plain PyTorch, for tests: LayerNorm in float64."""
    return F.layer_norm(x.double(), (x.shape[-1],), weight.double(), bias.double(), eps)


def layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float = 1e-5) -> Tensor:
    """`F.layer_norm(x, (H,), weight, bias, eps)` through the kernel when it can run (CUDA, bf16/fp32,
    H <= 8192, affine, weights fp32 or x's dtype); PyTorch's own op otherwise, with the same result."""
    entry = direct_entry(x, weight, bias)  # (the check and the call in C++: csrc/eager.cpp)
    if entry is not None and (y := entry.layer_norm(x, weight, bias, eps)) is not None:
        return y
    reason = why_not(x, params=(weight, bias)) if weight is not None and bias is not None else "no affine weight/bias"
    if reason is not None:
        note_fallback("layer_norm", reason)
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    # (any number of leading dimensions: the kernels take rows = numel / H; no views to make and undo per call)
    return _LAYER_NORM(x.contiguous(), None, None, weight, bias, 0.0, eps)


# ---------------------------------------------------------------------------------------- module
class FusedLayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` whose forward runs the kernel; same parameters and state_dict keys."""

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


def _skip_reason(m: nn.Module) -> str | None:
    if type(m) is not nn.LayerNorm:
        return ""
    return None if len(m.normalized_shape) == 1 and m.elementwise_affine else "not an affine LayerNorm over the last dimension"


SWAP = SwapEntry("layer_norm", _skip_reason, FusedLayerNorm.from_module, "nn.LayerNorm -> FusedLayerNorm")
