"""`attn_implementation: bertaccel`: our attention kernel behind transformers' AttentionInterface, on
padded batches (read in place as slots of the padded length, the lengths on the device: no host sync),
against SDPA."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from bertaccel.modules.hf_attention import attention_forward, padded_layout
from bertaccel.ops import eligibility
from tests.conftest import TINY_BERT, run_in_child
from tests.ops.conftest import capture_graph


def random_mask(B: int, S: int, seed: int = 0, left: bool = False) -> torch.Tensor:
    """Padding masks with lengths 1 .. S (one full row, one of length 1)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, S + 1, (B,), generator=g)
    lengths[0], lengths[-1] = S, 1
    mask = torch.arange(S)[None, :] < lengths[:, None]
    return mask.flip(1) if left else mask


@pytest.fixture
def packed_on_cpu(monkeypatch):
    """Run the packed path on CPU (the varlen op's CPU reference kernel) instead of falling back."""
    import bertaccel.ops.attention as attention

    monkeypatch.setattr(attention, "kernel_unavailable", lambda q, k, v: None)


def test_padded_layout_is_slots_of_the_padded_length_with_each_rows_token_count():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 1, 1], [1, 0, 1, 0]], dtype=torch.bool)
    cu, seqused = padded_layout(mask)
    assert cu.tolist() == [0, 4, 8, 12, 16, 20] and cu.dtype == torch.int32
    # right-padded rows (an empty one too): their token count; left padding and holes: -1 (no such layout)
    assert seqused.tolist() == [2, 4, 0, -1, -1] and seqused.dtype == torch.int32


def test_a_mask_that_is_not_right_padded_is_refused_with_the_reason(packed_on_cpu):
    """Left padding or holes have no in-place layout: the kernels stop (on the GPU a device-side assert with
    the same words), the CPU reference raises - never a silently wrong attention."""
    B, H, S, D = 3, 2, 6, 8
    q, k, v = (torch.randn(B, S, H * D, dtype=torch.float64).view(B, S, H, D).transpose(1, 2) for _ in range(3))
    for mask in (random_mask(B, S, left=True), torch.tensor([[1, 0, 1, 1, 0, 0]] * B, dtype=torch.bool)):
        with pytest.raises(ValueError, match="not right-padded.*padding_side='right'.*sdpa"):
            attention_forward(None, q, k, v, mask, scaling=D**-0.5)


def test_padded_path_equals_sdpa_on_real_positions(packed_on_cpu):
    B, H, S, D = 5, 3, 11, 16
    g = torch.Generator().manual_seed(1)
    # q, k, v as BERT makes them: views of [B, S, H*D] projections
    q, k, v = (torch.randn(B, S, H * D, generator=g, dtype=torch.float64).view(B, S, H, D).transpose(1, 2)
               .requires_grad_() for _ in range(3))
    mask = random_mask(B, S)
    out, weights = attention_forward(None, q, k, v, mask, dropout=0.0, scaling=D**-0.5)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :]).transpose(1, 2)
    assert weights is None and out.shape == (B, S, H, D)
    real = mask[:, :, None, None]
    torch.testing.assert_close(out * real, ref * real, rtol=1e-5, atol=1e-6)
    assert (out[~mask] == 0).all()  # padding query rows: zeros
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64) * real  # nothing reads padding rows
    ours = torch.autograd.grad(out, (q, k, v), grad)
    theirs = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_no_mask_reads_q_k_v_in_place(packed_on_cpu):
    B, H, S, D = 2, 2, 7, 8
    q, k, v = (torch.randn(B, S, H * D, dtype=torch.float64).view(B, S, H, D).transpose(1, 2) for _ in range(3))
    out, _ = attention_forward(None, q, k, v, None, scaling=0.3)
    ref = F.scaled_dot_product_attention(q, k, v, scale=0.3).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)  # the CPU reference computes in fp32


