"""FLOP count vs torch.utils.flop_counter, the throughput meter's token counts, profiler outputs."""

from __future__ import annotations

import json

import pytest

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import BertConfig, BertForSequenceClassification

from bertaccel.callbacks.profiler import CATEGORY_NAMES, categorize
from bertaccel.cli import BertAccelCLI
from bertaccel.modules.flops import bert_step_flops, bert_step_flops_unpadded


def test_flop_formula_matches_torch_flop_counter():
    cfg = BertConfig(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=256, max_position_embeddings=128, num_labels=3)
    model = BertForSequenceClassification(cfg)
    model.set_attn_implementation("eager")
    ids = torch.randint(0, 500, (4, 96))
    with FlopCounterMode(display=False) as fc:
        model(input_ids=ids).logits.sum().backward()
    counted = fc.get_total_flops()
    ours = bert_step_flops(cfg, 4, 96, training=True)
    assert abs(ours - counted) / counted < 0.02, (ours, counted)


def test_unpadded_flops_count_attention_per_sequence():
    """The unpadded step's FLOPs: projections on the packed rows, attention within each sequence
    (sum of length^2) when the varlen kernels run it, the padded square without them."""
    cfg = BertConfig(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=256, max_position_embeddings=128, num_labels=3)
    full = bert_step_flops_unpadded(cfg, 4, 96, 4 * 96, attention_pairs=4 * 96 * 96)
    assert full == bert_step_flops(cfg, 4, 96) == bert_step_flops_unpadded(cfg, 4, 96, 4 * 96)
    lengths = torch.tensor([3, 96, 0, 40])
    packed = bert_step_flops_unpadded(cfg, 4, 96, int(lengths.sum()), attention_pairs=lengths.double().square().sum())
    padded_attention = bert_step_flops_unpadded(cfg, 4, 96, int(lengths.sum()))
    H, L = cfg.hidden_size, cfg.num_hidden_layers
    assert float(padded_attention - packed) == 3 * L * 4 * H * (4 * 96 * 96 - (9 + 96 * 96 + 40 * 40))


def _fit_tiny_with_meter(tiny_data, tmp_path, callbacks, warmup_steps, **trainer_args):
    """Fit the tiny classifier on tiny_data with a ThroughputMeter first among `callbacks`; the meter."""
    import lightning.pytorch as pl

    from bertaccel.callbacks.throughput import ThroughputMeter
    from bertaccel.data import TextClassificationDataModule
    from bertaccel.modules import BertClassifier
    from tests.conftest import TINY_BERT

    pl.seed_everything(1)
    meter = ThroughputMeter(enabled=True, warmup_steps=warmup_steps)
    model = BertClassifier(config=TINY_BERT, vocab_size=256, num_labels=2)
    dm = TextClassificationDataModule(dataset=str(tiny_data), tokenizer="sample:sentiment", max_length=32,
                                      batch_size=16, val_size=0.2)
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path, callbacks=[meter, *callbacks],
                         **trainer_args)
    trainer.fit(model, datamodule=dm)
    return meter


def test_kernel_categories_cover_real_kernel_names():
    names = {
        "nvjet_sm90_tst_96x128_64x6_2x1_v_bz_NNN": "gemm",
        "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_bf16_256x64_32x4_nn_align2>": "gemm",
        "pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>": "attention",
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16>": "layernorm",
        "void bertaccel::(anonymous namespace)::bias_gelu_fwd_kernel<__nv_bfloat16, 8>": "gelu/activation",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4>": "softmax",
        "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer",
        "Memcpy HtoD (Pageable -> Device)": "memcpy/memset",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>": "elementwise",
        "void at::native::reduce_kernel<512, 1, ReduceOp<float, func_wrapper_t<float, sum_functor>>>": "reduction",
        "some_unknown_kernel": "other",
        # bertaccel's fused varlen attention (was "other" in the e2e profile of 8186c86)
        "void bertaccel::(anonymous namespace)::attn_bwd_kernel<__nv_bfloat16, 32, true>(bertaccel::AttnParams)": "attention",
        "void bertaccel::(anonymous namespace)::attn_fwd_kernel<__nv_bfloat16, 64, false>(bertaccel::AttnParams)": "attention",
        # autocast's casts: demangled lambdas must not read as the LAMB optimizer
        "void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda(at::TensorIteratorBase&)"
        "::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}>": "elementwise",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
        "::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}>": "elementwise",
        "void at::native::reduce_kernel<128, 4, at::native::ReduceOp<c10::BFloat16, at::native::func_wrapper_t<"
        "float, at::native::sum_functor<c10::BFloat16, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>>>": "reduction",
    }
    for name, cat in names.items():
        assert categorize(name) == cat, name
        assert cat in CATEGORY_NAMES


