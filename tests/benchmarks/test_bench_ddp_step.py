"""The graphed DDP step benchmark on CPU (2 gloo processes, the reference ops): the harness runs all three
variants, and the overlapped one sends its buckets from the backward's hooks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_on_cpu(tmp_path: Path, *extra: str) -> list[dict]:
    """The benchmark's rows from a CPU run (2 gloo processes, the tiny model, 4x16, two steps, one round)."""
    out = tmp_path / "ddp_step.json"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_ddp_step", "--device", "cpu", "--models", "tiny",
                           "--shapes", "4x16", "--steps", "2", "--warmup", "2", "--rounds", "1", "--out", str(out), *extra],
                          cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": f"{root / 'src'}:{root}"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())["rows"]


@pytest.mark.slow
def test_cpu_run_times_every_variant(tmp_path):
    rows = run_on_cpu(tmp_path)
    assert [r["variant"] for r in rows] == ["no-sync", "sync-after", "sync-overlapped", "sync-embedding-rows",
                                               "sync-overlapped-embedding-rows"]
    assert all(r["step_ms_p50"] > 0 and r["world"] == 2 for r in rows)
    overlapped = rows[2]
    assert overlapped["buckets"] >= 1 and overlapped["buckets_sent_in_backward"] >= 1
    assert rows[3]["embedding_rows_only"] is rows[4]["embedding_rows_only"] is True  # the classifier's word embeddings: a gradient in the batch's rows only


@pytest.mark.slow
def test_cpu_run_times_the_flat_variants_when_asked(tmp_path):
    rows = run_on_cpu(tmp_path, "--variants", "sync-embedding-rows", "sync-embedding-rows-flat", "sync-after-table-flat")
    assert [r["variant"] for r in rows] == ["sync-embedding-rows", "sync-embedding-rows-flat", "sync-after-table-flat"]
    assert [r["embedding_rows_only"] for r in rows] == [True, True, None]
    assert all(r["step_ms_p50"] > 0 for r in rows)
