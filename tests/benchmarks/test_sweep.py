"""The batch-size sweep and the end-to-end harness run end to end (on CPU, a tiny model) and write
their table, JSON and plot."""

from __future__ import annotations

import csv
import json
import sys

import pytest

from benchmarks import e2e, sweep


def test_sweep_writes_table_json_and_plot(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    out = tmp_path / "sweep"
    monkeypatch.setattr(sys, "argv", ["sweep", "--device", "cpu", "--models", "tiny", "--seq-lens", "16",
                                      "--batch-sizes", "1", "4", "--workloads", "infer", "train",
                                      "--variants", "hf-eager-fp32", "--warmup", "1", "--steps", "3", "--out", str(out)])
    sweep.main()
    rows = list(csv.DictReader(open(out / "sweep.csv")))
    assert [(r["workload"], int(r["batch"])) for r in rows] == [("infer", 1), ("infer", 4), ("train", 1), ("train", 4)]
    for r in rows:
        assert float(r["ms"]) > 0 and float(r["p90_ms"]) >= float(r["ms"])
        assert float(r["samples_per_s"]) == pytest.approx(int(r["batch"]) / float(r["ms"]) * 1e3, rel=1e-2)
    payload = json.loads((out / "sweep.json").read_text())
    assert payload["device"] == "cpu" and len(payload["rows"]) == 4
    png = (out / "sweep.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_e2e_harness_writes_its_table(tmp_path, monkeypatch):
    out = tmp_path / "e2e.json"
    monkeypatch.setattr(sys, "argv", ["e2e", "--device", "cpu", "--models", "tiny", "--shapes", "2x16",
                                      "--variants", "hf-eager-fp32", "fused", "attn-fused-graphs", "--warmup", "1",
                                      "--steps", "2", "--out", str(out)])
    e2e.main()
    rows = json.loads(out.read_text())["rows"]
    assert {(r["workload"], r["variant"]) for r in rows} == {
        (w, v) for w in ("train", "infer") for v in ("hf-eager-fp32", "fused", "attn-fused-graphs")}
    assert all(r["ms"] > 0 for r in rows)


def test_e2e_masked_lm_workload_counts_the_flops_that_run(tmp_path, monkeypatch):
    """workload mlm: BertMLM's step; the masked-last variant counts fewer FLOPs (its last layer at the masked rows),
    and a classifier-only variant is refused (a FAILED row, nan), as is the masked-LM's variant on a classifier."""
    out = tmp_path / "e2e.json"
    monkeypatch.setattr(sys, "argv", ["e2e", "--device", "cpu", "--models", "tiny", "--shapes", "4x32", "--workloads",
                                      "mlm", "train", "--variants", "hf-sdpa-bf16", "attn-fused-graphs",
                                      "attn-fused-graphs-masked-last", "fused-graphs-cls-only", "--warmup", "1",
                                      "--steps", "1", "--out", str(out)])
    e2e.main()
    rows = {(r["workload"], r["variant"]): r for r in json.loads(out.read_text())["rows"]}
    for w, v in (("mlm", "hf-sdpa-bf16"), ("mlm", "attn-fused-graphs"), ("mlm", "attn-fused-graphs-masked-last"),
                 ("train", "fused-graphs-cls-only")):
        assert rows[(w, v)]["ms"] > 0, (w, v)
    for w, v in (("mlm", "fused-graphs-cls-only"), ("train", "attn-fused-graphs-masked-last")):
        assert rows[(w, v)]["ms"] != rows[(w, v)]["ms"], (w, v)  # nan: refused
    flops = {k: v for k, v in e2e.FLOPS.items() if k[0] == "tiny" and k[1] == "4x32"}
    assert 0 < flops[("tiny", "4x32", "mlm", "attn-fused-graphs-masked-last")] < flops[("tiny", "4x32", "mlm", "attn-fused-graphs")]


def test_e2e_rounds_interleave_the_variants_and_keep_each_rounds_time(tmp_path, monkeypatch):
    """--rounds 3: each variant timed three times, in the order a, b, a, b, a, b; the cell is the median."""
    calls = []

    def fake_step_times(variant, *args, **kwargs):
        calls.append(variant)
        return [float(len(calls))]  # this call's position: rounds' medians 1, 3, 5 (a) and 2, 4, 6 (b)

    monkeypatch.setattr(e2e, "step_times", fake_step_times)
    out = tmp_path / "e2e.json"
    monkeypatch.setattr(sys, "argv", ["e2e", "--device", "cpu", "--models", "tiny", "--shapes", "2x16", "--workloads",
                                      "train", "--variants", "hf-sdpa-bf16", "fused", "--rounds", "3", "--out", str(out)])
    e2e.main()
    assert calls == ["hf-sdpa-bf16", "fused"] * 3
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["hf-sdpa-bf16"]["ms_rounds"] == [1.0, 3.0, 5.0] and rows["hf-sdpa-bf16"]["ms"] == 3.0
    assert rows["fused"]["ms_rounds"] == [2.0, 4.0, 6.0] and rows["fused"]["ms"] == 4.0


def test_preset_comparison_runs_every_kind_of_preset_on_cpu(tmp_path):
    """benchmarks/presets.py end to end on CPU (tiny model, the shipped sample text): a plain, the
    recommended (graphs fall back to eager steps on CPU) and the full preset (NorMuon, QK-norm) each
    train and validate, and the table, the equal-time losses and the picture are written."""
    from benchmarks import presets

    out = tmp_path / "presets.json"
    presets.main(["--smoke", "--presets", "baseline", "recommended", "full", "--steps", "6", "--val-every", "3",
                  "--val-batches", "2", "--warmup", "1", "--runs", str(tmp_path / "runs"), "--out", str(out)])
    payload = json.loads(out.read_text())
    assert set(payload["presets"]) == {"baseline", "recommended", "full"}
    for name, r in payload["presets"].items():
        assert "error" not in r, (name, r)
        assert r["tokens_per_s"] > 0 and [s for s, _ in r["val_loss_by_step"]] == [2, 5]
        # at the shortest run's time a slower preset may not have reached a validation yet (None)
        reached = [loss for t, loss in r["val_loss_by_time_s"] if t <= payload["equal_time_s"] + 1e-9]
        assert r["val_loss_at_equal_time"] == (reached[-1] if reached else None)
    assert payload["equal_time_s"] == min(r["val_loss_by_time_s"][-1][0] for r in payload["presets"].values())
    pytest.importorskip("matplotlib")
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gemm_baseline_harness_runs_on_cpu(tmp_path):
    """benchmarks/bench_gemm.py: every GEMM of a linear layer and the epilogue baseline per shape."""
    from benchmarks import bench_gemm

    out = tmp_path / "gemm.json"
    bench_gemm.main(["--device", "cpu", "--shapes", "64x48x32", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["gemm"] for r in rows] == ["fwd x W^T", "dgrad dy W", "wgrad dy^T x", "F.linear(bias) + gelu"]
    assert all(r["ms"] > 0 and r["TFLOP/s"] >= 0 for r in rows)


def test_ffn_bench_harness_runs_on_cpu(tmp_path):
    """benchmarks/bench_ffn.py: HF's block, the default swap's and the ffn family's, timed in turn."""
    from benchmarks import bench_ffn

    out = tmp_path / "ffn.json"
    bench_ffn.main(["--device", "cpu", "--tokens", "32", "--hidden", "64", "--inner", "128", "--rounds", "2",
                    "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["impl"] for r in rows] == ["hf", "fused", "ffn"]
    assert all(r["fwd+bwd_ms"] > 0 and len(r["rounds_fwd+bwd_ms"]) == 2 for r in rows)
    assert rows[0]["speedup_vs_hf"] == 1.0


def test_gemm_bench_times_implementations_in_turn_and_restores_the_kernel_switches(monkeypatch, tmp_path):
    """bench_gemm: implementations timed in turn, `rounds` times, medians (so clock drift under load
    affects them alike); the kernel switches (staged stores, split sums, tuning) are set only inside their
    calls and put back after."""
    import os

    from benchmarks import bench_gemm

    timings = {"a": iter([3.0, 1.0, 1.5]), "b": iter([5.0, 9.0, 4.0])}  # medians 1.5, 5 (means 1.83, 6)
    order = []

    def fake_time_ms(fn, args, device):
        order.append(fn())
        return next(timings[order[-1]])

    monkeypatch.setattr(bench_gemm, "time_ms", fake_time_ms)
    assert bench_gemm.interleaved_ms([lambda: "a", lambda: "b"], (), "cpu", rounds=3) == [1.5, 5.0]
    assert order == ["a", "b"] * 3

    for var, value in (("BERTACCEL_GEMM_STORE", "staged"), ("BERTACCEL_GEMM_SPLIT", "kernel"), ("BERTACCEL_GEMM_TUNE", "1"),
                       ("BERTACCEL_GEMM_CLUSTER", "2")):
        for before in (None, "other"):
            if before is None:
                monkeypatch.delenv(var, raising=False)
            else:
                monkeypatch.setenv(var, before)
            seen = bench_gemm._env_call(var, value, lambda v=var: os.environ.get(v))
            assert seen == value
            assert os.environ.get(var) == before
    # gemm_config's [tile rows, width, splits, schedule, in-kernel sum, tuned, cluster] labelled as the sweep labels rows
    assert bench_gemm.config_label([128, 256, 1, 1, 0, 0]) == "n256 s1"
    assert bench_gemm.config_label([192, 192, 2, 4, 1, 1]) == "r192 n192 s2 kernel-sum"
    assert bench_gemm.config_label([128, 128, 3, 2, 0, 0]) == "pp n128 s3"
    assert bench_gemm.config_label([128, 256, 1, 1, 0, 0, 2]) == "n256 s1 c2"  # blocks per cluster (7th value)
    assert bench_gemm.config_label([128, 256, 1, 3, 0, 0, 2]) == "sk n256 s1"  # stream-K runs single blocks

    monkeypatch.undo()
    out = tmp_path / "gelu.json"
    bench_gemm.main(["--device", "cpu", "--shapes", "64x48x32", "--gelu-only", "--rounds", "2", "--out", str(out)])
    assert [r["gemm"] for r in json.loads(out.read_text())["rows"]] == ["F.linear(bias) + gelu"]


def test_kernel_times_sum_each_cuda_kernel_per_call(monkeypatch):
    """benchmarks.common.kernel_times_us (behind e2e's kernel breakdown and the per-kernel scripts): CUDA
    kernels only, one entry per name summed over its launches, divided by the calls; `work` runs once."""
    from types import SimpleNamespace

    import torch.profiler

    from benchmarks import common

    CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(name="gemm", device_type=CUDA, device_time=30.0),
              SimpleNamespace(name="gemm", device_type=CUDA, device_time=50.0),
              SimpleNamespace(name="reduce", device_type=CUDA, device_time=8.0),
              SimpleNamespace(name="aten::mm", device_type=CPU, device_time=999.0)]

    class FakeProfile:
        def __init__(self, activities):
            assert activities == [torch.profiler.ProfilerActivity.CUDA]

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return events

    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    runs = []
    assert common.kernel_times_us(lambda: runs.append(1), calls=4) == {"gemm": 20.0, "reduce": 2.0}
    assert runs == [1]


def test_e2e_token_budgets_rerun_the_unpadded_variants(tmp_path, monkeypatch):
    """--token-budgets: each unpadded variant again with its packed token count padded to each budget (a row
    `variant@N` carrying `token_budget`); padded variants are not repeated, and a budget below the batch's real
    tokens is refused (a FAILED row, nan)."""
    out = tmp_path / "e2e.json"
    monkeypatch.setattr(sys, "argv", ["e2e", "--device", "cpu", "--models", "tiny", "--shapes", "2x16", "--workloads",
                                      "train", "--variants", "fused", "fused-unpadded-graphs-cls-only", "--lengths",
                                      "uniform", "--token-budgets", "3", "32", "--warmup", "1", "--steps", "1",
                                      "--out", str(out)])
    e2e.main()
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"fused", "fused-unpadded-graphs-cls-only", "fused-unpadded-graphs-cls-only@3",
                         "fused-unpadded-graphs-cls-only@32"}
    assert rows["fused-unpadded-graphs-cls-only@32"]["token_budget"] == 32
    assert rows["fused-unpadded-graphs-cls-only@32"]["ms"] > 0
    assert rows["fused-unpadded-graphs-cls-only@3"]["ms"] != rows["fused-unpadded-graphs-cls-only@3"]["ms"]  # nan
    assert "token_budget" not in rows["fused-unpadded-graphs-cls-only"]
