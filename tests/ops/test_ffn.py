"""Tests of the fused feed-forward block (ffn.py): the `feed_forward` op and the `ffn` swap family.

CPU (everywhere): the op's output and every gradient against PyTorch's formulas in float64 (the
composite runs the reference GEMM there), opcheck, the fused block's plumbing against HF's
BertIntermediate + BertOutput. `cuda` (Hopper): the op and the swapped block against a float64
reference from the same bf16 inputs, at most 2x the error of HF's block under bf16 autocast (cuBLAS),
dropout in training, CUDA-graph capture and `torch.compile(fullgraph=True)`. A whole swapped model's
gradients against HF's: tests/ops/test_gemm.py::test_swapped_bert_layer_matches_hf[linear_and_ffn].
"""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig
from transformers.models.bert.modeling_bert import BertLayer

import bertaccel.ops.swap  # noqa: F401 - imports every op family
from bertaccel.ops import ffn
from bertaccel.ops.ffn import FusedFeedForward, feed_forward, feed_forward_reference
from bertaccel.ops.swap import swap
from tests.ops.conftest import (
    FANOUT_CPU_BERT,
    FANOUT_GPU_BERT,
    assert_replay_matches_eager,
    bert_fanout_off_and_on,
    check_vs_cublas,
    hopper_test,
    poison,
)

OP = torch.ops.bertaccel.feed_forward_fwd.default


def _operands(T, H, I, dtype, device="cpu", requires_grad=True):
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(T, H, device=device, generator=g).to(dtype)
    w1 = (torch.randn(I, H, device=device, generator=g) * H**-0.5).to(dtype)
    b1 = torch.randn(I, device=device, generator=g).to(dtype)
    w2 = (torch.randn(H, I, device=device, generator=g) * I**-0.5).to(dtype)
    return [t.requires_grad_(requires_grad) for t in (x, w1, b1, w2)]


def _value_and_grads(fn, inputs, dy):
    y = fn(*inputs)
    return [y, *torch.autograd.grad(y, inputs, dy)]


