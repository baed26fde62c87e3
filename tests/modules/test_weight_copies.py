"""bf16 weight copies (bertaccel.modules.weight_copies) on CPU: which weights get a copy, the swap in
and out, gradients handed to the masters. The training equivalence is in test_step_engine.py."""

from __future__ import annotations

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
