"""Tests of LayerNorm and the fused residual LayerNorm (layer_norm.py, residual_layer_norm.py): CPU tests (opcheck, autograd formulas, fallback) run everywhere; `cuda` tests check
the kernels against float64 references on the GPU (see conftest.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import bertaccel.ops.swap  # noqa: F401 - imports every op family
from bertaccel.ops.gelu import bias_gelu
from bertaccel.ops.layer_norm import layer_norm
from bertaccel.ops.registration import row_dropout_keep
from bertaccel.ops.residual_layer_norm import bias_dropout_add_layer_norm
from bertaccel.ops.rms_norm import rms_norm
from tests.ops.conftest import (
    DTYPES,
    FANOUT_CPU_BERT,
    FANOUT_GPU_BERT,
    HIDDEN,
    ROWS,
    bert_fanout_off_and_on,
    check,
    cuda_kernel_names,
    cuda_test,
    leaves,
    poison,
    rand,
)


@pytest.mark.parametrize("fused", [False, True])
def test_layer_norm_opcheck_cpu(fused):
    H = 48
    x = rand(7, H, requires_grad=True)
    w, b = rand(H, requires_grad=True), rand(H, requires_grad=True)
    bias = rand(H, requires_grad=True) if fused else None
    res = rand(7, H, requires_grad=True) if fused else None
    torch.library.opcheck(torch.ops.bertaccel.layer_norm_fwd.default, (x, bias, res, w, b, 0.0, 1e-5))


@pytest.mark.parametrize("fused", [False, True])
def test_row_ops_take_any_leading_dimensions_cpu(fused):
    """The public functions hand the ops [..., H] as shaped (no per-call views): the ops' fake and CPU kernels and
    their autograd take a [B, S, H] input, and give what the [B * S, H] rows give."""
    H = 24
    x, w, b = rand(3, 5, H, requires_grad=True), rand(H, requires_grad=True), rand(H, requires_grad=True)
    bias = rand(H, requires_grad=True) if fused else None
    res = rand(3, 5, H, requires_grad=True) if fused else None
    torch.library.opcheck(torch.ops.bertaccel.layer_norm_fwd.default, (x, bias, res, w, b, 0.0, 1e-5))
    torch.library.opcheck(torch.ops.bertaccel.layer_norm.default, (x, bias, res, w, b, 0.0, 1e-5))
    torch.library.opcheck(torch.ops.bertaccel.rms_norm.default, (x, w, 1e-6))
    y3 = torch.ops.bertaccel.layer_norm(x, bias, res, w, b, 0.0, 1e-5)
    y2 = torch.ops.bertaccel.layer_norm(x.view(-1, H), bias, None if res is None else res.view(-1, H), w, b, 0.0, 1e-5)
    assert y3.shape == x.shape
    torch.testing.assert_close(y3.view(-1, H), y2, rtol=0, atol=0)


@cuda_test
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "residual_layer_norm"])
def test_row_ops_on_a_3d_input_give_the_rows_bits(op):
    """[B, S, H] through the public function (the ops take it as shaped) gives the bits of the same rows as
    [B * S, H]: the output and every gradient."""
    B, S, H = 4, 37, 768
    torch.manual_seed(0)
    x, r = (torch.randn(B, S, H, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w, b = torch.randn(H, device="cuda"), torch.randn(H, device="cuda")
    bias = torch.randn(H, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(B, S, H, device="cuda", dtype=torch.bfloat16)
    fn = {"layer_norm": lambda a, rr, bi, ww, bb: layer_norm(a, ww, bb, 1e-12),
          "rms_norm": lambda a, rr, bi, ww, bb: rms_norm(a, ww, 1e-6),
          "residual_layer_norm": lambda a, rr, bi, ww, bb: bias_dropout_add_layer_norm(a, bi, rr, ww, bb, 0.0, 1e-12)}[op]
    outs = []
    for shape in ((B, S, H), (B * S, H)):
        ins = leaves(x.reshape(shape), r.reshape(shape), bias, w, b)
        y = fn(*ins)
        assert y.shape == shape
        used = [t for t in ins if t.requires_grad]
        grads = torch.autograd.grad(y, used, dy.reshape(shape), allow_unused=True)
        outs.append([y.reshape(-1, H)] + [g.reshape(-1, g.shape[-1]) if g is not None else None for g in grads])
    for a, c in zip(*outs):
        assert (a is None) == (c is None)
        if a is not None:
            torch.testing.assert_close(a, c, rtol=0, atol=0)


def test_layer_norm_backward_formula_matches_autograd():
    H = 33
    x, bias, res = rand(9, H, dtype=torch.float32), rand(H), rand(9, H)
    w, b = rand(H), rand(H)
    leaves = [t.clone().requires_grad_(True) for t in (x, bias, res, w, b)]
    y = torch.ops.bertaccel.layer_norm_fwd(*leaves[:3], leaves[3], leaves[4], 0.0, 1e-5)[0]
    dy = rand(9, H)
    ours = torch.autograd.grad(y, leaves, dy)
    ref_leaves = [t.clone().requires_grad_(True) for t in (x, bias, res, w, b)]
    xr, br, rr, wr, bbr = ref_leaves
    yr = F.layer_norm(xr + br + rr, (H,), wr, bbr, 1e-5)
    refs = torch.autograd.grad(yr, ref_leaves, dy)
    torch.testing.assert_close(y, yr)
    for a, r in zip(ours, refs):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-5)


def test_dropout_backward_uses_the_forward_mask():
    H = 64
    x = rand(20, H, requires_grad=True)
    zero_res = torch.zeros(20, H)
    w, b = torch.ones(H), torch.zeros(H)
    y, z, *_ = torch.ops.bertaccel.layer_norm_fwd(x, torch.zeros(H), zero_res, w, b, 0.5, 1e-5)
    (dx,) = torch.autograd.grad(y.sum() * 0 + (y * rand(20, H)).sum(), x)
    dropped = z == 0
    assert dropped.float().mean().item() == pytest.approx(0.5, abs=0.08)
    assert torch.all(dx[dropped] == 0) and torch.all(dx[~dropped] != 0)


def test_public_ops_equal_their_saving_forms():
    """A public op (what models call: output only, C++ autograd on CUDA) and its saving form (what
    the autograd formulas run) agree in value and gradient."""
    H = 24
    x, w, b = rand(6, H, requires_grad=True), rand(H, requires_grad=True), rand(H, requires_grad=True)
    bias, res = rand(H, requires_grad=True), rand(6, H, requires_grad=True)
    for args in ((x, None, None, w, b, 0.0, 1e-5), (x, bias, res, w, b, 0.0, 1e-5)):
        leaves = [a for a in args if torch.is_tensor(a)]
        y1 = torch.ops.bertaccel.layer_norm_fwd(*args)[0]
        y2 = torch.ops.bertaccel.layer_norm(*args)
        assert torch.equal(y1, y2)
        for g1, g2 in zip(torch.autograd.grad(y1.sum(), leaves), torch.autograd.grad(y2.sum(), leaves)):
            assert torch.equal(g1, g2)
    y1, y2 = torch.ops.bertaccel.rms_norm_fwd(x, w, 1e-6)[0], torch.ops.bertaccel.rms_norm(x, w, 1e-6)
    for g1, g2 in zip(torch.autograd.grad(y1.sum(), (x, w)), torch.autograd.grad(y2.sum(), (x, w))):
        assert torch.equal(g1, g2)
    with torch.no_grad():
        assert torch.equal(torch.ops.bertaccel.layer_norm(x, bias, res, w, b, 0.0, 1e-5),
                           torch.ops.bertaccel.layer_norm_fwd(x, bias, res, w, b, 0.0, 1e-5)[0])


def test_layer_norm_takes_weights_in_the_activation_dtype():
    """bf16 weights (bf16-true training) need no cast: the gradient comes back in bf16."""
    x = rand(5, 16, dtype=torch.bfloat16, requires_grad=True)
    w = rand(16, dtype=torch.bfloat16, requires_grad=True)
    b = rand(16, dtype=torch.bfloat16, requires_grad=True)
    y = torch.ops.bertaccel.layer_norm(x, None, None, w, b, 0.0, 1e-5)
    gx, gw, gb = torch.autograd.grad(y.float().sum(), (x, w, b))
    assert gw.dtype == gb.dtype == torch.bfloat16
    ref = F.layer_norm(x.double(), (16,), w.double(), b.double(), 1e-5)
    torch.testing.assert_close(y.double(), ref, rtol=2e-2, atol=2e-2)


@cuda_test
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("rows", ROWS)
def test_layer_norm(rows, hidden, dtype):
    x = torch.randn(rows, hidden, device="cuda") * 3 + 1
    w, b = torch.randn(hidden, device="cuda"), torch.randn(hidden, device="cuda")
    dy = torch.randn(rows, hidden, device="cuda")
    ref_in = leaves(x.double(), w.double(), b.double())
    ref = F.layer_norm(ref_in[0], (hidden,), ref_in[1], ref_in[2], 1e-5)
    ref_g = torch.autograd.grad(ref, ref_in, dy.double())
    th_in = leaves(x.to(dtype), w.to(dtype), b.to(dtype))
    th = F.layer_norm(th_in[0], (hidden,), th_in[1], th_in[2], 1e-5)
    th_g = torch.autograd.grad(th, th_in, dy.to(dtype))
    poison()
    our_in = leaves(x.to(dtype), w, b)
    ours = layer_norm(our_in[0], our_in[1], our_in[2], 1e-5)
    our_g = torch.autograd.grad(ours, our_in, dy.to(dtype))
    assert ours.dtype == dtype
    check(ours, th, ref, dtype, "y")
    for name, a, t, r in zip(("dx", "dweight", "dbias"), our_g, th_g, ref_g):
        check(a, t, r, dtype, name)


@cuda_test
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [128, 768, 1000, 4096])
@pytest.mark.parametrize("rows", ROWS)
def test_residual_layer_norm_without_dropout(rows, hidden, dtype):
    x, r = torch.randn(rows, hidden, device="cuda"), torch.randn(rows, hidden, device="cuda") * 2
    bias, w, b = torch.randn(hidden, device="cuda"), torch.randn(hidden, device="cuda"), torch.randn(hidden, device="cuda")
    dy = torch.randn(rows, hidden, device="cuda")

    def run(fn, dt, wdt):
        ins = leaves(x.to(dt), bias.to(dt), r.to(dt), w.to(wdt), b.to(wdt))
        out = fn(*ins)
        return out, torch.autograd.grad(out, ins, dy.to(out.dtype))

    ref, ref_g = run(lambda a, bi, rr, ww, bb: F.layer_norm(a + bi + rr, (hidden,), ww, bb, 1e-12), torch.float64, torch.float64)
    th, th_g = run(lambda a, bi, rr, ww, bb: F.layer_norm(a + bi + rr, (hidden,), ww, bb, 1e-12), dtype, dtype)
    poison()
    ours, our_g = run(lambda a, bi, rr, ww, bb: bias_dropout_add_layer_norm(a, bi, rr, ww, bb, 0.0, 1e-12), dtype, torch.float32)
    check(ours, th, ref, dtype, "y")
    for name, a, t, rf in zip(("dx", "dbias", "dresidual", "dweight", "dln_bias"), our_g, th_g, ref_g):
        check(a, t, rf, dtype, name)


@cuda_test
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
# 16-byte vectors (384: bf16 rows on half a warp in the forward ring, from 4,096 rows), scalar and 2-wide paths
# (odd sizes); an odd row count: the ring's last half-warp row slot has no row
@pytest.mark.parametrize("H", [384, 768, 1001, 1002])
def test_residual_layer_norm_dropout_is_consistent_and_seeded(dtype, H):
    rows, p = 4101, 0.1
    x = torch.randn(rows, H, device="cuda", dtype=dtype)
    zero = torch.zeros(rows, H, device="cuda", dtype=dtype)
    w, b = torch.ones(H, device="cuda"), torch.zeros(H, device="cuda")
    out = torch.ops.bertaccel.layer_norm_fwd(x, torch.zeros(H, device="cuda", dtype=dtype), zero, w, b, p, 1e-5)
    z = out[1]
    dropped = (z == 0) & (x != 0)
    assert abs(dropped.float().mean().item() - p) < 0.005
    # exactly the documented draw (common.cuh dropout_keep): 16-bit Philox numbers at the saved seed/offset
    seed, offset = (int(v) for v in out[4].cpu())
    keep = row_dropout_keep(rows * H, p, seed, offset).view(rows, H).cuda()
    assert torch.equal(dropped, ~keep & (x != 0))
    kept = ~dropped
    torch.testing.assert_close(z[kept].float(), (x[kept].float() / (1 - p)).to(dtype).float())
    # backward regenerates the forward's mask
    xl = x.clone().requires_grad_(True)
    torch.manual_seed(123)
    y = bias_dropout_add_layer_norm(xl, torch.zeros(H, device="cuda", dtype=dtype), zero, w, b, p, 1e-5)
    (dx,) = torch.autograd.grad(y, xl, torch.randn_like(y))
    torch.manual_seed(123)
    y2 = bias_dropout_add_layer_norm(x.clone().requires_grad_(True), torch.zeros(H, device="cuda", dtype=dtype), zero,
                                     w, b, p, 1e-5)
    assert torch.equal(y, y2), "same seed, same masks"
    # without grad the output-only kernel runs (no saved sum written): the same masks from the same
    # seed, the sum normalised before its bf16 rounding (a mask difference would move ~10% of the
    # outputs by O(1))
    torch.manual_seed(123)
    with torch.no_grad():
        y3 = bias_dropout_add_layer_norm(xl, torch.zeros(H, device="cuda", dtype=dtype), zero, w, b, p, 1e-5)
    torch.testing.assert_close(y3.float(), y.detach().float(), rtol=2e-2, atol=2e-2)
    zz = torch.ops.bertaccel.layer_norm_fwd(x, torch.zeros(H, device="cuda", dtype=dtype), zero, w, b, p, 1e-5)[1]
    assert not torch.equal(zz, z), "a new call draws new masks"
    # where the forward dropped, the gradient is exactly 0 (recompute the forward mask of the seeded call)
    torch.manual_seed(123)
    z_seeded = torch.ops.bertaccel.layer_norm_fwd(x, torch.zeros(H, device="cuda", dtype=dtype), zero, w, b, p, 1e-5)[1]
    dropped_seeded = (z_seeded == 0) & (x != 0)
    assert torch.all(dx[dropped_seeded] == 0) and (dx[~dropped_seeded] != 0).float().mean() > 0.99


@cuda_test
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
# partly filled warps (25 and 49 vectors of 8) and a full one; in bf16 the forward ring's half-warp rows, full
# (384: 48 vectors, 3 a lane on 16 lanes) and partly filled (328: 41)
@pytest.mark.parametrize("H", [200, 328, 384, 392, 1024])
def test_the_row_ring_keeps_every_row_in_order(dtype, H):
    """The persistent ring kernels (rows <= 1024 wide, forward and backward) walk many rows per warp:
    40,001 rows is ~19 per warp of a full H100 grid, so every ring stage is refilled several times.
    Each row must come out as its own LayerNorm (a stage mix-up would swap or repeat rows), with the
    saved sum and statistics, and its own gradients; the column sums gather every row once. The odd
    row count leaves the forward's last half-warp row slot without a row (it must write nothing)."""
    rows = 40001
    x = (torch.randn(rows, H, device="cuda") * 2 + torch.arange(rows, device="cuda")[:, None] % 7).to(dtype)
    r = torch.randn(rows, H, device="cuda", dtype=dtype)
    bias = torch.randn(H, device="cuda", dtype=dtype)
    w, b = torch.randn(H, device="cuda"), torch.randn(H, device="cuda")
    ref_z = x.double() + bias.double() + r.double()
    ref = F.layer_norm(ref_z, (H,), w.double(), b.double(), 1e-5)
    th = F.layer_norm((x + bias + r), (H,), w.to(dtype), b.to(dtype), 1e-5)
    poison()
    y, z, mean, rstd, _ = torch.ops.bertaccel.layer_norm_fwd(x, bias, r, w, b, 0.0, 1e-5)
    check(y, th, ref, dtype, "y")
    check(z, (x + bias + r), ref_z, dtype, "z")
    torch.testing.assert_close(mean.double(), z.double().mean(-1), rtol=1e-5, atol=1e-5)
    check(layer_norm(x, w, b, 1e-5), F.layer_norm(x, (H,), w.to(dtype), b.to(dtype), 1e-5),
          F.layer_norm(x.double(), (H,), w.double(), b.double(), 1e-5), dtype, "plain y")
    check(rms_norm(x, w, 1e-5), F.rms_norm(x, (H,), w.to(dtype), 1e-5),
          F.rms_norm(x.double(), (H,), w.double(), 1e-5), dtype, "rms y")
    # backward: fused form (dx, dbias, dresidual, dweight, dln_bias) and RMSNorm (dx, dweight)
    dy = torch.randn(rows, H, device="cuda")

    def grads(fn, dt, wdt):
        ins = leaves(x.to(dt), bias.to(dt), r.to(dt), w.to(wdt), b.to(wdt))
        out = fn(*ins)
        return torch.autograd.grad(out, ins, dy.to(out.dtype))

    res = lambda a, bi, rr, ww, bb: F.layer_norm(a + bi + rr, (H,), ww, bb, 1e-5)  # noqa: E731
    ref_g, th_g = grads(res, torch.float64, torch.float64), grads(res, dtype, dtype)
    poison()
    our_g = grads(lambda a, bi, rr, ww, bb: bias_dropout_add_layer_norm(a, bi, rr, ww, bb, 0.0, 1e-5), dtype, torch.float32)
    for name, a, t, rf in zip(("dx", "dbias", "dresidual", "dweight", "dln_bias"), our_g, th_g, ref_g):
        check(a, t, rf, dtype, name)
    rms = [leaves(x.to(dt), w.to(wdt)) for dt, wdt in ((torch.float64, torch.float64), (dtype, dtype), (dtype, torch.float32))]
    rms_g = [torch.autograd.grad(F.rms_norm(a, (H,), ww, 1e-5), (a, ww), dy.to(a.dtype)) for a, ww in rms[:2]]
    poison()
    ours = torch.autograd.grad(rms_norm(rms[2][0], rms[2][1], 1e-5), rms[2], dy.to(dtype))
    for name, a, t, rf in zip(("rms dx", "rms dweight"), ours, rms_g[1], rms_g[0]):
        check(a, t, rf, dtype, name)


