"""Tests of bias + GELU (gelu.py): CPU tests (opcheck, autograd formulas, fallback) run everywhere; `cuda` tests check
the kernels against float64 references on the GPU (see conftest.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import bertaccel.ops.swap  # noqa: F401 - imports every op family
from bertaccel.ops import gelu_math
from bertaccel.ops.gelu import bias_gelu
from bertaccel.ops.layer_norm import layer_norm
from tests.ops.conftest import DTYPES, check, cuda_kernel_names, cuda_test, leaves, poison, rand


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_opcheck_cpu(approximate):
    x, b = rand(5, 40, requires_grad=True), rand(40, requires_grad=True)
    torch.library.opcheck(torch.ops.bertaccel.bias_gelu.default, (x, b, approximate == "tanh"))
    # bf16 activations beside an fp32 bias, as the kernel takes them
    xb = rand(5, 40).bfloat16().requires_grad_(True)
    torch.library.opcheck(torch.ops.bertaccel.bias_gelu.default, (xb, b, approximate == "tanh"))


def test_gelu_backward_formula_matches_autograd():
    for approximate in ("none", "tanh"):
        x, b = rand(6, 20, requires_grad=True), rand(20, requires_grad=True)
        y = torch.ops.bertaccel.bias_gelu(x, b, approximate == "tanh")
        dy = rand(6, 20)
        gx, gb = torch.autograd.grad(y, (x, b), dy)
        xr, br = x.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
        rx, rb = torch.autograd.grad(F.gelu(xr + br, approximate=approximate), (xr, br), dy)
        torch.testing.assert_close(gx, rx)
        torch.testing.assert_close(gb, rb)


@pytest.mark.parametrize("tanh", [False, True])
def test_gelu_derivative_written_out_matches_autograd(tanh):
    """gelu_math.gelu_derivative (the CPU references of the bias+GELU backward and the GEMM's dGELU epilogue)
    against autograd through gelu_math.gelu, in float64, over the range BERT's pre-activations take and past it."""
    h = torch.cat([torch.linspace(-12, 12, 2001, dtype=torch.float64), torch.randn(1000, dtype=torch.float64) * 3])
    h.requires_grad_(True)
    (expect,) = torch.autograd.grad(gelu_math.gelu(h, tanh).sum(), h)
    torch.testing.assert_close(gelu_math.gelu_derivative(h.detach(), tanh), expect, atol=1e-13, rtol=1e-13)


@cuda_test
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
# The forward's vectors per thread follow the size (csrc/gelu.cu fwd_unroll; on an H100): 1 at 1023x3072
# and 2047x4096 (a partial last block), 2 at 16384x3072 (bf16 and fp32).
@pytest.mark.parametrize("shape", [(1, 128), (7, 1000), (1023, 3072), (2047, 4096), (16384, 3072), (5, 4097)])
def test_bias_gelu(shape, approximate, dtype):
    x, bias, dy = torch.randn(shape, device="cuda") * 2, torch.randn(shape[-1], device="cuda"), torch.randn(shape, device="cuda")

    def run(fn, dt):
        ins = leaves(x.to(dt), bias.to(dt))
        out = fn(*ins)
        return out, torch.autograd.grad(out, ins, dy.to(dt))

    ref, ref_g = run(lambda a, b: F.gelu(a + b, approximate=approximate), torch.float64)
    th, th_g = run(lambda a, b: F.gelu(a + b, approximate=approximate), dtype)
    poison()
    ours, our_g = run(lambda a, b: bias_gelu(a, b, approximate), dtype)
    check(ours, th, ref, dtype, "y")
    for name, a, t, r in zip(("dx", "dbias"), our_g, th_g, ref_g):
        check(a, t, r, dtype, name)


@cuda_test
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("shape", [(7, 1000), (1023, 3072), (16384, 3072)])
def test_bias_gelu_reads_an_fp32_bias_as_it_is(shape, approximate):
    """bf16 activations beside an fp32 master bias (BERT's intermediate layer under autocast): the kernels read the bias
    as it is, so forward and backward launch no cast kernel; y, dx and the fp32 dbias within 2x PyTorch's error (the
    PyTorch side as autocast runs it: the bias cast to bf16)."""
    g = torch.Generator(device="cuda").manual_seed(11)
    x = (torch.randn(shape, device="cuda", generator=g) * 2).bfloat16()
    bias, dy = torch.randn(shape[-1], device="cuda", generator=g), torch.randn(shape, device="cuda", generator=g).bfloat16()
    ins = leaves(x, bias)

    def step():
        out = bias_gelu(*ins, approximate)
        step.out, step.grads = out, torch.autograd.grad(out, ins, dy)

    step()
    kernels = cuda_kernel_names(step)
    assert not [k for k in kernels if "copy" in k.lower()], kernels
    assert step.out.dtype == torch.bfloat16 and step.grads[1].dtype == torch.float32
    ref_ins = leaves(x.double(), bias.double())
    ref = F.gelu(ref_ins[0] + ref_ins[1], approximate=approximate)
    ref_g = torch.autograd.grad(ref, ref_ins, dy.double())
    th_ins = leaves(x, bias)
    th = F.gelu(th_ins[0] + th_ins[1].bfloat16(), approximate=approximate)
    th_g = torch.autograd.grad(th, th_ins, dy)
    check(step.out, th, ref, torch.bfloat16, "y")
    for name, a, t, r in zip(("dx", "dbias"), step.grads, th_g, ref_g):
        check(a, t, r, torch.bfloat16, name)


@cuda_test
def test_non_contiguous_inputs():
    big = torch.randn(64, 1536, device="cuda", dtype=torch.bfloat16)
    x = big[:, ::2]  # (64, 768), strided
    w, b = torch.randn(768, device="cuda"), torch.randn(768, device="cuda")
    torch.testing.assert_close(layer_norm(x, w, b), F.layer_norm(x.float(), (768,), w, b).bfloat16(), atol=6e-2, rtol=2e-2)
    t = torch.randn(3072, 64, device="cuda", dtype=torch.bfloat16).t()  # (64, 3072) transposed view
    bias = torch.randn(3072, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(bias_gelu(t, bias), F.gelu(t.float() + bias.float()).bfloat16(), atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_falls_back_to_pytorch_exactly_on_cpu(approximate):
    x, b = rand(4, 24), rand(24)
    assert torch.equal(bias_gelu(x, b, approximate), F.gelu(x + b, approximate=approximate))
