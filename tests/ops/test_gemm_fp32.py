"""The fp32 path of our GEMM (csrc/gemm_fp32.cu: SIMT, CUDA cores; `bertaccel::gemm` with float32
operands). `cuda` tests (the kernel lives in the Hopper GEMM extension): every layout (forward, dgrad,
wgrad), every block tile and K split, odd and prime M, N and K not multiples of a tile, every epilogue,
against a float64 reference from the same fp32 inputs - the error at most twice cuBLAS's own fp32
error (TF32 off) against that reference; `linear` / `linear_gelu` gradients; opcheck, compile, CUDA
graphs; misaligned operands refused by the op and sent to cuBLAS by `linear`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import bertaccel.ops.swap  # noqa: F401 - imports every op family
from bertaccel.ops.gemm import EPILOGUES, apply_epilogue, linear, linear_gelu
from tests.ops.conftest import assert_replay_matches_eager, hopper_test, rel_err

GEMM = torch.ops.bertaccel.gemm.default
LAYOUTS = {"fwd": (False, False), "dgrad": (False, True), "wgrad": (True, True)}


@pytest.fixture(autouse=True)
def no_tf32():
    """cuBLAS's fp32 GEMM without TF32 (the baseline the kernel is held to); restored after."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.fixture(autouse=True)
def fp32_kernel_on(monkeypatch):
    """`linear` takes the SIMT kernel for fp32 only when asked (it is slower than cuBLAS)."""
    monkeypatch.setenv("BERTACCEL_GEMM_FP32", "1")


def check(ours, cublas, ref, name, sequential=None):
    """Ours within twice cuBLAS's fp32 error against float64 (plus a floor at fp32's resolution). With
    `sequential` (the product accumulated over K one step at a time in fp32, as one split of the kernel
    does): within twice the larger of the two - cuBLAS splits K at small tile counts, which sums in
    blocks and rounds less than any one-split configuration can."""
    e_ours, e_cublas = rel_err(ours, ref), rel_err(cublas, ref)
    bound = max(e_cublas, rel_err(sequential, ref)) if sequential is not None else e_cublas
    assert e_ours <= 2 * bound + 1e-7, f"{name}: error {e_ours:.2e} vs cuBLAS {e_cublas:.2e} (bound {bound:.2e})"


def sequential_product(A, B):
    """A @ B^T accumulated over K in order, in fp32 (one rounding per step, as a K-sequential kernel)."""
    acc = torch.zeros(A.shape[0], B.shape[0], device=A.device)
    for k in range(A.shape[1]):
        acc = torch.addcmul(acc, A[:, k : k + 1], B[:, k][None, :])
    return acc


