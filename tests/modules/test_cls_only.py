"""The last encoder layer at the [CLS] position only (bertaccel.modules.last_layer): the same logits and gradients as
the whole layer, with every attention implementation and mask form, the kernel swap and torch.compile; reversible;
the classifier's option and its FLOP count."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification

from bertaccel.modules.last_layer import is_cls_only, last_layer_cls_only
from bertaccel.modules.flops import bert_step_flops
from tests.ops.conftest import assert_within_twice, replayed_output_and_grads


def _model(attn: str = "sdpa", layers: int = 2, dropout: float = 0.0, dtype=torch.float64, hidden: int = 32,
           heads: int = 4, device: str = "cpu") -> BertForSequenceClassification:
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=120, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=4 * hidden, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                     num_labels=3, max_position_embeddings=256)
    if attn == "bertaccel":
        from bertaccel.modules.hf_attention import register

        register()
    model = BertForSequenceClassification(cfg).to(device=device, dtype=dtype).train()
    model.set_attn_implementation(attn)
    return model


def _batch(B: int = 4, S: int = 11, device: str = "cpu"):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 120, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    for b, n in enumerate([S, 7, 2, 1][:B]):  # right padding, down to [CLS] alone
        mask[b, n:] = 0
    labels = torch.randint(0, 3, (B,), generator=g)
    return ids.to(device), mask.to(device), labels.to(device)


def _logits_and_grads(model, ids, mask, labels):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    return out.logits.detach(), grads


@pytest.mark.parametrize("attn", ["sdpa", "eager", "bertaccel"])
def test_same_logits_and_gradients_as_the_whole_layer(attn):
    full = _model(attn)
    cls = copy.deepcopy(full)
    last_layer_cls_only(cls)
    batch = _batch()
    logits, grads = _logits_and_grads(full, *batch)
    logits_cls, grads_cls = _logits_and_grads(cls, *batch)
    torch.testing.assert_close(logits_cls, logits, rtol=1e-10, atol=1e-12)
    for name, g in grads.items():
        torch.testing.assert_close(grads_cls[name], g, rtol=1e-9, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
    # the rows left out get no gradient: the last layer's query weight gradient comes from [CLS] alone, and is not 0
    assert grads_cls["bert.encoder.layer.1.attention.self.query.weight"].abs().sum() > 0


def test_the_encoder_output_has_one_position_and_revert_puts_the_layer_back():
    model = _model(layers=3)
    ids, mask, _ = _batch()
    full = model.bert(input_ids=ids, attention_mask=mask).last_hidden_state
    handle = last_layer_cls_only(model)
    assert is_cls_only(model)
    out = model.bert(input_ids=ids, attention_mask=mask)
    assert out.last_hidden_state.shape == (4, 1, 32)
    torch.testing.assert_close(out.last_hidden_state[:, 0], full[:, 0], rtol=1e-10, atol=1e-12)
    # hidden states asked for: the whole layer runs (every position of every layer is returned)
    hs = model.bert(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    assert hs[-1].shape == full.shape
    handle.revert()
    assert not is_cls_only(model)
    torch.testing.assert_close(model.bert(input_ids=ids, attention_mask=mask).last_hidden_state, full)
    assert set(model.state_dict()) == set(_model(layers=3).state_dict())


def test_a_4d_additive_mask_and_no_mask():
    full = _model("eager")
    cls = copy.deepcopy(full)
    last_layer_cls_only(cls)
    ids, mask, _ = _batch()
    for m in (None, mask):
        torch.testing.assert_close(cls(input_ids=ids, attention_mask=m).logits, full(input_ids=ids, attention_mask=m).logits,
                                   rtol=1e-10, atol=1e-12)


def test_with_the_kernel_swap_before_or_after():
    from bertaccel.ops.swap import DEFAULT, swap

    full = _model("sdpa", dtype=torch.float32)
    before, after = copy.deepcopy(full), copy.deepcopy(full)
    last_layer_cls_only(before)
    swap(before, DEFAULT + ["ffn"])
    swap(after, DEFAULT + ["ffn"])
    last_layer_cls_only(after)
    batch = _batch()
    logits, grads = _logits_and_grads(full, *batch)
    for model in (before, after):
        logits_cls, grads_cls = _logits_and_grads(model, *batch)
        torch.testing.assert_close(logits_cls, logits, rtol=1e-5, atol=1e-6)
        for name, g in grads.items():
            torch.testing.assert_close(grads_cls[name], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_under_torch_compile():
    full = _model(dtype=torch.float32)
    cls = copy.deepcopy(full)
    last_layer_cls_only(cls)
    compiled = torch.compile(cls, backend="aot_eager")
    ids, mask, labels = _batch()
    torch.testing.assert_close(compiled(input_ids=ids, attention_mask=mask).logits,
                               full(input_ids=ids, attention_mask=mask).logits, rtol=1e-5, atol=1e-6)


def test_dropout_in_training_draws_but_eval_matches():
    full = _model(dropout=0.1)
    cls = copy.deepcopy(full)
    last_layer_cls_only(cls)
    ids, mask, labels = _batch()
    loss = cls(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert torch.isfinite(loss)
    loss.backward()
    full.eval(), cls.eval()
    torch.testing.assert_close(cls(input_ids=ids, attention_mask=mask).logits, full(input_ids=ids, attention_mask=mask).logits,
                               rtol=1e-10, atol=1e-12)


def test_flop_count_of_the_last_layer():
    cfg = BertConfig()  # BERT-base
    from bertaccel.modules.flops import bert_step_flops_unpadded

    whole = bert_step_flops(cfg, 32, 512)
    # the unpadded count with every token real is the padded one
    assert bert_step_flops_unpadded(cfg, 32, 512, 32 * 512, cls_only_last_layer=True) == bert_step_flops(
        cfg, 32, 512, cls_only_last_layer=True)
    cls = bert_step_flops(cfg, 32, 512, cls_only_last_layer=True)
    H, S, F = 768, 512, 3072
    per_layer = 2 * S * (4 * H * H + 2 * H * F) + 4 * S * S * H
    kept = 2 * S * 2 * H * H + 2 * (2 * H * H + 2 * H * F) + 4 * S * H  # K, V on every token; the rest at [CLS]
    assert whole - cls == 3 * 32 * (per_layer - kept)
    assert 0.07 < 1 - cls / whole < 1 / 12  # most of one layer of twelve


def test_classifier_option():
    from bertaccel.modules.classifier import BertClassifier

    config = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    whole = BertClassifier(config=config, num_labels=3, vocab_size=120)
    cls = BertClassifier(config=config, num_labels=3, vocab_size=120, last_layer_cls_only=True)
    cls.load_state_dict(whole.state_dict())
    assert is_cls_only(cls.model) and not is_cls_only(whole.model)
    ids, mask, _ = _batch()
    torch.testing.assert_close(cls(ids, mask), whole(ids, mask), rtol=1e-5, atol=1e-6)
    batch = {"input_ids": ids, "attention_mask": mask}
    assert cls.flops_per_batch(batch, True) < whole.flops_per_batch(batch, True)
    whole_u = BertClassifier(config=config, num_labels=3, vocab_size=120, unpadded=True)
    cls_u = BertClassifier(config=config, num_labels=3, vocab_size=120, unpadded=True, last_layer_cls_only=True)
    whole_u.load_state_dict(whole.state_dict()), cls_u.load_state_dict(whole.state_dict())
    torch.testing.assert_close(cls_u(ids, mask), whole(ids, mask), rtol=1e-5, atol=1e-6)
    assert cls_u.flops_per_batch(batch, True) < whole_u.flops_per_batch(batch, True)


def test_unpadded_encoder_same_logits_and_gradients_with_an_empty_row():
    """`model.unpadded`'s own form (cls_layer_forward_packed), and a batch row with no tokens (static-shape padding
    rows): the same logits for the real rows and the same, finite, gradients as the whole padded model."""
    from bertaccel.modules.unpadded import Unpadded, classifier_logits

    full = _model("sdpa", layers=3)
    cls = copy.deepcopy(full)
    last_layer_cls_only(cls)
    ids, mask, labels = _batch()
    mask[3] = 0  # an empty row
    labels[3] = -100
    out = {}
    for name, model, run in (("padded", full, lambda: full(input_ids=ids, attention_mask=mask).logits),
                             ("padded-cls", cls, lambda: cls(input_ids=ids, attention_mask=mask).logits),
                             ("unpadded-cls", cls, lambda: classifier_logits(cls, ids, mask, None, Unpadded.from_mask(mask)))):
        model.zero_grad(set_to_none=True)
        logits = run()
        torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100).backward()
        out[name] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    ref_logits, ref_grads = out["padded"]
    for name in ("padded-cls", "unpadded-cls"):
        logits, grads = out[name]
        torch.testing.assert_close(logits[:3], ref_logits[:3], rtol=1e-10, atol=1e-12)
        for n, g in ref_grads.items():
            assert torch.isfinite(grads[n]).all(), (name, n)
            torch.testing.assert_close(grads[n], g, rtol=1e-9, atol=1e-12, msg=lambda m, n=n: f"{name} {n}: {m}")


def test_a_row_without_keys_attends_to_position_0_not_to_nothing():
    from bertaccel.modules.last_layer import _key_mask

    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert _key_mask(mask, torch.float32).tolist() == [[[[True, True, False]]], [[[True, False, False]]]]
    additive = torch.tensor([0.0, torch.finfo(torch.float32).min]).repeat(2, 1, 3, 1)[..., [0, 0, 1]]
    additive[1] = torch.finfo(torch.float32).min
    got = _key_mask(additive, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 1, 1, 3)
    assert got[1, 0, 0, 0] == 0 and got[1, 0, 0, 1] < -1e38 and got[0, 0, 0, :2].eq(0).all()


@pytest.mark.cuda
def test_bf16_swapped_graph_on_gpu_within_twice_the_whole_layers_error():
    """bf16 autocast, the kernel swap and our attention (a Hopper GPU; SDPA elsewhere), forward + backward captured
    in a CUDA graph and replayed: logits and gradients against the fp64 whole model, within 2x the error of the
    bf16 whole model's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from bertaccel.ops.swap import DEFAULT, swap

    ref = _model("bertaccel", layers=2, hidden=384, heads=12, device="cuda")  # fp64, whole layers
    ids, mask, labels = _batch(B=4, S=136, device="cuda")
    ref_logits, ref_grads = _logits_and_grads(ref, ids, mask, labels)
    results = {}
    for name in ("whole", "cls"):
        model = copy.deepcopy(ref).float()
        swap(model, DEFAULT)
        if name == "cls":
            last_layer_cls_only(model)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(input_ids=ids, attention_mask=mask, labels=labels)
            out.loss.backward()
            return out.logits

        results[name] = replayed_output_and_grads(step, model)

    assert_within_twice(results["cls"], results["whole"], ref_logits, ref_grads)