def test_fallbacks_say_why_and_match_sdpa(monkeypatch):
    monkeypatch.setattr(eligibility, "_warned", set())
    B, H, S, D = 2, 2, 6, 8
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    mask = random_mask(B, S)
    with pytest.warns(UserWarning, match="attention uses PyTorch: not a CUDA tensor"):
        out, weights = attention_forward(None, q, k, v, mask, scaling=D**-0.5)  # CPU: not a CUDA tensor
    assert weights is None
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :]).transpose(1, 2)
    torch.testing.assert_close(out, ref)

    class Module(torch.nn.Module):  # eager_attention_forward reads module.training
        pass

    with pytest.warns(UserWarning, match="output_attentions"):
        out, weights = attention_forward(Module(), q, k, v, mask, scaling=D**-0.5, output_attentions=True)
    assert weights is not None and weights.shape == (B, H, S, S)
    assert torch.allclose(weights.sum(-1), torch.ones(B, H, S)) and (weights[0, :, :, ~mask[0]] == 0).all()
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_a_4d_mask_goes_to_sdpa_as_it_is_and_says_why(packed_on_cpu, monkeypatch, kind):
    """A caller's own 4-D mask (transformers passes it on unchanged) is not a padding mask the kernel can
    read: SDPA takes it as given, said once; with output_attentions eager attention gets it additive."""
    monkeypatch.setattr(eligibility, "_warned", set())
    B, H, S, D = 2, 2, 6, 8
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    allowed = torch.rand(B, 1, S, S, generator=torch.Generator().manual_seed(0)) > 0.3
    allowed |= torch.eye(S, dtype=torch.bool)  # every query keeps a key
    mask = allowed if kind == "bool" else torch.zeros(B, 1, S, S).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with pytest.warns(UserWarning, match="4-D attention mask"):
        out, _ = attention_forward(None, q, k, v, mask, scaling=D**-0.5)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=D**-0.5).transpose(1, 2)
    torch.testing.assert_close(out, ref)

    class Module(torch.nn.Module):  # eager_attention_forward reads module.training
        pass

    out, weights = attention_forward(Module().eval(), q, k, v, mask, scaling=D**-0.5, output_attentions=True)
    torch.testing.assert_close(out, ref)
    assert (weights.masked_select(~allowed.expand(B, H, S, S)) == 0).all()


def test_a_gpu_other_than_hopper_gets_sdpa_and_is_told_why(monkeypatch):
    """Off a Hopper (our kernel's warpgroup-MMA forms need sm_90; its mma.sync ones are not measured faster than
    SDPA anywhere) the interface says why and runs SDPA, unless BERTACCEL_HF_ATTENTION_ANY_GPU=1."""
    from types import SimpleNamespace

    from bertaccel.modules import hf_attention

    capability = {"value": (8, 6)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability["value"])
    monkeypatch.delenv("BERTACCEL_HF_ATTENTION_ANY_GPU", raising=False)
    gpu_query = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    for cap, env, want in (((8, 6), None, False), ((9, 0), None, True), ((10, 0), None, False), ((8, 0), "1", True)):
        monkeypatch.setattr(hf_attention, "_HOPPER", {})
        capability["value"] = cap
        if env:
            monkeypatch.setenv("BERTACCEL_HF_ATTENTION_ANY_GPU", env)
        assert hf_attention.hopper(gpu_query.device) is want, (cap, env)
        assert (hf_attention.not_hopper_reason(gpu_query) is None) is want
    assert hf_attention.not_hopper_reason(torch.zeros(1)) is None  # CPU: the kernel checks say why
    # the reason reaches attention_forward's fallback, which runs SDPA
    monkeypatch.setattr(eligibility, "_warned", set())
    monkeypatch.setattr(hf_attention, "_HOPPER", {0: False})
    monkeypatch.setattr(hf_attention, "not_hopper_reason", lambda q: "not a Hopper GPU: (stand-in)")
    B, H, S, D = 2, 2, 6, 8
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    mask = random_mask(B, S)
    with pytest.warns(UserWarning, match="not a Hopper GPU"):
        out, _ = attention_forward(None, q, k, v, mask, scaling=D**-0.5)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :]).transpose(1, 2)
    torch.testing.assert_close(out, ref)


