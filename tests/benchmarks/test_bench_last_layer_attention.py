"""The last layer's attention benchmark on CPU: its implementations agree with the float64 reference (the harness)."""

import json


def test_cpu_run_writes_errors_near_bf16_rounding(tmp_path):
    from benchmarks.bench_last_layer_attention import main

    out = tmp_path / "lla.json"
    main(["--device", "cpu", "--shapes", "2x1x16", "3x4x24", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    impls = {"sdpa", "bertaccel", "fp32-matmuls", "bertaccel-varlen", "bertaccel-repad"}
    assert {r["impl"] for r in rows} == impls and len(rows) == 10
    for r in rows:
        assert "error" not in r, r
        assert 0 < r["err_out"] < 1e-2 and 0 < r["err_dq"] < 1e-2 and 0 < r["err_dkv"] < 1e-2, r
    # the packed forms (dK / dV at the packed rows) give the padded form's errors: the same math on the same rows
    for shape in ("2x1x16", "3x4x24"):
        by = {r["impl"]: r for r in rows if r["shape"] == shape}
        for impl in ("bertaccel-varlen", "bertaccel-repad"):
            for k in ("err_out", "err_dq", "err_dkv"):
                assert abs(by[impl][k] - by["bertaccel"][k]) <= 1e-4, (shape, impl, k)
