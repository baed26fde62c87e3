"""`column_sum` (a linear layer's bias gradient: a bf16 [tokens, N] gradient summed over the tokens into fp32) at the
step's shapes - MiniLM's 384 / 1,152 / 1,536 and BERT-base's 768 / 2,304 / 3,072 columns at 2,048, 9,830 and 16,384
tokens (bench_bias_grad's shapes and 16384 x 1536) - graph-timed, for whichever `bertaccel` is first on PYTHONPATH, so
that trees alternate under scripts/ab_runs.sh (or set BERTACCEL_AB to tag the lines):
  bash scripts/ab_runs.sh --build ops /tmp/b/src 2 -- python scripts/colsum_sweep.py
The kernel switches `BERTACCEL_COLSUM_CHUNK_ROWS` / `BERTACCEL_COLSUM_LANES` / `BERTACCEL_COLSUM` are named in each
line when set (read once per process: one run per setting). Against PyTorch, cuBLAS and torch.compile:
`python -m benchmarks.bench_ops --ops bias_grad`. The share counts the bytes read (the partial rows not counted)
against the copy ceiling's read + write."""
import torch

from bertaccel.ops import build
from bertaccel.ops.bias_grad import column_sum
from benchmarks.bench_bias_grad import SHAPES as BENCH_SHAPES
from benchmarks.common import copy_bandwidth_gbs, graph_time_ms, rotations, run_tag

SHAPES = [*BENCH_SHAPES, (16384, 1536)]  # + MiniLM's FFN intermediate bias

assert build.load(), build.unavailable_reason()
tag = run_tag("BERTACCEL_COLSUM_CHUNK_ROWS", "BERTACCEL_COLSUM_CHUNK_ROUND", "BERTACCEL_COLSUM_LANES", "BERTACCEL_COLSUM")
ceil = copy_bandwidth_gbs()
for rows, cols in SHAPES:
    sets = [(torch.randn(rows, cols, device="cuda").bfloat16(),) for _ in range(rotations(rows * cols * 2))]
    with torch.no_grad():
        ours = graph_time_ms(column_sum, sets) * 1e3
    print(f"COLSUM {tag} {rows}x{cols}: {ours:.1f}us {100 * rows * cols * 2 / ours / 1e3 / ceil:.0f}%", flush=True)
