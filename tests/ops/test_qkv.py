"""The fused Q, K, V projection (qkv.py): the math on CPU (one GEMM over concatenated weights equals
the three projections), and on the GPU the swapped self-attention against HF's, forward and every
gradient, in fp32 and bf16 autocast, error at most twice HF's own against a float64 reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import BertConfig
from transformers.models.bert.modeling_bert import BertSelfAttention

from bertaccel.ops.qkv import FusedQKVSelfAttention, can_fuse, qkv_projection, split_heads
from tests.ops.conftest import check, cuda_test


def test_one_gemm_equals_the_three_projections():
    torch.manual_seed(0)
    q, k, v = (nn.Linear(24, 24).double() for _ in range(3))
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    heads = split_heads(qkv_projection(q, k, v, x), (24, 24, 24), 8)
    for lin, got in zip((q, k, v), heads):
        want = lin(x).view(2, 5, 3, 8).transpose(1, 2)
        assert got.shape == want.shape == (2, 3, 5, 8)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_projections_that_cannot_be_fused_say_why():
    a, b = nn.Linear(8, 8), nn.Linear(8, 8, bias=False)
    assert can_fuse(a, a, a) is None
    assert "bias" in can_fuse(a, b, a)
    assert "different sizes" in can_fuse(a, nn.Linear(4, 8), a)


@cuda_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("shape", [(2, 37, 64, 4), (4, 128, 384, 12), (1, 200, 768, 12)])
def test_fused_self_attention_matches_hf(shape, attn, dtype):
    b, t, hidden, heads = shape
    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=hidden, num_attention_heads=heads, attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = attn
    ref_mod = BertSelfAttention(cfg).cuda().double()
    x = torch.randn(b, t, hidden, device="cuda", dtype=torch.float64)
    dy = torch.randn(b, t, hidden, device="cuda", dtype=torch.float64)
    mask = torch.zeros(b, 1, 1, t, device="cuda")
    mask[0, ..., t // 2:] = torch.finfo(torch.float32).min  # padded keys in the first row

    def run(module, model_dtype, autocast):
        module = module.to(model_dtype)
        module.zero_grad(set_to_none=True)
        xi = x.to(model_dtype if not autocast else torch.float32).detach().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = module(xi, mask.to(model_dtype))[0]
        out.backward(dy.to(out.dtype))
        grads = [xi.grad] + [p.grad for p in module.parameters()]
        return out, grads

    bf16 = dtype == torch.bfloat16
    ref, ref_g = run(ref_mod, torch.float64, False)
    hf_mod = BertSelfAttention(cfg).cuda()
    hf_mod.load_state_dict(ref_mod.state_dict())
    hf, hf_g = run(hf_mod, torch.float32, bf16)
    fused = FusedQKVSelfAttention(hf_mod) if attn == "sdpa" else None
    if fused is None:
        from bertaccel.ops.softmax import FusedBertSelfAttention

        fused = FusedBertSelfAttention(hf_mod)
    ours, our_g = run(fused, torch.float32, bf16)
    check(ours, hf, ref, dtype, "out")
    names = ["x"] + [n for n, _ in hf_mod.named_parameters()]
    for name, a, h, r in zip(names, our_g, hf_g, ref_g):
        if name == "key.bias":  # softmax is invariant to it: its exact gradient is 0
            continue
        check(a, h, r, dtype, f"d{name}")
