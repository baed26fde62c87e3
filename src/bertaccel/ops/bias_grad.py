"""Linear layers' bias gradients: the column sums of the output gradient (csrc/column_sum.cu).

PyTorch's `dy.sum(0)` over a [tokens, N] bf16 gradient is a reduction of few output columns over
many rows, which its reduction kernel spreads badly: on an H100 it reached ~15% of the copy
bandwidth at [9,830, 384] and ~35% at [16,384, 1,152] (the MiniLM fine-tune's Q/K/V bias gradients,
0.30 / 0.21 ms per step). `column_sum` reads each element once with 16-byte loads over the whole
GPU and adds per-chunk partial rows in a second, dependently launched kernel (deterministic).

`dense(x, weight, bias)` is `F.linear` (cuBLAS) whose backward returns the bias gradient in the
bias's own dtype: an fp32 bias is summed straight into fp32, with no bf16 cast of the bias in the
forward and no widening of its gradient in the backward. Its weight and bias gradients come from
`dense_wgrad` (csrc/dense_wgrad.cu): cuBLAS's GEMM, then `column_sum`; BERTACCEL_DENSE_WGRAD=fused
makes them one cuBLASLt matmul with the BGRADB epilogue, which measured slower on an H200 (119 vs
110 us at BERT-base's Q/K/V projection) and offered only a bf16 bias gradient. The fused
Q/K/V projection (`bertaccel.ops.qkv`) runs on it; our GEMM's linear layers (`bertaccel.ops.gemm`)
sum their bias gradients with `column_sum` too.

Not a kernel-swap family: other ops call it. On CPU (and for dtypes the kernel does not take) the
op runs PyTorch's sum, so the schema, opcheck and the autograd are tested without a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from bertaccel.ops.eligibility import compute_dtype, note_fallback, why_not
from bertaccel.ops.registration import NS, lib

CUDA_SOURCES = ["column_sum.cu", "dense_wgrad.cu"]

lib.define("column_sum(Tensor x) -> Tensor")
lib.define("dense(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
# (dy^T x, dy summed over the tokens in fp32) for dy [tokens, out], x [tokens, in]
lib.define("dense_wgrad(Tensor dy, Tensor x) -> (Tensor, Tensor)")
lib.define("dense_wgrad_path(Tensor dy, Tensor x) -> str")


# ------------------------------------------------------------------------------ CPU reference / fake
def _sum_dtype(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs


def column_sum_reference(x: Tensor) -> Tensor:
    """x summed over every dimension but the last, accumulated and returned in fp32 (fp64 for fp64)."""
    return x.reshape(-1, x.shape[-1]).sum(0, dtype=_sum_dtype(x))


@torch.library.impl(lib, "column_sum", "CPU")
def _column_sum_cpu(x):
    return column_sum_reference(x)


@torch.library.register_fake(f"{NS}::column_sum")
def _column_sum_fake(x):
    return x.new_empty(x.shape[-1], dtype=_sum_dtype(x))


def _column_sum_setup(ctx, inputs, output):
    (x,) = inputs
    ctx.shape, ctx.dtype = x.shape, x.dtype


def _column_sum_backward(ctx, g):
    return g.to(ctx.dtype).expand(ctx.shape)


torch.library.register_autograd(f"{NS}::column_sum", _column_sum_backward, setup_context=_column_sum_setup)
_COLUMN_SUM = torch.ops.bertaccel.column_sum.default


def dense_wgrad_reference(dy: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    """A linear layer's weight gradient dy^T x (in dy's dtype) and bias gradient (fp32; fp64 for fp64)."""
    return dy.t() @ x, column_sum_reference(dy)


@torch.library.impl(lib, "dense_wgrad", "CPU")
def _dense_wgrad_cpu(dy, x):
    return dense_wgrad_reference(dy, x)


@torch.library.register_fake(f"{NS}::dense_wgrad")
def _dense_wgrad_fake(dy, x):
    return dy.new_empty(dy.shape[1], x.shape[1]), dy.new_empty(dy.shape[1], dtype=_sum_dtype(dy))


@torch.library.impl(lib, "dense_wgrad_path", "CPU")
def _dense_wgrad_path_cpu(dy, x):
    return "separate: a CPU tensor"


_DENSE_WGRAD = torch.ops.bertaccel.dense_wgrad.default


def dense_wgrad_path(dy: Tensor, x: Tensor) -> str:
    """Which form `dense_wgrad` takes for these inputs: "separate: <why not fused>" (the GEMM, then
    `column_sum`: the default), or with BERTACCEL_DENSE_WGRAD=fused "fused (fp32 bias gradient)" / "fused
    (bf16 bias gradient)" (one cuBLASLt matmul)."""
    return torch.ops.bertaccel.dense_wgrad_path(dy, x)