def test_profiler_and_meter_write_their_files(tiny_config, tmp_path):
    cfg = tiny_config("prof", epochs=1)
    BertAccelCLI(args=["fit", "-c", cfg, "--profiler.enabled", "true", "--profiler.skip_first", "1",
                       "--profiler.warmup", "1", "--profiler.active", "2", "--throughput.enabled", "true",
                       "--throughput.warmup_steps", "2"])
    run = tmp_path / "runs" / "prof" / "version_0"
    prof = run / "profiler"
    assert list(prof.glob("*.pt.trace.json.gz"))
    ops = json.loads((prof / "operator_statistics.json").read_text())
    assert any(r["name"] == "aten::mm" or r["name"] == "aten::addmm" for r in ops)
    assert (prof / "profile_summary.png").stat().st_size > 1000  # the picture next to the JSON
    summary = json.loads((prof / "profile_summary.json").read_text())
    assert {"embeddings", "layer0.attention", "layer0.ffn", "backward", "optimizer_step"} <= set(summary["regions"])
    # the recorded steps' own time beside the untraced ones' before them (skip_first 1 left out, wait 1; warm-up traced)
    step_ms = summary["step_ms"]
    assert step_ms["recorded_steps"] == 2 and step_ms["unrecorded_steps"] == 1, step_ms
    assert step_ms["recorded"] > 0 and step_ms["unrecorded"] > 0
    stats = json.loads((run / "benchmark_stats.json").read_text())["train"]
    assert stats["samples_per_s"] > 0 and 0 <= stats["padding_fraction"] < 1
    assert stats["real_tokens_per_s"] < stats["padded_tokens_per_s"] or stats["padding_fraction"] == 0


def test_training_throughput_leaves_out_validation_and_checkpoint_time(tiny_data, tmp_path, monkeypatch):
    """The training clock stops while validation runs and checkpoints are saved. The clock is made to
    jump 100 s at each validation's end (no real waiting, so nothing here depends on machine speed):
    the measured training time must not contain those jumps."""
    import time

    import lightning.pytorch as pl


    real_clock, jumped = time.perf_counter, [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + jumped[0])

    class SlowValidation(pl.Callback):
        def on_validation_end(self, trainer, pl_module):
            jumped[0] += 100.0

    meter = _fit_tiny_with_meter(tiny_data, tmp_path, [SlowValidation()], 1, accelerator="cpu", max_epochs=3)
    stats = meter.results["train"]
    assert stats["steps"] == 3 * 8 - 1
    seconds = stats["steps"] * 16 / stats["samples_per_s"]
    assert jumped[0] >= 300.0 and seconds < 100.0, seconds  # 2 or 3 jumps fall inside the measured window


def test_profiler_schedule_fits_a_short_stage(tiny_config, tmp_path, caplog):
    """A test stage of 3 batches with skip_first 5, wait 1, warmup 2, active 1 (9 steps): the skipped
    and warm-up steps give way, one line says so, and the recorded step is a whole step."""
    import logging

    cfg = tiny_config("short_prof", epochs=1)
    BertAccelCLI(args=["fit", "-c", cfg])
    with caplog.at_level(logging.INFO):
        BertAccelCLI(args=["test", "-c", cfg, "--ckpt_path", "last", "--profiler.enabled", "true",
                           "--profiler.stages", "[test]", "--profiler.skip_first", "5", "--profiler.wait", "1",
                           "--profiler.warmup", "2", "--profiler.active", "1"])
    assert "profiler (test): 3 batches: skip_first 5 -> 0, warmup 2 -> 1, so that 1 whole steps are recorded." in caplog.text
    prof = tmp_path / "runs" / "short_prof" / "version_1" / "profiler"
    summary = json.loads((prof / "test_profile_summary.json").read_text())
    regions = summary["regions"]
    assert regions["embeddings"]["calls"] == 1 and regions["layer0.attention"]["calls"] == 1  # one whole forward


