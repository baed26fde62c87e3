"""The GEMM share-of-cuBLAS table (docs/gemm.md) from `benchmarks/bench_gemm.py` JSONs: per BERT GEMM cell, the
model's pick as a share of cuBLAS in each run given ("a / b / c"), the tuned pick in brackets where a run has
one (`--tune`) and it differs from the model's by 0.02 or more; then per run the median and the cells at 0.9.

    python scripts/gemm_share_table.py benchmarks/results/h100/gemm_epilogue_unrolled_7f86ad8.json \
        benchmarks/results/h100/gemm_tuned_7f86ad8.json
"""

from __future__ import annotations

import argparse
import json
import statistics

GEMMS = ("fwd", "dgrad", "wgrad")


def shares(path: str) -> tuple[dict, dict]:
    """(model pick, tuned pick) share of cuBLAS per (shape, gemm) of one bench JSON."""
    model, tuned = {}, {}
    for r in json.load(open(path))["rows"]:
        key = (r["shape"], r["gemm"].split()[0])
        if r["impl"] == "bertaccel":
            model[key] = r["of_cublas"]
        elif r["impl"] == "bertaccel tuned":
            tuned[key] = r["of_cublas"]
    return model, tuned


def cell(runs: list[tuple[dict, dict]], key) -> str:
    vals = [m[key] for m, _ in runs if key in m]
    text = " / ".join(f"{v:.2f}" for v in vals) or "-"
    extra = [t[key] for m, t in runs if key in t and key in m and abs(t[key] - m[key]) >= 0.02]
    return text + (f" ({extra[-1]:.2f})" if extra else "")


def table(paths: list[str]) -> str:
    runs = [shares(p) for p in paths]
    shapes = sorted({k[0] for m, _ in runs for k in m}, key=lambda s: tuple(map(int, s.split("x"))))
    small = [s for s in shapes if int(s.split("x")[0]) < 16384]
    large = [s for s in shapes if int(s.split("x")[0]) >= 16384]
    lines = ["| M x N x K | fwd | dgrad | wgrad | | M x N x K | fwd | dgrad | wgrad |", "| --- " * 9 + "|"]
    for i in range(max(len(large), len(small))):
        left = [large[i]] + [cell(runs, (large[i], g)) for g in GEMMS] if i < len(large) else [""] * 4
        right = [small[i]] + [cell(runs, (small[i], g)) for g in GEMMS] if i < len(small) else [""] * 4
        lines.append("| " + " | ".join(left + [""] + right) + " |")
    for p, (m, t) in zip(paths, runs):
        line = f"{p}: model median {statistics.median(m.values()):.3f}, {sum(v >= 0.9 for v in m.values())} of {len(m)} at 0.9"
        if t:
            line += f"; tuned median {statistics.median(t.values()):.3f}, {sum(v >= 0.9 for v in t.values())} of {len(t)}"
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="bench_gemm JSONs (one column value per run)")
    print(table(ap.parse_args().runs))


if __name__ == "__main__":
    main()