def operands(M, N, K, trans_a, trans_b, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn((K, M) if trans_a else (M, K), device="cuda", generator=g)
    b = torch.randn((K, N) if trans_b else (N, K), device="cuda", generator=g) * K**-0.5
    return a, b


def logical(a, b, trans_a, trans_b):
    return (a.t() if trans_a else a), (b.t() if trans_b else b)


# M, N, K: odd, prime and tile-straddling sizes; the contiguous dimension of each operand a multiple of 4
SHAPES = {
    "fwd": [(131, 67, 52), (7, 5, 300), (257, 129, 1028), (64, 128, 8)],
    "dgrad": [(131, 68, 52), (7, 4, 300), (257, 132, 1028)],
    "wgrad": [(132, 68, 52), (4, 8, 300), (260, 132, 1028)],
}


@hopper_test
@pytest.mark.parametrize("tile", [0, 1, 2], ids=["chosen", "128x128", "128x64"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_tiles_and_odd_shapes(layout, tile):
    trans_a, trans_b = LAYOUTS[layout]
    for M, N, K in SHAPES[layout]:
        a, b = operands(M, N, K, trans_a, trans_b)
        A, B = logical(a, b, trans_a, trans_b)
        ref = A.double() @ B.double().t()
        out = GEMM(a, b, None, None, 0, trans_a, trans_b, True, False, tile, 1)[0]  # one split: K in order
        assert out.dtype == torch.float32 and out.shape == (M, N)
        check(out, A @ B.t(), ref, f"{layout} tile {tile} {M}x{N}x{K}", sequential=sequential_product(A, B))
        if tile == 0:  # as the op runs by default (the split it chooses): against cuBLAS alone
            check(GEMM(a, b, None, None, 0, trans_a, trans_b, True, False)[0], A @ B.t(), ref, f"{layout} default {M}x{N}x{K}")


@hopper_test
@pytest.mark.parametrize("tile", [1, 2], ids=["128x128", "128x64"])
@pytest.mark.parametrize("splits", [0, 2, 3, 7])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_k_splits_with_bias(layout, splits, tile):
    """The K range split over blocks (fp32 partial tiles summed in order by the second kernel, which adds
    the bias); 0: the split the kernel chooses. Repeatable bit for bit."""
    trans_a, trans_b = LAYOUTS[layout]
    M, N, K = 132, 68, 2052
    a, b = operands(M, N, K, trans_a, trans_b, seed=1)
    bias = torch.randn(N, device="cuda")
    A, B = logical(a, b, trans_a, trans_b)
    out = GEMM(a, b, bias, None, 1, trans_a, trans_b, True, False, tile, splits)[0]
    check(out, torch.addmm(bias, A, B.t()), A.double() @ B.double().t() + bias.double(), f"{layout} splits {splits}")
    assert torch.equal(out, GEMM(a, b, bias, None, 1, trans_a, trans_b, True, False, tile, splits)[0])


@hopper_test
@pytest.mark.parametrize("epilogue", ["none", "bias_gelu", "bias_residual"])
def test_tail_split(epilogue):
    """More 128 x 128 tiles than one wave of blocks holds (2 per SM): the rows of tiles that fit the full
    waves computed whole (epilogue in the GEMM kernel), the rows past them split 3 ways over K as a GEMM
    of their own (splits_k < 0; epilogue in the summing kernel); and the default plan at the same shape."""
    M, N, K = 2052, 2308, 260  # 17 x 19 = 323 tiles
    slots = 2 * torch.cuda.get_device_properties(0).multi_processor_count
    if not (323 > slots and 323 % slots != 0):
        pytest.skip(f"323 tiles fill whole waves of {slots} blocks on this GPU: no tail to split")
    a, b = operands(M, N, K, False, False, seed=5)
    bias, aux = torch.randn(N, device="cuda"), torch.randn(M, N, device="cuda")
    e = EPILOGUES[epilogue]
    ref, _ = apply_epilogue(a.double() @ b.double().t(), bias.double(), aux.double(), e, True, torch.float64)
    cub, _ = apply_epilogue(a @ b.t(), bias, aux, e, False, torch.float32)
    for splits in (-3, 0):
        out, _ = GEMM(a, b, bias, aux, e, False, False, True, False, 1, splits)
        check(out, cub, ref, f"{epilogue} splits {splits}")
    assert torch.equal(out, GEMM(a, b, bias, aux, e, False, False, True, False, 1, 0)[0])


@hopper_test
@pytest.mark.parametrize("splits", [0, 3], ids=["chosen", "3-splits"])
@pytest.mark.parametrize("epilogue", list(EPILOGUES))
def test_every_epilogue(epilogue, splits):
    """Every epilogue, in the GEMM kernel or (K split) in the kernel that sums the partial tiles."""
    M, N, K = 259, 132, 300
    a, b = operands(M, N, K, False, False, seed=2)
    bias, aux = torch.randn(N, device="cuda"), torch.randn(M, N, device="cuda")
    e = EPILOGUES[epilogue]
    out, pre = GEMM(a, b, bias, aux, e, False, False, True, True, 0, splits)
    ref, ref_pre = apply_epilogue(a.double() @ b.double().t(), bias.double(), aux.double(), e, True, torch.float64)
    cub, _ = apply_epilogue(a @ b.t(), bias, aux, e, False, torch.float32)
    check(out, cub, ref, epilogue)
    if e in (2, 3):  # the GELU epilogues hand the pre-activation to the backward
        check(pre, (a @ b.t()) + bias, ref_pre, f"{epilogue} pre-activation")
    else:
        assert pre.numel() == 0


@hopper_test
@pytest.mark.parametrize("gelu", [False, True], ids=["linear", "linear_gelu"])
def test_linear_gradients_in_fp32(gelu):
    """`linear` / `linear_gelu` with fp32 inputs (the fp32 preset) run the SIMT kernel forward and in
    both backward GEMMs; output and gradients against float64, within twice cuBLAS's error."""
    M, N, K = 300, 132, 260
    x = torch.randn(M, K, device="cuda", requires_grad=True)
    w = (torch.randn(N, K, device="cuda") * K**-0.5).requires_grad_(True)
    bias = torch.randn(N, device="cuda", requires_grad=True)
    dy = torch.randn(M, N, device="cuda")

    def run(fn, *args):
        y = fn(*args)
        return [y, *torch.autograd.grad(y, args, dy.to(y.dtype))]

    ours = run((lambda x, w, b: linear_gelu(x, w, b)) if gelu else linear, x, w, bias)
    cublas = run((lambda x, w, b: F.gelu(F.linear(x, w, b))) if gelu else F.linear, x, w, bias)
    ref = run((lambda x, w, b: F.gelu(F.linear(x, w, b))) if gelu else F.linear,
              *(t.detach().double().requires_grad_(True) for t in (x, w, bias)))
    for name, o, c, r in zip(["y", "dx", "dw", "db"], ours, cublas, ref):
        assert o.dtype == torch.float32
        check(o, c, r, name)


@hopper_test
def test_opcheck_compile_graphs_and_misaligned_operands():
    x = torch.randn(300, 256, device="cuda", requires_grad=True)
    w = torch.randn(132, 256, device="cuda", requires_grad=True)
    bias = torch.randn(132, device="cuda", requires_grad=True)
    torch.library.opcheck(torch.ops.bertaccel.linear.default, (x, w, bias))
    torch.library.opcheck(torch.ops.bertaccel.linear_gelu.default, (x, w, bias, False))

    def step(x, w, bias, fn=linear):
        y = fn(x, w, bias)
        return y, torch.autograd.grad(y.square().sum(), (x, w, bias))

    eager = step(x, w, bias)
    compiled = step(x, w, bias, fn=torch.compile(linear, fullgraph=True))
    for e, c in zip([eager[0], *eager[1]], [compiled[0], *compiled[1]]):  # fp32 sums over 300 rows, other order
        torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-4)
    del eager, compiled
    assert_replay_matches_eager(step, *(t.detach().clone().requires_grad_(True) for t in (x, w, bias)))

    odd = torch.randn(300, 257, device="cuda")[:, 1:]  # 256 wide, starts 4 bytes into a row
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        GEMM(odd, w.detach(), None, None, 0, False, False, True, False)
    # a weight that starts 4 bytes into its buffer: `linear` hands it to cuBLAS (bit for bit its result)
    w_odd = torch.randn(132 * 256 + 1, device="cuda")[1:].view(132, 256)
    assert w_odd.data_ptr() % 16 == 4
    assert torch.equal(linear(x.detach(), w_odd), F.linear(x.detach(), w_odd))
