"""scripts/sweep_table.py: the logs of alternated ln_bwd_sweep.py runs as one table, a column per setting."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import sweep_table  # noqa: E402

LOG = """copy ceiling 4150 GB/s; setting: default
BWD layer_norm 2048x768: 10.0 us  918 GB/s (22%)
BWD layer_norm 16384x768: 36.0 us  2072 GB/s (50%)
  kernels: void ln_bwd 33.2; void column_sums 10.7
FIT default layer_norm x768: fixed 10.9 us, rate 2962 GB/s (72% of copy)
copy ceiling 4149 GB/s; setting: BERTACCEL_COLSUM=wide
BWD layer_norm 2048x768: 11.0 us  918 GB/s (22%)
BWD layer_norm 16384x768: 37.8 us  2072 GB/s (50%)
BWD rms_norm 2048x768: 8.0 us  918 GB/s (22%)
copy ceiling 4151 GB/s; setting: default
BWD layer_norm 2048x768: 10.4 us  918 GB/s (22%)
BWD layer_norm 16384x768: 36.4 us  2072 GB/s (50%)
"""


def test_each_setting_a_column_each_run_in_order_and_the_median_ratio():
    settings, cells = sweep_table.parse(LOG.splitlines())
    assert settings == ["default", "BERTACCEL_COLSUM=wide"]
    assert cells[("layer_norm", 2048, 768)] == {"default": [10.0, 10.4], "BERTACCEL_COLSUM=wide": [11.0]}
    text = sweep_table.table(settings, cells).splitlines()
    assert text[0] == "| backward | default | BERTACCEL_COLSUM=wide |"
    assert "| layer_norm 2048x768 | 10.0 / 10.4 | 11.0 |" in text
    assert "| rms_norm 2048x768 | - | 8.0 |" in text  # a cell one setting did not time
    # wide over default: 11.0 / 10.2 and 37.8 / 36.2 -> median of the two ratios
    expected = (11.0 / 10.2 + 37.8 / 36.2) / 2
    assert text[-1] == f"| median time / first setting's | 1.000 | {expected:.3f} |"


def test_a_log_without_rows_is_refused(tmp_path):
    log = tmp_path / "empty.log"
    log.write_text("copy ceiling 4150 GB/s; setting: default\n")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "sweep_table.py"), str(log)], capture_output=True, text=True)
    assert r.returncode != 0 and "no `BWD` rows" in r.stderr
