"""Whole-step CUDA graphs on the GPU: graphed training equals eager training, dropout draws new
masks each replay, one capture per batch shape, flat memory, resume, and no host syncs per step."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch import Callback  # noqa: E402
from lightning.pytorch.callbacks import BaseFinetuning  # noqa: E402

from bertaccel.data import TextClassificationDataModule  # noqa: E402
from bertaccel.modules import BertClassifier  # noqa: E402
from bertaccel.modules.graphs import StepGraphs  # noqa: E402
from tests.conftest import TINY_BERT  # noqa: E402

SMALL = {**TINY_BERT, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128}


def fit(tiny_data, tmp_path, graphs: bool, dropout: float = 0.0, ckpt_path=None, callbacks=(), precision="bf16-mixed",
        model_kw=None, **kw):
    pl.seed_everything(5)
    cfg = {**SMALL, "hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
    model = BertClassifier(config=cfg, vocab_size=256, num_labels=2, lr=2e-3, cuda_graphs=graphs, **(model_kw or {}))
    dm = TextClassificationDataModule(dataset=str(tiny_data), tokenizer="sample:sentiment", max_length=48,
                                      batch_size=16, val_size=0.2, static_shapes=True, length_buckets=16)
    args = dict(accelerator="gpu", devices=1, precision=precision, max_epochs=3, logger=False,
                enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=4,
                default_root_dir=tmp_path, callbacks=list(callbacks))
    args.update(kw)
    trainer = pl.Trainer(**args)
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model, trainer


def assert_same_training(a: torch.nn.Module, b: torch.nn.Module, init: dict[str, torch.Tensor], tol: float = 0.05):
    """Same parameters up to bf16 noise: Adam turns tiny gradient differences on near-zero gradients
    into full-size updates, so compare the difference with the size of the training's update."""
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        if name.endswith("attention.self.key.bias"):
            # softmax is invariant to the key bias (it adds q.b_k to a whole row of scores): its exact
            # gradient is 0, so its update is pure rounding noise amplified by Adam; nothing to compare
            continue
        assert torch.isfinite(pa).all() and torch.isfinite(pb).all(), f"{name}: not finite (a: {torch.isfinite(pa).all()})"
        update = (pa.detach().float() - init[name].to(pa.device)).norm()
        diff = (pa.detach().float() - pb.detach().float()).norm()
        assert diff <= tol * update + 1e-6, f"{name}: |a-b| {diff:.3g} vs update {update:.3g}"


