"""scripts/ab_runs.sh: runs a command alternately against this checkout's src/ and another src/ tree
(first on PYTHONPATH), with @TAG@ replaced per run - the same-machine A/B of two versions' kernels."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_alternates_the_two_trees_and_tags_each_run(tmp_path):
    other = tmp_path / "other" / "src"
    other.mkdir(parents=True)
    (other / "ab_probe_module.py").write_text("WHICH = 'B'\n")
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "ab_runs.sh"), str(other), "2", "--", sys.executable, "-c",
         "import os, sys\n"
         "try:\n import ab_probe_module as m; w = m.WHICH\n"
         "except ImportError:\n w = 'A'\n"
         "print(os.environ['BERTACCEL_AB'], w, sys.argv[1])", "out_@TAG@.json"],
        capture_output=True, text=True, check=True).stdout.splitlines()
    runs = [line for line in out if not line.startswith("==")]
    assert runs == ["A1 A out_A1.json", "B1 B out_B1.json", "A2 A out_A2.json", "B2 B out_B2.json"]
    assert out[0].startswith("== A1 (") and str(ROOT / "src") in out[0]


def test_refuses_a_malformed_call():
    r = subprocess.run(["bash", str(ROOT / "scripts" / "ab_runs.sh"), "x", "1", "echo"], capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr
