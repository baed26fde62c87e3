"""scripts/gemm_share_table.py: docs/gemm.md's share-of-cuBLAS table from bench_gemm JSONs."""

from __future__ import annotations

import json
from pathlib import Path

from scripts import gemm_share_table


def bench(path: Path, cells: dict, tuned: dict | None = None) -> str:
    rows = []
    for (shape, gemm), share in cells.items():
        name = {"fwd": "fwd x W^T", "dgrad": "dgrad dy W", "wgrad": "wgrad dy^T x"}[gemm]
        rows.append({"shape": shape, "gemm": name, "impl": "cublas", "ms": 1.0})
        rows.append({"shape": shape, "gemm": name, "impl": "bertaccel", "ms": 1 / share, "of_cublas": share})
        if tuned and (shape, gemm) in tuned:
            rows.append({"shape": shape, "gemm": name, "impl": "bertaccel tuned", "of_cublas": tuned[(shape, gemm)]})
    rows.append({"shape": "16384x768x768", "gemm": "F.linear(bias) + gelu", "impl": "epilogue", "ms": 0.05, "of_cublas": 1.0})
    path.write_text(json.dumps({"rows": rows}))
    return str(path)


def test_table_columns_runs_and_marks_tuned_picks_that_differ(tmp_path):
    a = bench(tmp_path / "a.json", {("16384x768x768", "fwd"): 0.95, ("16384x768x768", "wgrad"): 0.84,
                                     ("2048x768x768", "dgrad"): 0.8})
    b = bench(tmp_path / "b.json", {("16384x768x768", "fwd"): 0.97, ("16384x768x768", "wgrad"): 0.85,
                                     ("2048x768x768", "dgrad"): 0.81},
              tuned={("16384x768x768", "fwd"): 0.975, ("16384x768x768", "wgrad"): 0.89})
    out = gemm_share_table.table([a, b]).splitlines()
    row = next(line for line in out if line.startswith("| 16384x768x768"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # large M on the left, M = 2048 on the right; the tuned wgrad (0.04 better) in brackets, the fwd (0.005) not
    assert cells[:4] == ["16384x768x768", "0.95 / 0.97", "-", "0.84 / 0.85 (0.89)"]
    assert cells[5:] == ["2048x768x768", "-", "0.80 / 0.81", "-"]
    summary = [line for line in out if line.endswith("at 0.9") or "tuned median" in line]
    assert summary[0].endswith("model median 0.840, 1 of 3 at 0.9")
    assert "tuned median 0.932, 1 of 2" in summary[1]