def test_bert_classifier_with_bertaccel_attention_equals_sdpa(packed_on_cpu):
    """The whole model, the transformers way (`attn_implementation: bertaccel`), same weights."""
    from bertaccel.modules import BertClassifier

    torch.manual_seed(0)
    config = dict(TINY_BERT, num_hidden_layers=2)
    models = {impl: BertClassifier(config=config, vocab_size=100, num_labels=3, attn_implementation=impl)
              for impl in ("sdpa", "bertaccel")}
    models["bertaccel"].model.load_state_dict(models["sdpa"].model.state_dict())
    assert models["bertaccel"].model.config._attn_implementation == "bertaccel"
    ids = torch.randint(5, 100, (4, 13))
    mask = random_mask(4, 13, seed=3).long()
    logits = {}
    for impl, m in models.items():
        m.train(False)
        logits[impl] = m.model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(logits["bertaccel"], logits["sdpa"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("qk_norm", [None, "rmsnorm"])
def test_bert_masked_lm_with_bertaccel_attention_equals_sdpa(packed_on_cpu, monkeypatch, qk_norm):
    """`recommended.yaml` names the interface for masked-LMs too (and `full.yaml`'s QK-norm, whose normed q and k
    are separate tensors, not views of one projection): the MLM head's logits and the loss's gradients equal
    SDPA's on a padded batch (padding rows' outputs are zeros in ours, averages in SDPA's; the loss reads real
    positions only)."""
    import bertaccel.ops.attention as attention
    from bertaccel.modules import BertMLM

    calls = []
    op = attention.varlen_attention
    monkeypatch.setattr(attention, "varlen_attention", lambda *a, **k: calls.append(1) or op(*a, **k))
    torch.manual_seed(0)
    config = dict(TINY_BERT, num_hidden_layers=2)
    models = {impl: BertMLM(config=config, vocab_size=100, attn_implementation=impl, qk_norm=qk_norm)
              for impl in ("sdpa", "bertaccel")}
    models["bertaccel"].model.load_state_dict(models["sdpa"].model.state_dict())
    ids = torch.randint(5, 100, (3, 11))
    mask = random_mask(3, 11, seed=6).long()
    labels = torch.where(mask.bool() & (torch.rand(3, 11, generator=torch.Generator().manual_seed(1)) < 0.4), ids, -100)
    results = {}
    for impl, m in models.items():
        m.train(False)
        out = m.model(input_ids=ids, attention_mask=mask, labels=labels)
        grads = torch.autograd.grad(out.loss, [p for p in m.model.parameters() if p.requires_grad], allow_unused=True)
        results[impl] = (out.logits[mask.bool()], out.loss, grads)
    assert len(calls) == 2, "the masked-LM did not run our op in each layer"
    torch.testing.assert_close(results["bertaccel"][0], results["sdpa"][0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(results["bertaccel"][1], results["sdpa"][1], rtol=1e-5, atol=1e-6)
    for a, b in zip(results["bertaccel"][2], results["sdpa"][2]):
        if a is None or b is None:
            assert a is None and b is None
            continue
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


def test_a_model_forward_reads_its_mask_once(packed_on_cpu, monkeypatch):
    """Through transformers' BERT (3 layers, and again with the kernel swap's fused QKV attention), one
    forward computes its mask's layout once: every layer gets the mask `padding_mask` made, which carries it."""
    from bertaccel.modules import BertClassifier, hf_attention
    from bertaccel.ops.swap import swap

    calls = []
    monkeypatch.setattr(hf_attention, "padded_layout", lambda m: calls.append(1) or padded_layout(m))
    model = BertClassifier(config=dict(TINY_BERT, num_hidden_layers=3), vocab_size=100, num_labels=2,
                           attn_implementation="bertaccel").model
    ids, mask = torch.randint(5, 100, (3, 11)), random_mask(3, 11, seed=2).long()
    for swapped in (False, True):
        if swapped:
            swap(model, ["qkv"])
        calls.clear()
        model(input_ids=ids, attention_mask=mask).logits.sum().backward()
        assert len(calls) == 1, f"swapped={swapped}: {len(calls)} layouts"


@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("dense_op", [False, True], ids=["F.linear", "dense-op"])
def test_fused_qkv_projection_goes_through_the_packed_call_with_the_same_gradients(packed_on_cpu, monkeypatch,
                                                                                   masked, dense_op):
    """With the kernel swap's fused QKV projection, each layer makes one packed call on the projection's
    output (one gradient tensor); logits and every parameter's gradient equal the unswapped
    model's (three separate q / k / v calls). `dense_op`: the projection through `bias_grad.dense`'s op, as
    on a GPU (its output once was a view outside the autograd graph: no packed call, a cat of the three
    gradients)."""
    import bertaccel.ops.attention as attention
    import bertaccel.ops.bias_grad as bias_grad
    import bertaccel.ops.qkv as qkv
    from bertaccel.modules import BertClassifier
    from bertaccel.ops.swap import swap

    monkeypatch.setattr(qkv, "why_not", lambda *a, **k: None)  # the fused projection on CPU too
    if dense_op:
        monkeypatch.setattr(bias_grad, "why_not", lambda *a, **k: None)
    calls = {"packed": 0, "separate": 0}
    packed, separate = attention.varlen_attention_packed, attention.varlen_attention

    def count(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(attention, "varlen_attention_packed", count("packed", packed))
    monkeypatch.setattr(attention, "varlen_attention", count("separate", separate))
    torch.manual_seed(0)
    config = dict(TINY_BERT, num_hidden_layers=2)
    models = [BertClassifier(config=config, vocab_size=100, num_labels=3, attn_implementation="bertaccel").model
              for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    swap(models[1], ["qkv"])
    ids = torch.randint(5, 100, (4, 9))
    mask = random_mask(4, 9, seed=5).long() if masked else None
    results = []

    monkeypatch.setattr(eligibility, "_warned", set())
    for model in models:
        model.train(False)
        calls.update(packed=0, separate=0)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            logits = model(input_ids=ids, attention_mask=mask).logits
        assert not [w for w in said if "not views of its one output" in str(w.message)]
        logits.square().sum().backward()
        grads = {n.replace("query.", "").replace("key.", "").replace("value.", ""): p.grad
                 for n, p in model.named_parameters() if p.grad is not None and "attention.self" not in n}
        results.append((logits, grads, dict(calls)))
    assert results[0][2] == {"packed": 0, "separate": 2}
    assert results[1][2] == {"packed": 2, "separate": 0}, "the fused projection's output was not passed packed"
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    assert results[0][1].keys() == results[1][1].keys()
    for name, g in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], g, rtol=1e-4, atol=1e-6, msg=name)
    # the projections' own gradients: the fused weight's rows are the three separate ones'
    for layer0, layer1 in zip(models[0].bert.encoder.layer, models[1].bert.encoder.layer):
        a0, a1 = layer0.attention.self, layer1.attention.self
        for part in ("query", "key", "value"):
            torch.testing.assert_close(getattr(a1, part).weight.grad, getattr(a0, part).weight.grad,
                                       rtol=1e-4, atol=1e-6)


def test_a_fused_projection_whose_parts_arrive_separately_is_said_once(packed_on_cpu, monkeypatch):
    """Where the fused QKV projection's q, k, v are not views of its one output (as with session 44's `dense` bug),
    the attention still runs (three tensors) and says once why it is slower; the result equals the packed run's."""
    import bertaccel.ops.qkv as qkv
    from bertaccel.modules import BertClassifier
    from bertaccel.ops.swap import swap

    monkeypatch.setattr(qkv, "why_not", lambda *a, **k: None)
    monkeypatch.setattr(eligibility, "_warned", set())
    torch.manual_seed(0)
    model = BertClassifier(config=dict(TINY_BERT, num_hidden_layers=2), vocab_size=100, num_labels=3,
                           attn_implementation="bertaccel").model
    swap(model, ["qkv"])
    model.train(False)
    ids, mask = torch.randint(5, 100, (3, 7)), random_mask(3, 7, seed=2).long()
    packed = model(input_ids=ids, attention_mask=mask).logits
    split = qkv.split_heads
    monkeypatch.setattr(qkv, "split_heads", lambda *a: tuple(t.clone() for t in split(*a)))
    with pytest.warns(UserWarning, match="not views of its one output") as said:
        separate = model(input_ids=ids, attention_mask=mask).logits
    assert sum("not views of its one output" in str(w.message) for w in said) == 1, "said once, not per layer"
    torch.testing.assert_close(separate, packed)


def _bf16_case(B, S, H, D, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(B, S, 3, H, D, device="cuda", generator=g).to(torch.bfloat16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # strided views, like the fused QKV swap
    return q, k, v, random_mask(B, S, seed=seed).cuda()


@pytest.mark.cuda
@pytest.mark.parametrize("D", [32, 64, 128])
@pytest.mark.parametrize("S", [128, 197])
def test_kernel_error_at_most_twice_sdpa_bf16_error(D, S, monkeypatch):
    monkeypatch.setattr(eligibility, "_warned", set())
    B, H = 6, 4
    q, k, v = (t.detach().requires_grad_() for t in _bf16_case(B, S, H, D, seed=D + S)[:3])
    mask = _bf16_case(B, S, H, D, seed=D + S)[3]
    real = mask[:, :, None, None]
    grad = torch.randn(B, S, H, D, device="cuda").to(torch.bfloat16) * real

    def run(fn, *inputs):
        out = fn(*inputs)
        return (out, *torch.autograd.grad(out, inputs, grad.to(out.dtype)))

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        ours = run(lambda q, k, v: attention_forward(None, q, k, v, mask, scaling=D**-0.5)[0], q, k, v)
    assert not [str(w.message) for w in said if "attention uses PyTorch" in str(w.message)]  # the kernel ran
    sdpa = run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :]).transpose(1, 2),
               q, k, v)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :]).transpose(1, 2),
              q64, k64, v64)
    keep = {"out": real, "dq": mask[:, None, :, None]}  # padding query rows: ours are zeros, SDPA's are not
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), ours, sdpa, ref):
        k_ = keep.get(name, torch.ones_like(r[..., :1, :1], dtype=torch.bool))
        err = ((a.double() - r) * k_).abs().max().item()
        err_sdpa = ((b.double() - r) * k_).abs().max().item()
        assert err <= 2 * err_sdpa + 1e-6, (name, err, err_sdpa)


