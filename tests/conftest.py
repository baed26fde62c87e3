"""Shared fixtures: tiny data and tiny configs written by the tests themselves."""

from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from bertaccel.ops.build import cache_root

ROOT = Path(__file__).resolve().parents[1]


def run_in_child(code: str, env: dict[str, str | None] | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    """`code` in a fresh Python process, from the repository root, with the package (src layout) and `tests` importable
    without installing: for what a process reads once (the kernels' environment switches) and for what ends a CUDA
    context or crashes a process (device-side asserts, error paths). `env`: variables set on top of this process's
    (a None value removes one). Returns the completed process, stdout and stderr as text."""
    full = dict(os.environ)
    for name, value in (env or {}).items():
        if value is None:
            full.pop(name, None)
        else:
            full[name] = value
    full["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=timeout)


SAMPLE = Path(__file__).resolve().parents[1] / "src" / "bertaccel" / "data" / "samples" / "sentiment"
TINY_BERT = {
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """With BERTACCEL_FAILURE_LOG set, each failure's traceback is appended to that file as it happens,
    so a GPU run cut off by its time limit still shows why the tests that finished failed."""
    path = os.environ.get("BERTACCEL_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


# The compiled CUDA extensions stay where the caller's environment keeps them (keyed by a hash of their
# sources, so sharing is safe): with only BERTACCEL_CACHE per test, every pytest process compiled them
# again inside its first GPU test (1.5-3 minutes; a GPU run's time limit once cut such a build off).
EXTENSIONS = str(cache_root())  # read before any test points BERTACCEL_CACHE elsewhere


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """Each test runs in its own folder with its own tokenized-data cache (the extensions folder is shared),
    and from the same random state: a test's unseeded draws do not depend on which tests ran before it (an
    added test once shifted the global stream into a draw that failed another test's tolerance)."""
    torch.manual_seed(0)
    random.seed(0)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BERTACCEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("BERTACCEL_EXTENSIONS", EXTENSIONS)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def sample_rows(split: str, n: int | None = None, seed: int = 0) -> list[dict]:
    rows = [json.loads(line) for line in (SAMPLE / f"{split}.jsonl").read_text().splitlines()]
    random.Random(seed).shuffle(rows)
    return rows[:n] if n else rows


def write_jsonl(path: Path, rows: list[dict], gz: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(r) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(data)
    else:
        path.write_text(data, encoding="utf-8")
    return path


@pytest.fixture
def tiny_data(tmp_path) -> Path:
    """A local classification directory: 160 train / 48 test rows of the sample corpus."""
    d = tmp_path / "tiny_data"
    write_jsonl(d / "train.jsonl", sample_rows("train", 160))
    write_jsonl(d / "test.jsonl.gz", sample_rows("test", 48), gz=True)
    return d


@pytest.fixture
def tiny_config(tmp_path, tiny_data):
    """Write a tiny classification experiment config; returns a function(name, **overrides) -> path."""

    def make(name: str = "tiny", epochs: int = 2, **data_overrides) -> str:
        cfg = {
            "seed_everything": 7,
            "trainer": {
                "max_epochs": epochs,
                "accelerator": "cpu",
                "devices": 1,
                "log_every_n_steps": 1,
                "enable_model_summary": False,
                "logger": {
                    "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                    "init_args": {"save_dir": str(tmp_path / "runs"), "name": name},
                },
            },
            "model": {
                "class_path": "bertaccel.modules.BertClassifier",
                "init_args": {"config": TINY_BERT, "lr": 3e-3, "warmup_ratio": 0.1},
            },
            "data": {
                "class_path": "bertaccel.data.TextClassificationDataModule",
                "init_args": {
                    "dataset": str(tiny_data),
                    "tokenizer": "sample:sentiment",
                    "max_length": 48,
                    "batch_size": 16,
                    "val_size": 0.2,
                    **data_overrides,
                },
            },
        }
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return str(path)

    return make