def initial_parameters() -> dict[str, torch.Tensor]:
    pl.seed_everything(5)
    cfg = {**SMALL, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    m = BertClassifier(config=cfg, vocab_size=256, num_labels=2)
    return {k: v.detach().float().clone() for k, v in m.named_parameters()}


def test_graphed_training_equals_eager_training(tiny_data, tmp_path):
    init = initial_parameters()
    # fp32: the comparison measures the step engine, not bf16 rounding amplified by Adam
    eager, te = fit(tiny_data, tmp_path / "e", graphs=False, precision="32-true")
    graphed, tg = fit(tiny_data, tmp_path / "g", graphs=True, precision="32-true")
    eager_clip, _ = fit(tiny_data, tmp_path / "c", graphs=False, gradient_clip_val=0.5, precision="32-true")
    graphed_clip, _ = fit(tiny_data, tmp_path / "gc", graphs=True, gradient_clip_val=0.5, precision="32-true")
    bf16_eager, tbe = fit(tiny_data, tmp_path / "be", graphs=False)
    bf16_graphed, tbg = fit(tiny_data, tmp_path / "bg", graphs=True)
    torch.testing.assert_close(tbg.callback_metrics["val/loss"], tbe.callback_metrics["val/loss"], rtol=5e-2, atol=5e-2)
    assert_same_training(bf16_eager, bf16_graphed, init, tol=0.25)
    assert not graphed.automatic_optimization
    stats = graphed.graph_stats()
    assert stats["train"]["disabled"] is None and stats["train"]["replays"] > stats["train"]["eager_steps"]
    assert stats["eval"]["disabled"] is None and stats["eval"]["replays"] > 0
    assert tg.global_step == te.global_step
    assert_same_training(eager, graphed, init)
    assert_same_training(eager_clip, graphed_clip, init)
    torch.testing.assert_close(tg.callback_metrics["val/loss"], te.callback_metrics["val/loss"], rtol=5e-2, atol=5e-2)


def test_captured_bf16_weight_copies_train_like_autocast_casts(tiny_data, tmp_path):
    """The captured bf16-mixed step with bf16 weight copies (the default) against the same captured
    step with autocast casting the fp32 weights: the same training up to kernel-order noise."""
    init = initial_parameters()
    cast, t_cast = fit(tiny_data, tmp_path / "a", graphs=True, model_kw={"bf16_weight_copies": False})
    copied, t_copied = fit(tiny_data, tmp_path / "b", graphs=True)
    for model in (cast, copied):
        stats = model.graph_stats()
        assert stats["train"]["disabled"] is None and stats["train"]["replays"] > stats["train"]["eager_steps"]
    assert all(p.dtype == torch.float32 for p in copied.parameters())
    assert_same_training(cast, copied, init, tol=0.05)
    torch.testing.assert_close(t_copied.callback_metrics["val/loss"], t_cast.callback_metrics["val/loss"], rtol=1e-2, atol=1e-2)


def test_graphed_step_with_every_parameter_in_our_adamw_trains_like_pytorchs(tiny_data, tmp_path, monkeypatch):
    """By default (BERTACCEL_ADAMW_ALL=0 turns it off) the graphed bf16-mixed step updates the uncopied parameters (embeddings, LayerNorms,
    biases) with `bertaccel::adamw_` instead of PyTorch's fused AdamW: the same training up to kernel-order noise,
    and the optimizer's state holds their moments and step counts as PyTorch's would."""
    init = initial_parameters()
    monkeypatch.setenv("BERTACCEL_ADAMW_ALL", "0")
    theirs, t_theirs = fit(tiny_data, tmp_path / "a", graphs=True)
    monkeypatch.delenv("BERTACCEL_ADAMW_ALL")  # the default
    ours, t_ours = fit(tiny_data, tmp_path / "b", graphs=True)
    stats = ours.graph_stats()
    assert stats["train"]["disabled"] is None and stats["train"]["replays"] > stats["train"]["eager_steps"]
    assert_same_training(theirs, ours, init, tol=0.05)
    torch.testing.assert_close(t_ours.callback_metrics["val/loss"], t_theirs.callback_metrics["val/loss"], rtol=1e-2, atol=1e-2)
    st_ours = t_ours.optimizers[0].state[ours.model.bert.embeddings.word_embeddings.weight]
    st_theirs = t_theirs.optimizers[0].state[theirs.model.bert.embeddings.word_embeddings.weight]
    assert float(st_ours["step"]) == float(st_theirs["step"]) > 0 and st_ours["exp_avg_sq"].abs().sum() > 0


def test_dropout_draws_new_masks_each_replay():
    runner = StepGraphs("t", warmup=1)
    x = torch.ones(4096, device="cuda")

    def step(x):
        return {"y": torch.nn.functional.dropout(x, 0.5, training=True)}

    outs = [runner.run(("k",), step, {"x": x})["y"].clone() for _ in range(4)]
    assert runner.stats.captured == [("k",)] and runner.stats.replays == 3
    assert not torch.equal(outs[2], outs[3]) and not torch.equal(outs[1], outs[2])
    assert abs(outs[3].count_nonzero().item() / 4096 - 0.5) < 0.05


def test_each_bucket_is_captured_once_and_memory_stays_flat():
    runner = StepGraphs("t", warmup=1)
    w = torch.randn(64, 64, device="cuda", requires_grad=True)

    def step(x):
        y = (x @ w).relu().sum()
        return {"y": y.detach()}

    shapes = [(8, 64), (16, 64), (8, 64), (32, 64)]
    for _ in range(3):
        for s in shapes:
            runner.run(("k", s), step, {"x": torch.randn(s, device="cuda")})
    assert sorted(runner.stats.captured) == sorted({("k", s) for s in shapes})
    x = torch.randn(16, 64, device="cuda")
    runner.run(("k", (16, 64)), step, {"x": x})
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(500):
        runner.run(("k", (16, 64)), step, {"x": x})
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


def test_later_shapes_are_captured_without_an_eager_step():
    """`later_warmup=0`: after the first key, a new shape is captured on its first batch (no eager step);
    a shape whose capture fails then (a lazy per-shape setup that synchronizes, say) gets its eager
    step and is captured on its next batch, and graphs stay on."""
    runner = StepGraphs("t", warmup=1, later_warmup=0)
    w = torch.randn(64, 64, device="cuda")
    set_up: set = set()

    def step(x):
        if x.shape[0] == 32 and x.shape not in set_up:
            set_up.add(x.shape)
            torch.cuda.synchronize()  # not allowed while capturing
        keep = torch.rand(x.shape[1], device="cuda") >= 0  # RNG in the step: usable after a failed capture
        return {"y": (x @ w).relu().sum(0) * keep}

    def run(n):
        x = torch.randn(n, 64, device="cuda")
        out = runner.run(("k", n), step, {"x": x})["y"].clone()
        torch.testing.assert_close(out, (x @ w).relu().sum(0))

    run(8)  # the first key: one eager step
    run(8)  # captured
    assert runner.stats.eager_steps == 1 and runner.stats.captured == [("k", 8)]
    run(16)  # a new shape: captured at once
    assert runner.stats.eager_steps == 1 and ("k", 16) in runner.stats.captured
    run(32)  # its capture fails: an eager step instead, graphs stay on
    assert runner.stats.eager_steps == 2 and runner.disabled_reason is None
    run(32)  # captured on its next batch
    assert ("k", 32) in runner.stats.captured and runner.disabled_reason is None
    for n in (8, 16, 32):
        run(n)
    assert runner.stats.eager_steps == 2
    torch.nn.functional.dropout(torch.ones(8, device="cuda"), 0.5)  # the generator left capture mode


def test_after_a_failed_capture_the_eager_steps_draw_random_numbers():
    """A capture that fails (the step reads the host) turns graphs off; the eager steps after it use
    dropout: PyTorch's generator must have left capture mode ("Offset increment outside graph capture")."""
    runner = StepGraphs("t", warmup=1)
    x = torch.ones(4096, device="cuda")

    def step(x):
        y = torch.nn.functional.dropout(x, 0.5, training=True)
        y.sum().item()  # a host read: cannot be captured
        return {"y": y}

    outs = [runner.run(("k",), step, {"x": x})["y"].clone() for _ in range(3)]
    assert runner.disabled_reason is not None and runner.stats.eager_steps == 3
    assert not torch.equal(outs[1], outs[2])


def test_graphed_fit_memory_is_flat_over_many_replays(tiny_data, tmp_path):
    class Memory(Callback):
        def __init__(self):
            self.seen = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.seen.append(torch.cuda.memory_allocated())

    mem = Memory()
    model, trainer = fit(tiny_data, tmp_path, graphs=True, dropout=0.1, max_epochs=70, callbacks=[mem],
                         limit_val_batches=0, num_sanity_val_steps=0)
    assert len(mem.seen) >= 500
    # batches of different length buckets differ by a few KB of input; nothing grows
    assert max(mem.seen[-100:]) <= max(mem.seen[100:200])


def test_resume_under_graphs_reaches_the_straight_run(tiny_data, tmp_path):
    init = initial_parameters()
    from lightning.pytorch.callbacks import ModelCheckpoint

    every_epoch = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_epochs=1, filename="e{epoch}",
                                  auto_insert_metric_name=False)
    straight, t1 = fit(tiny_data, tmp_path / "s", graphs=True, max_epochs=2, callbacks=[every_epoch], precision="32-true")
    ckpt = tmp_path / "ckpt" / "e0.ckpt"  # after epoch 0 of the same 2-epoch schedule
    state = torch.load(ckpt, weights_only=True)
    assert all(isinstance(g["lr"], float) for g in state["optimizer_states"][0]["param_groups"])
    resumed, t3 = fit(tiny_data, tmp_path / "r", graphs=True, max_epochs=2, ckpt_path=str(ckpt), precision="32-true")
    assert t3.global_step == t1.global_step
    sched_1 = t1.lr_scheduler_configs[0].scheduler.get_last_lr()
    sched_3 = t3.lr_scheduler_configs[0].scheduler.get_last_lr()
    assert [float(v) for v in sched_3] == pytest.approx([float(v) for v in sched_1])
    assert_same_training(straight, resumed, init)


