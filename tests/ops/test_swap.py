"""The kernel swap on CPU: reversible, parameter-preserving, exactly PyTorch on the fallback path."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification

from bertaccel.errors import ConfigError
from bertaccel.ops.embeddings import FusedBertEmbeddings
from bertaccel.ops.gelu import FusedBertIntermediate
from bertaccel.ops.layer_norm import FusedLayerNorm
from bertaccel.ops.residual_layer_norm import FusedBertOutput
from bertaccel.ops.rms_norm import FusedRMSNorm
from bertaccel.ops.softmax import FusedBertSelfAttention
from bertaccel.ops.swap import ORDER, swap

CFG = dict(vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
           max_position_embeddings=64, num_labels=3)


@pytest.fixture
def model():
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(**CFG)).eval()


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 120, (3, 17), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("with_ffn", [False, True], ids=["without_ffn", "with_ffn"])
def test_swap_replaces_instances_and_revert_restores_them(model, with_ffn):
    before = dict(model.named_modules())
    params = {n: p for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    report = swap(model, ORDER if with_ffn else [f for f in ORDER if f != "ffn"])
    counts = report.counts()
    # 2 layers x 2 outputs; the embeddings' LayerNorm goes with the embeddings; SDPA attention gets the
    # fused QKV projection; linear: 6 dense layers per layer + the pooler (the 3-class classifier is
    # not a multiple of 8). The ffn family takes each layer's intermediate and output (not its attention)
    if with_ffn:
        assert counts == {"linear": 13, "ffn": 2, "embeddings": 1, "qkv": 2, "residual_layer_norm": 2}
    else:
        assert counts == {"linear": 13, "embeddings": 1, "qkv": 2, "residual_layer_norm": 4, "bias_gelu": 2}
    assert [(n, f) for n, f, _ in report.skipped] == [("classifier", "linear")] + [
        (f"bert.encoder.layer.{i}.attention.self", "softmax") for i in range(2)]
    types = {type(m) for m in model.modules()}
    assert {FusedBertEmbeddings, FusedBertOutput} <= types
    assert (FusedBertIntermediate in types) != with_ffn
    layer = model.bert.encoder.layer[0]
    assert isinstance(layer, type(before["bert.encoder.layer.0"]))  # the same class's forward, checkpointing
    assert isinstance(layer.attention.output, FusedBertOutput)  # the attention stays open to the others
    assert isinstance(layer.output, FusedBertOutput) != with_ffn
    assert ("bert.encoder.layer.1.feed_forward" in dict(model.named_modules())) == with_ffn
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())  # the same Parameter objects
    assert type(model.bert.encoder.layer[0].output.LayerNorm) is nn.LayerNorm  # left to its parent
    report.revert()
    after = dict(model.named_modules())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    # HF classes are untouched: a fresh model has no fused modules
    fresh = BertForSequenceClassification(BertConfig(**CFG))
    assert not any(isinstance(m, (FusedBertOutput, FusedLayerNorm)) for m in fresh.modules())


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("ops", [["layer_norm"], ["residual_layer_norm"], ["bias_gelu"], ["embeddings"], ["softmax"], ["qkv"], ORDER])
def test_fallback_is_exactly_pytorch(model, ops, attn):
    model.set_attn_implementation(attn)
    if ops == ["softmax"] and attn == "sdpa":
        pytest.skip("the softmax family takes eager attention only")
    if ops == ["qkv"] and attn == "eager":
        pytest.skip("the qkv family takes SDPA attention (the softmax family fuses eager's projections)")
    b = batch()
    with torch.no_grad():
        ref = model(**b).logits
        report = swap(model, ops)
        out = model(**b).logits
    assert report.replaced
    assert torch.equal(out, ref)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_fallback_is_exactly_pytorch_in_training_with_gradients(model, attn):
    model.set_attn_implementation(attn)
    model.train()
    b, labels = batch(), torch.tensor([0, 2, 1])
    torch.manual_seed(5)
    loss_ref = model(**b, labels=labels).loss
    loss_ref.backward()
    grads_ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    swap(model, ORDER)
    torch.manual_seed(5)  # same dropout masks
    loss = model(**b, labels=labels).loss
    loss.backward()
    assert torch.equal(loss, loss_ref)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, grads_ref[n]), n


def test_double_claims_and_unknown_ops_are_errors(model):
    with pytest.raises(ConfigError, match="listed twice"):
        swap(model, ["layer_norm", "layer_norm"])
    with pytest.raises(ConfigError, match="unknown kernel-swap ops"):
        swap(model, ["layernorm"])


def test_checkpoint_round_trip_swapped_and_plain(model, tmp_path):
    report = swap(model, ORDER)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    sd = model.state_dict()
    plain = BertForSequenceClassification(BertConfig(**CFG)).eval()
    plain.load_state_dict(sd)  # a checkpoint saved while swapped loads into plain HF BERT
    b = batch()
    with torch.no_grad():
        assert torch.equal(plain(**b).logits, model(**b).logits)
    # and back: plain weights into a swapped model; save_pretrained of a swapped model
    other = BertForSequenceClassification(BertConfig(**CFG)).eval()
    swap(other, ORDER)
    other.load_state_dict(plain.state_dict())
    model.save_pretrained(tmp_path / "hf")
    loaded = BertForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert torch.equal(loaded(**b).logits, plain(**b).logits)
        assert torch.equal(other(**b).logits, plain(**b).logits)
    report.revert()


def test_masked_lm_swaps_too():
    m = BertForMaskedLM(BertConfig(**CFG)).eval()
    report = swap(m, ORDER)
    # the MLM head's transform LayerNorm is a plain LayerNorm: swapped as one
    assert report.counts()["layer_norm"] == 1 and report.counts()["embeddings"] == 1


def test_eager_attention_takes_the_softmax_family():
    m = BertForSequenceClassification(BertConfig(**CFG, attn_implementation="eager")).eval()
    report = swap(m, ["softmax"])
    assert report.counts() == {"softmax": 2}
    assert isinstance(m.bert.encoder.layer[0].attention.self, FusedBertSelfAttention)
    b = batch()
    with torch.no_grad():
        out = m(**b, output_attentions=True)
    assert out.attentions[0].shape == (3, 4, 17, 17)  # the probabilities, as eager attention returns them
    report.revert()
    assert type(m.bert.encoder.layer[0].attention.self).__name__ == "BertSelfAttention"


def test_rms_norm_family_swaps_nn_rmsnorm():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.RMSNorm(32, eps=1e-6), nn.Linear(32, 4))
    x = torch.randn(5, 16)
    ref = m(x)
    report = swap(m, ["rms_norm"])
    assert isinstance(m[1], FusedRMSNorm) and m[1].weight is report.replaced[0].original.weight
    assert torch.equal(m(x), ref)  # CPU: PyTorch's own op
    report.revert()
    assert type(m[1]) is nn.RMSNorm


def test_kernel_swap_callback_through_the_cli(tiny_config):
    from bertaccel.cli import BertAccelCLI

    run = BertAccelCLI(args=["fit", "-c", tiny_config("swap", epochs=1), "--kernel_swap.ops", "[all]"])
    # reverted at teardown: the trained module is plain HF again
    assert not any(isinstance(m, (FusedBertOutput, FusedLayerNorm, FusedBertIntermediate)) for m in run.model.modules())
    assert run.trainer.global_step > 0


def test_kernel_swap_all_leaves_out_the_opt_in_gemm_until_named():
    from bertaccel.callbacks.kernel_swap import KernelSwap

    assert "linear" not in KernelSwap(ops=["all"]).ops
    assert KernelSwap(ops=["all", "linear"]).ops[-1] == "linear"
    assert KernelSwap(ops=["linear", "layer_norm"]).ops == ["linear", "layer_norm"]


def test_attention_fallback_follows_train_and_eval():
    """The fallback runs the original attention, which is not a submodule: model.eval() did not reach
    it and its attention dropout stayed on. Now the fallback follows the swapped module's mode."""
    cfg = {**CFG, "attention_probs_dropout_prob": 0.5}
    m = BertForSequenceClassification(BertConfig(**cfg, attn_implementation="eager"))
    m.train()
    swap(m, ["softmax"])  # on CPU every call takes the fallback
    m.eval()
    b = batch()
    with torch.no_grad():
        first, second = m(**b).logits, m(**b).logits
    assert torch.equal(first, second)  # no dropout in eval
    m.train()
    with torch.no_grad():
        assert not torch.equal(m(**b).logits, m(**b).logits)  # dropout back in training


