"""benchmarks.common.measure_op: an implementation whose backward cannot be captured (twice) is timed eagerly,
marked so, and the CUDA generator is recovered before the next implementation runs (its eager dropout
would otherwise raise "Offset increment outside graph capture"). The GPU timers are stood in for, so the
bookkeeping runs on CPU."""

from __future__ import annotations

import pytest
import torch

from benchmarks import common


def test_a_backward_that_cannot_be_captured_is_timed_eagerly_after_recovering_the_generator(monkeypatch):
    pytest.importorskip("lightning")  # the recovery lives in bertaccel.modules.graphs
    import bertaccel.modules.graphs as graphs

    events = []

    def graph_time_ms(fn, inputs, **kwargs):
        if isinstance(inputs[0][1], list):  # the backward's (y, [leaves], dy) sets
            events.append("capture failed")
            raise RuntimeError("operation failed due to a previous error during capture\nmore text")
        return 0.5

    monkeypatch.setattr(common, "graph_time_ms", graph_time_ms)
    monkeypatch.setattr(common, "cuda_time_ms", lambda fn, inputs, **kw: events.append("eager") or 2.0)
    monkeypatch.setattr(graphs, "recover_from_failed_capture", lambda stream=None: events.append("recovered"))

    def make():
        return (torch.randn(4, 8), torch.randn(8))

    impls = {"ours": lambda x, w: x * w}
    rows = common.measure_op("scale", "4x8", impls, make, (0,), fwd_bytes=64, bwd_bytes=96, ceiling_gbs=100.0)
    (row,) = rows
    assert row["bwd_timing"].startswith("eager (capture failed: RuntimeError: operation failed due to a previous error")
    assert "more text" not in row["bwd_timing"]  # the first line of the message only
    assert row["bwd_us"] == 2000.0 and row["fwd_us"] == 500.0
    # the eager forward timing, two failed captures (one retry), each followed by the recovery, then the eager
    # backward - in that order
    assert events == ["eager", "capture failed", "recovered", "capture failed", "recovered", "eager"]


def test_a_backward_whose_first_capture_fails_is_captured_again(monkeypatch):
    """A one-time capture failure (the first capture of PyTorch's linear backward in a process, on the H100 and
    the H200): recovered, captured again, timed from the graph and labelled so."""
    pytest.importorskip("lightning")
    import bertaccel.modules.graphs as graphs

    events = []

    def graph_time_ms(fn, inputs, **kwargs):
        if isinstance(inputs[0][1], list):
            if "capture failed" not in events:
                events.append("capture failed")
                raise RuntimeError("operation failed due to a previous error during capture")
            events.append("captured")
            return 1.5
        return 0.5

    monkeypatch.setattr(common, "graph_time_ms", graph_time_ms)
    monkeypatch.setattr(common, "cuda_time_ms", lambda fn, inputs, **kw: events.append("eager") or 2.0)
    monkeypatch.setattr(graphs, "recover_from_failed_capture", lambda stream=None: events.append("recovered"))
    rows = common.measure_op("scale", "4x8", {"ours": lambda x, w: x * w}, lambda: (torch.randn(4, 8), torch.randn(8)),
                             (0,), fwd_bytes=64, bwd_bytes=96, ceiling_gbs=100.0)
    (row,) = rows
    assert row["bwd_timing"] == "graph (second capture)" and row["bwd_us"] == 1500.0
    assert events == ["eager", "capture failed", "recovered", "captured"]
