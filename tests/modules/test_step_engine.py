"""The step engine on CPU: static-shape batches, sync-free metrics, and the graph-mode loop (manual
optimization, the optimizer inside the step) run without capture, which must train exactly like
Lightning's automatic optimization: same parameters, global step, learning rate, clipping and
accumulation. The capture itself is tested on the GPU (test_graphs_cuda.py)."""

from __future__ import annotations

import logging
import math

import lightning.pytorch as pl
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import BaseFinetuning
import pytest
import torch
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

from bertaccel.data import TextClassificationDataModule
from bertaccel.data.collate import ClassificationCollator, bucket_lengths
from bertaccel.modules import BertClassifier
from bertaccel.modules.metrics import ClassificationStats
from tests.conftest import TINY_BERT


def rows(lengths, label=1):
    return [{"input_ids": torch.arange(5, 5 + n), "label": label, "index": i} for i, n in enumerate(lengths)]


def test_bucket_lengths():
    assert bucket_lengths(256, 64) == [64, 128, 192, 256]
    assert bucket_lengths(200, 64) == [64, 128, 192, 200]
    assert bucket_lengths(512, [128, 256, 1024]) == [128, 256, 512]
    with pytest.raises(ValueError):
        bucket_lengths(256, 0)


def test_static_shape_collator_buckets_lengths_and_pads_the_last_batch():
    c = ClassificationCollator(pad_id=0, buckets=[64, 128, 192], batch_size=4)
    full = c(rows([10, 70, 3, 65]))
    assert full["input_ids"].shape == (4, 128) and full["num_rows"] == 4
    assert full["attention_mask"].sum(1).tolist() == [70, 65, 10, 3]  # longest first
    assert full["index"].tolist() == [1, 3, 0, 2]
    assert full["num_tokens"] == 148 and "attention_pairs" not in full  # real tokens, counted on the host
    short = c(rows([5, 9]))
    assert short["input_ids"].shape == (4, 64) and short["num_rows"] == 2
    assert short["labels"].tolist() == [1, 1, -100, -100]
    assert short["index"].tolist() == [1, 0, -1, -1]
    assert short["num_tokens"] == 14  # the padding rows' token not counted
    # a padding row attends to one token, so no attention row is fully masked (no NaN)
    assert short["attention_mask"][2:].sum(1).tolist() == [1, 1]
    with pytest.raises(ValueError, match="longer than the largest bucket"):
        c(rows([193]))
    dynamic = ClassificationCollator(pad_id=0, pad_to_multiple_of=8)(rows([10, 3]))
    assert dynamic["input_ids"].shape == (2, 16) and dynamic["num_rows"] == 2


def test_classification_stats_match_torchmetrics_and_skip_padding_rows():
    torch.manual_seed(0)
    c = 5
    stats = ClassificationStats(c)
    acc, f1 = MulticlassAccuracy(c, average="micro"), MulticlassF1Score(c, average="macro")
    for _ in range(4):
        logits = torch.randn(32, c)
        labels = torch.randint(0, c - 1, (32,))  # class 4 never a label: still counted when predicted
        padded = labels.clone()
        padded[-3:] = -100
        stats.update(logits, padded, torch.tensor(2.0))
        acc.update(logits[:-3], labels[:-3])
        f1.update(logits[:-3], labels[:-3])
    out = stats.compute()
    torch.testing.assert_close(out["acc"], acc.compute())
    torch.testing.assert_close(out["f1"], f1.compute())
    torch.testing.assert_close(out["loss"], torch.tensor(8.0 / (4 * 29)))


def test_the_classifier_step_counts_its_confusion_matrix_for_the_metrics():
    """`step_outputs` returns the batch's confusion matrix (counted in the step - a CUDA graph's part when graphed);
    the metric updated with it equals the metric counting from the logits itself, padding rows (-100) left out."""
    from bertaccel.modules.metrics import confusion_counts

    torch.manual_seed(1)
    model = BertClassifier(config=TINY_BERT, vocab_size=256, num_labels=3).eval()
    ids = torch.randint(5, 256, (6, 12))
    labels = torch.tensor([0, 2, 1, 2, -100, -100])
    out = model.step_outputs(ids, torch.ones_like(ids), labels=labels)
    expected = torch.zeros(3, 3, dtype=torch.long)
    for y, p in zip(labels[:4].tolist(), out["logits"][:4].argmax(-1).tolist()):
        expected[y, p] += 1
    assert out["confusion"].dtype == torch.long and torch.equal(out["confusion"], expected)
    assert torch.equal(confusion_counts(out["logits"], labels, 3), expected)
    given, counted = ClassificationStats(3), ClassificationStats(3)
    given.update(out["logits"], labels, out["loss_sum"], counts=out["confusion"])
    counted.update(out["logits"], labels, out["loss_sum"])
    for k, v in counted.compute().items():
        torch.testing.assert_close(given.compute()[k], v)
    assert "confusion" not in model.step_outputs(ids, torch.ones_like(ids))  # no labels (prediction): no counts


