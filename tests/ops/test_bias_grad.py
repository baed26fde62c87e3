"""Tests of the bias-gradient column sums and `dense` (ops/bias_grad.py, csrc/column_sum.cu): CPU tests
(opcheck, autograd, fallback) run everywhere; `cuda` tests check the kernel against float64 sums."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bertaccel.ops.bias_grad import column_sum, column_sum_reference, dense, dense_wgrad_path, dense_wgrad_reference
from tests.ops.conftest import (DTYPES, assert_replay_matches_eager, check, cuda_kernel_names, cuda_test, leaves, poison,
                                rand)


@pytest.mark.parametrize("shape", [(5, 40), (2, 3, 17), (1, 8)])
def test_column_sum_opcheck_cpu(shape):
    torch.library.opcheck(torch.ops.bertaccel.column_sum.default, (rand(*shape, requires_grad=True),))


@pytest.mark.parametrize("bias", [True, False])
def test_dense_opcheck_cpu(bias):
    x, w = rand(3, 5, 16, requires_grad=True), rand(24, 16, requires_grad=True)
    b = rand(24, requires_grad=True) if bias else None
    torch.library.opcheck(torch.ops.bertaccel.dense.default, (x, w, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dense_wgrad_opcheck_cpu(dtype):
    torch.library.opcheck(torch.ops.bertaccel.dense_wgrad.default, (rand(13, 24).to(dtype), rand(13, 40).to(dtype)))


def test_dense_wgrad_is_the_weight_and_bias_gradient_cpu():
    dy, x = rand(11, 6).to(torch.bfloat16), rand(11, 9).to(torch.bfloat16)
    dw, db = torch.ops.bertaccel.dense_wgrad(dy, x)
    assert dw.dtype == torch.bfloat16 and dw.shape == (6, 9) and db.dtype == torch.float32
    torch.testing.assert_close(dw, dy.t() @ x)
    torch.testing.assert_close(db, dy.double().sum(0).float(), rtol=1e-6, atol=1e-6)
    assert dense_wgrad_path(dy, x).startswith("separate")


def test_column_sum_is_the_sum_over_leading_dims():
    x = rand(4, 6, 10).to(torch.bfloat16)
    out = column_sum(x)
    assert out.dtype == torch.float32 and out.shape == (10,)
    torch.testing.assert_close(out, x.double().sum((0, 1)).float(), rtol=1e-5, atol=1e-5)
    assert torch.equal(column_sum(x[:0]), torch.zeros(10))  # no rows: zeros


def test_dense_gradients_match_linear_cpu():
    x, w, b = rand(2, 7, 12), rand(9, 12), rand(9)
    ins, ref_ins = leaves(x, w, b), leaves(x, w, b)
    dy = rand(2, 7, 9)
    y = torch.ops.bertaccel.dense(*ins)
    ref = F.linear(*ref_ins)
    torch.testing.assert_close(y, ref)
    for g, r in zip(torch.autograd.grad(y, ins, dy), torch.autograd.grad(ref, ref_ins, dy)):
        torch.testing.assert_close(g, r)


def test_dense_bias_gradient_in_the_bias_dtype_cpu():
    """A bf16 input with an fp32 bias (a master weight): the bias is added in bf16 as autocast adds it,
    and its gradient comes back fp32, summed from the bf16 output gradient in fp32."""
    x, w = rand(6, 8).to(torch.bfloat16), rand(4, 8).to(torch.bfloat16)
    b = rand(4, requires_grad=True)
    y = torch.ops.bertaccel.dense(x, w, b)
    torch.testing.assert_close(y, F.linear(x, w, b.detach().to(torch.bfloat16)))
    dy = rand(6, 4).to(torch.bfloat16)
    (db,) = torch.autograd.grad(y, (b,), dy)
    assert db.dtype == torch.float32
    torch.testing.assert_close(db, dy.double().sum(0).float(), rtol=1e-6, atol=1e-6)


def test_dense_public_function_is_linear_on_cpu():
    x, w, b = rand(5, 8), rand(3, 8), rand(3)
    torch.testing.assert_close(dense(x, w, b), F.linear(x, w, b))
    torch.testing.assert_close(dense(x, w), F.linear(x, w))


# ------------------------------------------------------------------------------------------ cuda
# 384 / 1152: a MiniLM layer's bias / Q+K+V; 1001: the scalar path, 1004: 4-wide vectors;
# (1, 128): one chunk, the kernel writes the sums itself; 9830: packed IMDB-512 tokens
@cuda_test
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 128), (7, 1000), (63, 1001), (1023, 1004), (9830, 384), (9830, 1152),
                                   (16384, 3072), (2, 1025, 768)])
def test_column_sum(shape, dtype):
    x = torch.randn(shape, device="cuda").to(dtype)
    ref = x.double().reshape(-1, shape[-1]).sum(0)
    th = x.reshape(-1, shape[-1]).sum(0, dtype=torch.float32)  # PyTorch's fp32 accumulation of the same input
    poison()
    ours = column_sum(x)
    assert ours.dtype == torch.float32 and ours.shape == (shape[-1],)
    check(ours, th, ref, torch.float32, "column_sum")


@cuda_test
def test_column_sum_misaligned_contiguous_view():
    flat = torch.randn(1 + 300 * 768, device="cuda", dtype=torch.bfloat16)
    x = flat[1:].view(300, 768)  # contiguous, 2-byte aligned only: the one-element path
    torch.testing.assert_close(column_sum(x), x.double().sum(0).float(), rtol=1e-5, atol=1e-3)


@cuda_test
def test_column_sum_empty_and_deterministic():
    assert torch.equal(column_sum(torch.empty(0, 384, device="cuda", dtype=torch.bfloat16)), torch.zeros(384, device="cuda"))
    x = torch.randn(9830, 1152, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(column_sum(x), column_sum(x))  # no atomics: the same bits every call


@cuda_test
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dense_under_autocast(bias_dtype):
    """`dense` against F.linear under bf16 autocast: the same output, the same input and weight
    gradients, and a bias gradient at least as accurate (float64 reference from the same bf16 dy)."""
    x, w = torch.randn(4, 333, 384, device="cuda"), torch.randn(1152, 384, device="cuda") * 0.05
    b, dy = torch.randn(1152, device="cuda").to(bias_dtype), torch.randn(4, 333, 1152, device="cuda").to(torch.bfloat16)
    ins, ref_ins = leaves(x, w, b), leaves(x, w, b)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ours = dense(*ins)
        ref = F.linear(*ref_ins)
    torch.testing.assert_close(ours, ref)
    g, r = torch.autograd.grad(ours, ins, dy), torch.autograd.grad(ref, ref_ins, dy)
    assert all(a.dtype == t.dtype for a, t in zip(g, ins))
    dy2, x2, w2 = dy.double().reshape(-1, 1152), x.to(torch.bfloat16).double().reshape(-1, 384), w.to(torch.bfloat16).double()
    refs = ((dy2 @ w2).view(4, 333, 384), dy2.t() @ x2, dy2.sum(0))
    for name, a, t, ref64 in zip(("dx", "dweight", "dbias"), g, r, refs):
        check(a, t, ref64, torch.bfloat16, name)


@cuda_test
def test_dense_cuda_graph_replay():
    w = torch.randn(1152, 384, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(1152, device="cuda", requires_grad=True)
    x = torch.randn(2000, 384, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step(x, w, b):
        y = dense(x, w, b)
        gx, gw, gb = torch.autograd.grad(y, (x, w, b), torch.ones_like(y) * 0.5)
        return y, (gx, gw, gb)

    assert_replay_matches_eager(step, x, w, b)


@cuda_test
def test_dense_compiles_fullgraph():
    x = torch.randn(300, 384, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(768, 384, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(768, device="cuda", requires_grad=True)

    def f(x, w, b):
        return dense(x, w, b).float().square().sum()

    compiled = torch.compile(f, fullgraph=True)
    g = torch.autograd.grad(compiled(x, w, b), (x, w, b))
    r = torch.autograd.grad(f(x, w, b), (x, w, b))
    for a, t in zip(g, r):
        torch.testing.assert_close(a, t, rtol=2e-2, atol=2e-2)


def _wgrad_case(tokens, out_features, in_features, dtype=torch.bfloat16):
    dy = torch.randn(tokens, out_features, device="cuda").to(dtype)
    x = torch.randn(tokens, in_features, device="cuda").to(dtype)
    return dy, x


def _check_wgrad(dw, db, dy, x, name):
    """dw within 2x PyTorch's own GEMM error, db within 2x of PyTorch's bias gradient under autocast (a bf16
    sum) or fp32 sum, both against float64 from the same rounded inputs."""
    dy64, x64 = dy.double(), x.double()
    check(dw, dy.t() @ x, dy64.t() @ x64, dy.dtype, f"{name} dweight")
    check(db, dy.sum(0).float(), dy64.sum(0), dy.dtype, f"{name} dbias")


@cuda_test
@pytest.mark.parametrize("shape", [(16384, 2304, 768), (4000, 1152, 384), (333, 96, 40)], ids=str)
def test_dense_wgrad_fused_is_one_cublaslt_matmul(shape, monkeypatch):
    """BERTACCEL_DENSE_WGRAD=fused, bf16 at aligned sizes: one matmul (the BGRADB epilogue), no column-sum
    kernel; the gradients within 2x PyTorch's error; then the default: the GEMM and the column sum."""
    dy, x = _wgrad_case(*shape)
    monkeypatch.setenv("BERTACCEL_DENSE_WGRAD", "fused")
    assert dense_wgrad_path(dy, x).startswith("fused"), dense_wgrad_path(dy, x)
    names = cuda_kernel_names(lambda: torch.ops.bertaccel.dense_wgrad(dy, x))
    assert not any("column_sum" in n for n in names), names
    dw, db = torch.ops.bertaccel.dense_wgrad(dy, x)
    assert dw.dtype == torch.bfloat16 and dw.shape == (shape[1], shape[2]) and db.dtype == torch.float32
    _check_wgrad(dw, db, dy, x, "fused")
    monkeypatch.delenv("BERTACCEL_DENSE_WGRAD")
    assert dense_wgrad_path(dy, x).startswith("separate: the default"), dense_wgrad_path(dy, x)
    names = cuda_kernel_names(lambda: torch.ops.bertaccel.dense_wgrad(dy, x))
    assert any("column_sum" in n for n in names), names
    dw2, db2 = torch.ops.bertaccel.dense_wgrad(dy, x)
    _check_wgrad(dw2, db2, dy, x, "separate")