@pytest.mark.cuda
def test_unpadded_last_layer_reads_the_packed_keys_in_place_on_gpu(monkeypatch):
    """On a GPU the unpadded encoder's [CLS]-only layer hands the packed K / V rows to the query-rows kernel's varlen
    form (no padded copy of them): bf16 autocast, dropout, an empty row - the same logits as the re-padded path
    (BERTACCEL_QUERY_ROWS_VARLEN=0) from the same seed, and the same gradients (within the fp32 atomics' order of the
    other layers' attention and the embeddings)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from bertaccel.modules.unpadded import Unpadded, classifier_logits
    from bertaccel.ops import attention, build

    assert build.load_attention(), build.attention_reason()
    model = _model("sdpa", layers=2, hidden=128, heads=4, dropout=0.1, dtype=torch.float32, device="cuda")  # d 32
    last_layer_cls_only(model)
    ids, mask, labels = _batch(device="cuda")
    mask[3] = 0  # an empty row (a static-shape batch's padding row)
    labels[3] = -100
    layout = Unpadded.from_mask(mask)
    calls = []
    varlen = attention.query_rows_attention_varlen
    monkeypatch.setattr(attention, "query_rows_attention_varlen",
                        lambda *a, **k: calls.append(tuple(a[1].shape)) or varlen(*a, **k))

    def run():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = classifier_logits(model, ids, mask, None, layout)
        torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=-100).backward()
        return logits.float().detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    got, got_grads = run()
    assert calls == [(layout.tokens, 2 * 128)]
    monkeypatch.setenv("BERTACCEL_QUERY_ROWS_VARLEN", "0")
    ref, ref_grads = run()
    assert len(calls) == 1  # the re-padded path did not call it
    assert torch.equal(got, ref)
    assert got_grads.keys() == ref_grads.keys()
    for n, g in ref_grads.items():
        assert torch.isfinite(got_grads[n]).all(), n
        torch.testing.assert_close(got_grads[n], g, rtol=1e-2, atol=1e-3, msg=lambda m, n=n: f"{n}: {m}")


def test_bf16_weight_copies_key_and_value_read_in_place():
    """Under the graphed steps' bf16 weight copies the K and V weights lie back to back (each attention's Q, K, V in
    one block): the [CLS]-only layer projects K and V in one GEMM reading them in place, with the same result as the
    whole model under the same copies."""
    from bertaccel.modules.weight_copies import Bf16WeightCopies
    from bertaccel.ops.qkv import adjacent_rows

    full = _model(dtype=torch.float32)
    cls = copy.deepcopy(full)
    last_layer_cls_only(cls)
    ids, mask, labels = _batch()
    out = {}
    for name, model in (("full", full), ("cls", cls)):
        copies = Bf16WeightCopies(model)
        with copies.swapped_in(), torch.autocast("cpu", dtype=torch.bfloat16):
            sa = model.bert.encoder.layer[-1].attention.self
            assert adjacent_rows(sa.key.weight, sa.value.weight) is not None
            out[name] = model(input_ids=ids, attention_mask=mask).logits.float()
    torch.testing.assert_close(out["cls"], out["full"], rtol=2e-2, atol=2e-2)


def test_the_profilers_attention_region_of_the_last_layer_is_kept():
    """The skipped `BertAttention` call would have opened `layer{i}.attention` through the profiler's hooks: the
    [CLS]-only layer opens it itself (padded and unpadded encoders), so the region breakdown still has the layer."""
    from bertaccel.modules.unpadded import Unpadded, classifier_logits

    model = _model(layers=2)
    last_layer_cls_only(model)
    ids, mask, _ = _batch()
    for run in (lambda: model(input_ids=ids, attention_mask=mask),
                lambda: classifier_logits(model, ids, mask, None, Unpadded.from_mask(mask))):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run()
        names = {e.name for e in prof.events()}
        assert "layer1.attention" in names, sorted(n for n in names if n.startswith("layer"))