@pytest.mark.cuda
@pytest.mark.parametrize("masked", [True, False])
def test_views_of_one_qkv_tensor_take_the_packed_call_within_twice_sdpa_error(masked, monkeypatch):
    """q, k, v as views of one [B, S, 3, H, D] projection output that autograd differentiates (the fused QKV
    swap's case): the packed kernel call, its one gradient within twice SDPA's error of a float64 reference."""
    import bertaccel.ops.attention as attention

    B, S, H, D = 5, 160, 4, 64
    g = torch.Generator(device="cuda").manual_seed(11)
    qkv = torch.randn(B, S, 3 * H * D, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    mask = random_mask(B, S, seed=11).cuda() if masked else None
    real = mask[:, :, None, None] if masked else torch.ones(B, S, 1, 1, device="cuda", dtype=torch.bool)
    grad = torch.randn(B, S, H, D, device="cuda", generator=g).to(torch.bfloat16) * real
    calls = []
    packed = attention.varlen_attention_packed
    monkeypatch.setattr(attention, "varlen_attention_packed", lambda *a, **k: calls.append(1) or packed(*a, **k))

    def views(t):
        return tuple(t.view(B, S, 3, H, D)[:, :, i].transpose(1, 2) for i in range(3))

    def sdpa(t):
        q, k, v = views(t)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[:, None, None, :],
                                              scale=D**-0.5).transpose(1, 2)

    ours = attention_forward(None, *views(qkv), mask, scaling=D**-0.5)[0]
    assert calls == [1], "the views of one tensor did not take the packed call"
    (g_ours,) = torch.autograd.grad(ours, qkv, grad)
    base = sdpa(qkv)
    (g_sdpa,) = torch.autograd.grad(base, qkv, grad)
    q64 = qkv.detach().double().requires_grad_()
    ref = sdpa(q64)
    (g_ref,) = torch.autograd.grad(ref, q64, grad.double())
    err = lambda a, r: ((a.double() - r) * real).abs().max().item()  # noqa: E731 - padding rows: ours zero
    assert err(ours, ref) <= 2 * err(base, ref) + 1e-6
    # dq of padding query rows: ours zero, SDPA's not; dk, dv of padding keys: zero in both
    gq = lambda t: t.view(B, S, 3, H, D)  # noqa: E731
    for i, name in enumerate("qkv"):
        keep = real if name == "q" else torch.ones_like(real)
        e = ((gq(g_ours)[:, :, i].double() - gq(g_ref)[:, :, i]) * keep).abs().max().item()
        e_sdpa = ((gq(g_sdpa)[:, :, i].double() - gq(g_ref)[:, :, i]) * keep).abs().max().item()
        assert e <= 2 * e_sdpa + 1e-6, (name, e, e_sdpa)


