"""The direct eager entry points (csrc/eager.cpp, handed out by eligibility.direct_entry): the same eligibility
answer as why_not, the same bits as the torch.ops call, and torch.ops where an override or torch.compile must
see the call."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from bertaccel.ops import build
from bertaccel.ops.eligibility import bias_as_read, direct_entry, why_not
from bertaccel.ops.gelu import bias_gelu
from bertaccel.ops.layer_norm import layer_norm
from bertaccel.ops.residual_layer_norm import (_ResidualLayerNormFanOut, _kernel_args, bias_dropout_add_layer_norm,
                                               bias_dropout_add_layer_norm_fanout)
from bertaccel.ops.rms_norm import rms_norm
from tests.ops.conftest import cuda_test


class _PassThrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_direct_entry_steps_aside_for_overrides_and_compile(monkeypatch):
    """direct_entry hands out the loaded entry module, and None under a __torch_function__ mode, with an argument
    that overrides __torch_function__, while torch.compile traces, and before the extension has loaded."""
    sentinel = object()
    x, w = torch.randn(3, 8), torch.nn.Parameter(torch.randn(8))
    monkeypatch.setattr(build, "entry", sentinel)
    assert direct_entry(x, w, None) is sentinel  # (a Parameter does not override __torch_function__)
    with _PassThrough():
        assert direct_entry(x, w, None) is None

    class Sub(torch.Tensor):
        pass

    assert direct_entry(x.as_subclass(Sub), w) is None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert direct_entry(x, w) is None
    monkeypatch.undo()
    monkeypatch.setattr(build, "entry", None)
    assert direct_entry(x, w) is None


def _cases(device):
    """(x, weight, bias) triples, eligible and not, with why_not's answer for each."""
    bf, f32, f16 = torch.bfloat16, torch.float32, torch.float16
    out = []
    for H in (8, 1001, 8192, 8193):
        for xd, wd in ((bf, f32), (bf, bf), (f32, f32), (f32, bf), (f16, f16), (bf, f16)):
            x = torch.randn(3, H, device=device, dtype=xd)
            w, b = (torch.randn(H, device=device, dtype=wd) for _ in range(2))
            out.append((x, w, b))
    x = torch.randn(3, 64, device=device, dtype=bf)
    out.append((x, torch.randn(64, dtype=torch.float32), torch.randn(64, device=device)))  # weight on the CPU
    out.append((x.t(), torch.randn(3, device=device), torch.randn(3, device=device)))  # not contiguous: the op copies
    return out


@cuda_test
def test_entry_answers_as_why_not_and_gives_the_ops_bits():
    assert build.entry is not None, "bertaccel_ops did not import as a Python module"
    entry = build.entry
    ops = torch.ops.bertaccel
    for x, w, b in _cases("cuda"):
        eligible = why_not(x, params=(w, b)) is None
        desc = f"x {x.dtype} {tuple(x.shape)}, params {w.dtype} on {w.device}"
        y = entry.layer_norm(x, w, b, 1e-5)
        assert (y is not None) == eligible, desc
        if eligible:
            assert torch.equal(y, ops.layer_norm.default(x.contiguous(), None, None, w, b, 0.0, 1e-5)), desc
        y = entry.rms_norm(x, w, None)
        assert (y is not None) == (why_not(x, params=(w,)) is None), desc
        if y is not None:
            eps = torch.finfo(x.dtype).eps
            assert torch.equal(y, ops.rms_norm.default(x.contiguous(), w, eps)), desc
        if w.device != x.device:  # (bias_gelu's eligibility does not look at the bias: the op names the problem)
            with pytest.raises(RuntimeError, match="bias is on cpu"):
                entry.bias_gelu(x, w, False)
            continue
        y = entry.bias_gelu(x, w, False)
        assert (y is not None) == (why_not(x) is None), desc
        if y is not None:
            # the entry reads an fp32 bias as it is, like gelu.bias_gelu (eligibility.bias_as_read)
            assert torch.equal(y, ops.bias_gelu.default(x.contiguous(), bias_as_read(w, x.dtype), False)), desc
    assert entry.layer_norm(torch.randn(3, 8, device="cuda"), None, torch.randn(8, device="cuda"), 1e-5) is None