def test_swap_targets_modules_by_name_patterns(model):
    """`only` / `exclude` (fnmatch over module names) restrict what the families claim."""
    report = swap(model, ["residual_layer_norm", "bias_gelu"], only=["bert.encoder.layer.1.*"])
    assert sorted(r.name for r in report.replaced) == [
        "bert.encoder.layer.1.attention.output", "bert.encoder.layer.1.intermediate", "bert.encoder.layer.1.output"]
    report.revert()
    report = swap(model, ["residual_layer_norm"], exclude=["*.attention.output"])
    assert sorted(r.name for r in report.replaced) == ["bert.encoder.layer.0.output", "bert.encoder.layer.1.output"]
    report.revert()


def test_registry_derives_build_sources_and_swap_order():
    """The build's sources and the swap's families come from the family modules' declarations (and
    the other op modules': the optimizer's)."""
    from bertaccel.ops import build, registry

    assert ORDER == list(registry.swap_entries())
    others = {s for m in build._other_op_modules() for s in m.CUDA_SOURCES}
    assert "adamw.cu" in others
    assert set(build.sources()) == {s for m in registry.modules() for s in m.CUDA_SOURCES} | others | set(build.SHARED_SOURCES)
    assert all((build.CSRC / s).exists() for s in build.sources() + build.included_headers(build.sources()))
    assert all(name in registry.describe() for name in ORDER)
    # every CUDA / C++ source belongs to exactly one of the three extensions
    extensions = [build.sources(), build.GEMM_SOURCES, build.attention_sources()]
    on_disk = {p.name for p in build.CSRC.iterdir() if p.suffix in (".cu", ".cpp")}
    assert sorted(s for e in extensions for s in e) == sorted(on_disk)


