"""The fused tail of BERT's sub-layers (csrc/layer_norm_fwd.cu, layer_norm_bwd.cu; schemas in layer_norm.py): LayerNorm(dropout(x + bias) + residual)
in one kernel, dropout drawn from PyTorch's CUDA generator (Philox) and regenerated in backward."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import bertaccel.ops.layer_norm  # noqa: F401 - defines the op this family runs
from bertaccel.ops.eligibility import compute_dtype, direct_entry, note_fallback, why_not
from bertaccel.ops.gemm import dense_matmul
from bertaccel.ops.registration import SwapEntry

CUDA_SOURCES = ["layer_norm_fwd.cu", "layer_norm_bwd.cu"]
# the overload itself: calling it skips the packet's overload resolution on every eager call
_LAYER_NORM = torch.ops.bertaccel.layer_norm.default


def bias_dropout_add_layer_norm_reference(x, bias, residual, weight, ln_bias, p, eps, training=True) -> Tensor:
    """Plain PyTorch: the computation HF's BertSelfOutput / BertOutput do after their matmul."""
    return F.layer_norm(F.dropout(x + bias, p, training) + residual, (x.shape[-1],), weight, ln_bias, eps)


def bias_dropout_add_layer_norm(
    x: Tensor, bias: Tensor, residual: Tensor, weight: Tensor, ln_bias: Tensor, p: float, eps: float, training: bool = True
) -> Tensor:
    """LayerNorm(dropout(x + bias, p) + residual). Runs in x's dtype (the residual is cast to it, the bias
    read in the LayerNorm weight's dtype, the sums in fp32); the reference computation when the kernel cannot run."""
    entry = direct_entry(x, bias, residual, weight, ln_bias)  # (the check and the call in C++: csrc/eager.cpp)
    if entry is not None and (y := entry.bias_dropout_add_layer_norm(
            x, bias, residual, weight, ln_bias, float(p) if training else 0.0, eps)) is not None:
        return y
    reason = why_not(x, params=(weight, ln_bias))
    if reason is not None:
        note_fallback("residual_layer_norm", reason)
        return bias_dropout_add_layer_norm_reference(x, bias, residual, weight, ln_bias, p, eps, training)
    return _LAYER_NORM(*_kernel_args(x, bias, residual, weight, ln_bias, p, eps, training))


def _kernel_args(x, bias, residual, weight, ln_bias, p, eps, training):
    """The layer_norm op's arguments: x as it is shaped (the kernels take rows = numel / H, so no views are made
    and undone per call), the residual in x's dtype and shape, the bias in the LayerNorm weight's dtype (the kernel
    reads it so: an fp32 master bias goes as it is, no cast kernel, and its gradient comes back in fp32 unrounded),
    no dropout in eval."""
    if residual.shape != x.shape:
        residual = residual.reshape(x.shape)
    return (x.contiguous(), bias.to(weight.dtype).contiguous(), residual.to(x.dtype).contiguous(),
            weight, ln_bias, float(p) if training else 0.0, eps)


# --------------------------------------------------------------------- the residual gradient's fan-out
# A BERT sub-layer's output y = LayerNorm(...) has two consumers: the next sub-layer (its first GEMM) and the next
# residual LayerNorm (as its residual). Autograd adds their two gradients in a kernel of its own before y's
# backward runs (two [T, H] adds per layer: 0.54 ms of a BERT-base 32x512 H100 step). With the fan-out (on by
# default; BERTACCEL_RESIDUAL_FANOUT=0, read per forward, turns it off) the op hands the residual consumer an alias
# of y of its own (`residual_alias`: the same memory, another autograd edge), so the backward receives the two
# gradients apart and the LayerNorm backward kernel sums them as it loads the rows (layer_norm_bwd2). BERT-base
# 32x512 graphed step, H200, same call, two rounds (session 48): 23.057 / 23.067 ms with it, 23.256 / 23.297 without.
RESIDUAL_ALIAS = "_bertaccel_residual"  # the attribute of y holding the alias for the next residual LayerNorm


def residual_fanout_active() -> bool:
    """The fan-out applies: not turned off (BERTACCEL_RESIDUAL_FANOUT=0), gradients recorded, not traced by
    torch.compile (tested first: nothing for dynamo to trace in the environment read)."""
    return (not torch.compiler.is_compiling() and torch.is_grad_enabled()
            and os.environ.get("BERTACCEL_RESIDUAL_FANOUT", "1") != "0")


def leave_residual_alias(y: Tensor, alias: Tensor) -> Tensor:
    """y, carrying `alias` for its residual consumer (`residual_alias`)."""
    setattr(y, RESIDUAL_ALIAS, alias)
    return y


def layer_norm_bwd_of_parts(dy: Tensor | None, dy_alias: Tensor | None, z, weight, mean, rstd, rng, p: float):
    """The fused form's backward (layer_norm_bwd's five outputs) from its output's gradient in up to two parts: the
    summing kernel (layer_norm_bwd2) when both came, the plain backward on the one that did. Not both None."""
    if dy is not None and dy_alias is not None:
        return torch.ops.bertaccel.layer_norm_bwd2(dy.contiguous(), dy_alias.contiguous(), z, weight, mean, rstd, rng, p)
    return torch.ops.bertaccel.layer_norm_bwd((dy if dy is not None else dy_alias).contiguous(), z, weight, mean, rstd,
                                              rng, p, True)


