"""Tests of every op family together: opcheck of each op, tags, torch.compile and CUDA graphs across ops: CPU tests (opcheck, autograd formulas, fallback) run everywhere; `cuda` tests check
the kernels against float64 references on the GPU (see conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import bertaccel.ops.swap  # noqa: F401 - imports every op family
from bertaccel.ops.gelu import bias_gelu
from bertaccel.ops.layer_norm import layer_norm
from bertaccel.ops.residual_layer_norm import bias_dropout_add_layer_norm
from bertaccel.ops.rms_norm import rms_norm
from bertaccel.ops.softmax import softmax
from tests.ops.conftest import DTYPES, cuda_test, rand


@pytest.mark.parametrize("fused", [False, True])
def test_public_ops_opcheck_cpu(fused):
    H = 40
    x, w, b = rand(7, H, requires_grad=True), rand(H, requires_grad=True), rand(H, requires_grad=True)
    bias = rand(H, requires_grad=True) if fused else None
    res = rand(7, H, requires_grad=True) if fused else None
    torch.library.opcheck(torch.ops.bertaccel.layer_norm.default, (x, bias, res, w, b, 0.0, 1e-5))
    torch.library.opcheck(torch.ops.bertaccel.rms_norm.default, (x, w, 1e-6))
    ids = torch.randint(0, 30, (3, 9))
    pos = torch.arange(9).expand(3, 9).contiguous()
    tables = [rand(n, H, requires_grad=True) for n in (30, 9, 2)]
    torch.library.opcheck(torch.ops.bertaccel.embedding_layer_norm.default,
                          (ids, pos, torch.zeros_like(ids), *tables, w, b, 0.0, 1e-12, False, 0))


def test_new_ops_opcheck_cpu():
    H = 40
    x, w = rand(7, H, requires_grad=True), rand(H, requires_grad=True)
    torch.library.opcheck(torch.ops.bertaccel.rms_norm_fwd.default, (x, w, 1e-6))
    scores = rand(2, 3, 5, 16, requires_grad=True)
    keep = torch.rand(2, 1, 1, 16) > 0.3
    torch.library.opcheck(torch.ops.bertaccel.softmax.default, (scores, None, 0.5))
    torch.library.opcheck(torch.ops.bertaccel.softmax.default, (scores, keep, 0.5))
    torch.library.opcheck(torch.ops.bertaccel.softmax.default, (scores, rand(2, 1, 5, 16), 0.5))
    ids = torch.randint(0, 30, (3, 9))
    pos = torch.arange(9).expand(3, 9).contiguous()
    tables = [rand(n, H, requires_grad=True) for n in (30, 9, 2)]
    b = rand(H, requires_grad=True)
    torch.library.opcheck(torch.ops.bertaccel.embedding_layer_norm_fwd.default,
                          (ids, pos, torch.zeros_like(ids), *tables, w, b, 0.0, 1e-12, False, 0))


def test_rms_norm_and_softmax_backward_formulas_match_autograd():
    H = 33
    x, w, dy = rand(9, H), rand(H), rand(9, H)
    a = [t.clone().requires_grad_(True) for t in (x, w)]
    r = [t.clone().requires_grad_(True) for t in (x, w)]
    y = torch.ops.bertaccel.rms_norm_fwd(a[0], a[1], 1e-6)[0]
    yr = F.rms_norm(r[0], (H,), r[1], 1e-6)
    torch.testing.assert_close(y, yr)
    for g, gr in zip(torch.autograd.grad(y, a, dy), torch.autograd.grad(yr, r, dy)):
        torch.testing.assert_close(g, gr, rtol=1e-4, atol=1e-5)
    s = rand(2, 3, 4, 10)
    mask = torch.randn(2, 1, 1, 10)
    sa, sr = s.clone().requires_grad_(True), s.clone().requires_grad_(True)
    y = torch.ops.bertaccel.softmax(sa, mask, 0.3)
    yr = torch.softmax(sr * 0.3 + mask, -1)
    torch.testing.assert_close(y, yr)
    dy = rand(2, 3, 4, 10)
    torch.testing.assert_close(torch.autograd.grad(y, sa, dy)[0], torch.autograd.grad(yr, sr, dy)[0])


def test_dropout_ops_are_tagged_seeded_and_check_p():
    """Ops that draw dropout masks carry `nondeterministic_seeded` (torch.compile must not merge two
    calls), and a probability outside [0, 1) is refused instead of giving a wrong 1/(1-p) scale."""
    seeded = torch.Tag.nondeterministic_seeded
    assert seeded in torch.ops.bertaccel.layer_norm_fwd.default.tags
    assert seeded in torch.ops.bertaccel.embedding_layer_norm_fwd.default.tags
    assert seeded in torch.ops.bertaccel.layer_norm.default.tags
    assert seeded in torch.ops.bertaccel.embedding_layer_norm.default.tags
    assert seeded not in torch.ops.bertaccel.rms_norm_fwd.default.tags
    x, w, b = torch.randn(4, 8), torch.ones(8), torch.zeros(8)
    for p in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match=r"dropout probability must be in \[0, 1\)"):
            torch.ops.bertaccel.layer_norm(x, None, None, w, b, p, 1e-5)
        with pytest.raises(ValueError, match=r"dropout probability must be in \[0, 1\)"):
            torch.ops.bertaccel.layer_norm_fwd(x, None, None, w, b, p, 1e-5)  # the CPU kernel too
    ids = torch.zeros(2, 3, dtype=torch.long)
    emb = torch.randn(10, 8)
    with pytest.raises(ValueError, match=r"dropout probability"):
        torch.ops.bertaccel.embedding_layer_norm(ids, ids, ids, emb, emb, emb[:2], w, b, 1.0, 1e-5, False, 0)


@cuda_test
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


@cuda_test
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


@cuda_test
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


@cuda_test
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_calls_without_a_backward_equal_the_training_forward(p):
    """A call that records no backward (no_grad, or no input requiring grad) gives the values of a
    training call's forward: without dropout it runs the output-only kernel, equal up to one bf16
    rounding (it normalises the fp32 sum, the saving form the stored bf16 sum); with dropout it
    normalises the bf16-rounded sum too, so the outputs are the same bits when both start from the same
    generator state."""
    H = 768
    x = torch.randn(64, H, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(64, H, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(H, device="cuda", dtype=torch.bfloat16)
    w, b = torch.randn(H, device="cuda"), torch.randn(H, device="cuda")
    wg, bg = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
    torch.manual_seed(5)
    trained = torch.ops.bertaccel.layer_norm(x, bias, r, wg, bg, p, 1e-12)
    torch.manual_seed(5)
    with torch.no_grad():
        inferred = torch.ops.bertaccel.layer_norm(x, bias, r, w, b, p, 1e-12)
    assert trained.grad_fn is not None and inferred.grad_fn is None

    def same(a, b):
        if p > 0:
            assert torch.equal(a, b), "the same dropout masks from the same generator state"
        else:  # outputs ~ N(0, 1) * w + b: a few bf16 roundings of the pre-norm sum apart
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)

    same(trained.detach(), inferred)
    torch.testing.assert_close(torch.ops.bertaccel.rms_norm(x, wg, 1e-6).detach(), torch.ops.bertaccel.rms_norm(x, w, 1e-6))
    ids = torch.randint(0, 50, (4, 16), device="cuda")
    pos = torch.arange(16, device="cuda").expand(4, 16).contiguous()
    tables = [torch.randn(n, H, device="cuda") for n in (50, 16, 2)]
    grads = [t.clone().requires_grad_(True) for t in tables]
    torch.manual_seed(6)
    e_train = torch.ops.bertaccel.embedding_layer_norm(ids, pos, torch.zeros_like(ids), *grads, wg, bg, p, 1e-12, True, 0)
    torch.manual_seed(6)
    e_infer = torch.ops.bertaccel.embedding_layer_norm(ids, pos, torch.zeros_like(ids), *tables, w, b, p, 1e-12, True, 0)
    same(e_train.detach(), e_infer)


def test_extensions_folder_follows_its_variable_then_the_cache(monkeypatch, tmp_path):
    """BERTACCEL_EXTENSIONS names the compiled extensions' folder; without it they live under
    $BERTACCEL_CACHE/extensions. The suite's per-test data caches keep the caller's extensions folder
    (tests/conftest.py), so a GPU test run compiles the extensions once, not in each pytest process."""
    from bertaccel.ops import build
    from tests.conftest import EXTENSIONS

    assert build.cache_root() == Path(EXTENSIONS)  # set by the autouse fixture, not this test's own cache
    assert not str(build.cache_root()).startswith(str(tmp_path))
    monkeypatch.setenv("BERTACCEL_EXTENSIONS", str(tmp_path / "ext"))
    assert build.cache_root() == tmp_path / "ext"
    monkeypatch.delenv("BERTACCEL_EXTENSIONS")
    monkeypatch.setenv("BERTACCEL_CACHE", str(tmp_path / "c"))
    assert build.cache_root() == tmp_path / "c" / "extensions"