# ----------------------------------------------------------------------------------- CPU tests
@pytest.fixture(params=["kernel", "epilogue"])
def dgelu(request, monkeypatch):
    """Both places the backward can apply gelu'(pre) (BERTACCEL_FFN_DGELU)."""
    monkeypatch.setenv("BERTACCEL_FFN_DGELU", request.param)
    assert ffn.dgelu_in_epilogue() == (request.param == "epilogue")
    return request.param


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_op_and_gradients_match_pytorch(approximate, dgelu):
    inputs = _operands(37, 24, 40, torch.float64)
    dy = torch.randn(37, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ours = _value_and_grads(lambda *a: feed_forward(*a, approximate=approximate), inputs, dy)
    ref = _value_and_grads(lambda *a: feed_forward_reference(*a, approximate=approximate), inputs, dy)
    # bias_gelu_bwd's reference computes in fp32: an fp32 rounding per element, summed over 37 rows in dw1
    tol = {} if dgelu == "epilogue" else dict(rtol=1e-4, atol=1e-5)
    for name, o, r in zip(["y", "dx", "dw1", "db1", "dw2"], ours, ref):
        torch.testing.assert_close(o, r, msg=name, **tol)


def test_only_the_needed_gradients_are_computed():
    x, w1, b1, w2 = _operands(9, 16, 24, torch.float64)
    x.requires_grad_(False)
    y = feed_forward(x, w1, b1, w2)
    dw1, dw2 = torch.autograd.grad(y.sum(), (w1, w2))
    assert dw1.shape == w1.shape and dw2.shape == w2.shape


def test_opcheck_cpu():
    torch.library.opcheck(OP, (*_operands(9, 16, 24, torch.float32), False))
    torch.library.opcheck(OP, (*_operands(9, 16, 24, torch.float32), True))


BLOCK = torch.ops.bertaccel.feed_forward_layer_norm_fwd.default


def _block_operands(T, H, I, dtype, device="cpu"):
    """x, w1, b1, w2 in dtype; b2 and the LayerNorm's weight and bias fp32 (as the model's Parameters)."""
    g = torch.Generator(device=device).manual_seed(1)
    ln = [torch.randn(H, device=device, generator=g) * 0.1 + shift for shift in (0.0, 1.0, 0.0)]  # b2, weight, ln_bias
    ln = [t.double() if dtype == torch.float64 else t for t in ln]
    return [*_operands(T, H, I, dtype, device), *(t.requires_grad_(True) for t in ln)]


@pytest.fixture(params=["epilogue", "add"])
def residual(request, monkeypatch):
    """Both ways the block's backward can add the residual's gradient to x's (BERTACCEL_FFN_RESIDUAL)."""
    monkeypatch.setenv("BERTACCEL_FFN_RESIDUAL", request.param)
    assert ffn.residual_grad_in_epilogue() == (request.param == "epilogue")
    return request.param


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_block_op_and_every_gradient_match_pytorch(approximate, dgelu, residual):
    """The whole block (GEMMs, bias + GELU, residual LayerNorm) as one op: output and all seven gradients
    against HF's formulas (no dropout), the residual's gradient reaching x whichever way it is added."""
    inputs = _block_operands(29, 24, 40, torch.float64)
    dy = torch.randn(29, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ours = _value_and_grads(lambda *a: ffn.feed_forward_layer_norm(*a, 0.1, 1e-5, approximate, training=False), inputs, dy)
    ref = _value_and_grads(lambda *a: ffn.feed_forward_layer_norm_reference(*a, 0.0, 1e-5, approximate), inputs, dy)
    # the CPU LayerNorm reference computes in fp32 (as the kernel does)
    for name, o, r in zip(["y", "dx", "dw1", "db1", "dw2", "db2", "dweight", "dln_bias"], ours, ref):
        assert o.dtype == r.dtype, name
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-5, msg=name)


def test_block_dropout_is_the_layer_norm_ops_and_its_gradient_follows_the_mask(residual):
    """With dropout the block's output is the residual LayerNorm op's on the same GEMM output (same seed), and
    its input gradient is the GEMMs' plus the residual's, through the same mask."""
    x, w1, b1, w2, b2, weight, ln_bias = _block_operands(17, 16, 24, torch.float32)
    torch.manual_seed(5)
    y = ffn.feed_forward_layer_norm(x, w1, b1, w2, b2, weight, ln_bias, 0.3, 1e-5)
    xr = x.detach().clone().requires_grad_(True)
    torch.manual_seed(5)
    h = feed_forward(xr, w1, b1, w2)
    yr = torch.ops.bertaccel.layer_norm(h, b2, xr, weight, ln_bias, 0.3, 1e-5)
    torch.testing.assert_close(y, yr)
    assert (y - ffn.feed_forward_layer_norm(x, w1, b1, w2, b2, weight, ln_bias, 0.0, 1e-5)).abs().amax() > 0
    dy = torch.randn_like(y)
    torch.testing.assert_close(torch.autograd.grad(y, x, dy)[0], torch.autograd.grad(yr, xr, dy)[0], rtol=1e-4, atol=1e-5)


def test_block_computes_only_the_gradients_asked_for():
    x, w1, b1, w2, b2, weight, ln_bias = _block_operands(9, 16, 24, torch.float32)
    x.requires_grad_(False)
    y = ffn.feed_forward_layer_norm(x, w1, b1, w2, b2, weight, ln_bias, 0.0, 1e-5)
    grads = torch.autograd.grad(y.sum(), (w1, b2, weight))
    assert [g.shape for g in grads] == [w1.shape, b2.shape, weight.shape]


def test_block_opcheck_cpu():
    torch.library.opcheck(BLOCK, (*_block_operands(9, 16, 24, torch.float32), 0.0, 1e-5, False))
    torch.library.opcheck(BLOCK, (*_block_operands(9, 16, 24, torch.float32), 0.0, 1e-5, True))
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        BLOCK(*_block_operands(9, 16, 24, torch.float32), 1.0, 1e-5, False)


def _layer(hidden=64, inner=128, act="gelu", p=0.1):
    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=hidden, intermediate_size=inner, num_attention_heads=4, hidden_act=act,
                     hidden_dropout_prob=p)
    return BertLayer(cfg)


@pytest.mark.parametrize("act", ["gelu", "gelu_new"])
def test_fused_block_computes_hf_block(act, monkeypatch):
    """The fused route (forced on CPU, where its ops run their references) equals HF's block: the same
    weights, biases, activation, LayerNorm eps; dropout off in eval."""
    layer = _layer(act=act).eval()
    x = torch.randn(2, 11, 64, dtype=torch.float64)
    layer.double()
    ref = layer.feed_forward_chunk(x)
    fused = ffn.fused_layer(layer)
    monkeypatch.setattr(ffn, "why_not", lambda *a: None)
    monkeypatch.setattr(ffn, "_gemm_reason", lambda *a: None)
    # the block's residual LayerNorm computes its statistics in fp32 (the op's CPU reference, as the kernel)
    torch.testing.assert_close(fused.feed_forward_chunk(x), ref, rtol=1e-5, atol=1e-6)