@pytest.mark.cuda
def test_padded_batches_replay_in_a_cuda_graph():
    """cu_seqlens and the lengths live on the GPU: a captured forward + backward replays correctly for a
    new mask with other lengths, and its padding rows' outputs and gradients are zeros."""
    B, S, H, D = 4, 96, 4, 64
    q, k, v, mask = _bf16_case(B, S, H, D, seed=0)
    static = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    static_mask = mask.clone()

    def step():
        out = attention_forward(None, *static, static_mask, scaling=D**-0.5)[0]
        return out, torch.autograd.grad(out.float().sum(), static)

    graph, (out, grads) = capture_graph(step)
    q2, k2, v2, mask2 = _bf16_case(B, S, H, D, seed=5)
    for t, new in zip(static, (q2, k2, v2)):
        t.detach().copy_(new)
    static_mask.copy_(mask2)
    graph.replay()
    want = attention_forward(None, *(t.detach().requires_grad_() for t in (q2, k2, v2)), mask2, scaling=D**-0.5)[0]
    torch.testing.assert_close(out, want)
    assert not torch.equal(mask2, mask)
    assert not out[~mask2].any() and not any(g.transpose(1, 2)[~mask2].any() for g in grads)


def test_the_layout_is_computed_once_per_forward_mask_and_never_kept_on_a_given_mask():
    """A mask `padding_mask` made (one model forward's) carries its layout for the next layers; a mask given
    directly is read on every call - it may be refilled in place (a CUDA graph's static mask, whose layout
    must then be computed inside the capture: test_padded_batches_replay_in_a_cuda_graph)."""
    from bertaccel.modules.hf_attention import padded_layout_of, padding_mask

    raw = random_mask(4, 9)
    forward_mask = padding_mask(4, 9, 9, attention_mask=raw.long())
    first = padded_layout_of(forward_mask)
    assert padded_layout_of(forward_mask) is first  # the next layer of the same forward
    assert padding_mask(4, 9, 9, attention_mask=raw.long()) is not forward_mask  # the next forward's mask is new
    assert padded_layout_of(raw) is not padded_layout_of(raw)
    static = raw.clone()
    padded_layout_of(static)
    static.copy_(random_mask(4, 9, seed=4))  # refilled in place
    for a, b in zip(padded_layout_of(static), padded_layout(static)):
        assert torch.equal(a, b)


