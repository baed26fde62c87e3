"""The CUDA kernels against float64 references (GPU only; marked `cuda`).

Every check: fresh random inputs, the caching allocator poisoned with NaN first (an element the
kernel forgets to write shows as NaN), forward and every gradient, error at most twice PyTorch's
own error in the same dtype against the same float64 reference (plus a small floor)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from src.ops import build
from src.ops.gelu import bias_gelu
from src.ops.layer_norm import layer_norm
from src.ops.residual_layer_norm import bias_dropout_add_layer_norm

pytestmark = pytest.mark.cuda

ROWS = [1, 7, 1023, 16384]
HIDDEN = [128, 384, 768, 1000, 1024, 4096]
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
def test_residual_layer_norm_dropout_is_consistent_and_seeded(dtype):
    rows, H, p = 2048, 768, 0.1
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
    torch.library.opcheck(torch.ops.bertaccel.layer_norm_fwd.default, (x, None, None, w, b, 0.0, 1e-5))
    torch.library.opcheck(torch.ops.bertaccel.layer_norm_fwd.default, (x, bias, res, w, b, 0.0, 1e-5))
    torch.library.opcheck(torch.ops.bertaccel.bias_gelu_fwd.default, (x, bias, False))


def test_torch_compile_fullgraph():
    H = 768
    x = torch.randn(256, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w, b = torch.randn(H, device="cuda", requires_grad=True), torch.randn(H, device="cuda", requires_grad=True)
    bias = torch.randn(H, device="cuda", dtype=torch.bfloat16)

    def f(x, w, b):
        return bias_gelu(layer_norm(x, w, b), bias).float().square().mean()

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