def test_swapped_layer_is_the_same_layer_and_reverts():
    layer = _layer()
    model = torch.nn.Sequential(layer)
    keys, params = list(model.state_dict()), list(model.parameters())
    report = swap(model, ["ffn"])
    new = model[0]
    assert isinstance(new, BertLayer) and type(new) is not BertLayer
    assert isinstance(new.feed_forward, FusedFeedForward)
    assert new.intermediate is layer.intermediate and new.output is layer.output and new.attention is layer.attention
    assert list(model.state_dict()) == keys and list(model.parameters()) == params
    assert "feed_forward" not in layer._modules  # the original's dictionaries are untouched
    model.eval()
    assert not new.feed_forward.training  # train()/eval() reach the block
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        torch.testing.assert_close(new(x), layer(x))  # CPU: HF's modules run
    report.revert()
    assert model[0] is layer


def test_layers_the_family_cannot_take_are_reported():
    layer = _layer(act="relu")
    report = swap(torch.nn.Sequential(layer), ["ffn"])
    assert not report.replaced and "not a GELU" in report.skipped[0][2]
    report = swap(torch.nn.Sequential(_layer(hidden=60, inner=132)), ["ffn"])
    assert "multiples of 8" in report.skipped[0][2]


# ---------------------------------------------------------------------------------- CUDA tests
@hopper_test
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("T,H,I", [(1031, 768, 3072), (200, 384, 1536), (77, 136, 264)])
def test_op_against_float64(T, H, I, approximate, dgelu):
    inputs = _operands(T, H, I, torch.bfloat16, "cuda")
    dy = torch.randn(T, H, device="cuda").bfloat16()
    poison()
    ours = _value_and_grads(lambda *a: feed_forward(*a, approximate=approximate), inputs, dy)
    cublas = _value_and_grads(lambda *a: feed_forward_reference(*a, approximate=approximate), inputs, dy)
    ref_in = [t.detach().double().requires_grad_(True) for t in inputs]
    ref = _value_and_grads(lambda *a: feed_forward_reference(*a, approximate=approximate), ref_in, dy.double())
    for name, o, c, r in zip(["y", "dx", "dw1", "db1", "dw2"], ours, cublas, ref):
        assert o.dtype == c.dtype and o.shape == c.shape, name
        check_vs_cublas(o, c, r, f"{T}x{H}x{I} {approximate} {name}")


@hopper_test
def test_swapped_block_against_hf_under_autocast(residual):
    """The block (fp32 master weights, bf16 autocast) and every parameter's gradient, in eval (no
    dropout), against float64 HF from the same bf16-rounded weights; HF's bf16 block as the bar."""
    layer = _layer(768, 3072, p=0.1).cuda().eval()
    ref_layer = _layer(768, 3072, p=0.1).double().cuda().eval()
    with torch.no_grad():
        for p, r in zip(layer.parameters(), ref_layer.parameters()):
            p.copy_(p.bfloat16().float())
            r.copy_(p)
    x = torch.randn(4, 259, 768, device="cuda").bfloat16()
    dy = torch.randn(4, 259, 768, device="cuda").bfloat16().float()  # what each block's backward can take exactly

    def run(module, x):
        x = x.detach().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=x.dtype != torch.float64):
            y = module.feed_forward_chunk(x)
        params = [p for n, p in sorted(module.named_parameters()) if "attention" not in n]
        grads = torch.autograd.grad(y, [x, *params], dy.to(y.dtype))
        return [y, *grads]

    hf = run(layer, x)
    hf[0] = hf[0].bfloat16()  # the bar at the fused block's output dtype (HF's LayerNorm under autocast: fp32)
    ref = run(ref_layer, x.double())
    report = swap(torch.nn.Sequential(layer), ["ffn"])
    fused = run(report.model[0], x)
    assert fused[0].dtype == torch.bfloat16
    names = ["y", "dx"] + [n for n, _ in sorted(layer.named_parameters()) if "attention" not in n]
    for name, o, c, r in zip(names, fused, hf, ref):
        check_vs_cublas(o.float(), c.float(), r, f"ffn block {name}")


@hopper_test
def test_dropout_in_training_is_seeded_and_scaled():
    layer = _layer(256, 1024, p=0.25).cuda().train()
    fused = ffn.fused_layer(layer)
    x = torch.randn(3, 64, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        torch.manual_seed(3)
        a = fused.feed_forward_chunk(x)
        torch.manual_seed(3)
        b = fused.feed_forward_chunk(x)
        c = fused.feed_forward_chunk(x)
        fused.eval()
        d = fused.feed_forward_chunk(x)
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, d)
    assert (a - d).abs().amax(-1).gt(0).float().mean() > 0.9  # dropout acted on (almost) every row


