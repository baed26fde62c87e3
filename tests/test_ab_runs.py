"""scripts/ab_runs.sh: runs a command alternately against this checkout's src/ and another src/ tree
(first on PYTHONPATH), with @TAG@ replaced per run - the same-machine A/B of two versions' kernels."""

from __future__ import annotations

import os
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


def test_alternates_several_trees_in_the_order_given(tmp_path):
    trees = []
    for name in "BC":
        src = tmp_path / name / "src"
        src.mkdir(parents=True)
        (src / "ab_probe_module.py").write_text(f"WHICH = '{name}'\n")
        trees.append(str(src))
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "ab_runs.sh"), ",".join(trees), "2", "--", sys.executable, "-c",
         "import os\n"
         "try:\n import ab_probe_module as m; w = m.WHICH\n"
         "except ImportError:\n w = 'A'\n"
         "print(os.environ['BERTACCEL_AB'], w)"],
        capture_output=True, text=True, check=True).stdout.splitlines()
    runs = [line for line in out if not line.startswith("==")]
    assert runs == ["A1 A", "B1 B", "C1 C", "A2 A", "B2 B", "C2 C"]


def test_refuses_an_unknown_build_kind():
    r = subprocess.run(["bash", str(ROOT / "scripts" / "ab_runs.sh"), "--build", "gemm", "x", "1", "--", "echo"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr


def test_a_failed_build_stops_before_any_run(tmp_path):
    """--build builds every tree first, in parallel; where one cannot build (here a tree whose build module
    refuses) nothing runs and the exit status says so."""
    ops = tmp_path / "other" / "src" / "bertaccel" / "ops"
    ops.mkdir(parents=True)
    (ops.parent / "__init__.py").write_text("")
    (ops / "__init__.py").write_text("")
    (ops / "build.py").write_text("def load_attention(verbose=False):\n    return False\n\n"
                                  "def attention_reason():\n    return 'stub tree'\n")
    env = {**os.environ, "AB_LOG_DIR": str(tmp_path / "logs"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "ab_runs.sh"), "--build", "attention", str(ops.parents[1]), "1",
                        "--", "echo", "ran"], capture_output=True, text=True, env=env)
    assert r.returncode == 1 and "ran" not in r.stdout
    assert "build B failed" in r.stderr and "stub tree" in (tmp_path / "logs" / "build_B.log").read_text()
