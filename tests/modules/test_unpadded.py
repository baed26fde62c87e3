"""BERT on real tokens only (`model.unpadded`): the same logits and gradients as the padded model."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification

from bertaccel.modules.unpadded import Unpadded, classifier_logits, varlen_attention

CFG = dict(vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
           num_labels=3, max_position_embeddings=64)


def batch(lengths, seq=13, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 120, (len(lengths), seq), generator=g)
    mask = (torch.arange(seq)[None] < torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask, torch.randint(0, 2, (len(lengths), seq), generator=g) * mask


@pytest.mark.parametrize("lengths", [[13, 1, 7, 10], [13, 13], [1], [5, 0, 3]], ids=["mixed", "full", "one-token", "empty-row"])
def test_unpadded_logits_and_gradients_equal_the_padded_model(lengths):
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(**CFG, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    model.train()
    ids, mask, types = batch(lengths)
    ref = model(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
    ref_grads = torch.autograd.grad(ref.square().sum(), list(model.parameters()), allow_unused=True)
    got = classifier_logits(model, ids, mask, types)
    got_grads = torch.autograd.grad(got.square().sum(), list(model.parameters()), allow_unused=True)
    keep = torch.tensor(lengths) > 0  # an empty row's logits mean nothing in either model
    torch.testing.assert_close(got[keep], ref[keep], rtol=1e-5, atol=1e-5)
    if bool(keep.all()):
        for (name, _), a, b in zip(model.named_parameters(), got_grads, ref_grads):
            if b is None:
                assert a is None or not a.any(), name
            else:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_layout_counts_real_tokens_and_refuses_left_padding():
    ids, mask, _ = batch([4, 2, 6], seq=6)
    layout = Unpadded.from_mask(mask)
    assert layout.tokens == 12 and layout.cu_seqlens.tolist() == [0, 4, 6, 12]
    x = torch.randn(3, 6, 5)
    torch.testing.assert_close(layout.unpack(layout.pack(x)), x * mask[..., None])
    with pytest.raises(ValueError, match="right-padded"):
        Unpadded.from_mask(mask.flip(1))


def test_varlen_attention_equals_attention_per_sequence():
    lengths = [5, 1, 8]
    _, mask, _ = batch(lengths, seq=8)
    layout = Unpadded.from_mask(mask)
    q, k, v = (torch.randn(layout.tokens, 2, 4) for _ in range(3))
    out = varlen_attention(q, k, v, layout, scale=0.5)
    bounds = layout.cu_seqlens.tolist()
    for s, e in zip(bounds, bounds[1:]):
        ref = torch.softmax(torch.einsum("qhd,khd->hqk", q[s:e], k[s:e]) * 0.5, -1)
        torch.testing.assert_close(out[s:e], torch.einsum("hqk,khd->qhd", ref, v[s:e]), rtol=1e-5, atol=1e-6)


def test_unpadded_classifier_trains_through_the_cli(tiny_config):
    """`--model.init_args.unpadded true`: a fit and test through the CLI, and the unpadded FLOP count
    (projections on real tokens) is below the padded one."""
    from bertaccel.cli import main  # noqa: F401
    from tests.test_cli import cli

    run = cli("fit", "-c", tiny_config("unpadded", epochs=1), "--model.init_args.unpadded", "true",
              "--trainer.limit_train_batches", "3")
    assert run.trainer.global_step == 3 and run.model.unpadded
    loader = run.datamodule.val_dataloader()
    b = next(iter(loader))
    unpadded = run.model.flops_per_batch(b, training=True)
    run.model.unpadded = False
    padded = run.model.flops_per_batch(b, training=True)
    assert float(unpadded) < padded


def test_packed_layout_rounds_the_token_count_with_distinct_fillers():
    from bertaccel.data.collate import packed_layout

    _, mask, _ = batch([4, 2, 6, 0], seq=6)
    exact, cu = packed_layout(mask)
    assert exact.tolist() == [0, 1, 2, 3, 6, 7, 12, 13, 14, 15, 16, 17] and cu.tolist() == [0, 4, 6, 12, 12]
    assert cu.dtype == torch.int32
    padded, cu2 = packed_layout(mask, token_quantum=8)
    assert padded.numel() == 16 and torch.equal(cu2, cu) and torch.equal(padded[:12], exact)
    fill = padded[12:]
    assert len(set(fill.tolist())) == 4 and not mask.reshape(-1)[fill].any()  # distinct padding positions
    assert packed_layout(mask, token_quantum=100)[0].numel() == mask.numel()  # capped at batch x seq
    with pytest.raises(ValueError, match="right-padded"):
        packed_layout(mask.flip(1))


@pytest.mark.parametrize("quantum", [None, 8, 32])
def test_packed_batches_give_the_padded_logits_and_gradients(quantum):
    """The collator's layout (fillers included) through the encoder: the padded model's results."""
    from bertaccel.data.collate import packed_layout

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(**CFG, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    ids, mask, types = batch([13, 1, 7, 10])
    ref = model(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
    ref_grads = torch.autograd.grad(ref.square().sum(), list(model.parameters()), allow_unused=True)
    indices, cu = packed_layout(mask, quantum)
    layout = Unpadded.from_packed(indices, cu, mask)
    got = classifier_logits(model, ids, mask, types, layout)
    got_grads = torch.autograd.grad(got.square().sum(), list(model.parameters()), allow_unused=True)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for (name, _), a, b in zip(model.named_parameters(), got_grads, ref_grads):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_collator_packs_static_and_dynamic_batches():
    from bertaccel.data.collate import ClassificationCollator

    rows = [{"input_ids": torch.arange(5, 5 + n), "label": 1, "index": i} for i, n in enumerate([10, 3, 7])]
    dynamic = ClassificationCollator(pad_id=0, packed=True)(rows)
    # rows longest first (10, 7, 3)
    assert dynamic["packed_indices"].numel() == 20 and dynamic["cu_seqlens"].tolist() == [0, 10, 17, 20]
    static = ClassificationCollator(pad_id=0, buckets=[16, 32], batch_size=4, packed=True, token_sizes=8)(rows)
    # 4 x 16 slots in 8 steps of 8: 20 real tokens + the padding row's one token = 21 -> 24
    assert static["input_ids"].shape == (4, 16) and static["packed_indices"].numel() == 24
    assert static["cu_seqlens"].tolist() == [0, 10, 17, 20, 21]
    # the host's counts for the meters: real tokens, and the query-key pairs the varlen kernels run (cu_seqlens')
    assert static["num_tokens"] == 20 and dynamic["num_tokens"] == 20
    assert static["attention_pairs"] == int(static["cu_seqlens"].diff().square().sum()) == 100 + 49 + 9 + 1
    assert dynamic["attention_pairs"] == 100 + 49 + 9
    assert "packed_indices" not in ClassificationCollator(pad_id=0)(rows)
    # given sizes: the smallest that holds the 21 tokens; above the largest, the whole 4 x 16
    sized = ClassificationCollator(pad_id=0, buckets=[16], batch_size=4, packed=True, token_sizes=[32, 22, 40])
    assert sized(rows)["packed_indices"].numel() == 22
    assert ClassificationCollator(pad_id=0, buckets=[16], batch_size=4, packed=True, token_sizes=[12])(rows)[
        "packed_indices"].numel() == 64


def test_unpadded_with_cuda_graphs_trains_like_eager_unpadded(tiny_data, tmp_path):
    """`model.unpadded` with `model.cuda_graphs`: static packed batches (no host read per step) through
    the graph-mode loop (run without capture on CPU) train exactly as the eager unpadded model does."""
    import lightning.pytorch as pl

    from bertaccel.data import TextClassificationDataModule
    from bertaccel.modules import BertClassifier
    from tests.conftest import TINY_BERT

    def train(graphs: bool):
        pl.seed_everything(3)
        model = BertClassifier(config=TINY_BERT, vocab_size=256, num_labels=2, lr=3e-3, cuda_graphs=graphs, unpadded=True)
        model._capture_without_gpu = graphs
        dm = TextClassificationDataModule(dataset=str(tiny_data), tokenizer="sample:sentiment", max_length=48,
                                          batch_size=16, val_size=0.2, static_shapes=True, length_buckets=16,
                                          token_buckets=2)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
        trainer.fit(model, datamodule=dm)
        return model, trainer, dm

    eager, t_eager, dm = train(False)
    graph, t_graph, dm_graph = train(True)
    assert dm.packed and "packed_indices" in next(iter(dm.train_dataloader()))
    from bertaccel.data.collate import capture_cost_tokens

    # the model told the data module its width: a capture's cost in padding tokens for "auto" token buckets
    assert dm_graph._capture_cost == capture_cost_tokens(graph.model.config.hidden_size)
    # static packed batches: one length (max_length), token counts among the 2 sizes chosen for the split
    shapes = {(b["input_ids"].shape, b["packed_indices"].numel()) for b in dm_graph.train_dataloader()}
    sizes = dm_graph.token_sizes("train", 16, dm_graph._sampler("train", 16, train=True))
    assert {s for s, _ in shapes} == {torch.Size([16, 48])} and len(sizes) == 2
    assert {n for _, n in shapes} <= set(sizes) and len(shapes) > 1
    assert t_graph.global_step == t_eager.global_step > 0
    for (name, a), b in zip(eager.named_parameters(), graph.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("with_ffn", [False, True], ids=["without_ffn", "with_ffn"])
def test_unpadded_runs_through_swapped_modules(with_ffn):
    """With the kernel swap in place the unpadded path calls the fused modules (PyTorch fallback on
    CPU) and still equals the padded model."""
    from bertaccel.ops.swap import ORDER, swap

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(**CFG, attn_implementation="eager")).eval()
    ids, mask, types = batch([13, 4, 9])
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
        report = swap(model, ORDER if with_ffn else [f for f in ORDER if f != "ffn"])
        assert report.counts()["residual_layer_norm"] == (2 if with_ffn else 4)
        assert report.counts().get("ffn", 0) == (2 if with_ffn else 0)
        got = classifier_logits(model, ids, mask, types)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    report.revert()


def _sdpa_model_and_padded_reference():
    """A train-mode SDPA classifier without dropout, a batch, and the padded model's logits and gradients."""
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(**CFG, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                                     attn_implementation="sdpa")).train()
    inputs = batch([13, 1, 7, 10])
    ids, mask, types = inputs
    ref = model(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
    return model, inputs, ref, torch.autograd.grad(ref.square().sum(), list(model.parameters()))


def _assert_unpadded_equals(model, inputs, ref, ref_grads):
    """The unpadded logits and every parameter's gradient equal the padded reference's (fp32)."""
    got = classifier_logits(model, *inputs)
    got_grads = torch.autograd.grad(got.square().sum(), list(model.parameters()))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for (name, _), a, b in zip(model.named_parameters(), got_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_unpadded_runs_the_fused_qkv_projection(monkeypatch):
    """With the swap's Q/K/V module (SDPA models) the packed rows go through its one projection GEMM
    (`qkv_projection`, cuBLAS + our bias-gradient sums on a GPU), and the logits and every gradient
    still equal the padded model's."""
    import bertaccel.ops.qkv as qkv
    from bertaccel.ops.swap import swap

    model, inputs, ref, ref_grads = _sdpa_model_and_padded_reference()
    report = swap(model, ["qkv"])
    assert report.counts() == {"qkv": 2}
    calls = []
    original = qkv.qkv_projection
    monkeypatch.setattr(qkv, "qkv_projection", lambda *a: calls.append(1) or original(*a))
    _assert_unpadded_equals(model, inputs, ref, ref_grads)
    assert len(calls) == 2  # one projection per layer
    report.revert()


def test_packed_qkv_path_equals_the_padded_model_on_cpu(monkeypatch):
    """The packed form's wiring, on the CPU reference op: the swap's one projection output viewed as
    [T, 3, heads, d] (query, key, value in that order) through `varlen_attention_packed` and its autograd
    gives the padded model's logits and every gradient."""
    from bertaccel.modules import unpadded
    from bertaccel.ops import attention
    from bertaccel.ops.swap import swap

    model, inputs, ref, ref_grads = _sdpa_model_and_padded_reference()
    report = swap(model, ["qkv"])
    calls = []
    monkeypatch.setattr(unpadded, "varlen_attention_qkv", lambda qkv, layout, p, scale: calls.append(qkv.shape) or
                        attention.varlen_attention_packed(qkv, layout.cu_seqlens, layout.max_seqlen, p, scale))
    _assert_unpadded_equals(model, inputs, ref, ref_grads)
    assert len(calls) == 2 and all(s[1:] == (3, 4, 16) for s in calls)
    report.revert()


@pytest.mark.cuda
def test_fused_qkv_projection_hands_our_kernel_one_packed_qkv(monkeypatch):
    """On a GPU under bf16 autocast, the swap's Q/K/V projection output goes to our kernel as one packed
    [T, 3, heads, d] (`varlen_attention_packed`: its gradient is written in place, no cat of three), and the
    unpadded logits and gradients equal those of the same path with three separate parts (the packed
    entry point turned off) - within the fp32 dQ sums' order."""
    from bertaccel.modules import unpadded
    from bertaccel.ops import attention, build
    from bertaccel.ops.swap import swap

    assert build.load_attention(), build.attention_reason()
    torch.manual_seed(0)
    config = BertConfig(**{**CFG, "hidden_size": 128}, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        attn_implementation="sdpa")  # head dim 32 (CFG's 16 is not one the kernel takes)
    model = BertForSequenceClassification(config).cuda().train()
    report = swap(model, ["qkv"])
    ids, mask, types = (t.cuda() for t in batch([13, 1, 7, 10]))
    calls = []
    packed = attention.varlen_attention_packed
    monkeypatch.setattr(attention, "varlen_attention_packed", lambda *a: calls.append(a[0].shape) or packed(*a))

    def run():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16):
            logits = classifier_logits(model, ids, mask, types)
        logits.float().square().sum().backward()
        return logits.float(), [p.grad.clone() for p in model.parameters()]

    got, got_grads = run()
    assert len(calls) == 2 and all(s[1:] == (3, 4, 32) for s in calls)  # one packed call per layer
    monkeypatch.setattr(unpadded, "varlen_attention_qkv",
                        lambda qkv, layout, p, scale: unpadded.varlen_attention(*qkv.unbind(1), layout, p, scale))
    ref, ref_grads = run()
    assert len(calls) == 2
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)
    for (name, _), a, b in zip(model.named_parameters(), got_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2, msg=name)
    report.revert()