@pytest.mark.cuda
def test_confusion_counts_replay_in_a_cuda_graph():
    """The counts are device ops only: captured once in a CUDA graph, each replay counts the batch then in the
    static inputs (no host read during capture, which would fail it)."""
    from bertaccel.modules.metrics import confusion_counts

    logits = torch.zeros(16, 4, device="cuda")
    labels = torch.zeros(16, dtype=torch.long, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        confusion_counts(logits, labels, 4)  # warm-up
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        counts = confusion_counts(logits, labels, 4)
    g = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(3):
        logits.copy_(torch.randn(16, 4, device="cuda", generator=g))
        labels.copy_(torch.randint(0, 4, (16,), device="cuda", generator=g))
        labels[-2:] = -100
        graph.replay()
        expected = torch.zeros(4, 4, dtype=torch.long)
        for y, p in zip(labels[:-2].tolist(), logits[:-2].argmax(-1).tolist()):
            expected[y, p] += 1
        assert torch.equal(counts.cpu(), expected)


def _model_and_data(graph_loop: bool, tiny_data, model_kwargs=None, module_class=BertClassifier):
    """A seeded tiny classifier (the graph-mode loop run eagerly when `graph_loop`) and its static-shape data."""
    pl.seed_everything(3)
    model = module_class(config=TINY_BERT, vocab_size=256, num_labels=2, lr=3e-3, cuda_graphs=graph_loop,
                         **(model_kwargs or {}))
    model._capture_without_gpu = graph_loop  # the graph-mode loop, run eagerly
    dm = TextClassificationDataModule(dataset=str(tiny_data), tokenizer="sample:sentiment", max_length=48,
                                      batch_size=16, val_size=0.2, static_shapes=True, length_buckets=16)
    return model, dm


def _trainer(root, **kwargs) -> pl.Trainer:
    """A quiet CPU trainer: no logger, checkpoints, progress bar or summary unless `kwargs` say otherwise."""
    kwargs = {"enable_checkpointing": False, "logger": False, **kwargs}
    return pl.Trainer(accelerator="cpu", devices=1, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=root, **kwargs)


def _train(graph_loop: bool, tiny_data, tmp_path, model_kwargs=None, module_class=BertClassifier, **trainer_kwargs):
    model, dm = _model_and_data(graph_loop, tiny_data, model_kwargs, module_class)
    trainer = _trainer(tmp_path, **{"max_epochs": 2, "log_every_n_steps": 2, **trainer_kwargs})
    trainer.fit(model, datamodule=dm)
    lr = trainer.lr_scheduler_configs[0].scheduler.get_last_lr()
    return model, trainer, lr


@pytest.mark.parametrize("options", [{}, {"gradient_clip_val": 0.05}, {"accumulate_grad_batches": 3},
                                     {"gradient_clip_val": 0.1, "gradient_clip_algorithm": "value"}],
                         ids=["plain", "clip-norm", "accumulate", "clip-value"])
def test_graph_mode_loop_trains_like_automatic_optimization(options, tiny_data, tmp_path):
    eager, t_eager, lr_eager = _train(False, tiny_data, tmp_path / "a", **options)
    graph, t_graph, lr_graph = _train(True, tiny_data, tmp_path / "b", **options)
    assert eager.automatic_optimization and not graph.automatic_optimization
    assert t_graph.global_step == t_eager.global_step > 0
    assert lr_graph == pytest.approx(lr_eager)
    for (name, a), b in zip(eager.named_parameters(), graph.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    for key in ("val/acc", "val/loss", "train/acc"):
        torch.testing.assert_close(t_graph.callback_metrics[key], t_eager.callback_metrics[key], rtol=1e-4, atol=1e-5)


class _PlateauClassifier(BertClassifier):
    """A user's own schedule: ReduceLROnPlateau on the validation loss, stepped at epoch ends (it needs the metric)."""

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=10.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "val/loss", "interval": "epoch"}}


@pytest.mark.parametrize("schedule", ["swa", "plateau"])
def test_graph_mode_steps_the_schedulers_as_lightning_does(schedule, tiny_data, tmp_path):
    """Under graphs (manual optimization) Lightning steps no scheduler itself; the module has it step them as in
    automatic optimization: an epoch scheduler a callback installs (StochasticWeightAveraging's SWALR - stepped every
    batch, it annealed in ten steps instead of ten epochs) and ReduceLROnPlateau with its monitored metric (stepped
    without it, it raised). Same learning rates and parameters as the eager loop."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    def run(graph_loop, path):
        if schedule == "swa":
            return _train(graph_loop, tiny_data, path, max_epochs=3,
                          callbacks=[StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1)])
        return _train(graph_loop, tiny_data, path, module_class=_PlateauClassifier, max_epochs=3)

    import warnings

    eager, t_eager, lr_eager = run(False, tmp_path / "a")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph, t_graph, lr_graph = run(True, tmp_path / "b")
    # the scheduler dict parsed as automatic optimization's: no "keys will be ignored" for its `monitor`
    assert not [w for w in caught if "will be ignored" in str(w.message)]
    assert not graph.automatic_optimization and t_graph.global_step == t_eager.global_step > 0
    assert lr_graph == pytest.approx(lr_eager)
    assert lr_eager[0] < 3e-3  # the schedule moved the rate
    for (name, a), b in zip(eager.named_parameters(), graph.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    assert "_update_learning_rates" not in vars(t_graph.fit_loop.epoch_loop)  # removed after the fit


@pytest.mark.parametrize("every", ["steps", "time"])
def test_graph_mode_checkpoints_like_the_eager_loop(every, tiny_data, tmp_path):
    """Lightning's ModelCheckpoint branches on manual optimization (ignoring `train_time_interval`, warning at every
    save about a pre-optimization state); a graphed fit is manual optimization only in name, so the product's
    LatestCheckpoint saves at the eager loop's steps, without that warning."""
    import datetime
    import warnings

    from bertaccel.callbacks.checkpoint import LatestCheckpoint

    def run(graph_loop, path):
        when = {"every_n_train_steps": 3} if every == "steps" else {"train_time_interval": datetime.timedelta(0)}
        ckpt = LatestCheckpoint(dirpath=path / "ckpt", filename="{step}", save_top_k=-1, save_last=True, **when)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, trainer, _ = _train(graph_loop, tiny_data, path, callbacks=[ckpt], enable_checkpointing=True)
        return sorted(p.name for p in (path / "ckpt").glob("step=*.ckpt")), caught, trainer

    eager, _, t_eager = run(False, tmp_path / "a")
    graph, caught, t_graph = run(True, tmp_path / "b")
    assert t_graph.global_step == t_eager.global_step > 3 and not t_graph.lightning_module.automatic_optimization
    assert graph == eager and len(eager) > 2, (graph, eager)
    assert not [w for w in caught if "pre-optimization state" in str(w.message)]


