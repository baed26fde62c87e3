"""The CUDA kernels against float64 references (GPU only; marked `cuda`).

Every check: fresh random inputs, the caching allocator poisoned with NaN first (an element the
kernel forgets to write shows as NaN), forward and every gradient, error at most twice PyTorch's
own error in the same dtype against the same float64 reference (plus a small floor)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bertaccel.ops import build
import bertaccel.ops.embeddings  # noqa: F401 - defines the embedding ops
from bertaccel.ops.gelu import bias_gelu
from bertaccel.ops.layer_norm import layer_norm
from bertaccel.ops.residual_layer_norm import bias_dropout_add_layer_norm
from bertaccel.ops.rms_norm import rms_norm
from bertaccel.ops.softmax import softmax

pytestmark = pytest.mark.cuda

ROWS = [1, 7, 1023, 16384]
HIDDEN = [128, 384, 768, 1001, 1004, 1024, 4096]  # 1001 / 1004: the scalar and 4-wide vector paths
DTYPES = [torch.float32, torch.bfloat16]
FLOOR = {torch.float32: 1e-6, torch.bfloat16: 1e-3}


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    assert build.load(), f"the CUDA ops did not build: {build.unavailable_reason()}"


def poison():
    """Fill free allocator blocks with NaN so outputs that reuse them start as NaN."""
    blob = torch.empty(64 * 1024 * 1024, device="cuda", dtype=torch.float32).fill_(float("nan"))
    del blob


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    assert not torch.isnan(a).any(), "NaN in output (unwritten element?)"
    return ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check(ours, torch_same_dtype, ref, dtype, name):
    e_ours, e_torch = rel_err(ours, ref), rel_err(torch_same_dtype, ref)
    assert e_ours <= 2 * e_torch + FLOOR[dtype], f"{name}: error {e_ours:.2e} vs PyTorch {e_torch:.2e}"


def leaves(*ts):
    return [t.detach().clone().requires_grad_(True) for t in ts]


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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("H", [768, 1001, 1002])  # 16-byte vectors, scalar and 2-wide paths (odd sizes)
def test_residual_layer_norm_dropout_is_consistent_and_seeded(dtype, H):
    rows, p = 2048, 0.1
    x = torch.randn(rows, H, device="cuda", dtype=dtype)
    zero = torch.zeros(rows, H, device="cuda", dtype=dtype)
    w, b = torch.ones(H, device="cuda"), torch.zeros(H, device="cuda")
    out = torch.ops.bertaccel.layer_norm_fwd(x, torch.zeros(H, device="cuda", dtype=dtype), zero, w, b, p, 1e-5)
    z = out[1]
    dropped = (z == 0) & (x != 0)
    assert abs(dropped.float().mean().item() - p) < 0.005
    kept = ~dropped
    torch.testing.assert_close(z[kept].float(), (x[kept].float() / (1 - p)).to(dtype).float())
    # backward regenerates the forward's mask
    xl = x.clone().requires_grad_(True)
    torch.manual_seed(123)
    y = bias_dropout_add_layer_norm(xl, torch.zeros(H, device="cuda", dtype=dtype), zero, w, b, p, 1e-5)
    (dx,) = torch.autograd.grad(y, xl, torch.randn_like(y))
    torch.manual_seed(123)
    y2 = bias_dropout_add_layer_norm(x, torch.zeros(H, device="cuda", dtype=dtype), zero, w, b, p, 1e-5)
    assert torch.equal(y, y2), "same seed, same masks"
    zz = torch.ops.bertaccel.layer_norm_fwd(x, torch.zeros(H, device="cuda", dtype=dtype), zero, w, b, p, 1e-5)[1]
    assert not torch.equal(zz, z), "a new call draws new masks"
    # where the forward dropped, the gradient is exactly 0 (recompute the forward mask of the seeded call)
    torch.manual_seed(123)
    z_seeded = torch.ops.bertaccel.layer_norm_fwd(x, torch.zeros(H, device="cuda", dtype=dtype), zero, w, b, p, 1e-5)[1]
    dropped_seeded = (z_seeded == 0) & (x != 0)
    assert torch.all(dx[dropped_seeded] == 0) and (dx[~dropped_seeded] != 0).float().mean() > 0.99


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("shape", [(1, 128), (7, 1000), (1023, 3072), (16384, 3072), (5, 4097)])
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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 128, 768, 1000, 4096, 8192])
@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm(rows, hidden, dtype):
    x = torch.randn(rows, hidden, device="cuda") * 3 + 1
    w, dy = torch.randn(hidden, device="cuda"), torch.randn(rows, hidden, device="cuda")

    def run(fn, dt, wdt):
        ins = leaves(x.to(dt), w.to(wdt))
        out = fn(*ins)
        return out, torch.autograd.grad(out, ins, dy.to(dt))

    ref, ref_g = run(lambda a, b: F.rms_norm(a, (hidden,), b, 1e-6), torch.float64, torch.float64)
    th, th_g = run(lambda a, b: F.rms_norm(a, (hidden,), b, 1e-6), dtype, dtype)
    poison()
    ours, our_g = run(lambda a, b: rms_norm(a, b, 1e-6), dtype, torch.float32)
    assert ours.dtype == dtype
    check(ours, th, ref, dtype, "y")
    for name, a, t, r in zip(("dx", "dweight"), our_g, th_g, ref_g):
        check(a, t, r, dtype, name)


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
    if kind == "full_additive":  # a distinct additive bias per head and query
        return torch.randn(b, h, q, k, device="cuda", generator=g)
    raise ValueError(kind)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask_kind", ["none", "key_padding_additive", "bool_expanded", "full_additive"])
@pytest.mark.parametrize("shape", [(2, 12, 128, 128), (1, 3, 7, 1000), (4, 2, 33, 512), (1, 1, 5, 4097), (1, 2, 4, 8192)])
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


def test_softmax_fully_masked_rows_are_zero():
    x = torch.randn(2, 1, 3, 64, device="cuda", dtype=torch.bfloat16)
    keep = torch.ones(2, 1, 1, 64, dtype=torch.bool, device="cuda")
    keep[1] = False
    y = softmax(x, keep, 1.0)
    assert torch.all(y[1] == 0) and torch.allclose(y[0].float().sum(-1), torch.ones(1, 3, device="cuda"), atol=1e-2)


@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [128, 384, 768, 1000])
def test_embeddings(hidden, out_dtype):
    V, P, T, B, S = 1000, 512, 2, 8, 128
    g = torch.Generator(device="cuda").manual_seed(4)
    ids = torch.randint(0, V, (B, S), device="cuda", generator=g)
    ids[0, -5:] = 0  # padding ids: the padding row gets no gradient
    pos = torch.arange(S, device="cuda").expand(B, S).contiguous()
    tt = torch.randint(0, T, (B, S), device="cuda", generator=g)
    tables = [torch.randn(n, hidden, device="cuda") for n in (V, P, T)]
    w, b = torch.randn(hidden, device="cuda"), torch.randn(hidden, device="cuda")
    dy = torch.randn(B, S, hidden, device="cuda")

    def hf_like(word, position, token_type, w, b):
        word = word.clone()
        h = F.embedding(ids, word, padding_idx=0) + F.embedding(tt, token_type) + F.embedding(pos, position)
        return F.layer_norm(h, (hidden,), w, b, 1e-12)

    ref_in = leaves(*(t.double() for t in tables), w.double(), b.double())
    ref = hf_like(*ref_in)
    ref_g = torch.autograd.grad(ref, ref_in, dy.double())
    th_in = leaves(*(t.to(out_dtype) for t in (*tables, w, b)))  # PyTorch in the output dtype
    th = hf_like(*th_in)
    th_g = torch.autograd.grad(th, th_in, dy.to(out_dtype))
    poison()
    our_in = leaves(*tables, w, b)
    ours = torch.ops.bertaccel.embedding_layer_norm(ids, pos, tt, *our_in, 0.0, 1e-12, out_dtype == torch.bfloat16, 0)
    our_g = torch.autograd.grad(ours, our_in, dy.to(out_dtype))
    assert ours.dtype == out_dtype
    check(ours, th, ref, out_dtype, "y")
    for name, a, t, r in zip(("dword", "dposition", "dtoken_type", "dweight", "dbias"), our_g, th_g, ref_g):
        check(a, t, r, out_dtype, name)
    assert torch.all(our_g[0][0] == 0), "padding row got a gradient"


def test_embeddings_dropout_is_consistent():
    V, H, B, S, p = 500, 768, 16, 128, 0.1
    ids = torch.randint(0, V, (B, S), device="cuda")
    pos = torch.arange(S, device="cuda").expand(B, S).contiguous()
    tt = torch.zeros_like(ids)
    tables = leaves(torch.randn(V, H, device="cuda"), torch.randn(S, H, device="cuda"), torch.randn(2, H, device="cuda"))
    w, b = leaves(torch.ones(H, device="cuda"), torch.zeros(H, device="cuda"))
    y = torch.ops.bertaccel.embedding_layer_norm(ids, pos, tt, *tables, w, b, p, 1e-12, True, -1)
    y0 = torch.ops.bertaccel.embedding_layer_norm(ids, pos, tt, *tables, w, b, 0.0, 1e-12, True, -1)
    dropped = y == 0
    assert abs(dropped.float().mean().item() - p) < 0.005
    torch.testing.assert_close(y[~dropped].float(), y0[~dropped].float() / (1 - p), atol=2e-2, rtol=1e-2)
    # d(ln bias) = sum of the gradient over kept elements / (1 - p): the backward used the same mask
    dy = torch.randn_like(y)
    db = torch.autograd.grad(y, b, dy)[0]
    expect = (dy.float() * (~dropped).float() / (1 - p)).sum((0, 1))
    torch.testing.assert_close(db, expect, atol=1e-1, rtol=1e-2)


def test_non_contiguous_inputs():
    big = torch.randn(64, 1536, device="cuda", dtype=torch.bfloat16)
    x = big[:, ::2]  # (64, 768), strided
    w, b = torch.randn(768, device="cuda"), torch.randn(768, device="cuda")
    torch.testing.assert_close(layer_norm(x, w, b), F.layer_norm(x.float(), (768,), w, b).bfloat16(), atol=6e-2, rtol=2e-2)
    t = torch.randn(3072, 64, device="cuda", dtype=torch.bfloat16).t()  # (64, 3072) transposed view
    bias = torch.randn(3072, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(bias_gelu(t, bias), F.gelu(t.float() + bias.float()).bfloat16(), atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_opcheck_cuda(dtype):
    H = 384
    x = torch.randn(33, H, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(H, device="cuda", requires_grad=True)
    b = torch.randn(H, device="cuda", requires_grad=True)
    bias = torch.randn(H, device="cuda", dtype=dtype, requires_grad=True)
    res = torch.randn(33, H, device="cuda", dtype=dtype, requires_grad=True)
    for op in (torch.ops.bertaccel.layer_norm_fwd.default, torch.ops.bertaccel.layer_norm.default):
        torch.library.opcheck(op, (x, None, None, w, b, 0.0, 1e-5))
        torch.library.opcheck(op, (x, bias, res, w, b, 0.0, 1e-5))
    torch.library.opcheck(torch.ops.bertaccel.bias_gelu.default, (x, bias, False))
    torch.library.opcheck(torch.ops.bertaccel.rms_norm_fwd.default, (x, w, 1e-6))
    torch.library.opcheck(torch.ops.bertaccel.rms_norm.default, (x, w, 1e-6))
    if dtype == torch.bfloat16:  # bf16 parameters (bf16-true), read without a cast
        torch.library.opcheck(torch.ops.bertaccel.layer_norm.default,
                              (x, bias, res, w.detach().bfloat16().requires_grad_(), b.detach().bfloat16().requires_grad_(),
                               0.0, 1e-5))
        torch.library.opcheck(torch.ops.bertaccel.rms_norm.default, (x, w.detach().bfloat16().requires_grad_(), 1e-6))
    scores = torch.randn(2, 3, 5, 40, device="cuda", dtype=dtype, requires_grad=True)
    keep = torch.rand(2, 1, 1, 40, device="cuda") > 0.2
    torch.library.opcheck(torch.ops.bertaccel.softmax.default, (scores, None, 0.5))
    torch.library.opcheck(torch.ops.bertaccel.softmax.default, (scores, keep, 0.5))
    ids = torch.randint(0, 50, (3, 11), device="cuda")
    pos = torch.arange(11, device="cuda").expand(3, 11).contiguous()
    tables = [torch.randn(n, H, device="cuda", requires_grad=True) for n in (50, 11, 2)]
    for op in (torch.ops.bertaccel.embedding_layer_norm_fwd.default, torch.ops.bertaccel.embedding_layer_norm.default):
        torch.library.opcheck(op, (ids, pos, torch.zeros_like(ids), *tables, w, b, 0.0, 1e-12, dtype == torch.bfloat16, 0))


def test_cuda_autograd_is_the_cpp_kernel():
    """On CUDA the public ops' backward nodes come from csrc/autograd.cpp, not a Python function."""
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w, b = torch.ones(64, device="cuda", requires_grad=True), torch.zeros(64, device="cuda", requires_grad=True)
    y = torch.ops.bertaccel.layer_norm(x, None, None, w, b, 0.0, 1e-5)
    assert "CppNode" in type(y.grad_fn).__name__ or "LayerNormFn" in y.grad_fn.name(), y.grad_fn.name()
    with torch.no_grad():
        assert torch.ops.bertaccel.layer_norm(x, None, None, w, b, 0.0, 1e-5).grad_fn is None


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


