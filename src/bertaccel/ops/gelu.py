"""Fused bias + GELU (csrc/gelu.cu): exact erf GELU (HF's "gelu") or the tanh approximation
("gelu_new", "gelu_pytorch_tanh"), forward and backward (dbias reduced without atomics)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bertaccel.ops import gelu_math
from bertaccel.ops.eligibility import bias_as_read, compute_dtype, direct_entry, note_fallback, why_not
from bertaccel.ops.gemm import dense_matmul
from bertaccel.ops.registration import NS, SwapEntry, lib

CUDA_SOURCES = ["gelu.cu"]

# ------------------------------------------------------------------------------------ schemas
lib.define("bias_gelu(Tensor x, Tensor? bias, bool tanh) -> Tensor")
lib.define("bias_gelu_bwd(Tensor dy, Tensor x, Tensor? bias, bool tanh) -> (Tensor, Tensor)")


# ------------------------------------------------------------------------------ CPU reference
@torch.library.impl(lib, "bias_gelu", "CPU")
def _fwd_cpu(x, bias, tanh):
    h = x.float() if bias is None else x.float() + bias.float()
    return gelu_math.gelu(h, tanh).to(x.dtype)


@torch.library.impl(lib, "bias_gelu_bwd", "CPU")
def _bwd_cpu(dy, x, bias, tanh):
    h = x.float() if bias is None else x.float() + bias.float()
    dx = (dy.float() * gelu_math.gelu_derivative(h, tanh)).to(x.dtype)
    dbias = dx.float().reshape(-1, x.shape[-1]).sum(0) if bias is not None else dx.new_empty(0, dtype=torch.float32)
    return dx, dbias


# ----------------------------------------------------------------------------------------- fake
@torch.library.register_fake(f"{NS}::bias_gelu")
def _fwd_fake(x, bias, tanh):
    return torch.empty_like(x)


@torch.library.register_fake(f"{NS}::bias_gelu_bwd")
def _bwd_fake(dy, x, bias, tanh):
    return torch.empty_like(x), x.new_empty(x.shape[-1] if bias is not None else 0, dtype=torch.float32)


# ------------------------------------------------------------------------------------ autograd
def _setup(ctx, inputs, output):
    x, bias, tanh = inputs
    ctx.tanh = tanh
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.save_for_backward(x, bias)


def _backward(ctx, dy):
    x, bias = ctx.saved_tensors
    dx, dbias = torch.ops.bertaccel.bias_gelu_bwd(dy, x, bias, ctx.tanh)
    return dx, (dbias.to(ctx.bias_dtype) if bias is not None else None), None


torch.library.register_autograd(f"{NS}::bias_gelu", _backward, setup_context=_setup)

# ------------------------------------------------------------------------------ public function
# the overload itself: calling it skips the packet's overload resolution on every eager call
_BIAS_GELU = torch.ops.bertaccel.bias_gelu.default


TANH_ACTIVATIONS = {"NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "FastGELUActivation"}
ERF_ACTIVATIONS = {"GELUActivation"}


def bias_gelu_reference(x: Tensor, bias: Tensor | None, approximate: str = "none") -> Tensor:
    return F.gelu(x if bias is None else x + bias, approximate=approximate)


def bias_gelu(x: Tensor, bias: Tensor | None = None, approximate: str = "none") -> Tensor:
    """GELU(x + bias) in one pass (`approximate` as in `F.gelu`); PyTorch when the kernel cannot run."""
    entry = direct_entry(x, bias)  # (the check and the call in C++: csrc/eager.cpp)
    if entry is not None and (y := entry.bias_gelu(x, bias, approximate == "tanh")) is not None:
        return y
    reason = why_not(x)
    if reason is not None:
        note_fallback("bias_gelu", reason)
        return bias_gelu_reference(x, bias, approximate)
    b = None if bias is None else bias_as_read(bias, x.dtype).contiguous()
    return _BIAS_GELU(x.contiguous(), b, approximate == "tanh")


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    return bias_gelu(x, None, approximate)


def activation_kind(act: nn.Module) -> str | None:
    """"none" / "tanh" for the GELU modules HF uses, None for anything else."""
    name = type(act).__name__
    if name in ERF_ACTIVATIONS and not getattr(act, "use_gelu_python", False):
        return "none"
    if name in TANH_ACTIVATIONS:
        return "tanh"
    if isinstance(act, nn.GELU):
        return act.approximate
    return None


# ---------------------------------------------------------------------------------------- module
class FusedBertIntermediate(nn.Module):
    """Replaces an HF `BertIntermediate` (dense -> GELU): the matmul without bias, then bias + GELU
    in one kernel. Same submodules and state_dict keys; the original computation when the kernel
    cannot run."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        kind = activation_kind(original.intermediate_act_fn)
        if kind is None:
            raise ValueError(f"activation {type(original.intermediate_act_fn).__name__} is not a GELU")
        self.dense, self.intermediate_act_fn, self.approximate = original.dense, original.intermediate_act_fn, kind
        self.train(original.training)

    def forward(self, hidden_states: Tensor) -> Tensor:
        # The dtype the matmul will produce (bf16 under autocast) decides eligibility.
        dtype = compute_dtype(hidden_states)
        if self.dense.bias is None or why_not(hidden_states, self.dense.out_features, dtype) is not None:
            return self.intermediate_act_fn(self.dense(hidden_states))
        # With the GEMM swapped in, the matmul runs on it and bias + GELU stay in their own kernel: the
        # GEMM's GELU epilogue (gemm.linear_gelu) saving the pre-activation at best ties it at BERT's FFN
        # shape (16384 x 3072 x 768 on an H100: 0.202-0.218 ms vs 0.200-0.202 for a cuBLAS GEMM + this
        # kernel, three runs, docs/gemm.md), and this kernel's backward also sums the bias
        # gradient in the same pass.
        return bias_gelu(dense_matmul(self.dense, hidden_states), self.dense.bias, self.approximate)


def _skip_reason(m: nn.Module) -> str | None:
    if type(m).__name__ != "BertIntermediate" or not (hasattr(m, "dense") and hasattr(m, "intermediate_act_fn")):
        return ""
    if activation_kind(m.intermediate_act_fn) is None:
        return f"activation {type(m.intermediate_act_fn).__name__} is not a GELU"
    return None


SWAP = SwapEntry("bias_gelu", _skip_reason, FusedBertIntermediate,
                 "BertIntermediate -> FusedBertIntermediate (bias + GELU)")
