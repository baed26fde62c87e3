"""The two forward forms of LayerNorm and RMSNorm in one process, on the same inputs (bf16, fp32 weights):
the saving form a training step runs (`*_fwd`: y plus the statistics the backward reads) and the
output-only form evaluation runs (`layer_norm` / `rms_norm`, called by `bench_ops` under no_grad) -
the same kernel template, told not to write mean / rstd. Beside a clone of the same bytes, graph-timed.

Why: bench_ops timed RMSNorm 16384x4096 at 111.5 us (e5d2951, when its no-grad forward still ran the
saving form) and at 145.5 us (7d4edce, the output-only form), with the kernel's body unchanged.
  python scripts/norm_forms.py           (default settings; BERTACCEL_LN_RING=0 for the one-row kernel)
"""

import torch

import bertaccel.ops.layer_norm  # noqa: F401 - registers the ops
import bertaccel.ops.rms_norm  # noqa: F401
from benchmarks.common import copy_bandwidth_gbs, graph_time_ms, rotations
from bertaccel.ops import build

assert build.load(), build.unavailable_reason()
ops = torch.ops.bertaccel
ceil = copy_bandwidth_gbs()
print(f"copy ceiling {ceil:.0f} GB/s")
for n, h in [(16384, 768), (16384, 1024), (16384, 4096), (2048, 4096), (16384, 2048)]:
    sets = [(torch.randn(n, h, device="cuda", dtype=torch.bfloat16), torch.randn(h, device="cuda"),
             torch.randn(h, device="cuda")) for _ in range(rotations(2 * n * h * 2))]
    pct = lambda us: 100 * 2 * n * h * 2 / us / 1e3 / ceil  # noqa: E731 - read x, write y (bf16)
    with torch.no_grad():
        t = {
            "clone": graph_time_ms(lambda x, w, b: x.clone(), sets),
            "rms_norm (output only)": graph_time_ms(lambda x, w, b: ops.rms_norm(x, w, 1e-6), sets),
            "rms_norm_fwd (saving)": graph_time_ms(lambda x, w, b: ops.rms_norm_fwd(x, w, 1e-6), sets),
            "layer_norm (output only)": graph_time_ms(lambda x, w, b: ops.layer_norm(x, None, None, w, b, 0.0, 1e-12), sets),
            "layer_norm_fwd (saving)": graph_time_ms(lambda x, w, b: ops.layer_norm_fwd(x, None, None, w, b, 0.0, 1e-12),
                                                     sets),
        }
    print(f"FORMS {n}x{h}: " + " | ".join(f"{k} {ms * 1e3:.1f}us {pct(ms * 1e3):.0f}%" for k, ms in t.items()))
