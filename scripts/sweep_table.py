"""One table from the logs of several `scripts/ln_bwd_sweep.py` runs (settings alternated, rounds repeated): per op
and rows x width, each setting's backward times in µs, one per run in log order (`36.9 / 37.2`), settings as columns
in the order they first appear, and each setting's median over the cells relative to the first setting's. Every
run's own header names its setting (`copy ceiling ... GB/s; setting: BERTACCEL_X=1`), so the logs can be
concatenated as they come back from the device.

    python scripts/sweep_table.py benchmarks/results/h200/ln_bwd_sweep_colsum_shapes_67b5dfb.log [more.log ...]
"""
from __future__ import annotations

import argparse
import re
import statistics
from pathlib import Path

HEADER = re.compile(r"copy ceiling \d+ GB/s; setting: (.*)$")
ROW = re.compile(r"BWD (\S+) (\d+)x(\d+): ([\d.]+) us")


def parse(lines) -> tuple[list[str], dict[tuple[str, int, int], dict[str, list[float]]]]:
    """The settings in order of appearance and, per (op, rows, width), each setting's times in log order."""
    settings: list[str] = []
    cells: dict[tuple[str, int, int], dict[str, list[float]]] = {}
    setting = None
    for line in lines:
        if m := HEADER.search(line):
            setting = m.group(1).strip()
            if setting not in settings:
                settings.append(setting)
        elif (m := ROW.match(line)) and setting is not None:
            key = (m.group(1), int(m.group(2)), int(m.group(3)))
            cells.setdefault(key, {}).setdefault(setting, []).append(float(m.group(4)))
    return settings, cells


def table(settings: list[str], cells: dict) -> str:
    out = ["| backward | " + " | ".join(settings) + " |", "| --- |" + " --- |" * len(settings)]
    for (op, rows, width), times in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        out.append(f"| {op} {rows}x{width} | " + " | ".join(" / ".join(f"{t:.1f}" for t in times.get(s, [])) or "-"
                                                           for s in settings) + " |")
    base = settings[0] if settings else None
    ratios = []
    for s in settings:
        r = [statistics.median(t[s]) / statistics.median(t[base]) for t in cells.values() if s in t and base in t]
        ratios.append(f"{statistics.median(r):.3f}" if r else "-")
    out.append("| median time / first setting's | " + " | ".join(ratios) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+", type=Path)
    args = ap.parse_args()
    lines = [line for path in args.logs for line in path.read_text().splitlines()]
    settings, cells = parse(lines)
    if not cells:
        raise SystemExit(f"no `BWD` rows under a `setting:` header in {', '.join(map(str, args.logs))}")
    print(table(settings, cells))


if __name__ == "__main__":
    main()