@pytest.mark.cuda
def test_gpu_step_fraction_shows_a_gpu_waiting_for_the_host(tiny_data, tmp_path):
    """`gpu_step_fraction`: the steps' GPU time over the wall time. A host that sleeps 50 ms between
    tiny steps leaves the GPU idle most of the time: the fraction must say so."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    import time

    import lightning.pytorch as pl


    class SlowHost(pl.Callback):
        def on_train_batch_end(self, *args):
            time.sleep(0.05)

    fractions = {}
    for name, extra in (("plain", []), ("slow host", [SlowHost()])):
        meter = _fit_tiny_with_meter(tiny_data, tmp_path, extra, 2, accelerator="gpu", devices=1, max_epochs=1,
                                     limit_val_batches=0)
        fractions[name] = meter.results["train"]["gpu_step_fraction"]
    assert 0 < fractions["plain"] <= 1.05, fractions
    assert fractions["slow host"] < 0.5 and fractions["slow host"] < fractions["plain"], fractions


def test_meter_times_the_hosts_garbage_collection(tiny_data, tmp_path):
    """A full collection forced inside one training step shows in that step's `slowest_steps_gc_ms`
    and in `host_gc_ms_total`; the meter's gc hook is gone after the fit."""
    import gc

    import lightning.pytorch as pl


    class CollectAtStep5(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 5:
                junk = [[i] for i in range(300_000)]  # a heap worth walking
                gc.collect()
                del junk

    meter = _fit_tiny_with_meter(tiny_data, tmp_path, [CollectAtStep5()], 1, accelerator="cpu", max_epochs=1,
                                 limit_val_batches=0)
    stats = meter.results["train"]
    at = stats["slowest_steps_at"].index(5.0)  # the collection made step 5 one of the slowest
    assert stats["slowest_steps_gc_ms"][at] > 0
    assert stats["host_gc_ms_total"] >= stats["slowest_steps_gc_ms"][at]
    assert meter._on_gc not in gc.callbacks


def test_meter_counts_the_collators_real_tokens_on_the_host(tiny_data, tmp_path):
    """Real tokens come from the batch's `num_tokens` (the collator's host count, no device work per step): the
    meter's total equals the attention masks' ones of the real rows summed over the counted steps, and is a
    Python int."""
    import lightning.pytorch as pl

    masks = []

    class Masks(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            masks.append(int(batch["attention_mask"][: batch["num_rows"]].sum()))

        def on_train_epoch_end(self, trainer, pl_module):  # the meter's stage, before its end of training
            counted.append(trainer.callbacks[0].stages["train"].real)

    counted = []
    _fit_tiny_with_meter(tiny_data, tmp_path, [Masks()], 2, accelerator="cpu", max_epochs=1, limit_val_batches=0)
    assert isinstance(counted[0], int) and counted[0] == sum(masks[2:]) > 0


def test_meter_logs_its_window_straight_to_the_loggers(tiny_data, tmp_path):
    """Every `log_every_n_steps` batches - on the batches where Lightning logs step metrics - the meter reads its
    running numbers for the steps before the batch, before the batch's step runs, and writes them to the loggers
    (metrics.csv here) at the trainer's step; they do not enter Lightning's per-epoch results, which the loop walks
    after every batch."""
    import csv

    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from bertaccel.callbacks.throughput import ThroughputMeter
    from bertaccel.data import TextClassificationDataModule
    from bertaccel.modules import BertClassifier
    from tests.conftest import TINY_BERT

    pl.seed_everything(1)
    meter = ThroughputMeter(enabled=True, warmup_steps=1, log_every_n_steps=2)
    dm = TextClassificationDataModule(dataset=str(tiny_data), tokenizer="sample:sentiment", max_length=32,
                                      batch_size=16, val_size=0.2)
    trainer = pl.Trainer(logger=CSVLogger(tmp_path), enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[meter], accelerator="cpu", max_epochs=1,
                         limit_val_batches=0, log_every_n_steps=1000)
    trainer.fit(BertClassifier(config=TINY_BERT, vocab_size=256, num_labels=2), datamodule=dm)
    steps = trainer.global_step
    assert steps >= 4
    with open(trainer.logger.log_dir + "/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("throughput/samples_per_s")]
    # batches 1, 3, 5, ... (0-based: Lightning's logging batches for an interval of 2), the first with a counted step
    # before it (warm-up 1: batch 3), at the step `self.log` in that batch is written at, so they line up with train/loss
    assert [int(r["step"]) for r in rows] == list(range(3, steps, 2))
    assert all(float(r["throughput/samples_per_s"]) > 0 for r in rows)
    # the counted steps before the batch: batches 1 .. n-1 (batch 0 is warm-up)
    assert [float(r["throughput/steps"]) for r in rows] == [int(r["step"]) - 1 for r in rows]
    assert not any(k.startswith("throughput/") for k in trainer.callback_metrics)
    # 0: nothing written along the way, the stage's numbers only at its end
    pl.seed_everything(1)
    quiet = ThroughputMeter(enabled=True, warmup_steps=1, log_every_n_steps=0)
    trainer = pl.Trainer(logger=CSVLogger(tmp_path / "quiet"), enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[quiet], accelerator="cpu", max_epochs=1,
                         limit_val_batches=0, log_every_n_steps=1000, default_root_dir=tmp_path / "quiet")
    trainer.fit(BertClassifier(config=TINY_BERT, vocab_size=256, num_labels=2), datamodule=dm)
    assert quiet.results["train"]["samples_per_s"] > 0
    metrics_csv = tmp_path / "quiet" / "lightning_logs" / "version_0" / "metrics.csv"
    assert not metrics_csv.exists() or "throughput/" not in metrics_csv.read_text()


def test_meter_and_loss_windows_follow_lightnings_step_count_after_a_resume(tiny_data, tmp_path):
    """A fit resumed mid-epoch: the meter writes its window on the batches where Lightning writes train/loss (its
    count of batches that stepped, restored from the checkpoint), not on batches of its own count since the resume -
    so the two device reads of a logging batch stay on one batch."""
    import csv

    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from bertaccel.callbacks.throughput import ThroughputMeter
    from bertaccel.data import TextClassificationDataModule
    from bertaccel.modules import BertClassifier
    from tests.conftest import TINY_BERT

    def trainer(max_steps, name):
        return pl.Trainer(logger=CSVLogger(tmp_path, name=name), enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                          max_steps=max_steps, limit_val_batches=0, log_every_n_steps=3,
                          callbacks=[ThroughputMeter(enabled=True, warmup_steps=1, log_every_n_steps=3)])

    dm = TextClassificationDataModule(dataset=str(tiny_data), tokenizer="sample:sentiment", max_length=32,
                                      batch_size=4, val_size=0.2)
    pl.seed_everything(1)
    first = trainer(4, "first")
    first.fit(BertClassifier(config=TINY_BERT, vocab_size=256, num_labels=2), datamodule=dm)
    first.save_checkpoint(tmp_path / "mid.ckpt")
    resumed = trainer(14, "resumed")
    resumed.fit(BertClassifier(config=TINY_BERT, vocab_size=256, num_labels=2), datamodule=dm,
                ckpt_path=tmp_path / "mid.ckpt")
    assert resumed.global_step == 14
    with open(resumed.logger.log_dir + "/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    loss_steps = [int(r["step"]) for r in rows if r.get("train/loss")]
    meter_steps = [int(r["step"]) for r in rows if r.get("throughput/samples_per_s")]
    # Lightning's logging batches after step 4: its count + 1 a multiple of 3 -> steps 5, 8, 11
    assert loss_steps == [5, 8, 11]
    # the meter's: the same batches once a counted step lies before them (the resumed run's first two batches,
    # steps 4 and 5, are its warm-up and first counted step) - its own count would have given 6, 9, 12
    assert meter_steps == [8, 11]


@pytest.mark.parametrize("freeze", ["1", "0"])
def test_training_freezes_the_heap_and_teardown_unfreezes_it(tiny_data, tmp_path, monkeypatch, freeze):
    """The objects alive at train start are out of the collector's reach during the steps (a full
    collection then walks only what the steps made) and back after the run; BERTACCEL_GC_FREEZE=0
    leaves the collector alone."""
    import gc

    import lightning.pytorch as pl

    monkeypatch.setenv("BERTACCEL_GC_FREEZE", freeze)
    seen = []

    class FrozenCount(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(gc.get_freeze_count())

    gc.unfreeze()
    _fit_tiny_with_meter(tiny_data, tmp_path, [FrozenCount()], 1, accelerator="cpu", max_epochs=1, limit_val_batches=0)
    assert seen and (min(seen) > 10_000 if freeze == "1" else max(seen) == 0)
    assert gc.get_freeze_count() == 0


def test_exposed_time_counts_overlapped_kernel_time_once():
    """A kernel launched early by programmatic dependent launch waits inside its own time: only what runs past its
    predecessor is its own. Exposed times add up to the busy time (the union), per GPU."""
    from bertaccel.callbacks.profiler import exposed_us

    pdl = [(0, 0.0, 10.0), (0, 2.0, 15.0)]  # the second starts at 2, waits until 10, ends at 15
    assert exposed_us(pdl) == [10.0, 5.0]
    assert exposed_us([(0, 6.0, 8.0), (0, 0.0, 5.0)]) == [2.0, 5.0]  # apart: their own times, in any input order
    assert exposed_us([(0, 0.0, 10.0), (0, 2.0, 4.0)]) == [10.0, 0.0]  # inside another: nothing exposed
    assert exposed_us([(0, 0.0, 4.0), (0, 0.0, 10.0)]) == [0.0, 10.0]  # same start: the longer one first
    assert exposed_us([(0, 0.0, 10.0), (1, 2.0, 15.0)]) == [10.0, 13.0]  # two GPUs: no overlap between them
    chain = [(0, 0.0, 3.0), (0, 1.0, 7.0), (0, 6.0, 9.0), (0, 20.0, 21.0)]
    assert sum(exposed_us(chain)) == 9.0 + 1.0  # the union: [0, 9] and [20, 21]


def test_idle_gaps_are_the_holes_in_the_union_per_gpu():
    """The GPU's idle time between its first and last activity, as the gaps of the union on each device: overlapping
    (programmatic dependent launch) or nested kernels leave none; before the first and after the last are not gaps."""
    from bertaccel.callbacks.profiler import idle_gaps_us

    chain = [(0, 0.0, 3.0), (0, 1.0, 7.0), (0, 6.0, 9.0), (0, 20.0, 21.0), (0, 21.5, 22.0)]
    assert idle_gaps_us(chain) == [11.0, 0.5]
    assert idle_gaps_us([(0, 5.0, 6.0), (0, 0.0, 10.0), (0, 12.0, 13.0)]) == [2.0]  # inside another: no gap
    assert sorted(idle_gaps_us([(0, 0.0, 1.0), (1, 4.0, 5.0), (0, 3.0, 4.0), (1, 0.0, 2.0)])) == [2.0, 2.0]  # per GPU
    assert idle_gaps_us([(0, 0.0, 1.0)]) == [] and idle_gaps_us([]) == []


def test_exposed_by_name_skips_annotations_and_host_events():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from bertaccel.callbacks.profiler import exposed_by_name

    def ev(name, start, end, device_type=DeviceType.CUDA, annotation=False):
        return SimpleNamespace(key=name, device_type=device_type, device_index=0, is_user_annotation=annotation,
                               time_range=SimpleNamespace(start=start, end=end))

    events = [ev("gemm", 0.0, 10.0), ev("layer_norm", 8.0, 13.0), ev("layer_norm", 20.0, 22.0),
              ev("layer0.ffn", 0.0, 30.0, annotation=True), ev("aten::mm", 0.0, 50.0, device_type=DeviceType.CPU)]
    assert exposed_by_name(events) == {"gemm": 10.0, "layer_norm": 5.0}


@pytest.mark.cuda
@pytest.mark.parametrize("graphs", [True, False], ids=["graphed", "eager"])
def test_profiler_counts_overlapping_gpu_time_once(tiny_config, tmp_path, graphs):
    """On a GPU with the kernel swap (our row kernels launched by programmatic dependent launch), graphed or eager
    steps: the busy time is at most the kernels' summed own times, each kernel's exposed time at most its own, the
    shares of exposed time add up to one, the categories add up to the busy time, the recorded and untraced steps'
    times are there; eager, the labelled regions' device time (exposed) is positive and at most their kernels' own
    times."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    cfg = tiny_config("prof_gpu", epochs=1)
    BertAccelCLI(args=["fit", "-c", cfg, "--trainer.accelerator", "gpu", "--trainer.precision", "bf16-mixed",
                       "--kernel_swap.ops", "[all]", "--model.cuda_graphs", str(graphs).lower(), "--profiler.enabled",
                       "true", "--profiler.skip_first", "2", "--profiler.warmup", "1", "--profiler.active", "3"])
    prof = tmp_path / "runs" / "prof_gpu" / "version_0" / "profiler"
    summary = json.loads((prof / "profile_summary.json").read_text())
    kernels = json.loads((prof / "kernel_statistics.json").read_text())
    assert kernels and 0 < summary["gpu_ms"] <= summary["kernel_sum_ms"] + 1e-6
    assert all(k["exposed_ms"] <= k["total_ms"] + 1e-6 for k in kernels)
    assert sum(k["share"] for k in kernels) == pytest.approx(1.0, rel=1e-6)
    assert sum(c["ms"] for c in summary["categories"].values()) == pytest.approx(summary["gpu_ms"], rel=1e-6)
    step_ms = summary["step_ms"]  # timed by CUDA events on the GPU's timeline
    assert step_ms["recorded_steps"] == 3 and step_ms["unrecorded_steps"] >= 1, step_ms
    assert step_ms["recorded"] > 0 and step_ms["unrecorded"] > 0, step_ms
    if not graphs:
        regions = summary["regions"]
        assert regions["layer0.ffn"]["device_ms"] > 0
        assert all(r["device_ms"] <= r["device_own_ms"] + 1e-6 for r in regions.values())


def test_region_device_time_counts_overlapping_kernels_once():
    """A labelled region whose two ops launched overlapping kernels (the second waiting for the first inside its own
    time): the region's exposed device time is their union; a region of another name and host-only events add
    nothing."""
    import re
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    from bertaccel.callbacks.profiler import region_exposed_us

    def cpu(name, id_, children=()):
        return NS(name=name, id=id_, device_type=DeviceType.CPU, cpu_children=list(children))

    def kernel(start, end, corr):
        return NS(name="k", key="k", device_type=DeviceType.CUDA, device_index=0, is_user_annotation=False,
                  time_range=NS(start=start, end=end), linked_correlation_id=corr)

    ops = [cpu("aten::mm", 1), cpu("bertaccel::layer_norm", 2)]
    region = cpu("layer0.ffn", 10, [cpu("aten::linear", 11, [ops[0]]), ops[1]])
    other = cpu("layer1.ffn", 20, [cpu("aten::mm", 3)])
    events = [region, other, *ops, kernel(0.0, 10.0, 1), kernel(2.0, 15.0, 2), kernel(30.0, 34.0, 3)]
    got = region_exposed_us(events, re.compile(r"^layer\d+\.ffn$"))
    assert got == {"layer0.ffn": 15.0, "layer1.ffn": 4.0}
    assert region_exposed_us([region, NS(name="k", device_type=DeviceType.CUDA, device_index=0,
                                         time_range=NS(start=0.0, end=1.0))], re.compile("layer0.ffn")) is None


def test_profiler_step_times_recorded_against_unrecorded(monkeypatch):
    """Step times from the marks at each step's end: the recorded steps' median beside the untraced (skipped, waiting)
    steps' before them (the stage's first step left out; warm-up steps are traced); after a recorded cycle only the
    last unrecorded mark is kept, so a later cycle's first recorded step is timed from the step before it and the list
    stays short."""
    import time
    from types import SimpleNamespace

    from torch.profiler import ProfilerAction

    from bertaccel.callbacks.profiler import ProfilerCallback

    cb = ProfilerCallback(enabled=True)
    cb._cuda, cb._stage = False, "train"
    clock = iter([0.0, 0.050, 0.060, 0.070, 0.090, 0.110, 0.120, 0.130, 0.140, 0.165, 0.200])  # s, at each step's end
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    N, W, R = ProfilerAction.NONE, ProfilerAction.WARMUP, ProfilerAction.RECORD
    actions = iter([N, N, N, W, R, R, N, N, W, R])  # skip 1, then two cycles of wait 1 / warmup 1 / active 2 (the last cut short)
    cb._prof = SimpleNamespace(current_action=None, step=lambda: None)
    cb._marks = [("none", cb._mark())]
    for action in actions:
        cb._prof.current_action = action
        cb._step("train")
    assert len(cb._marks) == 9  # of the three unrecorded marks after the first cycle only the last is kept
    times = cb._step_times()
    # untraced before the first record: 10, 10 ms (the first step's 50 ms left out, the warm-up's 20 too); recorded:
    # 20, 10 ms, and 35 ms timed from the second cycle's warm-up step (the marks before it dropped)
    assert times == {"recorded": pytest.approx(20.0), "recorded_steps": 3, "unrecorded": pytest.approx(10.0),
                     "unrecorded_steps": 2}


def test_evaluation_warm_up_is_its_own(tiny_data, tmp_path, caplog):
    """`eval_warmup_steps` leaves out the first test batches alone: a test set of fewer batches than the training
    warm-up is measured (48 rows in batches of 16: three batches, one left out), and without it nothing is - said."""
    import logging

    import lightning.pytorch as pl

    from bertaccel.callbacks.throughput import ThroughputMeter
    from bertaccel.data import TextClassificationDataModule
    from bertaccel.modules import BertClassifier
    from tests.conftest import TINY_BERT

    results = {}
    for eval_warmup in (1, None):
        pl.seed_everything(1)
        meter = ThroughputMeter(enabled=True, warmup_steps=10, eval_warmup_steps=eval_warmup)
        dm = TextClassificationDataModule(dataset=str(tiny_data), tokenizer="sample:sentiment", max_length=32,
                                          batch_size=16, val_size=0.2)
        trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=tmp_path, callbacks=[meter],
                             accelerator="cpu", devices=1)
        with caplog.at_level(logging.INFO):
            trainer.test(BertClassifier(config=TINY_BERT, vocab_size=256, num_labels=2), datamodule=dm)
        results[eval_warmup] = meter.results.get("test")
    stats = results[1]
    assert stats is not None and stats["steps"] == 2 and stats["samples_per_s"] > 0, stats
    assert sorted(stats["slowest_steps_at"]) == [1.0, 2.0], stats  # the stage's steps 1 and 2: step 0 left out
    assert results[None] is None
    assert "fewer steps than warmup_steps=10; nothing measured" in caplog.text


def test_negative_warm_ups_are_refused():
    from bertaccel.callbacks.throughput import ThroughputMeter

    with pytest.raises(ValueError, match="throughput.eval_warmup_steps must be at least 0"):
        ThroughputMeter(eval_warmup_steps=-1)
    with pytest.raises(ValueError, match="throughput.warmup_steps must be at least 0"):
        ThroughputMeter(warmup_steps=-2)
