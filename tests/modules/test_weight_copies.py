"""bf16 weight copies (bertaccel.modules.weight_copies) on CPU: which weights get a copy, the swap in
and out, gradients handed to the masters. The training equivalence is in test_step_engine.py."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM

from bertaccel.modules.weight_copies import Bf16WeightCopies
from tests.conftest import TINY_BERT


def test_tied_decoder_stays_fp32_and_every_other_linear_weight_gets_a_copy():
    model = BertForMaskedLM(BertConfig(**{**TINY_BERT, "vocab_size": 120}))
    copies = Bf16WeightCopies(model)
    embedding = model.get_input_embeddings().weight
    assert model.cls.predictions.decoder.weight is embedding  # tied
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight is not embedding]
    assert len(copies) == len(linears) > 0
    assert all(m is not embedding for m in copies.masters)
    for master, copy in zip(copies.masters, copies.copies):
        assert copy.dtype == torch.bfloat16 and copy.requires_grad and torch.equal(copy, master.detach().bfloat16())


def test_swap_in_runs_on_the_copies_and_hands_gradients_to_the_masters():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4), torch.nn.Linear(3, 3))
    copies = Bf16WeightCopies(model)
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)  # static gradient buffers holding stale values
    x = torch.randn(5, 8)
    with copies.swapped_in():
        assert model[0].weight is copies.copies[0] and model[0].weight.dtype == torch.bfloat16
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model[:3](x).float().square().sum().backward()
    assert all(m.weight.dtype == torch.float32 for m in model if isinstance(m, torch.nn.Linear))
    wanted = [c.grad.float() for c in copies.copies[:2]]
    copies.grads_to_masters(accumulate=False)
    torch.testing.assert_close(model[0].weight.grad, wanted[0], rtol=0, atol=0)
    torch.testing.assert_close(model[2].weight.grad, wanted[1], rtol=0, atol=0)
    assert torch.equal(model[3].weight.grad, torch.zeros(3, 3))  # unused this step: zeroed, not stale
    assert all(c.grad is None for c in copies.copies)
    # accumulation adds; refresh brings the copies to the (changed) masters
    model[0].weight.grad.zero_()
    copies.copies[0].grad = torch.ones_like(copies.copies[0])
    copies.grads_to_masters(accumulate=True)
    copies.grads_to_masters(accumulate=True)  # no gradient this time: nothing added
    assert torch.equal(model[0].weight.grad, torch.ones(16, 8))
    with torch.no_grad():
        model[0].weight.add_(1.0)
    copies.refresh()
    assert torch.equal(copies.copies[0], model[0].weight.detach().bfloat16())


def test_copies_made_under_inference_mode_are_normal_tensors():
    model = torch.nn.Linear(4, 4)
    with torch.inference_mode():
        copies = Bf16WeightCopies(model)
        copies.refresh()
    assert not copies.copies[0].is_inference()


def _self_attentions(model):
    return [m for m in model.modules() if type(m).__name__ == "BertSelfAttention"]


def test_query_key_value_copies_lie_back_to_back_in_one_buffer():
    """Each self-attention's three copies are views of one [3 x hidden, hidden] block, in order, so the fused
    projection reads them in place; the other copies have storages of their own; refresh keeps the block."""
    model = BertForMaskedLM(BertConfig(**{**TINY_BERT, "vocab_size": 120}))
    copies = Bf16WeightCopies(model)
    by_master = {id(m): c for m, c in zip(copies.masters, copies.copies)}
    blocks = set()
    for att in _self_attentions(model):
        q, k, v = (by_master[id(getattr(att, n).weight)] for n in ("query", "key", "value"))
        assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
        assert (k.storage_offset(), v.storage_offset()) == (q.storage_offset() + q.numel(), q.storage_offset() + 2 * q.numel())
        blocks.add(q.untyped_storage().data_ptr())
    assert len(blocks) == len(_self_attentions(model)) == TINY_BERT["num_hidden_layers"]
    others = [c for c in copies.copies if c.untyped_storage().data_ptr() not in blocks]
    assert len({c.untyped_storage().data_ptr() for c in others}) == len(others) == len(copies) - 3 * len(blocks)
    with torch.no_grad():
        for m in copies.masters:
            m.add_(0.5)
    copies.refresh()
    for m, c in zip(copies.masters, copies.copies):
        assert torch.equal(c, m.detach().bfloat16())
    att = _self_attentions(model)[0]
    assert by_master[id(att.query.weight)].untyped_storage().data_ptr() in blocks  # still the same block


def test_tied_or_mismatched_projections_get_copies_of_their_own():
    """A query weight that another Linear also reads, or projections of different input widths: no shared block."""
    class Attention(torch.nn.Module):
        def __init__(self, widths):
            super().__init__()
            self.query, self.key, self.value = (torch.nn.Linear(w, 8) for w in widths)

    tied = torch.nn.Sequential(Attention((4, 4, 4)), torch.nn.Linear(4, 8))
    tied[1].weight = tied[0].query.weight
    mixed = Attention((4, 4, 6))
    for model in (tied, mixed):
        copies = Bf16WeightCopies(model)
        ptrs = [c.untyped_storage().data_ptr() for c in copies.copies]
        assert len(set(ptrs)) == len(ptrs)


def test_fused_projection_reads_the_block_in_place_with_the_same_gradients():
    """qkv_projection over the block's three copies: the weight handed to the GEMM is the block itself (no cat), and
    the output and every gradient equal those of the concatenating path (separate copies of the same values)."""
    from bertaccel.ops.qkv import adjacent_rows, qkv_projection

    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(**{**TINY_BERT, "vocab_size": 120}))
    att = _self_attentions(model)[0]
    copies = Bf16WeightCopies(model)
    x = torch.randn(3, 5, att.query.in_features).bfloat16()
    dy = torch.randn(3, 5, 3 * att.query.out_features).bfloat16()
    with copies.swapped_in():
        q, k, v = att.query.weight, att.key.weight, att.value.weight
        whole = adjacent_rows(q, k, v)
        assert whole is not None and whole.data_ptr() == q.data_ptr() and whole.shape == (3 * q.shape[0], q.shape[1])
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the fp32 biases, as in a bf16-mixed step
            y = qkv_projection(att.query, att.key, att.value, x)
        grads = torch.autograd.grad(y, (q, k, v, att.query.bias), dy)
    apart = [torch.nn.Parameter(t.detach().clone()) for t in (q, k, v)]
    assert adjacent_rows(*apart) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = torch.nn.functional.linear(x, torch.cat(apart), torch.cat((att.query.bias, att.key.bias, att.value.bias)))
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    ref_grads = torch.autograd.grad(ref, (*apart, att.query.bias), dy)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.float(), r.float(), rtol=1e-2, atol=1e-2)
    for g, r in zip(grads[:3], ref_grads[:3]):
        assert torch.equal(g, r)  # the weight gradients: row slices of the same product


def test_adjacent_rows_turns_away_what_is_not_one_block(monkeypatch):
    from bertaccel.ops.qkv import adjacent_rows

    buf = torch.zeros(12, 4)
    assert adjacent_rows(buf[0:4], buf[4:8], buf[8:12]) is not None
    monkeypatch.setenv("BERTACCEL_QKV_IN_PLACE", "0")
    assert adjacent_rows(buf[0:4], buf[4:8], buf[8:12]) is None  # switched off: the caller concatenates
    monkeypatch.delenv("BERTACCEL_QKV_IN_PLACE")
    assert adjacent_rows(buf[0:4], buf[8:12], buf[4:8]) is None  # out of order
    assert adjacent_rows(buf[0:4], buf[5:9], buf[8:12]) is None  # overlapping
    assert adjacent_rows(buf[0:4], buf[4:8], torch.zeros(4, 4)) is None  # another storage
    assert adjacent_rows(buf[:, :2], buf[:, 2:], buf[0:4]) is None  # not contiguous rows
    assert adjacent_rows(buf[0:4], buf[4:8].double(), buf[8:12]) is None  # another dtype


@pytest.mark.cuda
def test_qkv_swapped_model_reads_the_block_in_place_on_the_gpu(monkeypatch):
    """A BERT with the `qkv` family swapped, on its bf16 copies under autocast: one concatenation kernel per layer
    fewer (the weights read in place; the biases are still concatenated) than with BERTACCEL_QKV_IN_PLACE=0, and the
    same output and copy gradients, bit for bit."""
    from transformers import BertModel

    from bertaccel.ops import build
    from bertaccel.ops.swap import swap
    from tests.ops.conftest import cuda_kernel_names

    assert build.load(), build.unavailable_reason()
    torch.manual_seed(0)
    config = BertConfig(hidden_size=768, num_hidden_layers=2, num_attention_heads=12, intermediate_size=3072,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    model = BertModel(config).cuda()
    assert swap(model, ["qkv"]).counts().get("qkv") == 2
    copies = Bf16WeightCopies(model)
    ids = torch.randint(0, config.vocab_size, (4, 128), device="cuda")

    def run():
        with copies.swapped_in(), torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=ids).last_hidden_state
            out.float().square().mean().backward()
        grads = [None if c.grad is None else c.grad.clone() for c in copies.copies]  # (the pooler's: None)
        for c in copies.copies:
            c.grad = None
        return out.detach(), grads

    def cats(fn):
        return sum("CatArrayBatchedCopy" in n for n in cuda_kernel_names(fn))

    out, grads = run()
    in_place = cats(run)
    monkeypatch.setenv("BERTACCEL_QKV_IN_PLACE", "0")
    out_cat, grads_cat = run()
    assert cats(run) == in_place + 2
    assert torch.equal(out, out_cat)
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(grads, grads_cat))
    assert sum(g is not None for g in grads) == len(grads) - 1  # every copy but the pooler's got a gradient


def test_swapped_attention_projects_from_the_block_on_its_copies(monkeypatch):
    """The `qkv` family's module (what the graphed steps run), on the copies: its projection concatenates only the
    biases (the weights come from the block); with BERTACCEL_QKV_IN_PLACE=0 the weights too. CPU: the module's
    projection called directly (its forward runs HF's module on CPU)."""
    from bertaccel.ops.swap import swap

    model = BertForMaskedLM(BertConfig(**{**TINY_BERT, "vocab_size": 120, "attn_implementation": "sdpa"}))
    assert swap(model, ["qkv"]).counts().get("qkv") == TINY_BERT["num_hidden_layers"]
    att = next(m for m in model.modules() if type(m).__name__ == "FusedQKVSelfAttention")
    copies = Bf16WeightCopies(model)
    calls = []
    cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda ts, *a, **k: calls.append([t.shape for t in ts]) or cat(ts, *a, **k))
    x = torch.randn(2, 5, att.query.in_features)
    with copies.swapped_in(), torch.autocast("cpu", dtype=torch.bfloat16):
        att.heads(x)
        assert calls == [[att.query.bias.shape] * 3]
        monkeypatch.setenv("BERTACCEL_QKV_IN_PLACE", "0")
        calls.clear()
        att.heads(x)
        assert calls == [[att.query.weight.shape] * 3, [att.query.bias.shape] * 3]
