"""Why each kernel's warps waited, from an Nsight Compute report's raw page: per kernel its duration and the
cycles per issued instruction spent in each stall reason (the WarpStateStats section's
`smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio`), largest first.

    ncu --section WarpStateStats --section SpeedOfLight -o rep python scripts/gemm_calls.py ...
    ncu -i rep.ncu-rep --page raw --csv > raw.csv
    python scripts/ncu_stall_reasons.py raw.csv [--top 8] [--label cold]

`no_instruction` is the instruction fetch: a warp whose next instruction is not in the instruction cache.
"""
from __future__ import annotations

import argparse
import csv
import re
import sys

STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio")


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def stall_rows(lines: list[str]) -> list[dict]:
    """One dict per profiled kernel: name, duration_us, stalls {reason: cycles per issued instruction}."""
    rows = list(csv.reader(line for line in lines if line.strip()))
    if not rows:
        return []
    header = rows[0]
    body = [r for r in rows[1:] if len(r) == len(header)]
    if body and _number(body[0][header.index("gpu__time_duration.sum")] if "gpu__time_duration.sum" in header else "x") is None:
        units, body = body[0], body[1:]  # the raw page's second line holds the units
    else:
        units = [""] * len(header)
    name_col = header.index("Kernel Name")
    out = []
    for r in body:
        row = {"name": r[name_col], "duration_us": None, "stalls": {}}
        if "gpu__time_duration.sum" in header:
            i = header.index("gpu__time_duration.sum")
            value = _number(r[i])
            scale = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "nsecond": 1e-3, "ms": 1e3, "msecond": 1e3}.get(units[i], 1.0)
            row["duration_us"] = None if value is None else value * scale
        for i, col in enumerate(header):
            m = STALL.fullmatch(col)
            value = _number(r[i]) if m else None
            if m and value is not None and not m.group(1).endswith("_not_issued"):
                row["stalls"][m.group(1)] = value
        out.append(row)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--label", default="", help="printed before each line (e.g. the cache setting)")
    args = ap.parse_args(argv)
    with open(args.csv) if args.csv != "-" else sys.stdin as f:
        rows = stall_rows(f.read().splitlines())
    for row in rows:
        stalls = sorted(row["stalls"].items(), key=lambda kv: -kv[1])
        total = sum(row["stalls"].values())
        duration = f"{row['duration_us']:.2f} us" if row["duration_us"] is not None else "?"
        top = ", ".join(f"{k} {v:.2f}" for k, v in stalls[: args.top])
        print(f"STALLS {args.label} {row['name'][:70]:70s} | {duration} | {total:.2f} cycles/issue: {top}")


if __name__ == "__main__":
    main()
