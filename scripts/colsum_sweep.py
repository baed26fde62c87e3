"""`column_sum` (a linear layer's bias gradient: a bf16 [tokens, N] gradient summed over the tokens into fp32) at the
step's shapes - MiniLM's 384 / 1,152 / 1,536 and BERT-base's 768 / 2,304 / 3,072 columns at 2,048, 9,830 and 16,384
tokens - graph-timed, for whichever `bertaccel` is first on PYTHONPATH, so that trees alternate under
scripts/ab_runs.sh (or set BERTACCEL_AB to tag the lines):
  bash scripts/ab_runs.sh --build ops /tmp/b/src 2 -- python scripts/colsum_sweep.py
The kernel switches `BERTACCEL_COLSUM_CHUNK_ROWS` / `BERTACCEL_COLSUM_LANES` / `BERTACCEL_COLSUM` are named in each
line when set (read once per process: one run per setting). `--compile` adds torch.compile's `x.float().sum(0)` at
static shapes (one reduction kernel pair, fp32 out). The share counts the bytes read (the partial rows not counted)
against the copy ceiling's read + write."""
import argparse
import os

import torch

from bertaccel.ops import build
from benchmarks.common import compile_static, copy_bandwidth_gbs, graph_time_ms, rotations
import bertaccel.ops.bias_grad  # noqa: F401 - defines column_sum

SHAPES = [(2048, 768), (2048, 2304), (9830, 384), (9830, 1152), (16384, 384), (16384, 768), (16384, 1152),
          (16384, 1536), (16384, 2304), (16384, 3072)]
SWITCHES = ("BERTACCEL_COLSUM_CHUNK_ROWS", "BERTACCEL_COLSUM_LANES", "BERTACCEL_COLSUM")

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--compile", action="store_true")
args = ap.parse_args()
assert build.load(), build.unavailable_reason()
tag = " ".join([os.environ.get("BERTACCEL_AB", "")] + [f"{k}={os.environ[k]}" for k in SWITCHES if k in os.environ])
ceil = copy_bandwidth_gbs()
if args.compile:
    compiled = compile_static(lambda x: x.float().sum(0))
for rows, cols in SHAPES:
    sets = [(torch.randn(rows, cols, device="cuda").bfloat16(),) for _ in range(rotations(rows * cols * 2))]
    with torch.no_grad():
        ours = graph_time_ms(torch.ops.bertaccel.column_sum, sets) * 1e3
        comp = graph_time_ms(compiled, sets) * 1e3 if args.compile else float("nan")
    pct = lambda us: 100 * rows * cols * 2 / us / 1e3 / ceil  # noqa: E731
    print(f"COLSUM {tag} {rows}x{cols}: {ours:.1f}us {pct(ours):.0f}%"
          + (f" | compile {comp:.1f}us {pct(comp):.0f}%" if args.compile else ""), flush=True)
