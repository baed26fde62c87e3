"""Fit the GEMM's tile/split cost model (csrc/gemm.cu, `estimate_us`) to a sweep of timed configurations.

    python scripts/fit_gemm_model.py benchmarks/results/h100/gemm_sweep.json     (needs scipy)

The sweep comes from `python -m benchmarks.bench_gemm --sweep` on the GPU. Each row of the sweep is a
configuration (tile width, K splits) timed at one shape and GEMM. The model is

    waves x (MFLOP per unit x c[tile width] + tile elements / 1000 x c_epi)
    + (splits > 1) x (workspace MB x c_ws + c_reduce)

It is fitted by non-negative least squares on relative error. The script prints the coefficients to
copy into `estimate_us`, the median prediction error, and how fast the model's picks run compared
with the best configuration measured at each shape (on the sweep itself).

Rows whose split the kernel refuses (fewer than 4 K-blocks per split) are dropped: they ran the
default configuration, not the one their label names.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict

import numpy as np

BM, BK, SMS = 128, 64, 132
WIDTHS = (64, 128, 192, 256)


def problem(shape: str, gemm: str) -> tuple[int, int, int]:
    """The kernel's (M, N, K) for the benchmark's m x n x k and GEMM name."""
    m, n, k = map(int, shape.split("x"))
    if gemm.startswith("fwd"):
        return m, n, k
    if gemm.startswith("dgrad"):
        return m, k, n
    return n, k, m  # wgrad: dW [n, k], reduced over the m tokens


def features(M: int, N: int, K: int, bn: int, s: int) -> np.ndarray:
    kb = math.ceil(K / BK)
    units = math.ceil(M / BM) * math.ceil(N / bn) * s
    waves = math.ceil(units / SMS)
    f = np.zeros(len(WIDTHS) + 3)
    f[WIDTHS.index(bn)] = waves * 2.0 * BM * bn * BK * math.ceil(kb / s) / 1e6
    f[len(WIDTHS)] = waves * BM * bn / 1e3
    if s > 1:
        f[len(WIDTHS) + 1] = (s * M * N * 4 * 2 + M * N * 2) / 1e6
        f[len(WIDTHS) + 2] = 1.0
    return f


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep", help="a bench_gemm --sweep JSON")
    args = ap.parse_args()
    from scipy.optimize import nnls

    rows = []
    for r in json.load(open(args.sweep))["rows"]:
        parts = r["impl"].split()
        if parts[0] != "bertaccel" or len(parts) != 3:  # the swept cooperative configurations: "bertaccel n128 s2"
            continue
        bn, s = int(parts[1][1:]), int(parts[2][1:])
        M, N, K = problem(r["shape"], r["gemm"])
        if s > 1 and math.ceil(K / BK) // s < 4:
            continue
        rows.append((M, N, K, bn, s, r["ms"] * 1e3, (r["shape"], r["gemm"])))
    X = np.array([features(*r[:5]) for r in rows])
    y = np.array([r[5] for r in rows])
    coef, _ = nnls(X / y[:, None], np.ones(len(y)))
    pred = X @ coef
    names = [f"us/MFLOP n{w}" for w in WIDTHS] + ["us per 1000 tile elements", "us per workspace MB", "reduce us"]
    for name, c in zip(names, coef):
        print(f"{name:28s} {c:.4f}")
    print(f"{len(rows)} configurations; median |error| {np.median(np.abs(pred / y - 1)):.3f}")
    groups: dict = defaultdict(list)
    for r, p in zip(rows, pred):
        groups[r[6]].append((p, r[5]))
    share = [min(t for _, t in g) / min(g)[1] for g in groups.values()]
    print(f"model picks: {np.mean(share):.3f} of the best configuration's speed on average, worst {np.min(share):.3f}")


if __name__ == "__main__":
    main()
