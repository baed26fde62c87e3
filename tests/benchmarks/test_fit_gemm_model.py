import json
import sys

import numpy as np

from scripts import fit_gemm_model as fit


def test_optimize_picks_moves_a_coefficient_until_the_model_picks_the_fastest():
    """Two configurations of one problem, each timed by one feature: the starting coefficients rank the slower one
    first (share 0.5); the coordinate search lowers the faster one's coefficient until it is picked (share 1)."""
    X = np.array([[1.0, 0.0], [0.0, 1.0]])
    y = np.array([2.0, 1.0])  # the second configuration is the faster
    groups = [np.array([0, 1])]
    start = np.array([1.0, 1.5])
    assert fit.pick_shares(start, X, y, groups).tolist() == [0.5]
    tuned = fit.optimize_picks(start, X, y, groups)
    assert fit.pick_shares(tuned, X, y, groups).tolist() == [1.0]


def test_the_script_evaluates_optimizes_and_reports_held_out_sweeps(tmp_path, monkeypatch, capsys):
    """Two synthetic sweeps of one shape (a cuBLAS row and three of our configurations, the 128-wide tile the
    fastest in both): --coefficients with --optimize-picks --holdout prints the coefficient line, and the picks of
    the fitted and of the held-out sweep are both the fastest configuration (share 1.000)."""
    def sweep(times):
        rows = [{"shape": "2048x768x768", "gemm": "fwd x W^T", "impl": "cublas", "ms": 0.010}]
        rows += [{"shape": "2048x768x768", "gemm": "fwd x W^T", "impl": f"bertaccel {cfg}", "ms": ms}
                 for cfg, ms in times.items()]
        return {"rows": rows}

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(sweep({"n64 s1": 0.020, "n128 s1": 0.012, "n256 s1": 0.015})))
    b.write_text(json.dumps(sweep({"n64 s1": 0.021, "n128 s1": 0.011, "n256 s1": 0.016})))
    coefficients = ",".join(["0.1"] * fit.N_FEATURES)
    monkeypatch.setattr(sys, "argv", ["fit", str(a), "--coefficients", coefficients, "--optimize-picks", "--holdout", str(b)])
    fit.main()
    out = capsys.readouterr().out
    assert "coefficients: " in out and "held-out sweeps: model picks: 1.000" in out
    assert "\nmodel picks: 1.000" in out