def test_build_keys_hash_every_header_a_source_includes(tmp_path, monkeypatch):
    """Each extension's build key covers the headers its sources include, directly or through other headers (found
    by reading the includes, not kept by hand), so editing one rebuilds the extension."""
    import shutil

    from bertaccel.ops import build

    ops, gemm, attention = build.sources(), build.GEMM_SOURCES, build.attention_sources()
    assert {"common.cuh", "check.h", "vec.cuh", "switches.h"} <= set(build.included_headers(ops))
    assert "check.h" in build.included_headers(["gemm_plain.cu"])  # only through gemm_kernel.cuh
    assert "vec.cuh" in build.included_headers(attention)  # through query_rows_attention.cu
    headers = {p.name for p in build.CSRC.iterdir() if p.suffix in (".h", ".cuh")}
    used = set(build.included_headers(ops + gemm + attention))
    assert used <= headers and used == headers, f"headers no source includes: {sorted(headers - used)}"
    # editing a header that a source reaches only through another header changes the key
    csrc = tmp_path / "csrc"
    shutil.copytree(build.CSRC, csrc)
    monkeypatch.setattr(build, "CSRC", csrc)
    files = ["gemm_plain.cu"] + build.included_headers(["gemm_plain.cu"])
    before = build.build_key(files, arch="9.0a")
    (csrc / "check.h").write_text((csrc / "check.h").read_text() + "\n// edited\n")
    assert build.build_key(files, arch="9.0a") != before


class _RecordingCache:
    """Stands in for an HF KV cache: returns the keys and values it is given, counting the calls."""

    def __init__(self):
        self.updates = 0

    def update(self, key, value, *args, **kwargs):
        self.updates += 1
        return key, value


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_swapped_self_attention_hands_a_kv_cache_to_the_original(model, attn, monkeypatch):
    """A KV cache, under the name this transformers passes it (`cache` or `past_key_values`), sends
    the replacement to the original module with the cache (said once), and the result is HF's."""
    import inspect

    from transformers.models.bert.modeling_bert import BertSelfAttention

    from bertaccel.ops import eligibility

    monkeypatch.setattr(eligibility, "_warned", set())
    model.set_attn_implementation(attn)
    name = next(n for n in ("cache", "past_key_values") if n in inspect.signature(BertSelfAttention.forward).parameters)
    original = model.bert.encoder.layer[0].attention.self
    h = torch.randn(2, 5, CFG["hidden_size"])
    with torch.no_grad():
        want = original(h, None, **{name: _RecordingCache()})[0]
        swap(model, ["softmax" if attn == "eager" else "qkv"])
        replaced = model.bert.encoder.layer[0].attention.self
        assert replaced is not original
        cache = _RecordingCache()
        with pytest.warns(UserWarning, match="a KV cache is in use"):
            got = replaced(h, None, **{name: cache})[0]
    assert cache.updates == 1, "the cache did not reach the original module"
    torch.testing.assert_close(got, want)
