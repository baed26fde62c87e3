"""Where a kernel's warps wait, per SASS instruction: reads `ncu -i REPORT --page source --csv --print-source sass`
(a report taken with --section SourceCounters / WarpStateStats) and prints the instructions holding the most warp
stall samples, and the samples summed by opcode.

    python scripts/ncu_stalls.py sass.csv [--top 30]
"""

from __future__ import annotations

import argparse
import collections
import csv
import io


def number(s: str) -> float:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    text = open(args.csv, encoding="utf-8", errors="replace").read()
    start = text.find('"Address"') if '"Address"' in text else text.find("Address")
    rows = list(csv.DictReader(io.StringIO(text[max(start, 0):])))
    if not rows:
        print("no rows in", args.csv)
        return
    cols = list(rows[0])
    print("COLUMNS", cols)
    total_col = next((c for c in cols if "Sampling" in c and "All" in c), None) or next(c for c in cols if "Sampl" in c)
    src_col = next((c for c in cols if c.lower() in ("source", "sass")), cols[1])
    total = sum(number(r[total_col]) for r in rows)
    print(f"{total_col}: {total:.0f} samples over {len(rows)} instructions")
    by_op = collections.Counter()
    for r in rows:  # the opcode, past a predicate (@P0, @!P1)
        words = [w for w in r[src_col].split() if not w.startswith("@")]
        by_op[words[0] if words else "?"] += number(r[total_col])
    print("BY OPCODE", ", ".join(f"{op} {100 * n / total:.1f}%" for op, n in by_op.most_common(15)))
    for r in sorted(rows, key=lambda r: -number(r[total_col]))[: args.top]:
        print(f"STALL {100 * number(r[total_col]) / total:5.1f}%  {r.get('Address', '?'):>6}  {r[src_col][:110]}")


if __name__ == "__main__":
    main()