# ------------------------------------------------------------------------------ public column_sum
def column_sum(x: Tensor) -> Tensor:
    """`x.reshape(-1, N).sum(0, dtype=torch.float32)` (fp64 for fp64 inputs): on the kernel for bf16 /
    fp32 CUDA tensors, PyTorch's sum otherwise (said once)."""
    reason = why_not(x, hidden=1)
    if reason is None:
        return _COLUMN_SUM(x.contiguous())
    note_fallback("column_sum", reason)
    return column_sum_reference(x)


# ------------------------------------------------------------------------------ dense: F.linear
# Composite: the forward and both matmuls of the backward are PyTorch's (cuBLAS); only the bias
# gradient is ours. x and weight come in one dtype (the public function casts them as autocast
# would); the bias may be wider (an fp32 master): it is added in x's dtype, as autocast adds it.
@torch.library.impl(lib, "dense", "CompositeExplicitAutograd")
def _dense(x, weight, bias):
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))


@torch.library.register_fake(f"{NS}::dense")
def _dense_fake(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def linear_setup(ctx, inputs, output):
    """What a linear op's backward keeps (`dense` here, `linear` in gemm.py): x, weight, the bias's dtype."""
    x, weight, bias = inputs
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.save_for_backward(x, weight)


def _dense_backward(ctx, dy):
    x, weight = ctx.saved_tensors
    dy2 = dy.reshape(-1, dy.shape[-1])
    dx = (dy2 @ weight).view(*dy.shape[:-1], weight.shape[1]) if ctx.needs_input_grad[0] else None
    x2 = x.reshape(-1, x.shape[-1])
    want_db = ctx.bias_dtype is not None and ctx.needs_input_grad[2]
    dw = db = None
    if ctx.needs_input_grad[1] and want_db and why_not(dy2, hidden=1) is None:
        dw, db = _DENSE_WGRAD(dy2, x2)  # GEMM + column_sum, or one cuBLASLt matmul (csrc/dense_wgrad.cu)
    else:
        dw = dy2.t() @ x2 if ctx.needs_input_grad[1] else None
        db = column_sum(dy2) if want_db else None
    return dx, dw, None if db is None else db.to(ctx.bias_dtype)


torch.library.register_autograd(f"{NS}::dense", _dense_backward, setup_context=linear_setup)
_DENSE = torch.ops.bertaccel.dense.default


def dense(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)` computed in x's dtype or the autocast dtype (weight cast to it as
    autocast would), whose bias gradient is summed by `column_sum` into the bias's own dtype. Plain
    `F.linear` where the kernels cannot run (CPU, fp16, the extension not built: said once)."""
    dtype = compute_dtype(x)
    reason = why_not(x, hidden=1, dtype=dtype)
    if reason is not None or bias is None:
        if reason is not None:
            note_fallback("dense", reason)
        return F.linear(x, weight, bias)
    # on [tokens, in] rows: the op's output is then a tensor of its own, and the [..., out] result a view of
    # it in the autograd graph. (A 3-D x gave the op's output as a view of F.linear's internal 2-D product,
    # outside the graph: the attention interface could not see q, k, v as one projection's parts, and
    # autograd joined their three gradients with a cat - 0.6 ms per BERT-base 32x512 step.)
    with torch.autocast(x.device.type, enabled=False):
        y = _DENSE(x.reshape(-1, x.shape[-1]).to(dtype), weight.to(dtype), bias)
    return y.view(*x.shape[:-1], y.shape[-1])
