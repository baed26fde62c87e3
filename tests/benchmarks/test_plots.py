"""The benchmark pictures draw from the JSON layouts the benchmarks write."""

from __future__ import annotations

import json

import pytest

from benchmarks.plots import plot_file

pytest.importorskip("matplotlib")


def test_ops_and_e2e_json_become_pngs(tmp_path):
    ops = {"environment": {"gpu": "test"}, "copy_ceiling_GBs": 3000, "rows": [
        {"op": "layer_norm", "shape": "16x8 bfloat16", "impl": impl, "fwd_%copy": f, "bwd_%copy": b}
        for impl, f, b in (("pytorch", 40, 20), ("compile", 50, 30), ("bertaccel", 80, 60))]}
    e2e = {"environment": {}, "rows": [
        {"model": "bert-base", "shape": "16x128", "workload": w, "variant": v, "ms": ms, "speedup_vs_sdpa": s}
        for w in ("train", "infer") for v, ms, s in (("hf-sdpa-bf16", 10.0, 1.0), ("graphs", 4.0, 2.5))]}
    for name, payload in (("ops.json", ops), ("e2e.json", e2e)):
        path = tmp_path / name
        path.write_text(json.dumps(payload))
        png = plot_file(path)
        assert png == path.with_suffix(".png") and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    unknown = tmp_path / "other.json"
    unknown.write_text(json.dumps({"rows": [{"x": 1}]}))
    assert plot_file(unknown) is None
