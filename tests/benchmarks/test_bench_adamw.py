"""The optimizer benchmark on CPU (the harness): our AdamW ops' reference agrees with PyTorch's fused AdamW."""

import json


def test_cpu_run_agrees_with_pytorchs_fused_adamw(tmp_path):
    from benchmarks.bench_adamw import main

    out = tmp_path / "adamw.json"
    main(["--device", "cpu", "--models", "tiny", "--chunks", "default", "1024", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["impl"] for r in rows] == ["bertaccel chunk=default", "bertaccel chunk=1024", "pytorch fused"]
    assert rows[0]["params_M"] > 0
    for r in rows[:2]:
        assert float(r["max_diff"]) < 1e-6, r  # the same fp32 formula: parameters ~0.02, steps ~2e-5
