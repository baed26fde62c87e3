"""Our own bf16 tensor-core GEMM (csrc/gemm.cu: TMA + wgmma, warp-specialised, persistent; sm_90a)
with fused epilogues, and the linear layers built on it.

`gemm(a, b, ...)` computes `epilogue(op(a) @ op(b)^T)` where op transposes an operand given in the
other layout (`trans_a`: a is stored [K, M]; `trans_b`: b is stored [K, N]); no operand is ever
transposed in memory. A linear layer's three GEMMs are all one kernel:
    forward  y  = x W^T        gemm(x, W)                          (+ bias, + GELU, + residual)
    dgrad    dx = dy W         gemm(dy, W, trans_b=True)          (x dGELU(pre) for the FFN)
    wgrad    dW = dy^T x       gemm(dy, x, trans_a=True, trans_b=True)   (split-K: K = tokens)

Epilogues (`EPILOGUES`): none, bias, bias+GELU (erf or tanh; optionally writing the pre-activation
for the backward), bias+residual (the bias optional: the fused FFN's input gradient adds the residual's
gradient to its dgrad with it), and dGELU (the incoming gradient times gelu'(saved pre-activation)).

The kernel runs on Hopper (compute capability 9.0) for bf16 operands whose inner dimensions are
multiples of 8 with 16-byte aligned data (what the copy engine needs); M, N and K need not be
multiples of the tile. fp32 operands run a SIMT kernel on the CUDA cores (csrc/gemm_fp32.cu: 128 x
128 or 128 x 64 block tiles, K steps of 16, 8 x 8 outputs per thread, double-buffered shared memory;
fp32 out, same epilogues, K split where the tiles are too few); `linear` / `linear_gelu` take it only
with BERTACCEL_GEMM_FP32=1 (it measured 0.64-0.92x of cuBLAS's fp32 GEMM, commit 9da32bf), the fused
FFN stays bf16.
Anything else runs `F.linear` / `torch.matmul` (cuBLAS), said once.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bertaccel.ops import build, gelu_math
from bertaccel.ops.bias_grad import column_sum, linear_setup
from bertaccel.ops.eligibility import bias_as_read, compute_dtype, note_fallback
from bertaccel.ops.registration import NS, SwapEntry, lib

CUDA_SOURCES: list[str] = []  # the GEMM is its own sm_90a extension: build.GEMM_SOURCES

EPILOGUES = {"none": 0, "bias": 1, "bias_gelu": 2, "bias_gelu_tanh": 3, "bias_residual": 4, "dgelu": 5,
             "dgelu_tanh": 6}

# ------------------------------------------------------------------------------------ schemas
lib.define("gemm(Tensor a, Tensor b, Tensor? bias, Tensor? aux, int epilogue, bool trans_a, bool trans_b, "
           "bool out_fp32, bool save_pre, int tile_n=0, int splits=0, int schedule=0) -> (Tensor, Tensor)")
# the configuration a gemm call with these arguments runs (the cost model's pick, or a kept tuned pick with
# BERTACCEL_GEMM_TUNE=1): [tile rows, tile width, K splits, schedule, in-kernel split sum, tuned, blocks per
# cluster]; CUDA only
lib.define("gemm_config(Tensor a, Tensor b, int epilogue, bool trans_a, bool trans_b, bool out_fp32, "
           "bool save_pre) -> int[]")
lib.define("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
lib.define("linear_gelu(Tensor x, Tensor weight, Tensor bias, bool tanh) -> (Tensor, Tensor)")


# ------------------------------------------------------------------------------ CPU reference
def apply_epilogue(acc: Tensor, bias, aux, epilogue: int, save_pre: bool, pre_dtype: torch.dtype):
    """The epilogues on a product `acc` (in acc's precision): (output, pre-activation or empty)."""
    pre = acc.new_empty(0, dtype=pre_dtype)
    if epilogue in (1, 2, 3) or (epilogue == 4 and bias is not None):  # the residual epilogue's bias is optional
        acc = acc + bias.to(acc.dtype)
    if epilogue in (2, 3):
        if save_pre:
            pre = acc.to(pre_dtype)
        acc = gelu_math.gelu(acc, epilogue == 3)
    elif epilogue == 4:
        acc = acc + aux.to(acc.dtype)
    elif epilogue in (5, 6):
        acc = acc * gelu_math.gelu_derivative(aux.to(acc.dtype), epilogue == 6)
    return acc, pre


def gemm_reference(a, b, bias, aux, epilogue, trans_a, trans_b, out_fp32, save_pre, tile_n=0, splits=0, schedule=0):
    """What the kernel computes, from the given operands (any device): the product and epilogue in
    fp32 (float64 for float64 operands), the output in fp32 or the operands' dtype."""
    work = torch.float64 if a.dtype == torch.float64 else torch.float32
    A = (a.t() if trans_a else a).to(work)
    B = (b.t() if trans_b else b).to(work)
    out, pre = apply_epilogue(A @ B.t(), bias, aux, epilogue, save_pre, a.dtype)
    return out.to(torch.float32 if out_fp32 else a.dtype), pre


@torch.library.impl(lib, "gemm", "CPU")
def _gemm_cpu(a, b, bias, aux, epilogue, trans_a, trans_b, out_fp32, save_pre, tile_n=0, splits=0, schedule=0):
    return gemm_reference(a, b, bias, aux, epilogue, trans_a, trans_b, out_fp32, save_pre)


# ----------------------------------------------------------------------------------------- fake
@torch.library.register_fake(f"{NS}::gemm")
def _gemm_fake(a, b, bias, aux, epilogue, trans_a, trans_b, out_fp32, save_pre, tile_n=0, splits=0, schedule=0):
    M = a.shape[1] if trans_a else a.shape[0]
    N = b.shape[1] if trans_b else b.shape[0]
    out = a.new_empty(M, N, dtype=torch.float32 if out_fp32 else a.dtype)
    pre = a.new_empty(M, N) if (save_pre and epilogue in (2, 3)) else a.new_empty(0)
    return out, pre


_GEMM = torch.ops.bertaccel.gemm.default


# ------------------------------------------------------------- linear and linear + GELU (ops)
# Composite over `gemm`: on CPU the reference runs through the same formulas, so CI tests the
# autograd, opcheck and compile paths; on a GPU every GEMM below is the kernel.
def _wgrad_dgrad(ctx, dh: Tensor, x: Tensor, weight: Tensor) -> tuple[Tensor | None, Tensor | None]:
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = _GEMM(dh, weight, None, None, 0, False, True, False, False)[0]
    if ctx.needs_input_grad[1]:
        dw = _GEMM(dh, x, None, None, 0, True, True, weight.dtype == torch.float32, False)[0]
    return dx, dw


@torch.library.impl(lib, "linear", "CompositeExplicitAutograd")
def _linear(x, weight, bias):
    return _GEMM(x, weight, bias, None, 0 if bias is None else 1, False, False, False, False)[0]


@torch.library.register_fake(f"{NS}::linear")
def _linear_fake(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


def _linear_backward(ctx, dy):
    x, weight = ctx.saved_tensors
    dy = dy.contiguous()  # the copy engine reads unit-stride rows (a broadcast gradient is not)
    dx, dw = _wgrad_dgrad(ctx, dy, x, weight)
    # summed in fp32 as it is read (bias_grad.column_sum; PyTorch's dy.sum(0) spreads few columns badly)
    db = column_sum(dy).to(ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[2] else None
    return dx, dw, db


torch.library.register_autograd(f"{NS}::linear", _linear_backward, setup_context=linear_setup)


@torch.library.impl(lib, "linear_gelu", "CompositeExplicitAutograd")
def _linear_gelu(x, weight, bias, tanh):
    return _GEMM(x, weight, bias, None, 3 if tanh else 2, False, False, False, True)


@torch.library.register_fake(f"{NS}::linear_gelu")
def _linear_gelu_fake(x, weight, bias, tanh):
    return x.new_empty(x.shape[0], weight.shape[0]), x.new_empty(x.shape[0], weight.shape[0])


def _linear_gelu_setup(ctx, inputs, output):
    x, weight, bias, tanh = inputs
    ctx.tanh, ctx.bias_dtype = tanh, bias.dtype
    ctx.save_for_backward(x, weight, output[1])


def _linear_gelu_backward(ctx, dy, _dpre):
    x, weight, pre = ctx.saved_tensors
    # d(pre) = dy * gelu'(pre): the existing bias_gelu backward kernel (no bias) gives it in one pass
    dh = torch.ops.bertaccel.bias_gelu_bwd(dy.contiguous(), pre, None, ctx.tanh)[0]
    dx, dw = _wgrad_dgrad(ctx, dh, x, weight)
    db = column_sum(dh).to(ctx.bias_dtype) if ctx.needs_input_grad[2] else None
    return dx, dw, db, None


torch.library.register_autograd(f"{NS}::linear_gelu", _linear_gelu_backward, setup_context=_linear_gelu_setup)

_LINEAR = torch.ops.bertaccel.linear.default
_LINEAR_GELU = torch.ops.bertaccel.linear_gelu.default


# ------------------------------------------------------------------------------ public functions
def why_not(x: Tensor, weight: Tensor, dtype: torch.dtype | None = None, allow_fp32: bool = False) -> str | None:
    """None when `x @ weight^T` (computed in `dtype`) can run on the kernel, else the reason. The
    addresses are checked later, on the operands the kernel reads (`_misaligned`). `allow_fp32`: float32
    runs the SIMT kernel (csrc/gemm_fp32.cu) - the linear ops take it; the FFN's fused path stays bf16."""
    dtype = dtype or x.dtype
    if not x.is_cuda:
        return "input is not on a CUDA device"
    if dtype == torch.float32 and allow_fp32 and os.environ.get("BERTACCEL_GEMM_FP32") != "1":
        return ("dtype float32 runs cuBLAS (our SIMT fp32 kernel measured 0.64-0.92x of cuBLAS's fp32 GEMM on the "
                "H100; BERTACCEL_GEMM_FP32=1 uses it)")
    if dtype != torch.bfloat16 and not (allow_fp32 and dtype == torch.float32):
        return f"dtype {dtype} (the tensor-core GEMM takes bfloat16; fp32 runs cuBLAS)"
    if not (build.gemm_loaded() if torch.compiler.is_compiling() else build.load_gemm()):
        return build.gemm_reason() or "the GEMM extension is not built"
    K, N = x.shape[-1], weight.shape[0]
    if K % 8 or N % 8:
        return f"in/out features {K}/{N} are not multiples of 8 (the copy engine needs 16-byte rows)"
    return None


def _misaligned(*operands: Tensor) -> str | None:
    # traced by torch.compile there is no address to check: the op itself refuses a misaligned one
    if not torch.compiler.is_compiling() and any(t.data_ptr() % 16 for t in operands):
        return "operands are not 16-byte aligned"
    return None


def _on_kernel(name: str, x: Tensor, weight: Tensor, bias: Tensor | None, run, fallback) -> Tensor:
    """`run(x2, w2, bias2)` on the 2-D operands cast to the compute dtype (x's, or autocast's, as
    F.linear would), reshaped back; an fp32 bias goes as it is (the epilogue reads it so: no cast kernel per
    call, and its gradient comes back in fp32, not rounded to bf16 and widened again); `fallback()` (said once,
    with the reason) when the kernel cannot run."""
    dtype = compute_dtype(x)
    reason = why_not(x, weight, dtype, allow_fp32=True)
    if reason is None:
        shape = x.shape
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.to(dtype).reshape(-1, shape[-1]).contiguous()
            w2 = weight.to(dtype)
            reason = _misaligned(x2, w2)
            if reason is None:
                y = run(x2, w2, bias_as_read(bias, dtype))
                return y.view(*shape[:-1], weight.shape[0])
    note_fallback(name, reason)
    return fallback()


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)` on our GEMM (computed in x's dtype or the autocast dtype; weight and
    bias are cast to it as autocast would); `F.linear` when the kernel cannot run."""
    return _on_kernel("linear", x, weight, bias, _LINEAR, lambda: F.linear(x, weight, bias))


def linear_gelu(x: Tensor, weight: Tensor, bias: Tensor, approximate: str = "none") -> Tensor:
    """`F.gelu(F.linear(x, weight, bias), approximate)` with bias and GELU in the GEMM's epilogue."""
    return _on_kernel("linear_gelu", x, weight, bias,
                      lambda x2, w2, b2: _LINEAR_GELU(x2, w2, b2, approximate == "tanh")[0],
                      lambda: F.gelu(F.linear(x, weight, bias), approximate=approximate))


def gemm_case(name: str):
    """The benchmark's three GEMMs of a linear layer (benchmarks/bench_gemm.py), on the kernel."""
    if name.startswith("fwd"):
        return lambda x, w: _GEMM(x, w, None, None, 0, False, False, False, False)[0]
    if name.startswith("dgrad"):
        return lambda dy, w: _GEMM(dy, w, None, None, 0, False, True, False, False)[0]
    if name.startswith("wgrad-f32"):  # the weight gradient of an fp32 weight, as GemmLinear's backward writes it
        return lambda dy, x: _GEMM(dy, x, None, None, 0, True, True, True, False)[0]
    if name.startswith("wgrad"):
        return lambda dy, x: _GEMM(dy, x, None, None, 0, True, True, False, False)[0]
    raise ValueError(f"unknown GEMM case {name!r}")


# ---------------------------------------------------------------------------------------- modules
class GemmLinear(nn.Linear):
    """`nn.Linear` whose forward runs our GEMM; the same Parameter objects and state_dict keys."""

    @classmethod
    def from_module(cls, m: nn.Linear) -> GemmLinear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = m.in_features, m.out_features
        new.weight, new.bias = m.weight, m.bias
        new.train(m.training)
        return new

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


def dense_matmul(dense: nn.Linear, x: Tensor) -> Tensor:
    """`x @ dense.weight^T` without the bias (the fused modules add it in their own kernels): our GEMM
    when the kernel swap made `dense` a GemmLinear, cuBLAS otherwise."""
    if isinstance(dense, GemmLinear):
        return linear(x, dense.weight, None)
    return F.linear(x, dense.weight)


def _skip_reason(m: nn.Module) -> str | None:
    if type(m) is not nn.Linear:
        return ""
    if m.in_features % 8 or m.out_features % 8:
        return f"in/out features {m.in_features}/{m.out_features} are not multiples of 8"
    return None


SWAP = SwapEntry("linear", _skip_reason, GemmLinear.from_module,
                 "nn.Linear -> GemmLinear (own TMA + wgmma GEMM, Hopper; opt-in)", opt_in=True)