@hopper_test
def test_capture_and_compile():
    layer = _layer(256, 1024).cuda().eval()
    fused = ffn.fused_layer(layer)
    x = torch.randn(2, 100, 256, device="cuda", requires_grad=True)
    params = [*layer.intermediate.parameters(), *layer.output.parameters()]

    def step(x, fn=fused.feed_forward_chunk):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fn(x)
        return y, torch.autograd.grad(y.float().square().sum(), [x, *params])

    eager = step(x)
    compiled = step(x, torch.compile(fused.feed_forward_chunk, fullgraph=True))
    for e, c in zip([eager[0], *eager[1]], [compiled[0], *compiled[1]]):
        torch.testing.assert_close(c, e, rtol=2e-2, atol=2e-2)
    torch.library.opcheck(OP, (*_operands(300, 256, 512, torch.bfloat16, "cuda"), False))
    torch.library.opcheck(BLOCK, (*_block_operands(300, 256, 512, torch.bfloat16, "cuda"), 0.0, 1e-12, False))
    del eager, compiled
    assert_replay_matches_eager(step, x.detach().clone().requires_grad_(True))


# ------------------------------------------------------------------- the residual gradient's fan-out (CPU)
def test_block_fanout_hands_the_two_gradients_apart_and_sums_them(residual):
    """The block's fan-out (BERTACCEL_RESIDUAL_FANOUT): y and its alias feed two consumers; every input's gradient is
    what one output used twice gives (autograd's add), and with one consumer alone."""
    inputs = _block_operands(13, 16, 24, torch.float64)
    a, b = (torch.randn(13, 16, dtype=torch.float64) for _ in range(2))
    y, alias = ffn._FeedForwardLayerNormFanOut.apply(*inputs, 0.0, 1e-5, False)
    assert alias.data_ptr() == y.data_ptr() and alias is not y
    ours = torch.autograd.grad((y * a).sum() + (alias * b).sum(), inputs)
    yr = ffn.feed_forward_layer_norm(*inputs, 0.0, 1e-5)
    ref = torch.autograd.grad((yr * a).sum() + (yr * b).sum(), inputs)
    # (the CPU LayerNorm reference sums the two gradients and computes in fp32, as the kernel does)
    for name, o, r in zip(["dx", "dw1", "db1", "dw2", "db2", "dweight", "dln_bias"], ours, ref):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-5, msg=name)
    y, alias = ffn._FeedForwardLayerNormFanOut.apply(*inputs, 0.0, 1e-5, False)
    only = torch.autograd.grad((alias * b).sum(), inputs)
    yr = ffn.feed_forward_layer_norm(*inputs, 0.0, 1e-5)
    ref = torch.autograd.grad((yr * b).sum(), inputs)
    for o, r in zip(only, ref):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-5)


def test_fanout_from_the_block_to_the_next_layer_trains_like_autograds_add(monkeypatch):
    """BERTACCEL_RESIDUAL_FANOUT=1 in a 2-layer BERT with the `ffn` and residual LayerNorm families (their kernel paths
    forced on CPU): the block's output hands the next layer's attention-output LayerNorm an alias, the two gradients
    meet in layer_norm_bwd2 (once: layer 0's block output; the attention outputs feed the block alone), and the
    output and every gradient are autograd's add's."""
    from bertaccel.ops import residual_layer_norm

    monkeypatch.setattr(residual_layer_norm, "why_not", lambda *a, **k: None)
    monkeypatch.setattr(ffn, "why_not", lambda *a, **k: None)
    monkeypatch.setattr(ffn, "_gemm_reason", lambda *a: None)
    off, on, calls = bert_fanout_off_and_on(monkeypatch, ["residual_layer_norm", "ffn"], FANOUT_CPU_BERT)
    assert calls == 1, calls
    for a, b in zip(off, on):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@hopper_test
def test_fanout_with_everything_swapped_trains_like_autograds_add(monkeypatch):
    """BERTACCEL_RESIDUAL_FANOUT=1 on the GPU with every family (`ffn` and `linear` included; bf16 autocast, dropout
    off): layer_norm_bwd2 ran for each residual LayerNorm output with two consumers, and the output and every
    parameter's gradient are autograd's add's up to kernel-order noise."""
    off, on, calls = bert_fanout_off_and_on(monkeypatch, ["all", "linear", "ffn"], FANOUT_GPU_BERT, "cuda")
    assert calls == 1, calls  # layer 0's block output (its attention outputs feed the block alone)
    for i, (a, b) in enumerate(zip(off, on)):
        torch.testing.assert_close(b, a, rtol=2e-2, atol=1e-3 * a.abs().max().item() + 1e-6, msg=f"tensor {i}")