def test_torch_compile_fullgraph():
    H = 768
    x = torch.randn(256, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w, b = torch.randn(H, device="cuda", requires_grad=True), torch.randn(H, device="cuda", requires_grad=True)
    bias = torch.randn(H, device="cuda", dtype=torch.bfloat16)

    def f(x, w, b):
        h = bias_gelu(layer_norm(x, w, b), bias)
        h = rms_norm(h, w, 1e-6)
        return softmax(h.view(4, 4, 16, H), None, 0.5).float().square().mean()

    compiled = torch.compile(f, fullgraph=True)
    eager, comp = f(x, w, b), compiled(x, w, b)
    torch.testing.assert_close(comp, eager)
    ge = torch.autograd.grad(eager, (x, w, b))
    gc = torch.autograd.grad(compiled(x, w, b), (x, w, b))
    for a, c in zip(ge, gc):
        torch.testing.assert_close(c, a)


def test_cuda_graph_capture_and_replay():
    H = 768
    x = torch.randn(512, H, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(512, H, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(H, device="cuda", dtype=torch.bfloat16)
    w, b = torch.randn(H, device="cuda"), torch.randn(H, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up off the capture stream
        for _ in range(2):
            bias_dropout_add_layer_norm(x, bias, r, w, b, 0.1, 1e-12)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y_static = bias_gelu(bias_dropout_add_layer_norm(x, bias, r, w, b, 0.0, 1e-12), bias)
        y_drop = bias_dropout_add_layer_norm(x, bias, r, w, b, 0.1, 1e-12)
    x.copy_(torch.randn_like(x))
    g.replay()
    expect = bias_gelu(bias_dropout_add_layer_norm(x, bias, r, w, b, 0.0, 1e-12), bias)
    torch.testing.assert_close(y_static, expect)
    first = y_drop.clone()
    g.replay()
    assert not torch.equal(first, y_drop), "each replay draws new dropout masks"


def test_fp16_falls_back_with_a_warning():
    x = torch.randn(8, 64, device="cuda", dtype=torch.float16)
    w, b = torch.randn(64, device="cuda", dtype=torch.float16), torch.randn(64, device="cuda", dtype=torch.float16)
    with pytest.warns(UserWarning, match="uses PyTorch"):
        y = layer_norm(x, w, b)
    assert torch.equal(y, F.layer_norm(x, (64,), w, b))


def test_autocast_keeps_the_input_dtype():
    x = torch.randn(16, 768, device="cuda", dtype=torch.bfloat16)
    w, b = torch.randn(768, device="cuda"), torch.randn(768, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert layer_norm(x, w, b).dtype == torch.bfloat16
        assert layer_norm(x.float(), w, b).dtype == torch.float32
        assert bias_gelu(x, w.bfloat16()).dtype == torch.bfloat16
