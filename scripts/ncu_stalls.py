"""Where a kernel's warps wait, per SASS instruction: reads `ncu -i REPORT --page source --csv --print-source sass`
(a report taken with --section SourceCounters / WarpStateStats) and prints the instructions holding the most warp
stall samples, the samples summed by opcode, and the code the kernel ran (FOOTPRINT: the instructions executed at
least once, the 128-byte instruction-cache lines they sit in and the contiguous runs they form - what a launch
fetches into cold instruction caches).

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


def footprint(rows: list[dict], executed_col: str, address_col: str = "Address") -> dict:
    """The executed code: instructions run at least once, their 128-byte lines, contiguous runs, address span."""
    addresses = sorted(int(r[address_col], 16) for r in rows if number(r[executed_col]) > 0)
    if not addresses:
        return {"instructions": 0, "lines": 0, "runs": 0, "span_kb": 0.0, "total_instructions": len(rows)}
    runs = 1 + sum(1 for x, y in zip(addresses, addresses[1:]) if y - x > 16)  # SASS instructions are 16 bytes
    return {"instructions": len(addresses), "lines": len({a // 128 for a in addresses}), "runs": runs,
            "span_kb": round((addresses[-1] - addresses[0] + 16) / 1024, 1), "total_instructions": len(rows)}


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
    executed_col = next((c for c in cols if c == "Instructions Executed"), None)
    if executed_col and "Address" in cols:
        f = footprint(rows, executed_col)
        print(f"FOOTPRINT executed {f['instructions']} of {f['total_instructions']} instructions "
              f"({f['instructions'] * 16 / 1024:.1f} KB) in {f['lines']} 128-byte lines, {f['runs']} contiguous runs, "
              f"span {f['span_kb']} KB")
    for r in sorted(rows, key=lambda r: -number(r[total_col]))[: args.top]:
        print(f"STALL {100 * number(r[total_col]) / total:5.1f}%  {r.get('Address', '?'):>6}  {r[src_col][:110]}")


if __name__ == "__main__":
    main()
