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


def test_unpadded_with_cuda_graphs_is_refused():
    from bertaccel.errors import ConfigError
    from bertaccel.modules import BertClassifier

    with pytest.raises(ConfigError, match="model.unpadded reads each batch's number of real tokens"):
        BertClassifier(config={k: v for k, v in CFG.items() if k not in ("num_labels", "vocab_size")}, vocab_size=120,
                       unpadded=True, cuda_graphs=True)


def test_unpadded_runs_through_swapped_modules():
    """With the kernel swap in place the unpadded path calls the fused modules (PyTorch fallback on
    CPU) and still equals the padded model."""
    from bertaccel.ops.swap import ORDER, swap

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(**CFG, attn_implementation="eager")).eval()
    ids, mask, types = batch([13, 4, 9])
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
        report = swap(model, ORDER)
        assert report.counts()["residual_layer_norm"] == 4
        got = classifier_logits(model, ids, mask, types)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    report.revert()


def test_unpadded_path_keeps_the_profiler_regions():
    """Under the profiler the unpadded model shows the padded model's region labels."""
    from bertaccel.callbacks.profiler import _RegionHooks as RegionHooks

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(**CFG)).eval()
    hooks = RegionHooks()
    hooks.attach(model)
    ids, mask, types = batch([13, 4])
    with torch.profiler.profile() as prof, torch.no_grad():
        classifier_logits(model, ids, mask, types)
    hooks.remove()
    names = {e.name for e in prof.events()}
    assert {"embeddings", "layer0.attention", "layer0.ffn", "layer1.attention", "layer1.ffn", "head"} <= names
