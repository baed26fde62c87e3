"""The profiler's trace opens in TensorBoard's profiler plugin (torch-tb-profiler): a real TensorBoard
server on a loopback port lists the profiled run through the plugin's HTTP endpoint."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from bertaccel.cli import BertAccelCLI

pytest.importorskip("torch_tb_profiler", reason="the TensorBoard profiler plugin is the `profile` extra")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def test_tensorboard_profiler_plugin_lists_the_run(tiny_config, tmp_path):
    cfg = tiny_config("tbprof", epochs=1)
    BertAccelCLI(args=["fit", "-c", cfg, "--profiler.enabled", "true", "--profiler.skip_first", "1",
                       "--profiler.warmup", "1", "--profiler.active", "1"])
    logdir = tmp_path / "runs" / "tbprof"
    assert list(logdir.glob("version_0/profiler/*.pt.trace.json.gz"))

    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1",
         "--port", str(port), "--load_fast", "false"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    runs, last_error = None, None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"tensorboard exited with {proc.returncode}:\n{proc.stdout.read()}")
            try:
                plugins = _get_json(f"{base}/data/plugins_listing")
                assert "pytorch_profiler" in plugins, sorted(plugins)
                runs = _get_json(f"{base}/data/plugin/pytorch_profiler/runs")
                if runs.get("runs") and not runs.get("loading"):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
                last_error = e
            time.sleep(1)
        assert runs and runs.get("runs"), f"plugin listed no run (last answer {runs}, error {last_error})"
        run = runs["runs"][0]
        assert run == "version_0/profiler", runs
        q = urllib.parse.quote(run)
        views = _get_json(f"{base}/data/plugin/pytorch_profiler/views?run={q}")
        assert views, "the plugin parsed the trace into no view"
        workers = _get_json(f"{base}/data/plugin/pytorch_profiler/workers?run={q}&view={urllib.parse.quote(views[0])}")
        assert workers, "the run has no worker (trace file not parsed)"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