@cuda_test
@pytest.mark.parametrize("fanout", ["0", "1"], ids=["plain", "fanout"])
def test_residual_layer_norm_reads_an_fp32_bias_as_it_is(fanout, monkeypatch):
    """BERT's case under autocast: bf16 activations beside fp32 master parameters (the linear bias and the
    LayerNorm's). The bias goes to the kernel as it is: forward and backward launch no cast kernel, and its
    gradient comes back in fp32 (not rounded to bf16 and widened again), within 2x PyTorch's error."""
    from bertaccel.ops.residual_layer_norm import bias_dropout_add_layer_norm_fanout

    monkeypatch.setenv("BERTACCEL_RESIDUAL_FANOUT", fanout)
    rows, H = 1000, 768
    g = torch.Generator(device="cuda").manual_seed(7)
    x, r, dy = (torch.randn(rows, H, device="cuda", generator=g).bfloat16() for _ in range(3))
    bias, w, b = (torch.randn(H, device="cuda", generator=g) for _ in range(3))
    ins = leaves(x, bias, r, w, b)

    def step():
        y = (bias_dropout_add_layer_norm_fanout(*ins, 0.0, 1e-12)[0] if fanout == "1"
             else bias_dropout_add_layer_norm(*ins, 0.0, 1e-12))
        step.grads = torch.autograd.grad(y, ins, dy)

    step()  # warm-up (the kernels' one-time setup)
    kernels = cuda_kernel_names(step)
    assert not [k for k in kernels if "copy" in k.lower()], kernels
    dbias = step.grads[1]
    assert dbias.dtype == torch.float32
    ref_ins = leaves(x.double(), bias.double(), r.double(), w.double(), b.double())
    ref = torch.autograd.grad(F.layer_norm(ref_ins[0] + ref_ins[1] + ref_ins[2], (H,), ref_ins[3], ref_ins[4], 1e-12),
                              ref_ins[1], dy.double())[0]
    th_ins = leaves(x, bias, r, w, b)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        th = F.layer_norm(th_ins[0] + th_ins[1].bfloat16() + th_ins[2], (H,), th_ins[3], th_ins[4], 1e-12)
    check(dbias, torch.autograd.grad(th, th_ins[1], dy.to(th.dtype))[0], ref, torch.bfloat16, "dbias")