@pytest.mark.parametrize("name", ["GradientAccumulationScheduler", "LearningRateFinder"])
def test_callbacks_that_need_automatic_optimization_take_eager_steps_saying_why(name, tiny_data, tmp_path, caplog):
    """Lightning's GradientAccumulationScheduler refuses manual optimization (a RuntimeError naming manual
    optimization, which the user never chose) and its LearningRateFinder reads each step's loss from the step's
    output (None from a graphed step: no suggestion); with either, the fit takes eager steps, saying why."""
    from lightning.pytorch import callbacks

    callback = (callbacks.GradientAccumulationScheduler({0: 1, 1: 2}) if name == "GradientAccumulationScheduler"
                else callbacks.LearningRateFinder(num_training_steps=8))
    with caplog.at_level(logging.INFO):
        model, trainer, _ = _train(True, tiny_data, tmp_path, callbacks=[callback])
    assert model.automatic_optimization and trainer.global_step > 0
    assert any(f"runs eager steps: {name}" in r.getMessage() for r in caplog.records)
    if name == "LearningRateFinder":  # a loss for every learning rate tried (NaN where a step's output was None)
        losses = callback.optimal_lr.results["loss"]
        assert len(losses) >= 4 and all(math.isfinite(x) for x in losses), losses


def test_graph_mode_steps_hand_the_callbacks_their_loss(tiny_data, tmp_path):
    """`outputs["loss"]` in on_train_batch_end, as the eager loop gives it (Lightning's SpikeDetection raised a
    KeyError under graphs): the same values, step by step."""
    from lightning.pytorch.callbacks import SpikeDetection

    class Losses(Callback):
        def __init__(self):
            self.seen = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.seen.append(outputs["loss"])

    eager, graph = Losses(), Losses()
    _train(False, tiny_data, tmp_path / "a", callbacks=[eager, SpikeDetection()])
    _train(True, tiny_data, tmp_path / "b", callbacks=[graph, SpikeDetection()])
    assert len(graph.seen) == len(eager.seen) > 4
    torch.testing.assert_close(torch.stack(graph.seen), torch.stack(eager.seen), rtol=1e-4, atol=1e-5)


