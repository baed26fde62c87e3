"""The open issues' speed targets, read from one call's benchmark JSONs: one line per target cell with the measured
figure, the target and whether it is met, and the GPU and commit each file names (the targets are written for an
H100; on another GPU the table says so and counts nothing as met). `scripts/measure_targets.sh` makes the files.

    python scripts/targets_table.py DIR                 # DIR/ops.json, gemm.json, attention.json, e2e.json
    python scripts/targets_table.py --ops a.json --gemm b.json --attention c.json --e2e d.json

Any file may be missing: its targets print as "not measured". What each target is (the issues' words):
- issue 9: LayerNorm, residual LayerNorm, RMSNorm at 16384 rows: forward >= 85% of the copy ceiling, backward >= 70%;
  at 2,048 rows no slower than PyTorch; softmax and bias+GELU forward >= 88% (their large cells); every op at least
  as fast as torch.compile's kernel, forward and backward.
- issue 10: our GEMM >= 0.9 of cuBLAS in every BERT cell, one cell faster than cuBLAS; the BERT-base 32x512 graphed
  train step <= 24 ms.
- issue 11: attention forward + backward faster than SDPA's best backend at seq 128 and 512, head dims 64 and 32.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

TARGET_GPU = "H100"
NORM_OPS = ("layer_norm", "residual_layer_norm", "rms_norm")
ATTENTION_CELLS = ("128x128x12x64:full", "128x128x12x32:full", "32x512x12x64:full", "32x512x12x32:full")
OURS_ATTENTION = ("bertaccel (padded, hf interface)", "bertaccel-varlen (packed)")
# (the last: `model.last_layer_cls_only`, the same step's function with the last layer's unread positions skipped;
# its line names it)
STEP_VARIANTS = ("attn-fused-graphs", "attn-ffn-gemm-fused-graphs", "attn-fused-graphs-cls-only")
STEP_TARGET_MS = 24.0


def _load(path: str | None) -> dict | None:
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _rows_per_cell(rows: list[dict]) -> dict:
    """{(op, shape): {impl: row}} from bench_ops rows."""
    out: dict = {}
    for r in rows:
        out.setdefault((r["op"], r["shape"]), {})[r["impl"]] = r
    return out


def ops_targets(doc: dict) -> list[tuple]:
    """(issue, target, cell, measured, met) for the row ops."""
    lines = []
    cells = _rows_per_cell(doc["rows"])
    for (op, shape), impls in sorted(cells.items()):
        ours = impls.get("bertaccel")
        if ours is None:
            continue
        rows = int(shape.split("x")[0])
        if op in NORM_OPS and rows >= 16384:
            lines.append((9, "forward >= 85% of copy", f"{op} {shape}", f"{ours['fwd_%copy']}%", ours["fwd_%copy"] >= 85))
            if ours.get("bwd_%copy") is not None:
                lines.append((9, "backward >= 70% of copy", f"{op} {shape}", f"{ours['bwd_%copy']}%",
                              ours["bwd_%copy"] >= 70))
        if op in ("softmax", "bias_gelu") and ours["fwd_us"] >= 50:  # the large cells (tens of MB), not launch-bound ones
            lines.append((9, "forward >= 88% of copy", f"{op} {shape}", f"{ours['fwd_%copy']}%", ours["fwd_%copy"] >= 88))
        torch_op = impls.get("pytorch")
        if op in NORM_OPS and rows == 2048 and torch_op is not None:
            for part in ("fwd", "bwd"):
                if ours.get(f"{part}_us") is not None and torch_op.get(f"{part}_us") is not None:
                    lines.append((9, f"{part} at 2,048 rows no slower than PyTorch", f"{op} {shape}",
                                  f"{ours[f'{part}_us']} vs {torch_op[f'{part}_us']} us",
                                  ours[f"{part}_us"] <= torch_op[f"{part}_us"]))
        compiled = impls.get("compile")
        if compiled is not None:
            for part in ("fwd", "bwd"):
                a, b = ours.get(f"{part}_us"), compiled.get(f"{part}_us")
                if a is not None and b is not None:
                    lines.append((9, f"{part} at least as fast as torch.compile", f"{op} {shape}", f"{a} vs {b} us",
                                  a <= b))
    return lines


def gemm_targets(doc: dict) -> list[tuple]:
    shares = [(f"{s['shape']} {s['gemm']}", s["of_cublas"]) for s in doc["summary"] if s.get("of_cublas") is not None]
    lines = [(10, ">= 0.9 of cuBLAS", cell, f"{share:.3f}", share >= 0.9) for cell, share in sorted(shares)]
    if shares:
        best = max(shares, key=lambda c: c[1])
        lines.append((10, "one BERT cell faster than cuBLAS", best[0], f"{best[1]:.3f}", best[1] > 1.0))
    return lines


def attention_targets(doc: dict) -> list[tuple]:
    lines = []
    for cell in ATTENTION_CELLS:
        rows = [r for r in doc["rows"] if r["cell"] == cell]
        sdpa = [r for r in rows if r["impl"].startswith("sdpa-")]
        if not sdpa:
            continue
        best = min(sdpa, key=lambda r: r["ms"])
        for impl in OURS_ATTENTION:
            ours = next((r for r in rows if r["impl"] == impl), None)
            if ours is not None:
                speedup = best["ms"] / ours["ms"]
                lines.append((11, f"fwd + bwd faster than SDPA's best ({best['impl']})", f"{cell} {impl}",
                              f"{ours['ms']} vs {best['ms']} ms ({speedup:.3f}x)", speedup > 1.0))
    return lines


def step_targets(doc: dict) -> list[tuple]:
    lines = []
    for r in doc["rows"]:
        if r["model"] == "bert-base" and r["shape"] == "32x512" and r["workload"] == "train" and r["variant"] in STEP_VARIANTS:
            rounds = r.get("ms_rounds") or [r["ms"]]
            lines.append((10, f"BERT-base 32x512 train step <= {STEP_TARGET_MS:g} ms", r["variant"],
                          " / ".join(f"{x:.3f}" for x in rounds) + " ms", max(rounds) <= STEP_TARGET_MS))
    return lines


def table(paths: dict[str, str | None], unmet_only: bool = False) -> tuple[list[str], int, int]:
    """Printable lines, targets met, targets measured (both counted only on the target's GPU), then one line per
    issue: cells at target / cells measured, on whichever GPU the files name."""
    readers = {"ops": ops_targets, "gemm": gemm_targets, "attention": attention_targets, "e2e": step_targets}
    out, met, measured = [], 0, 0
    per_issue: dict[int, list[int]] = {}
    for name, read in readers.items():
        doc = _load(paths.get(name))
        if doc is None:
            out.append(f"{name}: not measured ({paths.get(name) or 'no file'})")
            continue
        env = doc.get("environment") or doc.get("environment_e2e") or {}
        gpu = str(env.get("gpu", "unknown GPU"))
        on_target = TARGET_GPU in gpu
        note = "" if on_target else f" - not an {TARGET_GPU}: shown, not counted"
        out.append(f"{name}: {gpu}, commit {env.get('commit', '?')}{note}")
        for issue, target, cell, value, ok in read(doc):
            measured += on_target
            met += on_target and ok
            counts = per_issue.setdefault(issue, [0, 0])
            counts[0] += ok
            counts[1] += 1
            if unmet_only and ok:
                continue
            mark = ("met" if ok else "NOT met") if on_target else ("(met)" if ok else "(not met)")
            out.append(f"  issue {issue:>2} | {target:<45} | {cell:<48} | {value:<28} | {mark}")
    for issue, (ok, n) in sorted(per_issue.items()):
        out.append(f"issue {issue}: {ok} of {n} cells at target")
    return out, met, measured


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", nargs="?", help="a directory holding ops.json, gemm.json, attention.json, e2e.json")
    for name in ("ops", "gemm", "attention", "e2e"):
        ap.add_argument(f"--{name}", help=f"the {name} JSON (default DIR/{name}.json)")
    ap.add_argument("--unmet", action="store_true", help="list only the cells not at target")
    args = ap.parse_args(argv)
    paths = {n: getattr(args, n) or (os.path.join(args.dir, f"{n}.json") if args.dir else None)
             for n in ("ops", "gemm", "attention", "e2e")}
    lines, met, measured = table(paths, args.unmet)
    print("\n".join(lines))
    print(f"targets met on an {TARGET_GPU}: {met} of {measured} measured there")
    return 0


if __name__ == "__main__":
    sys.exit(main())