@cuda_test
@pytest.mark.parametrize("shape,dtype,why", [((300, 30, 40), torch.bfloat16, "aligned"), ((300, 96, 44), torch.bfloat16, "aligned"),
                                             ((257, 96, 40), torch.float32, "bfloat16 only")], ids=str)
def test_dense_wgrad_separate_where_it_cannot_fuse(shape, dtype, why, monkeypatch):
    """Asked for the fused form, sizes that are not multiples of 8 and fp32 take the GEMM and the column sum, with
    the reason, and the same results."""
    monkeypatch.setenv("BERTACCEL_DENSE_WGRAD", "fused")
    dy, x = _wgrad_case(*shape, dtype=dtype)
    path = dense_wgrad_path(dy, x)
    assert path.startswith("separate") and why in path, path
    dw, db = torch.ops.bertaccel.dense_wgrad(dy, x)
    ref_dw, ref_db = dense_wgrad_reference(dy.double(), x.double())
    torch.testing.assert_close(dw.double(), ref_dw, rtol=2e-2, atol=2e-2 * shape[0] ** 0.5)
    torch.testing.assert_close(db.double(), ref_db, rtol=1e-3, atol=1e-3)


@cuda_test
def test_dense_wgrad_misaligned_view_takes_the_separate_path(monkeypatch):
    """Asked for the fused form, a [tokens, out] view starting 2 bytes into its storage: not handed to cuBLASLt
    (which was told 16-byte alignment), summed by the GEMM and the column sum, not misread."""
    monkeypatch.setenv("BERTACCEL_DENSE_WGRAD", "fused")
    flat = torch.randn(1 + 512 * 768, device="cuda").to(torch.bfloat16)
    dy = flat[1:].view(512, 768)
    x = torch.randn(512, 256, device="cuda").to(torch.bfloat16)
    assert "aligned" in dense_wgrad_path(dy, x)
    dw, db = torch.ops.bertaccel.dense_wgrad(dy, x)
    _check_wgrad(dw, db, dy.clone(), x, "misaligned")


@cuda_test
@pytest.mark.parametrize("form", ["fused", "default"])
def test_dense_backward_takes_the_switched_wgrad(form, monkeypatch):
    """`dense`'s backward (the Q/K/V projection's) at a BERT-base shape: a column-sum kernel by default, none with
    BERTACCEL_DENSE_WGRAD=fused."""
    if form == "fused":
        monkeypatch.setenv("BERTACCEL_DENSE_WGRAD", "fused")
    x = torch.randn(2048, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(2304, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(2304, device="cuda", requires_grad=True)
    dy = torch.randn(2048, 2304, device="cuda", dtype=torch.bfloat16)
    y = dense(x, w, b)
    names = cuda_kernel_names(lambda: torch.autograd.grad(y, (x, w, b), dy))
    assert any("column_sum" in n for n in names) == (form == "default"), names


def test_reference_matches_torch_sum():
    x = rand(33, 7)
    torch.testing.assert_close(column_sum_reference(x), x.sum(0))


def test_column_sum_keeps_float64():
    x = rand(9, 5, dtype=torch.float64)
    out = column_sum(x)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, x.sum(0), rtol=0, atol=1e-12)
