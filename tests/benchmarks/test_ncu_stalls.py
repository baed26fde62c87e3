"""scripts/ncu_stalls.py: the per-instruction warp-stall summary of an `ncu --page source --csv` export."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ncu_stalls.py"


def test_stall_summary_ranks_instructions_and_sums_opcodes(tmp_path):
    # what ncu prints: a preamble, then the CSV (thousands with commas, a predicate before some opcodes)
    csv = tmp_path / "sass.csv"
    csv.write_text(
        "==PROF== Connected to process 1\n"
        '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","Instructions Executed"\n'
        '"0x10","HGMMA.64x256x16.F32.BF16 R24, gdesc[UR16], R24","1,000","900","12"\n'
        '"0x20","WARPGROUP.DEPBAR.LE gsb0, 0x1","2,500","2,400","12"\n'
        '"0x30","@!P0  BRA 0x10","500","500","40"\n'
        '"0x40","HGMMA.64x256x16.F32.BF16 R24, gdesc[UR20], R24","1,000","800","12"\n'
    )
    out = subprocess.run([sys.executable, str(SCRIPT), str(csv), "--top", "3"], capture_output=True, text=True, check=True).stdout
    assert "5000 samples over 4 instructions" in out
    by_op = next(line for line in out.splitlines() if line.startswith("BY OPCODE"))
    assert "WARPGROUP.DEPBAR.LE 50.0%" in by_op and "HGMMA.64x256x16.F32.BF16 40.0%" in by_op and "BRA 10.0%" in by_op
    stalls = [line for line in out.splitlines() if line.startswith("STALL")]
    assert len(stalls) == 3  # --top
    assert "50.0%" in stalls[0] and "0x20" in stalls[0] and "DEPBAR" in stalls[0]
    assert all("20.0%" in line and "HGMMA" in line for line in stalls[1:])


def test_stall_summary_of_an_empty_export(tmp_path):
    csv = tmp_path / "empty.csv"
    csv.write_text('"Address","Source","Warp Stall Sampling (All Samples)"\n')
    out = subprocess.run([sys.executable, str(SCRIPT), str(csv)], capture_output=True, text=True, check=True).stdout
    assert "no rows" in out


def test_footprint_counts_executed_lines_and_runs():
    sys.path.insert(0, str(SCRIPT.parent))
    from ncu_stalls import footprint

    rows = [{"Address": hex(a), "Instructions Executed": e}
            for a, e in [(0x0, "1"), (0x10, "1"), (0x20, "0"), (0x80, "5"), (0x400, "1,024"), (0x410, "1")]]
    f = footprint(rows, "Instructions Executed")
    assert f["instructions"] == 5 and f["total_instructions"] == 6
    assert f["lines"] == 3  # 0x0 and 0x10 in line 0, 0x80 in line 1, 0x400 and 0x410 in line 8
    assert f["runs"] == 3  # 0x0-0x10, 0x80, 0x400-0x410
    assert f["span_kb"] == round((0x410 + 16) / 1024, 1)
