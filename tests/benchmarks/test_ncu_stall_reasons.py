"""scripts/ncu_stall_reasons.py reads Nsight Compute's raw CSV page (units line included)."""
from scripts.ncu_stall_reasons import stall_rows

RAW = '''"ID","Kernel Name","gpu__time_duration.sum","smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio","smsp__average_warps_issue_stalled_wait_per_issue_active.ratio","smsp__average_warps_issue_stalled_wait_not_issued_per_issue_active.ratio"
"","","nsecond","ratio","ratio","ratio"
"0","gemm_kernel<128>","22,240","3.5","1.25","0.5"
"1","nvjet","18460","0.25","2","0.1"
'''


def test_durations_in_microseconds_and_stalls_by_reason():
    rows = stall_rows(RAW.splitlines())
    assert [r["name"] for r in rows] == ["gemm_kernel<128>", "nvjet"]
    assert abs(rows[0]["duration_us"] - 22.24) < 1e-9 and abs(rows[1]["duration_us"] - 18.46) < 1e-9
    assert rows[0]["stalls"] == {"no_instruction": 3.5, "wait": 1.25}  # the not-issued variants left out