def test_a_second_fit_of_the_module_reads_its_own_trainer_settings(tiny_data, tmp_path):
    """A graphed fit takes the trainer's clipping and accumulation over (Lightning applies them only in automatic
    optimization) and hands them back at its end; a second fit of the same module - a notebook's next cell, with
    another trainer - decides anew and takes its own (the first fit's decision was kept: Lightning refused the
    second trainer's clipping for manual optimization). Same weights as the eager module after both fits."""
    weights, settings = {}, {}
    for graph_loop in (False, True):
        model, dm = _model_and_data(graph_loop, tiny_data)
        trainers = []
        for i, options in enumerate([{}, {"gradient_clip_val": 0.05, "accumulate_grad_batches": 2}]):
            trainer = _trainer(tmp_path / f"{graph_loop}{i}", max_epochs=1, **options)
            trainer.fit(model, datamodule=dm)
            trainers.append(trainer)
        weights[graph_loop] = [p.detach().clone() for p in model.parameters()]
        settings[graph_loop] = [(t.gradient_clip_val, t.accumulate_grad_batches, t.global_step) for t in trainers]
    assert settings[True] == settings[False] == [(None, 1, 8), (0.05, 2, 4)]  # handed back after each fit
    for a, b in zip(weights[False], weights[True]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_graph_mode_logs_what_the_eager_loop_logs(tiny_data, tmp_path):
    """The loggers' rows of a graphed fit - LearningRateMonitor's rates by step, train/loss, the epoch metrics - are
    the eager fit's (the learning rates moved to Lightning's scheduler update after the batch, 21fd5fa)."""
    import csv

    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import CSVLogger

    rows = {}
    for graph_loop in (False, True):
        _, trainer, _ = _train(graph_loop, tiny_data, tmp_path / str(graph_loop), logger=CSVLogger(tmp_path / f"log{graph_loop}"),
                               callbacks=[LearningRateMonitor(logging_interval="step")])
        with open(trainer.logger.log_dir + "/metrics.csv") as f:
            rows[graph_loop] = [{k: v for k, v in r.items() if v} for r in csv.DictReader(f)]
    assert any("lr-AdamW/pg1" in r for r in rows[False]) and any("train/loss" in r for r in rows[False])
    assert len(rows[True]) == len(rows[False])
    for a, b in zip(rows[False], rows[True]):
        assert a.keys() == b.keys()
        for k in a:
            assert float(a[k]) == pytest.approx(float(b[k]), rel=1e-4, abs=1e-6), k


def test_weight_copies_follow_weights_a_callback_swaps_for_validation(tiny_data, tmp_path):
    """EMAWeightAveraging swaps its averaged weights in for each validation and out after it, in place. The bf16
    copies a graphed bf16-mixed step runs on were refreshed from the averaged weights for the validation and the
    next training step ran on them (the graphed fit left the eager one by 7e-3); they are refreshed after each
    validation and at each epoch's start. Same weights and validation loss as the eager fit."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    runs = {}
    for graph_loop in (False, True):
        model, trainer, _ = _train(graph_loop, tiny_data, tmp_path / str(graph_loop), precision="bf16-mixed",
                                   max_epochs=3, callbacks=[EMAWeightAveraging(decay=0.5)])
        runs[graph_loop] = (model, trainer)
    for a, b in zip(runs[False][0].parameters(), runs[True][0].parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert float(runs[True][1].callback_metrics["val/loss"]) == float(runs[False][1].callback_metrics["val/loss"])


class _ClampLinearWeights(pl.Callback):
    """A max-norm-style constraint: after every training batch, each Linear weight clamped in place."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        with torch.no_grad():
            for m in pl_module.modules():
                if isinstance(m, torch.nn.Linear):
                    m.weight.clamp_(-0.02, 0.02)


def test_weight_copies_follow_weights_a_callback_changes_between_steps(tiny_data, tmp_path):
    """A callback that changes weights in place between two training steps (a clamp in `on_train_batch_end`): the
    next graphed bf16-mixed step's forward ran on bf16 copies of the unclamped weights (the copies are refreshed by
    the update, before the callback), one step behind the eager fit at every step. The step now sees the masters'
    version counters move and refreshes the copies first: the eager fit's weights, bit for bit."""
    runs = {}
    for graph_loop in (False, True):
        model, trainer, _ = _train(graph_loop, tiny_data, tmp_path / str(graph_loop), precision="bf16-mixed",
                                   max_epochs=2, callbacks=[_ClampLinearWeights()])
        runs[graph_loop] = model
    for (name, a), b in zip(runs[False].named_parameters(), runs[True].parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_fit_validate_fit_test_in_one_session(tiny_data, tmp_path):
    """A notebook's sequence on one trainer - fit, validate, fit on, test - runs, with the eager loop's results and
    step count. The validate's `reset()` of the metrics ran in inference mode and the next fit's first validation
    step raised ("Inplace update to inference tensor"), eager or graphed; and after a graphed fit
    `trainer.global_step` read 0 in validate / test (the steps are counted by Lightning's manual loop)."""
    results = {}
    for graph_loop in (False, True):
        model, dm = _model_and_data(graph_loop, tiny_data)
        trainer = _trainer(tmp_path / str(graph_loop), max_epochs=1, gradient_clip_val=0.1, accumulate_grad_batches=2)
        trainer.fit(model, datamodule=dm)
        validated = trainer.validate(model, datamodule=dm, verbose=False)[0]
        step_after_validate = trainer.global_step
        trainer.fit_loop.max_epochs = 2
        trainer.fit(model, datamodule=dm)
        tested = trainer.test(model, datamodule=dm, verbose=False)[0]
        results[graph_loop] = (validated, step_after_validate, tested, trainer.global_step,
                               [p.detach().clone() for p in model.parameters()])
    eager, graph = results[False], results[True]
    assert eager[1] == graph[1] == 4 and eager[3] == graph[3] == 8
    assert graph[0] == pytest.approx(eager[0]) and graph[2] == pytest.approx(eager[2])
    for a, b in zip(eager[4], graph[4]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_fit_after_one_that_raised_trains_with_its_own_optimizer(tiny_data, tmp_path):
    """A fit that raises mid-epoch gets no on_train_end or teardown: its training graphs and step functions (which
    hold its optimizer) and the trainer's taken-over clipping stayed, and the next fit trained with the old
    optimizer's state and rates. Released at each fit's start; the next fit's predictions equal the eager module's."""

    class RaiseOnce(Callback):
        def __init__(self):
            self.armed = True

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.armed and trainer.global_step == 3:
                self.armed = False
                raise RuntimeError("stop")

    probs, clips = {}, {}
    for graph_loop in (False, True):
        model, dm = _model_and_data(graph_loop, tiny_data)
        first = _trainer(tmp_path / f"first{graph_loop}", max_epochs=1, gradient_clip_val=0.1, callbacks=[RaiseOnce()])
        with pytest.raises(RuntimeError, match="stop"):
            first.fit(model, datamodule=dm)
        second = _trainer(tmp_path / f"second{graph_loop}", max_epochs=1, accumulate_grad_batches=2)
        second.fit(model, datamodule=dm)
        probs[graph_loop] = torch.cat([p["probs"] for p in second.predict(model, datamodule=dm)])
        clips[graph_loop] = first.gradient_clip_val
    assert clips[True] == clips[False] == 0.1  # the first trainer's setting handed back
    torch.testing.assert_close(probs[True], probs[False], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("written,resumed", [(True, False), (False, True)], ids=["graphed-to-eager", "eager-to-graphed"])
def test_a_checkpoint_resumes_across_eager_and_graphed_steps(written, resumed, tiny_data, tmp_path):
    """Lightning counts eager fits' optimizer steps in its automatic loop and graphed fits' in its manual loop; a
    fit resumed from a checkpoint of the other mode started at global_step 0 and ran max_steps more steps (17
    batches for max_steps 12 from step 5). The restored count is carried to this mode's loop."""

    def fit(graph_loop, root, max_steps, ckpt=None):
        model, dm = _model_and_data(graph_loop, tiny_data)
        trainer = _trainer(root, max_steps=max_steps, limit_val_batches=0)
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt)
        return trainer

    fit(written, tmp_path / "a", 5).save_checkpoint(tmp_path / "mid.ckpt")
    trainer = fit(resumed, tmp_path / "b", 12, ckpt=tmp_path / "mid.ckpt")
    assert trainer.global_step == 12 and trainer.fit_loop.epoch_loop._batches_that_stepped == 12


class _CheckWeightCopies(Callback):
    """After each training step: the Linear modules hold their fp32 masters again, and each bf16 copy
    equals its master rounded to bf16 (refreshed after the optimizer step)."""

    def __init__(self):
        self.checked = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        copies = pl_module._weight_copies
        assert copies, "no bf16 weight copies in a graph-mode bf16-mixed step"
        assert all(c.grad is None for c in copies.copies)
        linears = [m for m in pl_module.model.modules() if isinstance(m, torch.nn.Linear)]
        assert all(m.weight.dtype == torch.float32 for m in linears)
        assert {id(m) for m in copies.masters} == {id(m.weight) for m in linears}
        for master, copy in zip(copies.masters, copies.copies):
            assert copy.dtype == torch.bfloat16 and torch.equal(copy, master.detach().to(torch.bfloat16))
        self.checked += 1


@pytest.mark.parametrize("options", [{}, {"accumulate_grad_batches": 3}, {"gradient_clip_val": 0.05}],
                         ids=["plain", "accumulate", "clip-norm"])
def test_bf16_weight_copies_compute_what_autocast_casts_compute(options, tiny_data, tmp_path):
    """bf16-mixed graph-mode steps with the copies give the same parameters, bit for bit, as with
    autocast casting the fp32 weights: same rounding of the weights, same widening of the gradients."""
    check = _CheckWeightCopies()
    cast, t_cast, _ = _train(True, tiny_data, tmp_path / "a", {"bf16_weight_copies": False},
                             precision="bf16-mixed", **options)
    copied, t_copied, _ = _train(True, tiny_data, tmp_path / "b", callbacks=[check], precision="bf16-mixed", **options)
    assert check.checked >= t_copied.global_step > 0
    assert t_copied.global_step == t_cast.global_step > 0
    assert not cast._weight_copies and not copied._weight_copies  # dropped at teardown
    for (name, a), b in zip(cast.named_parameters(), copied.parameters()):
        assert b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    for key in ("val/acc", "val/loss", "train/acc"):
        torch.testing.assert_close(t_copied.callback_metrics[key], t_cast.callback_metrics[key], rtol=0, atol=0)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_graph_mode_steps_do_not_make_the_scheduler_warn_of_a_missing_optimizer_step(precision, tiny_data, tmp_path):
    """The graph-mode step updates the weights with our AdamW kernels (bf16-mixed: from the weight copies), not
    through `optimizer.step()`; PyTorch's LR scheduler must still see the optimizer as stepped, or every graphed fit
    warns "Detected call of `lr_scheduler.step()` before `optimizer.step()`" at its first step."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, trainer, _ = _train(True, tiny_data, tmp_path, precision=precision)
    assert trainer.global_step > 0
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]


def test_cuda_graphs_on_cpu_fall_back_to_eager_with_one_line(tiny_data, tmp_path, caplog):
    model = BertClassifier(config=TINY_BERT, vocab_size=256, num_labels=2, cuda_graphs=True)
    dm = TextClassificationDataModule(dataset=str(tiny_data), tokenizer="sample:sentiment", max_length=48, batch_size=16)
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1,
                         default_root_dir=tmp_path, gradient_clip_val=1.0)
    with caplog.at_level(logging.INFO):
        trainer.fit(model, datamodule=dm)
    lines = [r.getMessage() for r in caplog.records if "model.cuda_graphs" in r.getMessage()]
    assert lines == ["bertaccel: model.cuda_graphs is on, but `fit` runs eager steps: no CUDA device (graphs need an NVIDIA GPU)."]
    assert model.automatic_optimization and trainer.gradient_clip_val == 1.0  # nothing taken over
    assert not dm.static_shapes


def test_compile_modes_that_graph_themselves_are_refused_with_graphs():
    BertClassifier(config=TINY_BERT, vocab_size=50, cuda_graphs=True, compile="default")  # kernels inside the graph
    with pytest.raises(Exception, match="captures CUDA graphs itself"):
        BertClassifier(config=TINY_BERT, vocab_size=50, cuda_graphs=True, compile="reduce-overhead")
    with pytest.raises(Exception, match="compile must be one of"):
        BertClassifier(config=TINY_BERT, vocab_size=50, compile="fast")


def test_graph_mode_keeps_its_gradient_buffers_across_validation(tiny_data, tmp_path):
    """A captured step writes into the gradient buffers it was captured with. Lightning drops
    gradients before validation (set to None): the buffers would be freed and reused while the graph
    kept writing into them (GPU: NaN parameters after the first validation). The step engine keeps
    the same buffers for the whole fit, and a gradient dropped or replaced by someone else is put back."""

    class GradBuffers(Callback):
        def __init__(self):
            self.first, self.same = None, []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            grads = [p.grad for p in pl_module.parameters()]
            if self.first is None:
                self.first = grads
            else:
                self.same.append(all(a is b for a, b in zip(grads, self.first)))
            if trainer.current_epoch == 1 and batch_idx == 1:
                next(pl_module.parameters()).grad = None  # a callback dropping a gradient

    watch = GradBuffers()
    _train(True, tiny_data, tmp_path, callbacks=[watch])
    assert watch.first is not None and all(g is not None for g in watch.first)
    assert len(watch.same) > 4 and all(watch.same), "gradient buffers changed during the fit"


def test_mlm_static_mask_budget_gives_the_dynamic_loss_and_graph_loop_trains_like_eager(tmp_path):
    """The masked-LM under graphs picks masked positions into a fixed budget (nonzero_static): same
    loss, count and accuracy as the data-dependent selection; the graph-mode loop (run eagerly on
    CPU) trains like Lightning's automatic optimization."""
    from bertaccel.data import MLMDataModule
    from bertaccel.modules import BertMLM

    torch.manual_seed(0)
    m = BertMLM(config=TINY_BERT, vocab_size=60).eval()
    ids = torch.randint(5, 60, (4, 32))
    labels = torch.where(torch.rand(ids.shape) < 0.15, ids, torch.full_like(ids, -100))
    dynamic = m.step_outputs(ids, torch.ones_like(ids), labels)
    m.cuda_graphs = True
    static = m.step_outputs(ids, torch.ones_like(ids), labels)
    assert m.mask_budget(128) % 64 == 0 and m.mask_budget(128) >= int((labels != -100).sum())
    for k in ("loss", "count", "correct"):
        torch.testing.assert_close(static[k], dynamic[k])
    assert float(static["dropped_masked"]) == 0

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"the film number {i} was {'good' if i % 2 else 'bad'} and long" for i in range(400)))

    def train(graph_loop: bool):
        pl.seed_everything(4)
        model = BertMLM(config=TINY_BERT, vocab_size=None, lr=3e-3, cuda_graphs=graph_loop)
        model._capture_without_gpu = graph_loop
        dm = MLMDataModule(train_files=[str(corpus)], tokenizer="sample:sentiment", block_size=32, batch_size=8)
        trainer = pl.Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=2,
                             default_root_dir=tmp_path, limit_train_batches=6, limit_val_batches=2)
        trainer.fit(model, datamodule=dm)
        return model, trainer

    eager, te = train(False)
    graph, tg = train(True)
    assert not graph.automatic_optimization and tg.global_step == te.global_step == 12
    for (name, a), b in zip(eager.named_parameters(), graph.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    torch.testing.assert_close(tg.callback_metrics["val/loss"], te.callback_metrics["val/loss"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("options", [{}, {"limit_train_batches": 5, "accumulate_grad_batches": 2},
                                     {"max_steps": 7}, {"limit_train_batches": 0.5}],
                         ids=["plain", "limit-accumulate", "max-steps", "fraction"])
def test_schedule_length_counts_like_lightning(options, tiny_data, tmp_path):
    """The schedule's length is counted from our own loader (so that Lightning sets up the training
    data only after a checkpoint's loop state is restored): it must equal Lightning's own estimate."""

    class Compare(Callback):
        def on_train_start(self, trainer, pl_module):
            self.ours = pl_module._schedule["total_steps"]
            self.lightning = int(trainer.estimated_stepping_batches)

    compare = Compare()
    _train(False, tiny_data, tmp_path, callbacks=[compare], **options)
    assert compare.ours == compare.lightning


def test_graphed_steps_take_ddp_but_not_fsdp():
    """Several processes: DDP's ranks hold whole parameters, so the step (with its own all-reduce) is
    captured; FSDP shards them: eager steps, saying so and naming the strategy that works."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    model = BertClassifier(config=TINY_BERT, vocab_size=256, num_labels=2, cuda_graphs=True)
    model._trainer = SimpleNamespace(world_size=2, strategy=FSDPStrategy(), precision="bf16-mixed", callbacks=[])
    reason = model.graphs_unavailable()
    assert reason and "FSDPStrategy" in reason and "trainer.strategy: ddp" in reason
    model._capture_without_gpu = True  # the GPU checks that come after the strategy's
    assert model.graphs_unavailable() is not None
    model._trainer = SimpleNamespace(world_size=2, strategy=DDPStrategy(), precision="bf16-mixed", callbacks=[])
    assert model.graphs_unavailable() is None


class _UnfreezeEmbeddings(BaseFinetuning):
    """Lightning's fine-tuning callback as its docs use it: the embeddings frozen before training, unfrozen
    into a parameter group of their own at epoch 1."""

    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.model.bert.embeddings)

    def finetune_function(self, pl_module, current_epoch, optimizer):
        if current_epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.model.bert.embeddings, optimizer, initial_denom_lr=4.0)


class _FreezeEncoderLayer(Callback):
    """Freezes the first encoder layer at epoch 1 (its parameters stay in their groups)."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            pl_module.model.bert.encoder.layer[0].requires_grad_(False)


@pytest.mark.parametrize("callback", [_UnfreezeEmbeddings, _FreezeEncoderLayer], ids=["unfreeze", "freeze"])
def test_graph_mode_loop_follows_parameters_frozen_and_unfrozen(callback, tiny_data, tmp_path):
    """BaseFinetuning's added group made the schedule raise at the next step (transformers' LambdaLR, eager fits
    too), and the graph-mode step, built for the parameters trainable at its first step, went on updating only
    those: the unfrozen embeddings never trained. Both now follow the eager fit."""
    fits = {}
    for graph_loop in (False, True):
        model, dm = _model_and_data(graph_loop, tiny_data)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        trainer = _trainer(tmp_path / str(graph_loop), max_epochs=3, callbacks=[callback()])
        trainer.fit(model, datamodule=dm)
        fits[graph_loop] = (model, trainer, before)
    (eager, t_eager, before), (graph, t_graph, _) = fits[False], fits[True]
    assert not graph.automatic_optimization and t_graph.global_step == t_eager.global_step > 0
    for (name, a), b in zip(eager.named_parameters(), graph.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=name)
    lrs = [t.optimizers[0].param_groups[-1]["lr"] for t in (t_eager, t_graph)]
    assert float(lrs[1]) == pytest.approx(float(lrs[0]))
    embeddings = dict(eager.named_parameters())["model.bert.embeddings.word_embeddings.weight"]
    first_layer = dict(eager.named_parameters())["model.bert.encoder.layer.0.output.dense.weight"]
    name = "model.bert.embeddings.word_embeddings.weight" if callback is _UnfreezeEmbeddings else \
        "model.bert.encoder.layer.0.output.dense.weight"
    changed = not torch.equal((embeddings if callback is _UnfreezeEmbeddings else first_layer), before[name])
    assert changed  # unfrozen at epoch 1: trained after; frozen at epoch 1: trained before


def test_graph_mode_loop_follows_weights_a_callback_prunes(tiny_data, tmp_path):
    """Lightning's ModelPruning reparametrizes each pruned weight at an epoch's end (`weight_orig` x `weight_mask`,
    set by a forward pre-hook) and makes it permanent at the fit's end. Under bf16-mixed the graph-mode step swapped
    its bf16 copy into the pruned Linear's `weight` and the pruning hook's assignment raised (TypeError); the
    copies and steps are now built again for the new parameters, and the fit equals the eager one."""
    from lightning.pytorch.callbacks import ModelPruning

    fits = {}
    for graph_loop in (False, True):
        model, dm = _model_and_data(graph_loop, tiny_data)
        pruning = ModelPruning("l1_unstructured", amount=0.3, make_pruning_permanent=True, verbose=0)
        trainer = _trainer(tmp_path / str(graph_loop), max_epochs=3, precision="bf16-mixed", callbacks=[pruning])
        trainer.fit(model, datamodule=dm)
        fits[graph_loop] = (model, trainer)
    (eager, t_eager), (graph, t_graph) = fits[False], fits[True]
    assert not graph.automatic_optimization and t_graph.global_step == t_eager.global_step > 0
    a, b = eager.state_dict(), graph.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-3, atol=1e-4, msg=name)
    weight = a["model.bert.encoder.layer.0.output.dense.weight"]
    assert (weight == 0).float().mean() > 0.25  # pruned, then trained on


class _UnfreezeEmbeddingsFrom1(_UnfreezeEmbeddings):
    """As `_UnfreezeEmbeddings`, written to resume: unfreezes at every epoch from 1 (BaseFinetuning restores the
    added group on resume, not `requires_grad`; the call is a no-op, with Lightning's warning, once they train)."""

    def finetune_function(self, pl_module, current_epoch, optimizer):
        if current_epoch >= 1:
            self.unfreeze_and_add_param_group(pl_module.model.bert.embeddings, optimizer, initial_denom_lr=4.0)


@pytest.mark.parametrize("graph_loop", [False, True], ids=["eager", "graph-mode"])
def test_a_fit_resumed_after_unfreezing_equals_the_straight_fit(graph_loop, tiny_data, tmp_path):
    """The schedule's state holds the added group's base rate, the optimizer the added group (restored by
    BaseFinetuning), the graph-mode step is built for the resumed groups: same weights as the uninterrupted fit."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    model, dm = _model_and_data(graph_loop, tiny_data)
    every_epoch = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_epochs=1, save_top_k=-1, filename="{epoch}")
    _trainer(tmp_path / "a", max_epochs=3, callbacks=[_UnfreezeEmbeddingsFrom1(), every_epoch],
             enable_checkpointing=True).fit(model, datamodule=dm)
    straight = {name: p.detach().clone() for name, p in model.named_parameters()}
    model, dm = _model_and_data(graph_loop, tiny_data)
    trainer = _trainer(tmp_path / "b", max_epochs=3, callbacks=[_UnfreezeEmbeddingsFrom1()])
    trainer.fit(model, datamodule=dm, ckpt_path=tmp_path / "ck" / "epoch=1.ckpt")
    assert len(trainer.optimizers[0].param_groups) == 3
    assert len(trainer.lr_scheduler_configs[0].scheduler.base_lrs) == 3
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, straight[name], rtol=1e-4, atol=1e-5, msg=name)


def test_graph_mode_step_is_built_on_pruned_weights_without_their_pruning_autograd(tiny_data, tmp_path):
    """The masked weight torch's pruning leaves on a module holds the autograd graph it was computed with (on the
    GPU: a gradient-accumulation node of the default stream, and the training step's capture failed). The
    graph-mode step recomputes it without autograd before it is built: same values, no graph."""
    from torch.nn.utils import prune

    model, dm = _model_and_data(True, tiny_data)
    dense = model.model.bert.encoder.layer[0].output.dense
    prune.l1_unstructured(dense, "weight", amount=0.3)
    before = dense.weight.detach().clone()
    assert dense.weight.grad_fn is not None
    model._drop_pruning_autograd()
    assert dense.weight.grad_fn is None and torch.equal(dense.weight, before)
    orig = dense.weight_orig.detach().clone()
    trainer = _trainer(tmp_path, max_epochs=1)
    trainer.fit(model, datamodule=dm)  # trains through the pruned weight (its hook recomputes it each forward)
    assert not torch.equal(dense.weight_orig.detach(), orig)
    assert torch.equal(dense.weight.detach() == 0, dense.weight_mask == 0)


class _GradientNormLogger(Callback):
    """A user's gradient-norm logger where Lightning's docs put one (`on_before_optimizer_step`), counting the
    other hooks Lightning calls between a step's forward and its update."""

    def __init__(self):
        self.calls = {"on_before_backward": 0, "on_after_backward": 0, "on_before_zero_grad": 0}
        self.norms = []

    def on_before_backward(self, trainer, pl_module, loss):
        self.calls["on_before_backward"] += 1

    def on_after_backward(self, trainer, pl_module):
        self.calls["on_after_backward"] += 1

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.norms.append(float(sum(p.grad.norm() ** 2 for p in pl_module.parameters() if p.grad is not None)))

    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        self.calls["on_before_zero_grad"] += 1


class _HookedClassifier(BertClassifier):
    def on_after_backward(self):
        self.after_backward_calls = getattr(self, "after_backward_calls", 0) + 1


class _OwnOptimizerStep(BertClassifier):
    """A manual learning-rate warm-up where Lightning's docs put one."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        self.optimizer_steps = getattr(self, "optimizer_steps", 0) + 1
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)


def test_hooks_inside_the_step_take_eager_steps_saying_why(tiny_data, tmp_path, caplog):
    """A graphed step runs backward and update inside one graph, so Lightning's hooks between them never ran: a
    gradient-norm logger in `on_before_optimizer_step` logged nothing, silently. A callback or module that overrides
    one of them now makes the fit take eager steps, saying which hook."""
    logger = _GradientNormLogger()
    with caplog.at_level(logging.INFO):
        model, trainer, _ = _train(True, tiny_data, tmp_path / "cb", callbacks=[logger], max_epochs=1)
    assert model.automatic_optimization and trainer.global_step == 8
    assert len(logger.norms) == 8 and all(n > 0 for n in logger.norms)
    assert logger.calls == {"on_before_backward": 8, "on_after_backward": 8, "on_before_zero_grad": 8}
    assert any("runs eager steps: _GradientNormLogger.on_before_backward hooks into the step" in r.getMessage()
               for r in caplog.records)
    hooked, trainer, _ = _train(True, tiny_data, tmp_path / "module", module_class=_HookedClassifier, max_epochs=1)
    assert hooked.automatic_optimization and hooked.after_backward_calls == 8
    stepped, trainer, _ = _train(True, tiny_data, tmp_path / "step", module_class=_OwnOptimizerStep, max_epochs=1)
    assert stepped.automatic_optimization and stepped.optimizer_steps == 8
    from bertaccel.callbacks.profiler import ProfilerCallback
    from bertaccel.callbacks.throughput import ThroughputMeter

    # the product's own callbacks (the profiler hooks into the step, off unless enabled, saying so itself): graphed
    plain, _, _ = _train(True, tiny_data, tmp_path / "plain", max_epochs=1,
                         callbacks=[ProfilerCallback(enabled=False), ThroughputMeter(enabled=True)])
    assert not plain.automatic_optimization


class _OwnTrainingStep(BertClassifier):
    """A user's subclass with a training step of its own (not calling the module's)."""

    def training_step(self, batch, batch_idx):
        out = self.step_outputs(**self.step_inputs(batch))
        self.log("own/loss", out["loss"])
        return out["loss"]


def test_an_overridden_training_step_takes_eager_steps_saying_why(tiny_data, tmp_path, caplog):
    """A graphed fit is manual optimization to Lightning, the update inside the module's captured step: a subclass's
    own training_step returned its loss and nothing stepped (global_step 0, weights unchanged, silently). It now runs
    eagerly, saying why, and trains as in an eager fit."""
    eager, t_eager, _ = _train(False, tiny_data, tmp_path / "e", module_class=_OwnTrainingStep, max_epochs=1)
    with caplog.at_level(logging.INFO):
        graph, t_graph, _ = _train(True, tiny_data, tmp_path / "g", module_class=_OwnTrainingStep, max_epochs=1)
    assert graph.automatic_optimization and t_graph.global_step == t_eager.global_step == 8
    assert any("runs eager steps: _OwnTrainingStep overrides training_step" in r.getMessage() for r in caplog.records)
    for (name, a), b in zip(eager.named_parameters(), graph.parameters()):
        torch.testing.assert_close(b, a, msg=name)


def _logged(root, key: str) -> list[tuple[int, float]]:
    import csv

    (path,) = list(root.rglob("metrics.csv"))
    with open(path) as f:
        return [(int(r["step"]), float(r[key])) for r in csv.DictReader(f) if r.get(key)]


@pytest.mark.parametrize("options", [{}, {"accumulate_grad_batches": 2}, {"gradient_clip_val": 0.05}],
                         ids=["plain", "accumulate", "clip"])
def test_gradient_norm_is_logged_alike_by_eager_and_graphed_steps(options, tiny_data, tmp_path):
    """`model.log_grad_norm`: graphed steps compute the norm inside the step (a hook in `on_before_optimizer_step`
    would make them eager) and log the window's mean at the logging steps, as eager steps do from
    `on_before_optimizer_step`: same steps, same values (before clipping, after accumulation). Under accumulation
    the graphed fit's loggers counted every micro-batch as a step (steps 1, 3, ..., 15 for eager's 1, 3, 5, 7 at
    accumulation 2, and a row at each micro-batch): the rows are now the eager fit's, train/loss too."""
    from lightning.pytorch.loggers import CSVLogger

    logged = {}
    for graph_loop in (False, True):
        model, dm = _model_and_data(graph_loop, tiny_data, {"log_grad_norm": True})
        root = tmp_path / str(graph_loop)
        trainer = _trainer(root, max_epochs=2, log_every_n_steps=2, logger=CSVLogger(root), **options)
        trainer.fit(model, datamodule=dm)
        assert model.automatic_optimization is not graph_loop
        logged[graph_loop] = {key: _logged(root, key) for key in ("train/grad_norm", "train/loss")}
        assert trainer.fit_loop.epoch_loop._batches_that_stepped == trainer.global_step
    for key in ("train/grad_norm", "train/loss"):
        eager, graph = logged[False][key], logged[True][key]
        assert len(eager) >= 3 and [s for s, _ in graph] == [s for s, _ in eager], key
        assert all(v > 0 for _, v in eager)
        assert [v for _, v in graph] == pytest.approx([v for _, v in eager], rel=1e-4), key