def test_graphed_steps_do_not_synchronize_with_the_host(tiny_data, tmp_path):
    """Between log steps a graphed training step reads nothing back from the GPU."""
    import warnings

    class SyncWatch(Callback):
        """Watches from one batch start to the next: the step, Lightning's bookkeeping, the next fetch."""

        def __init__(self):
            self.syncs, self._open = {}, None

        def _close(self):
            if self._open is not None:
                idx, ctx, caught = self._open
                torch.cuda.set_sync_debug_mode("default")
                ctx.__exit__(None, None, None)
                self.syncs[idx] = [str(w.message)[:160] for w in caught
                                   if "synchroniz" in str(w.message).lower() and "prototype" not in str(w.message)]
                self._open = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._close()
            if trainer.current_epoch == 1:
                ctx = warnings.catch_warnings(record=True)
                caught = ctx.__enter__()
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                self._open = (batch_idx, ctx, caught)

        def on_train_epoch_end(self, trainer, pl_module):
            self._close()

    watch = SyncWatch()
    fit(tiny_data, tmp_path, graphs=True, max_epochs=2, callbacks=[watch], log_every_n_steps=1000,
        limit_val_batches=0, num_sanity_val_steps=0)
    assert watch.syncs, "no steady-state steps watched"
    steps = sorted(watch.syncs)[:-1]  # the last window holds the epoch's end (metrics read once)
    offending = {i: watch.syncs[i] for i in steps if watch.syncs[i]}
    assert not offending, offending


