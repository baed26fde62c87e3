"""One call each of `column_sum` and torch.compile's column sum (compiled for the shape) at the shapes given, for Nsight
Compute: both are warmed up (and compiled) first, and only the calls between cudaProfilerStart / Stop are profiled:
  ncu --profile-from-start off --metrics gpu__time_duration.sum,dram__bytes_read.sum,... \\
      python scripts/colsum_calls.py 16384x1152 16384x2304 2048x2304
Session 80 asked it why our column sums stay behind compile's at 16384 x 1152 / 2304 (bench_ops at 2ec25f5)."""
import sys

import torch

from bertaccel.ops import build
from bertaccel.ops.bias_grad import column_sum

assert build.load(), build.unavailable_reason()
shapes = [tuple(int(v) for v in a.split("x")) for a in (sys.argv[1:] or ["16384x1152", "16384x2304", "2048x2304"])]
calls = []
for rows, cols in shapes:
    x = torch.randn(rows, cols, device="cuda").bfloat16()
    compiled = torch.compile(lambda t: t.sum(0, dtype=torch.float32), dynamic=False)
    for _ in range(3):
        column_sum(x), compiled(x)
    calls.append((x, compiled))
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
for x, compiled in calls:
    column_sum(x)
    compiled(x)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print("colsum calls ok", shapes)
