"""Tests of softmax (softmax.py): CPU tests (opcheck, autograd formulas, fallback) run everywhere; `cuda` tests check
the kernels against float64 references on the GPU (see conftest.py)."""

from __future__ import annotations

import pytest
import torch

import bertaccel.ops.swap  # noqa: F401 - imports every op family
from bertaccel.ops.softmax import softmax
from tests.ops.conftest import DTYPES, FLOOR, check, cuda_kernel_names, cuda_test, leaves, poison, rand


def _mask(kind, b, h, q, k):
    g = torch.Generator(device="cuda").manual_seed(3)
    if kind == "none":
        return None
    if kind == "key_padding_additive":  # HF eager: [b, 1, 1 or q, k] with finfo.min at padded keys
        keep = torch.rand(b, 1, 1, k, device="cuda", generator=g) > 0.3
        keep[..., 0] = True
        return torch.zeros(b, 1, 1, k, device="cuda").masked_fill(~keep, torch.finfo(torch.float32).min)
    if kind == "bool_expanded":  # HF sdpa-style boolean mask, expanded over queries (stride 0)
        keep = torch.rand(b, 1, 1, k, device="cuda", generator=g) > 0.3
        keep[..., 0] = True
        return keep.expand(b, 1, q, k)
    if kind == "misaligned_additive":  # the key-padding mask at an odd offset: the kernel's scalar mask loads
        keep = torch.rand(b, 1, 1, k, device="cuda", generator=g) > 0.3
        keep[..., 0] = True
        flat = torch.zeros(b * k + 1, device="cuda")
        mask = flat[1:].view(b, 1, 1, k)
        return mask.masked_fill_(~keep, torch.finfo(torch.float32).min)
    if kind == "full_additive":  # a distinct additive bias per head and query
        return torch.randn(b, h, q, k, device="cuda", generator=g)
    raise ValueError(kind)


@cuda_test
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask_kind", ["none", "key_padding_additive", "misaligned_additive", "bool_expanded", "full_additive"])
@pytest.mark.parametrize("shape", [(2, 12, 128, 128), (1, 3, 7, 1000), (4, 2, 33, 512), (2, 6, 401, 1024), (1, 1, 5, 4097), (1, 2, 4, 8192)])
def test_softmax(shape, mask_kind, dtype):
    b, h, q, k = shape
    x, dy = torch.randn(shape, device="cuda") * 4, torch.randn(shape, device="cuda")
    mask, scale = _mask(mask_kind, b, h, q, k), 0.125

    def run(fn, dt):
        (xi,) = leaves(x.to(dt))
        out = fn(xi)
        return out, torch.autograd.grad(out, xi, dy.to(dt))[0]

    def torch_softmax(xi):
        v = xi * scale
        if mask is not None:
            v = v.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else v + mask.to(v.dtype)
        return torch.softmax(v, dim=-1)

    ref, ref_g = run(torch_softmax, torch.float64)
    th, th_g = run(torch_softmax, dtype)
    poison()
    ours, our_g = run(lambda xi: softmax(xi, mask, scale), dtype)
    assert ours.dtype == dtype
    check(ours, th, ref, dtype, "y")
    check(our_g, th_g, ref_g, dtype, "dx")


@cuda_test
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["key_padding", "misaligned", "full"])
@pytest.mark.parametrize("shape", [(2, 12, 128, 128), (1, 3, 7, 1000), (2, 6, 401, 1024)])
def test_softmax_reads_16_bit_masks_as_their_float32_values(shape, layout, mask_dtype, dtype):
    """A bf16 / fp16 additive mask (what a bf16 / fp16 model builds) is read in its own dtype, 4 keys per 8-byte
    load where aligned, one key per load where not: the result equals the float32 mask's bit for bit (the widening
    is exact), and the call launches the softmax kernel alone (no conversion kernel before it)."""
    b, h, q, k = shape
    g = torch.Generator(device="cuda").manual_seed(5)
    x = (torch.randn(shape, device="cuda", generator=g) * 4).to(dtype)
    lo = torch.finfo(mask_dtype).min
    if layout == "full":
        mask = torch.randn(b, h, q, k, device="cuda", generator=g).to(mask_dtype)
    else:
        keep = torch.rand(b, 1, 1, k, device="cuda", generator=g) > 0.3
        keep[..., 0] = True
        if layout == "key_padding":
            mask = torch.zeros(b, 1, 1, k, device="cuda", dtype=mask_dtype)
        else:  # one element past an aligned start: the scalar loads
            mask = torch.zeros(b * k + 1, device="cuda", dtype=mask_dtype)[1:].view(b, 1, 1, k)
        mask.masked_fill_(~keep, lo)
        mask += (torch.rand(b, 1, 1, k, device="cuda", generator=g) * 2).to(mask_dtype)  # not only 0 / min
    poison()
    ours = softmax(x, mask, 0.125)
    want = softmax(x, mask.float(), 0.125)
    assert torch.equal(ours, want)
    kernels = cuda_kernel_names(lambda: softmax(x, mask, 0.125))
    assert len(kernels) == 1 and "softmax" in kernels[0], kernels


@cuda_test
def test_softmax_fully_masked_rows_are_zero():
    x = torch.randn(2, 1, 3, 64, device="cuda", dtype=torch.bfloat16)
    keep = torch.ones(2, 1, 1, 64, dtype=torch.bool, device="cuda")
    keep[1] = False
    y = softmax(x, keep, 1.0)
    assert torch.all(y[1] == 0) and torch.allclose(y[0].float().sum(-1), torch.ones(1, 3, device="cuda"), atol=1e-2)


def test_softmax_falls_back_to_the_reference_on_cpu():
    from bertaccel.ops.softmax import softmax_reference

    x, mask = rand(2, 3, 4, 10), torch.rand(2, 1, 1, 10) > 0.3
    assert torch.equal(softmax(x, mask, 0.5), softmax_reference(x, mask, 0.5).to(x.dtype))


@cuda_test
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["key_padding", "full"])
@pytest.mark.parametrize("shape", [(3, 5, 1031, 256), (4, 7, 333, 512), (2, 3, 2053, 1024)])
def test_softmax_ring_rows_find_their_mask_rows(shape, layout, dtype):
    """The forward ring's warps walk rows first, first + stride, ... and find each row's mask row by stepping
    (batch, head, query) with carries (bf16) or by division (float32): with thousands of rows, a query count and a
    head count that the grid stride does not divide, and a mask that differs per batch (key padding) or per (batch,
    head, query) (full), every row must use its own mask row. Checked row by row - each row's error within twice
    PyTorch's worst row's against float64 (plus a floor) - since one wrong row would hide in a whole-tensor norm."""
    b, h, q, k = shape
    g = torch.Generator(device="cuda").manual_seed(11)
    x = (torch.randn(shape, device="cuda", generator=g) * 4).to(dtype)
    if layout == "full":
        mask = torch.randn(b, h, q, k, device="cuda", generator=g).to(dtype)
    else:
        keep = torch.rand(b, 1, 1, k, device="cuda", generator=g) > 0.3
        keep[..., 0] = True
        mask = torch.zeros(b, 1, 1, k, device="cuda", dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)
    ref = torch.softmax(x.double() * 0.125 + mask.double(), dim=-1)
    th = torch.softmax(x * 0.125 + mask, dim=-1)
    poison()
    ours = softmax(x, mask, 0.125)

    def worst_row(a):
        return ((a.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()

    assert worst_row(ours) <= 2 * worst_row(th) + FLOOR[dtype], (worst_row(ours), worst_row(th))