@pytest.mark.parametrize("ffn", [False, True], ids=["hf_ffn", "fused_ffn"])
def test_unpadded_path_keeps_the_profiler_regions(ffn):
    """Under the profiler the unpadded model shows the padded model's region labels (with the ffn
    family's fused block too: one layer{i}.ffn region around it)."""
    from bertaccel.callbacks.profiler import _RegionHooks as RegionHooks
    from bertaccel.ops.swap import swap

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(**CFG)).eval()
    if ffn:
        assert swap(model, ["ffn"]).counts() == {"ffn": 2}
    hooks = RegionHooks()
    hooks.attach(model)
    ids, mask, types = batch([13, 4])
    with torch.profiler.profile() as prof, torch.no_grad():
        classifier_logits(model, ids, mask, types)
    hooks.remove()
    names = [e.name for e in prof.events()]
    assert {"embeddings", "layer0.attention", "layer0.ffn", "layer1.attention", "layer1.ffn", "head"} <= set(names)
    # HF's block: one region per module (intermediate, output); the fused block: one, also when it falls
    # back to HF's modules (on CPU here), not nested twice
    assert names.count("layer0.ffn") == (1 if ffn else 2)


def _attention_reference(q, k, v, cu, scale):
    """fp64 attention per sequence of packed rows; zeros past the last sequence."""
    out = torch.zeros_like(q, dtype=torch.float64)
    bounds = cu.tolist()
    for s, e in zip(bounds, bounds[1:]):
        if e > s:
            qs, ks, vs = (t[s:e].double() for t in (q, k, v))
            p = torch.softmax(torch.einsum("qhd,khd->hqk", qs, ks) * scale, -1)
            out[s:e] = torch.einsum("hqk,khd->qhd", p, vs)
    return out


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["bertaccel", "flash"])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_varlen_attention_matches_fp64_within_twice_sdpa_error(head_dim, backend, monkeypatch):
    """The varlen paths (ours, FlashAttention's; bf16, packed rows with fillers and an empty sequence)
    against an fp64 reference from the same bf16 inputs: output and q/k/v gradients within 2x the error
    of the re-padded SDPA path; the fillers' outputs and gradients are zero."""
    from bertaccel.data.collate import packed_layout
    from bertaccel.modules import unpadded
    from bertaccel.ops import attention

    monkeypatch.setenv("BERTACCEL_VARLEN_ATTENTION", backend)

    lengths, seq, heads = [77, 1, 0, 128, 33], 128, 3
    mask = (torch.arange(seq)[None] < torch.tensor(lengths)[:, None]).long()
    indices, cu = packed_layout(mask, token_quantum=64)
    layout = Unpadded.from_packed(indices.cuda(), cu.cuda(), mask.cuda())
    T, real = indices.numel(), int(cu[-1])
    assert T > real  # fillers present
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(T, heads, head_dim, device="cuda", generator=g).bfloat16().requires_grad_() for _ in range(3))
    dout = torch.randn(T, heads, head_dim, device="cuda", generator=g).bfloat16()
    scale = head_dim ** -0.5
    assert unpadded.flash_varlen_unavailable(q) is None
    assert backend == "flash" or attention.kernel_unavailable(q, k, v) is None

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = _attention_reference(*leaves, layout.cu_seqlens.cpu(), scale)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())

    def run(fn):
        out = fn()
        return out, torch.autograd.grad(out, (q, k, v), dout)

    varlen, varlen_grads = run(lambda: varlen_attention(q, k, v, layout, scale=scale))
    sdpa, sdpa_grads = run(lambda: unpadded.F.scaled_dot_product_attention(
        *(layout.unpack(t).transpose(1, 2) for t in (q, k, v)), attn_mask=layout.key_padding, scale=scale
    ).transpose(1, 2).reshape(-1, heads, head_dim).index_select(0, layout.indices))
    err = lambda a, b: (a[:real].double() - b[:real]).abs().max().item()  # noqa: E731
    assert err(varlen, ref) <= 2 * err(sdpa, ref) + 1e-3
    for name, a, b, r in zip("qkv", varlen_grads, sdpa_grads, ref_grads):
        assert err(a, r) <= 2 * err(b, r) + 1e-3, name
        assert not a[real:].any(), f"d{name} of the fillers"
    assert not varlen[real:].any()


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["bertaccel", "flash"])
def test_varlen_attention_dropout_is_seeded_and_finite(backend, monkeypatch):
    """Dropout inside the varlen paths: the same seed gives the same output and gradients, another
    seed other masks; with p = 0 it equals the deterministic output."""
    monkeypatch.setenv("BERTACCEL_VARLEN_ATTENTION", backend)
    lengths = [40, 7, 64]
    mask = (torch.arange(64)[None] < torch.tensor(lengths)[:, None]).long().cuda()
    layout = Unpadded.from_mask(mask)
    q, k, v = (torch.randn(layout.tokens, 2, 32, device="cuda").bfloat16().requires_grad_() for _ in range(3))

    def run(seed, p):
        torch.manual_seed(seed)
        out = varlen_attention(q, k, v, layout, dropout_p=p)
        return out, torch.autograd.grad(out.float().square().sum(), (q, k, v))

    a, ga = run(1, 0.3)
    b, gb = run(1, 0.3)
    c, _ = run(2, 0.3)
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ga, gb))
    assert not torch.equal(a, c)
    assert all(torch.isfinite(x).all() for x in (a, *ga))
    d, _ = run(1, 0.0)
    assert not torch.equal(a, d)


