"""Fit the GEMM's tile/split cost model (csrc/gemm.cu, `estimate_us`) to a sweep of timed configurations.

    python scripts/fit_gemm_model.py benchmarks/results/h100/gemm_sweep.json \
        benchmarks/results/h100/gemm_pingpong_sweep.json                          (needs scipy)

The sweep comes from `python -m benchmarks.bench_gemm --sweep` on the GPU. Each row of the sweep is a
configuration (tile width, K splits) timed at one shape and GEMM. The model is

    waves x (MFLOP per unit x c[tile width] + tile elements / 1000 x c_epi)
    + (splits > 1) x (workspace MB x c_ws + c_reduce)

for the cooperative schedule, and for ping-pong (schedule 2: one warpgroup per 128-row tile, the
other warpgroup's epilogue overlapping)

    waves x (MFLOP per unit x c_pp[tile width] + tile elements / 1000 x c_pp_epi) + tile elements / 1000 x c_pp_tail
    + (splits > 1) x (workspace MB x c_ws + c_reduce)

and for 192-row tiles (schedule 4: three consumer warpgroups, cooperative) the cooperative form with its
own c_r192[tile width] and c_r192_epi. K splits summed inside the kernel (rows labelled "kernel-sum":
the last split of a tile to finish adds the others' partials, then runs the epilogue) replace the
workspace terms with

    (splits > 1) x (partials MB x c_ks + tile elements / 1000 x (splits - 1) x c_ks_add + c_ks0)

(the partials the other splits write and the last reads; the last one's additions, which no other
block overlaps; the counters' memset).

Several sweeps (e.g. one per schedule, from different runs) are fitted together: each row's time is
rescaled by the ratio of cuBLAS's time at its shape in the last sweep that timed that shape to that in
its own sweep.

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

BK, SMS = 64, 132
WIDTHS = (64, 96, 128, 192, 256)


def problem(shape: str, gemm: str) -> tuple[int, int, int]:
    """The kernel's (M, N, K) for the benchmark's m x n x k and GEMM name."""
    m, n, k = map(int, shape.split("x"))
    if gemm.startswith("fwd"):
        return m, n, k
    if gemm.startswith("dgrad"):
        return m, k, n
    return n, k, m  # wgrad: dW [n, k], reduced over the m tokens


PP_WIDTHS = (64, 128)
R192_WIDTHS = (64, 128, 192)
N_FEATURES = len(WIDTHS) + len(PP_WIDTHS) + len(R192_WIDTHS) + 9


def features(M: int, N: int, K: int, bn: int, s: int, kind: str = "", kernel_sum: bool = False) -> np.ndarray:
    """kind: "" cooperative, "pp" ping-pong, "r192" 192-row tiles; kernel_sum: K splits summed in the kernel."""
    BM = 192 if kind == "r192" else 128
    kb = math.ceil(K / BK)
    units = math.ceil(M / BM) * math.ceil(N / bn) * s
    waves = math.ceil(units / SMS)
    mflop = waves * 2.0 * BM * bn * BK * math.ceil(kb / s) / 1e6
    f = np.zeros(N_FEATURES)
    base = len(WIDTHS) + len(PP_WIDTHS) + len(R192_WIDTHS)
    if kind == "pp":
        f[len(WIDTHS) + PP_WIDTHS.index(bn)] = mflop
        f[base + 3] = waves * BM * bn / 1e3
        f[base + 4] = BM * bn / 1e3
    elif kind == "r192":
        f[len(WIDTHS) + len(PP_WIDTHS) + R192_WIDTHS.index(bn)] = mflop
        f[base + 5] = waves * BM * bn / 1e3
    else:
        f[WIDTHS.index(bn)] = mflop
        f[base] = waves * BM * bn / 1e3
    if s > 1 and kernel_sum:
        f[base + 6] = (s - 1) * M * N * 4 * 2 / 1e6
        f[base + 7] = BM * bn / 1e3 * (s - 1)
        f[base + 8] = 1.0
    elif s > 1:
        f[base + 1] = (s * M * N * 4 * 2 + M * N * 2) / 1e6
        f[base + 2] = 1.0
    return f


NAMES = ([f"us/MFLOP n{w}" for w in WIDTHS] + [f"us/MFLOP pp n{w}" for w in PP_WIDTHS]
         + [f"us/MFLOP r192 n{w}" for w in R192_WIDTHS]
         + ["us per 1000 tile elements", "us per workspace MB", "reduce us",
            "pp: us per 1000 tile elements per wave", "pp: us per 1000 tile elements, once",
            "r192: us per 1000 tile elements", "kernel sum: us per partials MB",
            "kernel sum: us per 1000 tile elements added", "kernel sum us"])


def load_rows(paths: list[str]):
    """The sweeps' configurations: (M, N, K, bn, splits, kind, kernel_sum, us rescaled, (shape, GEMM)) rows and
    cuBLAS's time per (shape, GEMM) in the last sweep that timed it."""

    def cublas_ms(data):
        return {(r["shape"], r["gemm"]): r["ms"] for r in data["rows"] if r["impl"] == "cublas"}

    files = [json.load(open(path)) for path in paths]
    scale_to = {}  # cuBLAS's time per (shape, GEMM) in the last sweep that timed it
    for data in files:
        scale_to.update(cublas_ms(data))
    rows = []
    for data in files:
        own = cublas_ms(data)
        for r in data["rows"]:
            parts = r["impl"].split()  # "bertaccel n128 s2" (cooperative), "bertaccel pp n128 s1", "bertaccel r192 n64 s1"
            if parts[-1] == "c2":
                continue  # clusters of two (bench_gemm --clusters 2): not modelled, the model picks single blocks
            kernel_sum = parts[-1] == "kernel-sum"  # "bertaccel n128 s2 kernel-sum": K splits summed in the kernel
            if parts[-1].endswith("-sum"):
                parts = parts[:-1]
            if parts[0] != "bertaccel" or len(parts) not in (3, 4):
                continue
            if parts[1] == "sk":
                continue  # stream-K has its own estimate (estimate_streamk_us), not fitted here
            kind = parts[1] if len(parts) == 4 else ""
            bn, s = int(parts[-2][1:]), int(parts[-1][1:])
            M, N, K = problem(r["shape"], r["gemm"])
            if s > 1 and math.ceil(K / BK) // s < 4:
                continue  # refused split: the kernel ran its default configuration
            key = (r["shape"], r["gemm"])
            if key not in scale_to or key not in own:
                continue
            rows.append((M, N, K, bn, s, kind, kernel_sum, r["ms"] * 1e3 * scale_to[key] / own[key], key))
    return rows, scale_to


