"""BertClassifier / BertMLM: loss and metrics, perplexity, optimizer groups, and checkpoint checks."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from bertaccel.cli import BertAccelCLI
from bertaccel.errors import CheckpointError, ConfigError
from bertaccel.modules import BertClassifier, BertMLM
from bertaccel.modules.base import decay_groups
from tests.conftest import TINY_BERT


def test_weight_decay_groups_exclude_biases_and_layernorm():
    m = BertClassifier(config=TINY_BERT, vocab_size=100)
    decay, no_decay = decay_groups(m.model, 0.01)
    names = {id(p): n for n, p in m.model.named_parameters()}
    assert all(not names[id(p)].endswith("bias") and "LayerNorm" not in names[id(p)] for p in decay["params"])
    assert any("LayerNorm" in names[id(p)] for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(m.model.parameters()))


def test_master_weights_are_fp32_and_attention_is_selectable():
    m = BertClassifier(config=TINY_BERT, vocab_size=100, attn_implementation="eager")
    assert all(p.dtype == torch.float32 for p in m.parameters())
    assert m.model.config._attn_implementation == "eager"
    with pytest.raises(Exception, match="attn_implementation"):
        BertClassifier(config=TINY_BERT, vocab_size=100, attn_implementation="flash")


def test_mlm_loss_is_over_masked_positions_and_perplexity_is_exp_loss():
    torch.manual_seed(0)
    m = BertMLM(config=TINY_BERT, vocab_size=50).eval()
    ids = torch.randint(5, 50, (3, 16))
    labels = torch.full_like(ids, -100)
    labels[:, 3] = ids[:, 3]
    labels[0, 7] = ids[0, 7]
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}
    logits, sel = m.masked_logits(batch)
    assert logits.shape == (4, 50) and torch.equal(sel, labels[labels != -100])
    full = m.model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss
    ours = torch.nn.functional.cross_entropy(logits, sel)
    torch.testing.assert_close(ours, full)
    m.validation_step(batch, 0)
    m.validation_step({k: v[:1] for k, v in batch.items()}, 1)
    loss = m.val_loss.compute()
    # token-weighted mean over both batches: 4 tokens then 2 tokens
    l1 = ours
    l2 = torch.nn.functional.cross_entropy(*m.masked_logits({k: v[:1] for k, v in batch.items()}))
    torch.testing.assert_close(loss, (4 * l1 + 2 * l2) / 6)
    assert math.isclose(math.exp(float(loss)), float(torch.exp(loss)), rel_tol=1e-6)


def test_max_length_above_model_positions_is_refused(tiny_config):
    cfg = tiny_config("long", max_length=128)  # TINY_BERT has 64 positions
    with pytest.raises(ConfigError, match="above the model's 64 positions"):
        BertAccelCLI(args=["fit", "-c", cfg])


def test_checkpoint_with_other_labels_is_refused(tiny_config, tmp_path):
    cfg = tiny_config("labels", epochs=1)
    BertAccelCLI(args=["fit", "-c", cfg])
    last = tmp_path / "runs" / "labels" / "checkpoints" / "last.ckpt"
    (tmp_path / "tiny_data" / "classes.txt").write_text("a\nb\nc\n")  # the data now has 3 classes
    with pytest.raises(CheckpointError, match="num_labels: checkpoint 2 vs config 3"):
        BertAccelCLI(args=["test", "-c", cfg, "--ckpt_path", str(last)])


def test_checkpoint_whose_weights_the_strategy_already_loaded_is_still_checked_for_architecture():
    """FSDP's strategy loads (strictly) and pops the checkpoint's state_dict before the module's hook:
    the hook must not report every weight missing, and still refuses another architecture."""
    from bertaccel.modules import BertClassifier
    from tests.conftest import TINY_BERT

    model = BertClassifier(config=TINY_BERT, vocab_size=64, num_labels=2)
    ckpt = {"state_dict": model.state_dict()}
    model.on_save_checkpoint(ckpt)
    popped = {k: v for k, v in ckpt.items() if k != "state_dict"}
    model.on_load_checkpoint(popped)  # no error: nothing left to compare
    ckpt["state_dict"] = {k: v for k, v in ckpt["state_dict"].items() if "classifier" not in k}
    with pytest.raises(CheckpointError, match="2 missing"):
        model.on_load_checkpoint(ckpt)
    other = BertClassifier(config=TINY_BERT, vocab_size=64, num_labels=3)
    with pytest.raises(CheckpointError, match="num_labels"):
        other.on_load_checkpoint(popped)


def test_missing_and_corrupt_checkpoints(tiny_config, tmp_path):
    cfg = tiny_config("ck", epochs=1)
    with pytest.raises(CheckpointError, match="does not exist"):
        BertAccelCLI(args=["test", "-c", cfg, "--ckpt_path", str(tmp_path / "nope.ckpt")])
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(CheckpointError, match="cannot be read"):
        BertAccelCLI(args=["test", "-c", cfg, "--ckpt_path", str(bad)])
    with pytest.raises(CheckpointError, match="does not exist"):
        BertAccelCLI(args=["test", "-c", cfg, "--ckpt_path", "best"])  # no run yet


def test_an_interrupted_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    """Lightning writes checkpoints through an fsspec transaction (temp file + move): a save that
    dies half-way must leave the old `last.ckpt` as it was."""
    from lightning.fabric.utilities import cloud_io

    path = tmp_path / "last.ckpt"
    cloud_io._atomic_save({"state_dict": {"w": torch.ones(3)}}, path)
    before = path.read_bytes()

    from fsspec.implementations.local import LocalFileOpener

    real_write = LocalFileOpener.write

    def dies_half_way(self, data):
        real_write(self, data[: len(data) // 2])
        raise OSError("disk full")

    monkeypatch.setattr(LocalFileOpener, "write", dies_half_way)
    with pytest.raises(OSError, match="disk full"):
        cloud_io._atomic_save({"state_dict": {"w": torch.zeros(3)}}, path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert torch.load(path, weights_only=True)["state_dict"]["w"].sum() == 3


def test_checkpoint_loads_with_weights_only(tiny_config, tmp_path):
    BertAccelCLI(args=["fit", "-c", tiny_config("wo", epochs=1)])
    ckpt = torch.load(tmp_path / "runs" / "wo" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["bertaccel"]["architecture"]["num_labels"] == 2
    m = BertClassifier(config=TINY_BERT, vocab_size=ckpt["bertaccel"]["architecture"]["vocab_size"])
    m.load_state_dict(ckpt["state_dict"])
    assert isinstance(Path(tmp_path), Path)


def test_pretrained_models_train_with_dropout(tmp_path):
    """HF's from_pretrained returns an eval-mode model; the module must put it back in train mode."""
    from transformers import BertConfig, BertForSequenceClassification

    BertForSequenceClassification(BertConfig(**TINY_BERT, vocab_size=100)).save_pretrained(tmp_path / "m")
    m = BertClassifier(pretrained=str(tmp_path / "m"), num_labels=2)
    assert all(mod.training for mod in m.modules())


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_qk_norm_normalises_each_heads_queries_and_keys(kind, attn):
    from bertaccel.modules.bert import QKNormLinear

    cfg = {**TINY_BERT, "num_attention_heads": 4, "hidden_size": 32}
    m = BertClassifier(config=cfg, vocab_size=64, num_labels=2, qk_norm=kind, attn_implementation=attn)
    attention = m.model.bert.encoder.layer[0].attention.self
    assert isinstance(attention.query, QKNormLinear) and isinstance(attention.key, QKNormLinear)
    x = torch.randn(2, 5, 32)
    q = attention.query(x).view(2, 5, 4, 8)
    if kind == "layernorm":
        torch.testing.assert_close(q.mean(-1), torch.zeros(2, 5, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close((q.pow(2).mean(-1) if kind == "rmsnorm" else q.var(-1, unbiased=False)),
                               torch.ones(2, 5, 4), atol=1e-3, rtol=0)
    ids = torch.randint(0, 64, (2, 7))
    loss = torch.nn.functional.cross_entropy(m(ids, torch.ones_like(ids)), torch.tensor([0, 1]))
    loss.backward()
    assert attention.query.norm.weight.grad is not None and torch.isfinite(loss)


def test_qk_norm_needs_a_model_trained_from_scratch_and_checkpoints_must_agree(tmp_path):
    with pytest.raises(ConfigError, match="qk_norm adds norm parameters that a pretrained model does not have"):
        BertClassifier(pretrained=str(tmp_path), qk_norm="rmsnorm")
    plain = BertClassifier(config=TINY_BERT, vocab_size=64, num_labels=2)
    from bertaccel.modules.bert import architecture_of

    old_arch = {k: v for k, v in architecture_of(plain.model).items() if k != "qk_norm"}  # before the option
    ckpt = {"state_dict": plain.state_dict(), "bertaccel": {"class": "BertClassifier", "architecture": old_arch}}
    normed = BertClassifier(config=TINY_BERT, vocab_size=64, num_labels=2, qk_norm="layernorm")
    with pytest.raises(CheckpointError, match="qk_norm: checkpoint None vs config layernorm"):
        normed.on_load_checkpoint(ckpt)


def test_logged_train_loss_is_the_mean_of_the_window(monkeypatch):
    """The step losses are summed on the device (one add per step, the count on the host); every
    `log_every_n_steps` batches the mean of the steps before that batch is read (before its step, so a graphed
    step is queued behind the read, not waited for) and logged after it, the next window starting from zero. The
    fit's first step logs its own loss (a loss on the progress bar from the start)."""
    import types

    module = BertClassifier(num_labels=2, pretrained=None, config=TINY_BERT)
    loop = types.SimpleNamespace(_batches_that_stepped=0)
    fit_loop = types.SimpleNamespace(epoch_loop=loop, _should_accumulate=lambda: False)  # no accumulation
    module._trainer = types.SimpleNamespace(fit_loop=fit_loop, log_every_n_steps=3, global_step=0)
    logged = []
    monkeypatch.setattr(module, "log", lambda name, value, **kw: logged.append((name, float(value))))
    losses = [0.5, 1.25, 2.0, 4.0, 3.0, 0.25, 7.0]
    for i, x in enumerate(losses):
        window = module._take_train_loss_window()
        assert (window is None) == (i not in (2, 5)), i
        module._log_train_loss(torch.tensor(x, requires_grad=True) * 1.0, window)
        loop._batches_that_stepped = i + 1
    # the first step logs its own loss (read after it); batch 2 (the third) the step since (1), batch 5 the three
    # before it (2, 3, 4)
    assert logged == [("train/loss", 0.5), ("train/loss", 1.25), ("train/loss", pytest.approx(sum(losses[2:5]) / 3))]
    # log_every_n_steps 0 (Lightning writes no step metrics): the window is never read (no host read, no sync)
    module._trainer.log_every_n_steps = 0
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("read the loss window"))
    module._train_loss_logged = False  # nor the first step's loss
    for done in range(8, 20):
        loop._batches_that_stepped = done
        assert module._take_train_loss_window() is None
        module._log_train_loss(torch.tensor(1.0), None)