def test_unpadded_with_projections_that_cannot_fuse():
    """A swapped self-attention whose projections cannot share one GEMM (a key without bias) runs the
    three on the packed rows: still the padded model's logits."""
    from bertaccel.ops.swap import swap

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(**CFG, attn_implementation="sdpa")).eval()
    report = swap(model, ["qkv"])
    assert report.counts() == {"qkv": 2}
    for layer in model.bert.encoder.layer:  # after the swap: the replacement holds the same Linear
        layer.attention.self.key.bias = None
    ids, mask, types = batch([13, 1, 7, 10])
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
        got = classifier_logits(model, ids, mask, types)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    report.revert()


@pytest.mark.parametrize("static", [False, True])
def test_collator_host_counts_match_the_batch(static):
    """Random batches, fillers included: `num_tokens` is the real rows' attention-mask ones and `attention_pairs`
    the packed sequences' squared lengths summed (padding rows' one token each), as the device would count them."""
    from bertaccel.data.collate import ClassificationCollator

    g = torch.Generator().manual_seed(5)
    kwargs = {"buckets": [8, 16, 24], "batch_size": 6, "token_sizes": [40, 90]} if static else {"pad_to_multiple_of": 8}
    collate = ClassificationCollator(pad_id=0, packed=True, **kwargs)
    for trial in range(20):
        n = int(torch.randint(1 if not static else 0, 7, (), generator=g))
        rows = [{"input_ids": torch.arange(int(torch.randint(1, 25, (), generator=g))), "label": 0, "index": i}
                for i in range(n)]
        if static and trial % 3 == 0:
            rows.append({"filler": True, "label": -100})
        batch = collate(rows)
        real = batch["num_rows"]
        assert batch["num_tokens"] == int(batch["attention_mask"][:real].sum())
        assert batch["attention_pairs"] == int(batch["cu_seqlens"].diff().square().sum())