def test_compiled_model_inside_the_step_graph_trains_like_eager(tiny_data, tmp_path):
    """compile: default + cuda_graphs: inductor's kernels captured in the whole-step graph."""
    init = initial_parameters()
    eager, te = fit(tiny_data, tmp_path / "e", graphs=False, precision="32-true")
    pl.seed_everything(5)
    cfg = {**SMALL, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    model = BertClassifier(config=cfg, vocab_size=256, num_labels=2, lr=2e-3, cuda_graphs=True, compile="default")
    dm = TextClassificationDataModule(dataset=str(tiny_data), tokenizer="sample:sentiment", max_length=48,
                                      batch_size=16, val_size=0.2, static_shapes=True, length_buckets=16)
    trainer = pl.Trainer(accelerator="gpu", devices=1, precision="32-true", max_epochs=3, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=4,
                         default_root_dir=tmp_path / "c")
    trainer.fit(model, datamodule=dm)
    stats = model.graph_stats()
    assert stats["train"]["disabled"] is None and stats["train"]["replays"] > 0
    assert trainer.global_step == te.global_step
    # inductor's fusions round differently from eager kernels: compare as the bf16 runs are compared
    assert_same_training(eager, model, init, tol=0.25)


def test_compiled_dropout_draws_new_masks_each_replay():
    runner = StepGraphs("t", warmup=2)
    x = torch.ones(4096, device="cuda")
    f = torch.compile(lambda x: torch.nn.functional.dropout(x * 2, 0.5, training=True), dynamic=False)

    def step(x):
        return {"y": f(x)}

    outs = [runner.run(("k",), step, {"x": x})["y"].clone() for _ in range(5)]
    assert runner.stats.captured == [("k",)] and runner.stats.replays == 3
    assert not torch.equal(outs[3], outs[4]) and not torch.equal(outs[2], outs[3])
    assert abs(outs[4].count_nonzero().item() / 4096 - 0.5) < 0.05


def test_graphed_mlm_trains_like_eager(tmp_path):
    """The masked-LM under graphs (static mask budget) against eager steps, fp32, dropout off.
    (Written without a GPU at hand: first run pending.)"""
    from bertaccel.data import MLMDataModule
    from bertaccel.modules import BertMLM

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"the film number {i} was {'good' if i % 2 else 'bad'} and long" for i in range(600)))

    def run(graphs: bool):
        pl.seed_everything(4)
        model = BertMLM(config={**SMALL, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
                        lr=2e-3, cuda_graphs=graphs)
        dm = MLMDataModule(train_files=[str(corpus)], tokenizer="sample:sentiment", block_size=32, batch_size=8)
        trainer = pl.Trainer(accelerator="gpu", devices=1, precision="32-true", max_epochs=2, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                             default_root_dir=tmp_path, limit_val_batches=3)
        trainer.fit(model, datamodule=dm)
        return model, trainer

    eager, te = run(False)
    graphed, tg = run(True)
    stats = graphed.graph_stats()
    assert stats["train"]["disabled"] is None and stats["train"]["replays"] > 0
    assert tg.global_step == te.global_step
    pl.seed_everything(4)
    init_model = BertMLM(config={**SMALL, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0})
    init = {k: v.detach().float().clone() for k, v in init_model.named_parameters()}
    assert_same_training(eager, graphed, init, tol=0.1)
    torch.testing.assert_close(tg.callback_metrics["val/loss"], te.callback_metrics["val/loss"], rtol=5e-2, atol=5e-2)


class _UnfreezeEmbeddingsAtEpoch1(BaseFinetuning):
    """Lightning's fine-tuning callback: embeddings frozen before training, unfrozen into their own parameter
    group at epoch 1, when the first encoder layer is frozen."""

    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.model.bert.embeddings)

    def finetune_function(self, pl_module, current_epoch, optimizer):
        if current_epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.model.bert.embeddings, optimizer, initial_denom_lr=4.0)
            pl_module.model.bert.encoder.layer[0].requires_grad_(False)