class _BatchLosses(Callback):
    """Each training batch's loss, Lightning's count of batches that stepped when it began, and whether it updated."""

    def __init__(self):
        self.rows = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._stepped = trainer.fit_loop.epoch_loop._batches_that_stepped

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        updated = trainer.fit_loop.epoch_loop._batches_that_stepped != self._stepped or not trainer.fit_loop._should_accumulate()
        # Lightning hands over the loss it differentiates: divided by the accumulation (2 in the test below; a graphed
        # fit's trainer reads 1 while the module runs it)
        self.rows.append((self._stepped, float(outputs["loss"]) * 2, updated))


@pytest.mark.parametrize("graph_loop", [False, True], ids=["eager", "graph-mode"])
def test_logged_loss_under_accumulation_is_the_mean_of_the_window(graph_loop, tiny_data, tmp_path):
    """Under gradient accumulation the loss window was read at each micro-batch of a logging step and Lightning
    wrote the last read: the logged train/loss was the last micro-batch's loss alone. It is read at the batch that
    updates: the mean of every batch since the previous log (the first step logs its own). And the callbacks'
    `outputs["loss"]` is the loss divided by the accumulation in both modes (Lightning's automatic loop hands that
    over; graphed steps handed the undivided loss)."""
    from lightning.pytorch.loggers import CSVLogger

    model, dm = _model_and_data(graph_loop, tiny_data)
    spy = _BatchLosses()
    trainer = _trainer(tmp_path, max_epochs=2, log_every_n_steps=2, logger=CSVLogger(tmp_path),
                       accumulate_grad_batches=2, callbacks=[spy])
    trainer.fit(model, datamodule=dm)
    expected, window = [], []
    for i, (stepped, loss, updated) in enumerate(spy.rows):
        if window and updated and (stepped + 1) % 2 == 0:  # read before this batch's own loss joins
            expected.append((stepped, sum(window) / len(window)))
            window = []
        window.append(loss)
        if i == 0:  # the fit's first step reads its own loss (shown, not written: step 0 is no logging step)
            window = []
    logged = _logged(tmp_path, "train/loss")
    assert len(logged) >= 3 and [s for s, _ in logged] == [s for s, _ in expected]
    assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=1e-5)