@cuda_test
def test_cuda_autograd_is_the_cpp_kernel():
    """On CUDA the public ops' backward nodes come from csrc/autograd.cpp, not a Python function."""
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w, b = torch.ones(64, device="cuda", requires_grad=True), torch.zeros(64, device="cuda", requires_grad=True)
    y = torch.ops.bertaccel.layer_norm(x, None, None, w, b, 0.0, 1e-5)
    assert "CppNode" in type(y.grad_fn).__name__ or "LayerNormFn" in y.grad_fn.name(), y.grad_fn.name()
    with torch.no_grad():
        assert torch.ops.bertaccel.layer_norm(x, None, None, w, b, 0.0, 1e-5).grad_fn is None


@cuda_test
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "residual"])
def test_misaligned_fp32_weights(op):
    """Weights sliced out of a flat fp32 buffer at an odd offset are only 4-byte aligned; the kernels
    read them in narrower vectors instead of faulting (which would kill the CUDA context)."""
    H = 768
    flat = torch.randn(2 * H + 1, device="cuda")
    w, b = flat[1 : H + 1], flat[H + 1 :]
    assert w.data_ptr() % 16 != 0
    x = torch.randn(64, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    wl, bl = leaves(w, b)
    if op == "layer_norm":
        y, ref = layer_norm(x, wl, bl, 1e-5), F.layer_norm(x.double(), (H,), w.double(), b.double(), 1e-5)
    elif op == "rms_norm":
        y, ref = rms_norm(x, wl, 1e-6), F.rms_norm(x.double(), (H,), w.double(), 1e-6)
    else:
        y = bias_dropout_add_layer_norm(x, x[0].detach(), x.detach(), wl, bl, 0.0, 1e-5)
        ref = F.layer_norm(x.double() + x[0].double() + x.double(), (H,), w.double(), b.double(), 1e-5)
    torch.testing.assert_close(y.double(), ref, atol=5e-2, rtol=2e-2)
    torch.autograd.grad(y.float().sum(), (x, wl))
    torch.cuda.synchronize()


@cuda_test
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_bf16_weights_match_fp32_weights(op):
    """bf16 parameters (bf16-true training) are read as they are: same output as the same values
    held in fp32, gradients returned in bf16."""
    H = 1002  # not a multiple of 4: 2-wide vectors
    x = torch.randn(37, H, device="cuda", dtype=torch.bfloat16)
    w16, b16 = torch.randn(H, device="cuda").bfloat16(), torch.randn(H, device="cuda").bfloat16()
    a16, a32 = leaves(w16, b16), leaves(w16.float(), b16.float())
    if op == "layer_norm":
        y16, y32 = layer_norm(x, *a16, 1e-5), layer_norm(x, *a32, 1e-5)
    else:
        a16, a32 = a16[:1], a32[:1]
        y16, y32 = rms_norm(x, *a16, 1e-6), rms_norm(x, *a32, 1e-6)
    assert torch.equal(y16, y32)
    dy = torch.randn_like(y16)
    for g16, g32 in zip(torch.autograd.grad(y16, a16, dy), torch.autograd.grad(y32, a32, dy)):
        assert g16.dtype == torch.bfloat16
        torch.testing.assert_close(g16, g32.bfloat16())


@cuda_test
def test_backward_under_cuda_graph_replay():
    """Forward and backward of the fused LayerNorm captured once and replayed: without dropout the
    replayed gradients equal eager ones on the new input; with dropout every replay draws a new mask
    and the backward uses it (dx is zero exactly on a fraction p)."""
    H = 384
    x = torch.randn(256, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(256, H, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(H, device="cuda", dtype=torch.bfloat16)
    w, b = torch.randn(H, device="cuda", requires_grad=True), torch.randn(H, device="cuda", requires_grad=True)
    dy = torch.randn(256, H, device="cuda", dtype=torch.bfloat16)

    def step(p):
        y = bias_dropout_add_layer_norm(x, bias, r, w, b, p, 1e-12)
        return (y, *torch.autograd.grad(y, (x, w, b), dy))

    for p in (0.0, 0.1):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                step(p)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = step(p)
        grads = []
        for _ in range(2):
            with torch.no_grad():
                x.copy_(torch.randn_like(x))
            g.replay()
            torch.cuda.synchronize()
            grads.append(out[1].clone())
            if p == 0.0:
                for got, want in zip(out, step(0.0)):
                    torch.testing.assert_close(got, want)
            else:
                assert abs((out[1] == 0).float().mean().item() - p) < 0.02
        if p > 0:
            assert not torch.equal(grads[0] == 0, grads[1] == 0), "each replay draws a new mask"


@cuda_test
@pytest.mark.parametrize("rows,H", [(16384, 768), (1023, 384), (7, 1024), (40, 1024)])
def test_weight_grads_are_deterministic(rows, H):
    """The weight gradients' column sums run inside the backward kernel (the last blocks to finish sum
    the partial rows in block order): two backward calls on the same inputs give the same bits, and
    they match float64 (grids of one block, a few blocks each summing several slices, and hundreds)."""
    x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w, b = torch.randn(H, device="cuda", requires_grad=True), torch.randn(H, device="cuda", requires_grad=True)
    dy = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
    for fused in (False, True):
        y = bias_dropout_add_layer_norm(x, bias, r, w, b, 0.0, 1e-12) if fused else layer_norm(x, w, b, 1e-12)
        leaves_ = (x, w, b, bias) if fused else (x, w, b)
        first = torch.autograd.grad(y, leaves_, dy, retain_graph=True)
        second = torch.autograd.grad(y, leaves_, dy)
        for g1, g2 in zip(first, second):
            assert torch.equal(g1, g2)
        h = (x.double() + bias.double() + r.double()) if fused else x.double()
        dw_ref = (F.layer_norm(h, (H,), None, None, 1e-12) * dy.double()).sum(0)  # sum of x-hat * dy
        torch.testing.assert_close(first[1].double(), dw_ref, atol=1e-2 * rows**0.5, rtol=1e-2)
        torch.testing.assert_close(first[2].double(), dy.double().sum(0), atol=1e-3 * rows**0.5, rtol=1e-3)


@cuda_test
def test_fp16_falls_back_with_a_warning():
    x = torch.randn(8, 64, device="cuda", dtype=torch.float16)
    w, b = torch.randn(64, device="cuda", dtype=torch.float16), torch.randn(64, device="cuda", dtype=torch.float16)
    with pytest.warns(UserWarning, match="uses PyTorch"):
        y = layer_norm(x, w, b)
    assert torch.equal(y, F.layer_norm(x, (64,), w, b))


@cuda_test
def test_autocast_keeps_the_input_dtype():
    x = torch.randn(16, 768, device="cuda", dtype=torch.bfloat16)
    w, b = torch.randn(768, device="cuda"), torch.randn(768, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert layer_norm(x, w, b).dtype == torch.bfloat16
        assert layer_norm(x.float(), w, b).dtype == torch.float32
        assert bias_gelu(x, w.bfloat16()).dtype == torch.bfloat16


def test_residual_kernel_args_keep_an_fp32_bias_as_it_is():
    """The residual LayerNorm hands its kernel the linear bias in the LayerNorm weight's dtype: BERT's fp32 master bias
    as the same tensor (no cast kernel, its gradient not rounded to bf16), a bf16 bias beside fp32 weights widened."""
    from bertaccel.ops.residual_layer_norm import _kernel_args

    x, r = rand(4, 16).bfloat16(), rand(4, 16)
    w, b, bias32 = rand(16), rand(16), rand(16)
    args = _kernel_args(x, bias32, r, w, b, 0.1, 1e-12, True)
    assert args[1] is bias32 and args[2].dtype == torch.bfloat16 and args[5] == 0.1
    widened = _kernel_args(x, bias32.bfloat16(), r, w, b, 0.1, 1e-12, False)
    assert widened[1].dtype == torch.float32 and torch.equal(widened[1], bias32.bfloat16().float()) and widened[5] == 0.0


def test_layer_norm_falls_back_to_pytorch_exactly_on_cpu():
    x, w, b = rand(5, 48), rand(48), rand(48)
    assert torch.equal(layer_norm(x, w, b, 1e-5), F.layer_norm(x, (48,), w, b, 1e-5))
    y = bias_dropout_add_layer_norm(x, b, x, w, b, 0.0, 1e-5)
    assert torch.equal(y, F.layer_norm(x + b + x, (48,), w, b, 1e-5))


# ------------------------------------------------------------------- the residual gradient's fan-out (CPU)
def test_layer_norm_bwd2_is_the_backward_of_the_summed_gradient():
    """layer_norm_bwd2(dy, dy2, ...) = layer_norm_bwd(dy + dy2 rounded to the gradient's dtype, ...): bf16 and fp32."""
    H = 24
    for dtype in (torch.float32, torch.bfloat16):
        x, bias, res = rand(7, H, dtype=dtype), rand(H, dtype=dtype), rand(7, H, dtype=dtype)
        w, b = rand(H), rand(H)
        _, z, mean, rstd, rng = torch.ops.bertaccel.layer_norm_fwd(x, bias, res, w, b, 0.0, 1e-5)
        dy, dy2 = rand(7, H, dtype=dtype), rand(7, H, dtype=dtype)
        two = torch.ops.bertaccel.layer_norm_bwd2(dy, dy2, z, w, mean, rstd, rng, 0.0)
        one = torch.ops.bertaccel.layer_norm_bwd(dy + dy2, z, w, mean, rstd, rng, 0.0, True)
        for a, c in zip(two, one):
            assert torch.equal(a, c)
        torch.library.opcheck(torch.ops.bertaccel.layer_norm_bwd2.default, (dy, dy2, z, w, mean, rstd, rng, 0.0))


def test_fanout_hands_the_two_gradients_apart_and_sums_them():
    """The fan-out's y and its alias feed two consumers: their gradients reach the LayerNorm backward apart and give
    what one output used twice gives (autograd's add), for every input; one consumer alone works too."""
    from bertaccel.ops.residual_layer_norm import bias_dropout_add_layer_norm_fanout

    H = 16
    inputs = [rand(5, H, requires_grad=True), rand(H, requires_grad=True), rand(5, H, requires_grad=True),
              rand(H, requires_grad=True), rand(H, requires_grad=True)]
    a, b = rand(5, H), rand(5, H)
    y, alias = bias_dropout_add_layer_norm_fanout(*inputs[:3], *inputs[3:], 0.0, 1e-5)
    assert alias.data_ptr() == y.data_ptr() and alias is not y
    ours = torch.autograd.grad((y * a).sum() + (alias * b).sum(), inputs)
    yr = bias_dropout_add_layer_norm(*inputs[:3], *inputs[3:], 0.0, 1e-5)
    ref = torch.autograd.grad((yr * a).sum() + (yr * b).sum(), inputs)
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-6)
    y, alias = bias_dropout_add_layer_norm_fanout(*inputs[:3], *inputs[3:], 0.0, 1e-5)
    only = torch.autograd.grad((alias * b).sum(), inputs)  # y unused: its gradient never comes
    yr = bias_dropout_add_layer_norm(*inputs[:3], *inputs[3:], 0.0, 1e-5)
    ref = torch.autograd.grad((yr * b).sum(), inputs)
    for o, r in zip(only, ref):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-6)


def test_fanout_between_swapped_layers_trains_like_autograds_add(monkeypatch):
    """BERTACCEL_RESIDUAL_FANOUT=1 in a 2-layer BERT with the residual LayerNorms swapped (their kernel path forced on
    CPU, where the ops run their references): each output's residual consumer takes its alias, the backward sums
    the two gradients in layer_norm_bwd2 (counted), and the output and every parameter's gradient are the ones
    autograd's add gives."""
    from bertaccel.ops import residual_layer_norm

    monkeypatch.setattr(residual_layer_norm, "why_not", lambda *a, **k: None)
    off, on, calls = bert_fanout_off_and_on(monkeypatch, ["residual_layer_norm"], FANOUT_CPU_BERT)
    assert calls == 3, calls  # layer 0's two outputs and layer 1's attention output each have a residual consumer
    for a, b in zip(off, on):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_fanout_under_gradient_checkpointing_trains_like_autograds_add(monkeypatch, reentrant):
    """The fan-out (on by default) under HF's gradient checkpointing: non-reentrant, the forward records the aliases
    and the recomputation makes the same ones (the summing kernel runs as without checkpointing); reentrant, the
    forward runs without grad (no alias: each output's one gradient) and only the recomputed layer's inner output
    fans out. Either way the output and every gradient are autograd's add's."""
    from bertaccel.ops import residual_layer_norm

    monkeypatch.setattr(residual_layer_norm, "why_not", lambda *a, **k: None)
    off, on, calls = bert_fanout_off_and_on(monkeypatch, ["residual_layer_norm"], FANOUT_CPU_BERT,
                                            checkpointing={"use_reentrant": reentrant})
    assert calls == (2 if reentrant else 3), calls
    for a, b in zip(off, on):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@cuda_test
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("H", [384, 768, 1024, 1002])  # the prefetching kernel (bf16, 16-byte rows); else an add first
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_layer_norm_bwd2_kernel_gives_the_backward_of_the_added_gradients_bits(dtype, H, p):
    """The kernel summing dy + dy2 as it loads the rows gives layer_norm_bwd's bits on the added gradient (PyTorch's
    add rounds the sum to the dtype once, as the kernel does), with and without dropout, fp32 and bf16 weights.
    4,099 rows: from kPrefetch1024Rows (4,096) both forms run the prefetching kernel at 1024 wide by default too (below
    it the one-gradient form runs the ring, whose sums run in another order: test_ln_bwd_prefetch_1024.py)."""
    rows = 4099
    for wdtype in {torch.float32, dtype}:
        x, res = rand(rows, H, device="cuda", dtype=dtype), rand(rows, H, device="cuda", dtype=dtype)
        bias = rand(H, device="cuda", dtype=dtype)
        w, b = rand(H, device="cuda").to(wdtype), rand(H, device="cuda").to(wdtype)
        _, z, mean, rstd, rng = torch.ops.bertaccel.layer_norm_fwd(x, bias, res, w, b, p, 1e-5)
        dy, dy2 = rand(rows, H, device="cuda", dtype=dtype), rand(rows, H, device="cuda", dtype=dtype)
        poison()
        two = torch.ops.bertaccel.layer_norm_bwd2(dy, dy2, z, w, mean, rstd, rng, p)
        one = torch.ops.bertaccel.layer_norm_bwd(dy + dy2, z, w, mean, rstd, rng, p, True)
        for name, a, c in zip(["dz", "dh", "dweight", "dln_bias", "dbias"], two, one):
            assert torch.equal(a, c), f"{name} H={H} {dtype} weights {wdtype} p={p}"


@cuda_test
def test_layer_norm_bwd2_with_a_misaligned_second_gradient_adds_first():
    """A second gradient that is contiguous but starts 2 bytes into a 16-byte vector (a view one element into its
    buffer) cannot be copied by the prefetching kernel's 16-byte loads: the op adds first, and gives the same bits."""
    rows, H, dtype = 1031, 768, torch.bfloat16
    x, res = rand(rows, H, device="cuda", dtype=dtype), rand(rows, H, device="cuda", dtype=dtype)
    w, b = rand(H, device="cuda"), rand(H, device="cuda")
    _, z, mean, rstd, rng = torch.ops.bertaccel.layer_norm_fwd(x, None, res, w, b, 0.1, 1e-5)
    dy = rand(rows, H, device="cuda", dtype=dtype)
    dy2 = rand(rows * H + 1, device="cuda", dtype=dtype)[1:].view(rows, H)
    assert dy2.is_contiguous() and dy2.data_ptr() % 16 != 0
    two = torch.ops.bertaccel.layer_norm_bwd2(dy, dy2, z, w, mean, rstd, rng, 0.1)
    one = torch.ops.bertaccel.layer_norm_bwd(dy + dy2, z, w, mean, rstd, rng, 0.1, True)
    for name, a, c in zip(["dz", "dh", "dweight", "dln_bias", "dbias"], two, one):
        assert torch.equal(a, c), name


@cuda_test
@pytest.mark.parametrize("reentrant", [None, False, True], ids=["no-checkpointing", "non-reentrant", "reentrant"])
def test_fanout_in_a_swapped_bert_trains_like_autograds_add(monkeypatch, reentrant):
    """BERTACCEL_RESIDUAL_FANOUT=1 on the GPU (bf16 autocast, the default swap, dropout off; the fan-out's C++ form,
    csrc/autograd.cpp, as eager CUDA calls run it), also under HF's gradient checkpointing as the CPU test checks the
    Python Function: the summing kernel ran as often, and the output and every parameter's gradient are autograd's
    add's up to kernel-order noise (the same sums; the attention backward's dQ additions are unordered). (All three
    passed on an H200 in session 51, 459cb4c.)"""
    checkpointing = None if reentrant is None else {"use_reentrant": reentrant}
    off, on, calls = bert_fanout_off_and_on(monkeypatch, ["all"], FANOUT_GPU_BERT, "cuda", checkpointing=checkpointing)
    assert calls == (2 if reentrant else 3), calls
    for i, (a, b) in enumerate(zip(off, on)):
        torch.testing.assert_close(b, a, rtol=2e-2, atol=1e-3 * a.abs().max().item() + 1e-6, msg=f"tensor {i}")