def pick_shares(coef: np.ndarray, X: np.ndarray, y: np.ndarray, groups: list[np.ndarray]) -> np.ndarray:
    """Per (shape, GEMM): the best swept time over the time of the configuration the model picks (1 = the best)."""
    pred = X @ coef
    return np.array([y[g].min() / y[g[np.argmin(pred[g])]] for g in groups])


def optimize_picks(coef: np.ndarray, X: np.ndarray, y: np.ndarray, groups: list[np.ndarray], rounds: int = 12) -> np.ndarray:
    """Coordinate search on the coefficients (each scaled by a few factors in turn, a change kept when it raises
    the picks' mean share of the best swept speed by more than 1e-4): least squares fits the times, not which
    configuration is fastest, and the two disagree where the candidates' times are close."""
    coef = coef.copy()
    best = pick_shares(coef, X, y, groups).mean()
    for _ in range(rounds):
        improved = False
        for i in range(len(coef)):
            for factor in (0.5, 0.7, 0.85, 0.93, 1.07, 1.15, 1.4, 2.0):
                trial = coef.copy()
                trial[i] = trial[i] * factor if trial[i] > 0 else (factor - 0.5) * 0.05  # a zero: try small values
                score = pick_shares(trial, X, y, groups).mean()
                if score > best + 1e-4:
                    coef, best, improved = trial, score, True
        if not improved:
            break
    return coef


def report(rows, scale_to, pred: np.ndarray, label: str) -> None:
    """Print each (shape, GEMM)'s pick (the least predicted time `pred` per row) against the best swept configuration,
    then the picks' mean share of the best."""
    groups: dict = defaultdict(list)
    for r, p in zip(rows, pred):
        groups[r[8]].append((p, r[7], (f"{r[5]} " if r[5] else "") + f"n{r[3]} s{r[4]}" + (" ks" if r[6] else "")))
    share = []
    for key, g in sorted(groups.items()):
        pick = min(g)
        best = min(t for _, t, _ in g)
        share.append(best / pick[1])
        print(f"{key[0]:16s} {key[1]:14s} pick {pick[2]:12s} {scale_to[key] / pick[1] * 1e3:.3f} of cuBLAS "
              f"(best swept {min(g, key=lambda v: v[1])[2]}: {scale_to[key] / best * 1e3:.3f})")
    print(f"{label}model picks: {np.mean(share):.3f} of the best configuration's speed on average, worst {np.min(share):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweeps", nargs="+", help="bench_gemm --sweep JSONs (later ones set the time scale of the shapes they time)")
    ap.add_argument("--coefficients", help="start from (or, without --optimize-picks, evaluate) these, comma-separated "
                    "in the printed order (e.g. estimate_us's current ones), instead of the least-squares fit")
    ap.add_argument("--optimize-picks", action="store_true",
                    help="then adjust the coefficients for the picks' share of the best swept speed (coordinate search)")
    ap.add_argument("--holdout", nargs="*", default=[],
                    help="sweeps not fitted, on which the resulting coefficients' picks are reported too")
    args = ap.parse_args()

    rows, scale_to = load_rows(args.sweeps)
    X = np.array([features(*r[:7]) for r in rows])
    y = np.array([r[7] for r in rows])
    if args.coefficients:
        coef = np.array([float(c) for c in args.coefficients.split(",")])
        assert len(coef) == N_FEATURES, f"{N_FEATURES} coefficients, got {len(coef)}"
    else:
        from scipy.optimize import nnls

        coef, _ = nnls(X / y[:, None], np.ones(len(y)))
    if args.optimize_picks:
        keys = sorted({r[8] for r in rows})
        groups = [np.array([i for i, r in enumerate(rows) if r[8] == k]) for k in keys]
        coef = optimize_picks(coef, X, y, groups)
    pred = X @ coef
    for name, c in zip(NAMES, coef):
        print(f"{name:40s} {c:.4f}")
    print("coefficients: " + ",".join(f"{c:.4f}" for c in coef))
    print(f"{len(rows)} configurations; median |error| {np.median(np.abs(pred / y - 1)):.3f}")
    report(rows, scale_to, pred, "")
    if args.holdout:
        held, held_scale = load_rows(args.holdout)
        report(held, held_scale, np.array([features(*r[:7]) for r in held]) @ coef, "held-out sweeps: ")


if __name__ == "__main__":
    main()
