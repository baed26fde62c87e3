"""The table of a `gemm_variants` run (scripts/gpu_check.sh): kernel variants of the GEMM, built side by
side with different BERTACCEL_GEMM_DEFINES and timed in turn, one process per variant and round.

    python scripts/gemm_variants_table.py OUT inline:BERTACCEL_GEMM_HEAVY_EPILOGUE=0 noinline:...

Reads OUT/variant_<name>_gemm_r<round>.json (benchmarks/bench_gemm rows) and OUT/variant_<name>_ffn.json
(benchmarks/bench_ffn rows); prints, per shape and case, the median time over rounds of each variant and
its ratio to the first variant (< 1: faster than the first), and writes OUT/variants.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def collect(out: Path, names: list[str]) -> dict:
    gemm: dict[tuple[str, str], dict[str, list[float]]] = {}
    ffn: dict[tuple[str, str, str], dict[str, float]] = {}
    for name in names:
        for path in sorted(out.glob(f"variant_{name}_gemm_r*.json")):
            for row in json.loads(path.read_text())["rows"]:
                key = (row["shape"], row["gemm"] if row["impl"] == "epilogue" else f"{row['gemm']} {row['impl']}")
                gemm.setdefault(key, {}).setdefault(name, []).append(row["ms"])
        path = out / f"variant_{name}_ffn.json"
        if path.exists():
            for row in json.loads(path.read_text())["rows"]:
                for what in ("fwd_ms", "fwd+bwd_ms"):
                    ffn.setdefault((row["shape"], row["impl"], what), {})[name] = row[what]
    return {"gemm": gemm, "ffn": ffn}


def table(data: dict, names: list[str]) -> list[dict]:
    rows = []
    for (shape, case), per in data["gemm"].items():
        rows.append({"bench": "gemm", "shape": shape, "case": case,
                     **{n: round(statistics.median(per[n]), 4) if n in per else None for n in names}})
    for (shape, impl, what), per in data["ffn"].items():
        rows.append({"bench": "ffn", "shape": shape, "case": f"{impl} {what}", **{n: per.get(n) for n in names}})
    first = names[0]
    for r in rows:
        for n in names[1:]:
            r[f"{n}/{first}"] = round(r[n] / r[first], 3) if r.get(n) and r.get(first) else None
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("variants", nargs="+", help="name:DEFINES, as in GEMM_VARIANTS")
    args = ap.parse_args(argv)
    names = [v.split(":", 1)[0] for v in args.variants]
    rows = table(collect(args.out, names), names)
    (args.out / "variants.json").write_text(json.dumps({"variants": args.variants, "rows": rows}, indent=2))
    cols = ["bench", "shape", "case", *names, *[f"{n}/{names[0]}" for n in names[1:]]]
    widths = [max(len(c), *(len(str(r.get(c))) for r in rows)) if rows else len(c) for c in cols]
    print("VARIANTS " + " | ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("VARIANTS " + " | ".join(str(r.get(c)).ljust(w) for c, w in zip(cols, widths)))


if __name__ == "__main__":
    main()