@pytest.mark.cuda
def test_a_left_padded_mask_stops_the_gpu_kernel_with_the_reason():
    """On the GPU the check is a device-side assert (no host sync): it ends the process's CUDA context, so it
    runs in a child process, whose error output must name the problem and the fix."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    code = (
        "import torch\n"
        "from bertaccel.modules.hf_attention import attention_forward\n"
        "q, k, v = (torch.randn(2, 2, 16, 64, device='cuda').bfloat16() for _ in range(3))\n"
        "mask = torch.ones(2, 16, dtype=torch.bool, device='cuda'); mask[1, :5] = False\n"
        "out = attention_forward(None, q, k, v, mask, scaling=0.125)[0]\n"
        "torch.cuda.synchronize()\n"
    )
    run = run_in_child(code, timeout=300)
    assert run.returncode != 0, "a left-padded mask ran"
    assert "not right-padded" in run.stderr and "padding_side='right'" in run.stderr, run.stderr[-2000:]


def test_the_in_place_path_compiles_fullgraph_with_a_mask(packed_on_cpu):
    """Under torch.compile(fullgraph=True) the layout (the mask's counts, the right-padding mark) and the op with
    seqused trace into one graph: no host sync, no graph break; output and gradients as eager."""
    B, H, S, D = 3, 2, 9, 8
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(B, S, H * D, generator=g).view(B, S, H, D).transpose(1, 2).requires_grad_()
               for _ in range(3))
    mask = random_mask(B, S, seed=4)

    def f(q, k, v, mask):
        return attention_forward(None, q, k, v, mask, scaling=D**-0.5)[0]

    compiled = torch.compile(f, fullgraph=True)
    eager, comp = f(q, k, v, mask), compiled(q, k, v, mask)
    torch.testing.assert_close(comp, eager)
    grad = torch.randn(eager.shape, generator=g)
    for a, b in zip(torch.autograd.grad(comp, (q, k, v), grad), torch.autograd.grad(eager, (q, k, v), grad)):
        torch.testing.assert_close(a, b)
