"""The bertaccel op schemas on CPU: opcheck (schema, fake, autograd registration) of the public ops
and their saving forms, and the backward formulas of the reference implementations against
autograd of plain PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import bertaccel.ops.swap  # noqa: F401 - imports every op family


def rand(*shape, **kw):
    return torch.randn(*shape, **kw)


@pytest.mark.parametrize("fused", [False, True])
def test_layer_norm_opcheck_cpu(fused):
    H = 48
    x = rand(7, H, requires_grad=True)
    w, b = rand(H, requires_grad=True), rand(H, requires_grad=True)
    bias = rand(H, requires_grad=True) if fused else None
    res = rand(7, H, requires_grad=True) if fused else None
    torch.library.opcheck(torch.ops.bertaccel.layer_norm_fwd.default, (x, bias, res, w, b, 0.0, 1e-5))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_opcheck_cpu(approximate):
    x, b = rand(5, 40, requires_grad=True), rand(40, requires_grad=True)
    torch.library.opcheck(torch.ops.bertaccel.bias_gelu.default, (x, b, approximate == "tanh"))


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


def test_embedding_backward_matches_autograd_and_skips_the_padding_row():
    H, V = 24, 30
    ids = torch.randint(0, V, (4, 7))
    ids[0, :3] = 1  # padding id 1
    pos = torch.arange(7).expand(4, 7).contiguous()
    tt = torch.randint(0, 2, (4, 7))
    base = [rand(V, H), rand(7, H), rand(2, H), rand(H), rand(H)]
    a = [t.clone().requires_grad_(True) for t in base]
    r = [t.clone().requires_grad_(True) for t in base]
    y = torch.ops.bertaccel.embedding_layer_norm_fwd(ids, pos, tt, *a, 0.0, 1e-12, False, 1)[0]
    h = F.embedding(ids, r[0], padding_idx=1) + F.embedding(tt, r[2]) + F.embedding(pos, r[1])
    yr = F.layer_norm(h, (H,), r[3], r[4], 1e-12)
    torch.testing.assert_close(y, yr)
    dy = rand(4, 7, H)
    for g, gr in zip(torch.autograd.grad(y, a, dy), torch.autograd.grad(yr, r, dy)):
        torch.testing.assert_close(g, gr, rtol=1e-4, atol=1e-5)
    assert torch.all(torch.autograd.grad(torch.ops.bertaccel.embedding_layer_norm_fwd(
        ids, pos, tt, *a, 0.0, 1e-12, False, 1)[0], a[0], dy)[0][1] == 0)


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