class _ResidualLayerNormFanOut(torch.autograd.Function):
    """LayerNorm(dropout(x + bias) + residual) returning (y, an alias of y); the backward takes both outputs'
    gradients and runs the LayerNorm backward once on their sum (summed in the kernel). csrc/autograd.cpp's
    ResidualLayerNormFanOutFn is the same in C++ (eager calls)."""

    @staticmethod
    def forward(ctx, x, bias, residual, weight, ln_bias, p, eps):
        y, z, mean, rstd, rng = torch.ops.bertaccel.layer_norm_fwd(x, bias, residual, weight, ln_bias, p, eps)
        ctx.save_for_backward(z, weight, mean, rstd, rng)
        ctx.p = p
        ctx.dtypes = (bias.dtype, weight.dtype, ln_bias.dtype)
        ctx.set_materialize_grads(False)
        return y, y.detach()  # (detach: the same memory, not a view - no reference from the alias back to y)

    @staticmethod
    def backward(ctx, dy, dy_alias):
        if dy is None and dy_alias is None:
            return (None,) * 7
        dz, dh, dweight, dln_bias, dbias = layer_norm_bwd_of_parts(dy, dy_alias, *ctx.saved_tensors, ctx.p)
        bias_dtype, weight_dtype, ln_bias_dtype = ctx.dtypes
        return dh, dbias.to(bias_dtype), dz, dweight.to(weight_dtype), dln_bias.to(ln_bias_dtype), None, None


def bias_dropout_add_layer_norm_fanout(x: Tensor, bias: Tensor, residual: Tensor, weight: Tensor, ln_bias: Tensor,
                                       p: float, eps: float, training: bool = True) -> tuple[Tensor, Tensor]:
    """bias_dropout_add_layer_norm's output y and an alias of it for a second consumer, whose gradient then
    reaches the LayerNorm backward apart from y's (summed in its kernel instead of by autograd). The kernel's path
    only (see `bias_dropout_add_layer_norm`): in eager calls csrc/autograd.cpp's C++ form of the Function below
    (through csrc/eager.cpp), otherwise that Python Function."""
    entry = direct_entry(x, bias, residual, weight, ln_bias)
    if entry is not None and (out := entry.bias_dropout_add_layer_norm_fanout(
            x, bias, residual, weight, ln_bias, float(p) if training else 0.0, eps)) is not None:
        return out
    return _ResidualLayerNormFanOut.apply(*_kernel_args(x, bias, residual, weight, ln_bias, p, eps, training))


def residual_alias(t: Tensor) -> Tensor:
    """The alias a fan-out LayerNorm left on its output `t` for its residual consumer, or `t` itself."""
    alias = getattr(t, RESIDUAL_ALIAS, None)
    return alias if alias is not None and alias.shape == t.shape else t


class FusedBertOutput(nn.Module):
    """Replaces an HF `BertSelfOutput` / `BertOutput` (dense -> dropout -> LayerNorm(. + input)):
    the matmul without its bias, then bias + dropout + residual + LayerNorm in one kernel. Keeps the
    original submodules (`dense`, `dropout`, `LayerNorm`), so parameters and state_dict keys are
    unchanged, and runs the original computation exactly when the kernel cannot run."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        self.dense, self.dropout, self.LayerNorm = original.dense, original.dropout, original.LayerNorm
        self.train(original.training)

    def forward(self, hidden_states: Tensor, input_tensor: Tensor) -> Tensor:
        # The dtype the matmul will produce (bf16 under autocast) decides eligibility.
        dtype = compute_dtype(hidden_states)
        if self.dense.bias is None or why_not(hidden_states, self.dense.out_features, dtype,
                                              (self.LayerNorm.weight, self.LayerNorm.bias)) is not None:
            return self.LayerNorm(self.dropout(self.dense(hidden_states)) + input_tensor)
        h = dense_matmul(self.dense, hidden_states)
        args = (self.dense.bias, self.LayerNorm.weight, self.LayerNorm.bias, self.dropout.p, self.LayerNorm.eps,
                self.training)
        if residual_fanout_active():  # (h: the device, dtype and width the check above passed)
            # the residual through the alias its producer left (so its gradient comes back apart), and an alias of
            # this output for the next residual LayerNorm
            return leave_residual_alias(*bias_dropout_add_layer_norm_fanout(h, args[0], residual_alias(input_tensor),
                                                                            *args[1:]))
        return bias_dropout_add_layer_norm(h, args[0], input_tensor, *args[1:])


def _skip_reason(m: nn.Module) -> str | None:
    is_output = type(m).__name__ in ("BertSelfOutput", "BertOutput") and all(
        hasattr(m, a) for a in ("dense", "dropout", "LayerNorm")
    ) and isinstance(m.LayerNorm, nn.LayerNorm)
    return None if is_output else ""


SWAP = SwapEntry("residual_layer_norm", _skip_reason, FusedBertOutput,
                 "BertSelfOutput / BertOutput -> FusedBertOutput (bias + dropout + residual + LayerNorm)")
