"""Several processes through Lightning's DDP, on CPU (gloo, 2 processes): fit, test and predict
finish with the throughput meter and the profiler on (no rank-0-only collective hangs), throughput
is global, and every prediction row is written exactly once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import sample_rows, write_jsonl

DDP = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp"]


def bertaccel(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "bertaccel", *args], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    return out


@pytest.mark.slow
def test_ddp_fit_test_predict_with_meter_and_profiler(tiny_config, tmp_path):
    # an odd number of test rows: DistributedSampler pads one rank's share with a repeated row
    data = tmp_path / "odd"
    write_jsonl(data / "train.jsonl", sample_rows("train", 160))
    write_jsonl(data / "test.jsonl", sample_rows("test", 47))
    cfg = tiny_config("ddp", epochs=1, dataset=str(data))
    meter = ["--throughput.enabled", "true", "--throughput.warmup_steps", "1", "--throughput.log_every_n_steps", "2"]
    profiler = ["--profiler.enabled", "true", "--profiler.skip_first", "0", "--profiler.warmup", "1", "--profiler.active", "1"]
    bertaccel("fit", "-c", cfg, *DDP, *meter, *profiler, cwd=tmp_path)
    run = tmp_path / "runs" / "ddp" / "version_0"
    stats = json.loads((run / "benchmark_stats.json").read_text())["train"]
    assert stats["world_size"] == 2 and len(stats["step_ms_p50_per_rank"]) == 2
    # global samples: 128 training rows over 2 ranks, 4 steps of 16 per rank; 1 warm-up step left out per rank
    assert stats["steps"] == 3 and stats["samples_per_s"] > 0
    assert (run / "profiler" / "profile_summary.json").is_file()

    bertaccel("test", "-c", cfg, *DDP, *meter, "--ckpt_path", "last", cwd=tmp_path)
    out = tmp_path / "preds.jsonl"
    bertaccel("predict", "-c", cfg, *DDP, *meter, "--ckpt_path", "last", "--predictions.output_path", str(out), cwd=tmp_path)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(47))  # every row once, in dataset order
    assert all(r["label"] in (0, 1) and r["prediction"] in (0, 1) for r in rows)
    assert not list(tmp_path.glob("*.partial"))