def test_graphed_fit_follows_parameters_frozen_and_unfrozen(tiny_data, tmp_path):
    """A captured step replays the backward and update it was captured with: after BaseFinetuning unfroze the
    embeddings (a new parameter group) and a layer was frozen, the graphs must be captured again, or the
    embeddings never train and the frozen layer goes on training."""
    init = initial_parameters()
    eager, te = fit(tiny_data, tmp_path / "e", graphs=False, precision="32-true", callbacks=[_UnfreezeEmbeddingsAtEpoch1()])
    graphed, tg = fit(tiny_data, tmp_path / "g", graphs=True, precision="32-true", callbacks=[_UnfreezeEmbeddingsAtEpoch1()])
    assert not graphed.automatic_optimization and tg.global_step == te.global_step
    assert graphed.graph_stats()["train"]["replays"] > 0
    assert_same_training(eager, graphed, init)
    emb = "model.bert.embeddings.word_embeddings.weight"
    assert not torch.equal(dict(graphed.named_parameters())[emb].detach().float().cpu(), init[emb].cpu())


def test_graphed_fit_follows_weights_a_callback_prunes(tiny_data, tmp_path):
    """ModelPruning reparametrizes weights at each epoch's end (a forward pre-hook sets weight = weight_orig x
    mask, a new mask buffer each time): the graphs and bf16 copies are built again for the new parameters and
    buffers. The training step's capture failed at 6609195 (the masked weight ModelPruning leaves on the module kept
    an autograd node of the default stream alive) and the training steps ran eagerly; the step is now built on the
    pruned weights recomputed without autograd, and stays graphed. In fp32 the fit trains like the eager one; under bf16-mixed (the copy swapped into the pruned
    Linear made the hook raise) it runs, prunes and validates like it - not weight for weight: bf16 rounding moves
    which weights are the smallest 30%."""
    from lightning.pytorch.callbacks import ModelPruning

    init = initial_parameters()
    runs = {}
    for precision in ("32-true", "bf16-mixed"):
        for graphs in (False, True):
            pruning = ModelPruning("l1_unstructured", amount=0.3, make_pruning_permanent=True, verbose=0)
            runs[precision, graphs] = fit(tiny_data, tmp_path / f"{precision}{graphs}", graphs=graphs,
                                          precision=precision, callbacks=[pruning])
    (eager, te), (graphed, tg) = runs["32-true", False], runs["32-true", True]
    assert not graphed.automatic_optimization and tg.global_step == te.global_step
    assert graphed.graph_stats()["eval"]["disabled"] is None  # the evaluation steps stay graphed
    assert graphed.graph_stats()["train"]["disabled"] is None  # and the training steps
    assert_same_training(eager, graphed, init)
    torch.testing.assert_close(tg.callback_metrics["val/loss"], te.callback_metrics["val/loss"], rtol=1e-3, atol=1e-4)
    (_, tbe), (bf16_graphed, tbg) = runs["bf16-mixed", False], runs["bf16-mixed", True]
    assert tbg.global_step == tbe.global_step
    torch.testing.assert_close(tbg.callback_metrics["val/loss"], tbe.callback_metrics["val/loss"], rtol=5e-2, atol=5e-2)
    for model in (graphed, bf16_graphed):
        weight = dict(model.named_parameters())["model.bert.encoder.layer.0.output.dense.weight"]
        assert (weight == 0).float().mean() > 0.25