@cuda_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_wrappers_through_the_entry_match_torch_ops_with_gradients(dtype):
    """The public functions (the entry) against the torch.ops path (under a pass-through TorchFunctionMode, which
    the entry steps aside for): output and every gradient, bit for bit, dropout drawn from the same generator state."""
    T, H = 37, 384

    def leaves():
        torch.manual_seed(0)
        x = torch.randn(T, H, device="cuda", dtype=dtype, requires_grad=True)
        r = torch.randn(T, H, device="cuda", dtype=dtype, requires_grad=True)
        hb = torch.randn(H, device="cuda", dtype=dtype, requires_grad=True)
        w, b = (torch.randn(H, device="cuda", requires_grad=True) for _ in range(2))
        return x, r, hb, w, b

    def run(through_ops: bool):
        x, r, hb, w, b = ls = leaves()
        dy = torch.randn(T, H, device="cuda", dtype=dtype)
        torch.cuda.manual_seed(7)
        with _PassThrough() if through_ops else torch.enable_grad():
            if not through_ops:
                assert direct_entry(x, w, b) is build.entry is not None
            outs = [layer_norm(x, w, b, 1e-5), rms_norm(x, w, 1e-6), bias_gelu(x, hb, "tanh"),
                    bias_dropout_add_layer_norm(x, hb, r, w, b, 0.1, 1e-12)]
        grads = torch.autograd.grad(sum((o.float() * dy.float()).sum() for o in outs), ls)
        return outs, grads

    (o1, g1), (o2, g2) = run(False), run(True)
    for a, b in zip(o1 + list(g1), o2 + list(g2)):
        assert torch.equal(a, b)


@cuda_test
@pytest.mark.parametrize("consumers", ["both", "y", "alias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpp_fanout_equals_the_python_function(dtype, consumers):
    """The residual LayerNorm's fan-out in C++ (csrc/autograd.cpp, what an eager call runs) against the Python
    autograd.Function (what torch.ops-only callers run): y, the alias (the same memory, another autograd edge) and
    every input's gradient bit for bit, with dropout, the bias and residual cast from fp32 (their gradients back in
    fp32), with both consumers' gradients (layer_norm_bwd2) or either alone."""
    T, H = 53, 768

    def run(cpp: bool):
        torch.manual_seed(1)
        x = torch.randn(T, H, device="cuda", dtype=dtype, requires_grad=True)
        hb = torch.randn(H, device="cuda", requires_grad=True)  # fp32: cast to x's dtype on the way in
        r = torch.randn(T, H, device="cuda", requires_grad=True)
        w, b = (torch.randn(H, device="cuda", requires_grad=True) for _ in range(2))
        a, c = (torch.randn(T, H, device="cuda") for _ in range(2))
        torch.cuda.manual_seed(3)
        if cpp:
            y, alias = bias_dropout_add_layer_norm_fanout(x, hb, r, w, b, 0.1, 1e-12)
            assert "ResidualLayerNormFanOutFn" in y.grad_fn.name(), y.grad_fn.name()  # (the C++ node)
        else:
            y, alias = _ResidualLayerNormFanOut.apply(*_kernel_args(x, hb, r, w, b, 0.1, 1e-12, True))
        assert alias.data_ptr() == y.data_ptr() and alias is not y
        loss = {"both": (y.float() * a).sum() + (alias.float() * c).sum(), "y": (y.float() * a).sum(),
                "alias": (alias.float() * c).sum()}[consumers]
        return [y, *torch.autograd.grad(loss, (x, hb, r, w, b))]

    for i, (p, q) in enumerate(zip(run(True), run(False))):
        assert p.dtype == q.dtype and torch.equal(p, q), i


def test_a_library_that_does_not_import_leaves_no_entry(tmp_path):
    """A shared object that is not a Python module (no PyInit): build._import_entry warns and gives None (the ops
    then run through torch.ops), rather than failing the load."""
    bogus = tmp_path / "bertaccel_ops_000000000000.so"
    bogus.write_bytes(b"not an ELF file")
    with pytest.warns(UserWarning, match="direct eager entry did not import"):
        assert build._import_entry(bogus) is None
