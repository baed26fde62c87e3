"""tests.conftest.run_in_child: the helper the kernel-switch and crash-path tests run their checks through."""

from __future__ import annotations

from tests.conftest import ROOT, run_in_child


def test_a_child_gets_the_variables_set_and_not_those_removed_and_imports_the_sources(monkeypatch):
    monkeypatch.setenv("BERTACCEL_CHILD_KEPT", "kept")
    monkeypatch.setenv("BERTACCEL_CHILD_REMOVED", "there")
    code = ("import os, pathlib, bertaccel, tests.ops.conftest\n"
            "print(os.environ.get('BERTACCEL_CHILD_SET'), os.environ.get('BERTACCEL_CHILD_KEPT'),"
            " os.environ.get('BERTACCEL_CHILD_REMOVED'), pathlib.Path.cwd(), pathlib.Path(bertaccel.__file__).parent)")
    r = run_in_child(code, {"BERTACCEL_CHILD_SET": "1", "BERTACCEL_CHILD_REMOVED": None}, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["1", "kept", "None", str(ROOT), str(ROOT / "src" / "bertaccel")], r.stdout


def test_a_failing_child_is_reported_not_raised():
    r = run_in_child("import sys; print('before'); sys.exit(3)", timeout=60)
    assert r.returncode == 3 and r.stdout.strip() == "before"