class _AssignLearningRates(Callback):
    """Assigns each group's learning rate as a float at epoch 1 (as BackboneFinetuning does for the backbone's
    group each epoch, or `group["lr"] = value` in a user's callback): harmless in an eager fit."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            for group in trainer.optimizers[0].param_groups:
                group["lr"] = float(group["lr"])


def test_graphed_fit_follows_learning_rates_assigned_as_floats(tiny_data, tmp_path):
    """The captured update reads each group's learning-rate tensor; a float assigned in its place (and the floats
    the scheduler then assigns, having no tensor to fill) left the graph reading the old tensor: the rate frozen
    for the rest of the fit. The tensors are put back, with the assigned value, before each step."""
    init = initial_parameters()
    eager, te = fit(tiny_data, tmp_path / "e", graphs=False, precision="32-true", callbacks=[_AssignLearningRates()])
    graphed, tg = fit(tiny_data, tmp_path / "g", graphs=True, precision="32-true", callbacks=[_AssignLearningRates()])
    assert not graphed.automatic_optimization and tg.global_step == te.global_step
    assert all(isinstance(g["lr"], torch.Tensor) for g in tg.optimizers[0].param_groups)
    assert [float(g["lr"]) for g in tg.optimizers[0].param_groups] == pytest.approx(
        [float(g["lr"]) for g in te.optimizers[0].param_groups])
    assert_same_training(eager, graphed, init)


def test_graphed_fit_logs_the_gradient_norm_the_eager_fit_logs(tiny_data, tmp_path):
    """`model.log_grad_norm` computed inside the captured step (no host read) gives the eager fit's logged rows."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    rows = {}
    for graphs in (False, True):
        root = tmp_path / str(graphs)
        fit(tiny_data, root, graphs=graphs, precision="32-true", model_kw={"log_grad_norm": True},
            logger=CSVLogger(root), accumulate_grad_batches=2)
        (path,) = list(root.rglob("metrics.csv"))
        with open(path) as f:
            rows[graphs] = [(int(r["step"]), float(r["train/grad_norm"])) for r in csv.DictReader(f) if r.get("train/grad_norm")]
    assert len(rows[False]) >= 2 and [s for s, _ in rows[True]] == [s for s, _ in rows[False]]
    assert [v for _, v in rows[True]] == pytest.approx([v for _, v in rows[False]], rel=2e-2)


def test_graphed_bf16_fit_follows_weights_a_callback_clamps_between_steps(tiny_data, tmp_path):
    """A callback clamping every Linear weight in place after each training batch: the graphed bf16-mixed fit's
    steps see the clamped weights (the bf16 copies are refreshed when the masters' version counters moved), so it
    trains like the eager fit, both clamped; the training steps stay graphed."""
    from tests.modules.test_step_engine import _ClampLinearWeights

    init = initial_parameters()
    (eager, te), (graphed, tg) = (fit(tiny_data, tmp_path / str(g), graphs=g, callbacks=[_ClampLinearWeights()])
                                  for g in (False, True))
    assert graphed.graph_stats()["train"]["disabled"] is None and graphed.graph_stats()["train"]["replays"] > 0
    assert tg.global_step == te.global_step
    for model in (eager, graphed):
        assert float(model.model.bert.encoder.layer[0].output.dense.weight.abs().max()) <= 0.02
    assert_same_training(eager, graphed, init)
