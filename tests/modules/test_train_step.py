"""The graphed step body (bertaccel.modules.train_step), run eagerly on CPU: transient gradients give
the update that adding into the static buffers gives, leave the static buffers in place and zero,
and skip a parameter the forward did not use, as Lightning's eager loop does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bertaccel.modules.train_step import build_train_step, make_static_grads


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.norm = nn.LayerNorm(5)
        self.b = nn.Linear(5, 3)
        self.unused = nn.Linear(3, 3)

    def forward(self, x, y):
        return {"loss": nn.functional.cross_entropy(self.b(self.norm(self.a(x))), y)}


def _run(transient: bool, clip=None, steps=3):
    torch.manual_seed(0)
    net = _Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    statics = make_static_grads(net.parameters())
    step = build_train_step(net, opt, transient_grads=transient, clip=clip)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        step(x=torch.randn(8, 6, generator=g), y=torch.randint(0, 3, (8,), generator=g))
        assert all(p.grad is buf for p, buf in statics), "a static gradient buffer was replaced"
        assert all(torch.count_nonzero(buf) == 0 for _, buf in statics), "static buffers not left zeroed"
    return net


@pytest.mark.parametrize("clip", [None, (0.05, "norm"), (0.01, "value")], ids=["plain", "clip-norm", "clip-value"])
def test_transient_gradients_update_like_static_buffers(clip):
    static, transient = _run(False, clip), _run(True, clip)
    # the norm of the static run also sums the unused parameter's zeros: its rounding may move a last bit
    tol = 1e-6 if clip and clip[1] == "norm" else 0.0
    for (name, a), b in zip(static.named_parameters(), transient.parameters()):
        if not name.startswith("unused"):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=name)


def test_a_parameter_without_gradient_is_not_updated():
    """Static buffers hand AdamW a zero gradient (weight decay moves the weight); transient gradients
    hand it none, as Lightning's `zero_grad(set_to_none=True)` eager loop does."""
    torch.manual_seed(0)
    before = _Net().unused.weight.detach().clone()
    assert torch.equal(_run(True).unused.weight, before)
    assert not torch.equal(_run(False).unused.weight, before)


def test_missing_static_gradients_are_an_error():
    net = _Net()
    opt = torch.optim.AdamW(net.parameters())
    with pytest.raises(RuntimeError, match="no static .grad buffer"):
        build_train_step(net, opt)
