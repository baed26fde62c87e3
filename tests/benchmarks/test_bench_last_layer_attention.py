"""The last layer's attention benchmark on CPU: its implementations agree with the float64 reference (the harness)."""

import json


def test_cpu_run_writes_errors_near_bf16_rounding(tmp_path):
    from benchmarks.bench_last_layer_attention import main

    out = tmp_path / "lla.json"
    main(["--device", "cpu", "--shapes", "2x1x16", "3x4x24", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert {r["impl"] for r in rows} == {"sdpa", "bertaccel", "fp32-matmuls"} and len(rows) == 6
    for r in rows:
        assert "error" not in r, r
        assert 0 < r["err_out"] < 1e-2 and 0 < r["err_dq"] < 1e-2 and 0 < r["err_dkv"] < 1e-2, r
