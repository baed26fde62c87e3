"""The bertaccel op schemas on CPU: opcheck (schema, fake, autograd registration) and the backward
formulas of the reference implementations against autograd of plain PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from src.ops import library


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
    torch.library.opcheck(torch.ops.bertaccel.bias_gelu_fwd.default, (x, b, approximate == "tanh"))


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
        y = torch.ops.bertaccel.bias_gelu_fwd(x, b, approximate == "tanh")
        dy = rand(6, 20)
        gx, gb = torch.autograd.grad(y, (x, b), dy)
        xr, br = x.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
        rx, rb = torch.autograd.grad(F.gelu(xr + br, approximate=approximate), (xr, br), dy)
        torch.testing.assert_close(gx, rx)
        torch.testing.assert_close(gb, rb)


def test_eager_entry_points_match_the_registered_ops():
    """The eager autograd.Function path and the registered op (what torch.compile traces) agree."""
    H = 24
    x, w, b = rand(6, H, requires_grad=True), rand(H, requires_grad=True), rand(H, requires_grad=True)
    bias, res = rand(H, requires_grad=True), rand(6, H, requires_grad=True)
    for args in ((x, None, None, w, b, 0.0, 1e-5), (x, bias, res, w, b, 0.0, 1e-5)):
        leaves = [a for a in args if torch.is_tensor(a)]
        y1 = torch.ops.bertaccel.layer_norm_fwd(*args)[0]
        y2 = library.layer_norm_fwd(*args)[0]
        assert torch.equal(y1, y2)
        for g1, g2 in zip(torch.autograd.grad(y1.sum(), leaves), torch.autograd.grad(y2.sum(), leaves)):
            assert torch.equal(g1, g2)
    y1, y2 = torch.ops.bertaccel.bias_gelu_fwd(x, bias, False), library.bias_gelu_fwd(x, bias, False)
    for g1, g2 in zip(torch.autograd.grad(y1.sum(), (x, bias)), torch.autograd.grad(y2.sum(), (x, bias))):
        assert torch.equal(g1, g2)
