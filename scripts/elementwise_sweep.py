"""bias + GELU forward time at BERT's FFN shapes (bf16, no grad) for one setting of the forward
kernel's vectors per thread, beside a clone of the same bytes and torch.compile's kernel. The
setting is an environment variable read once per process, so run once per setting:
  BERTACCEL_GELU_UNROLL=1|2|4  force that many 16-byte vectors per thread
  (unset)                      the default choice (csrc/gelu.cu fwd_unroll: by how many times the
                               tensor fills the GPU's resident threads)
`for s in "" BERTACCEL_GELU_UNROLL=1 BERTACCEL_GELU_UNROLL=2 BERTACCEL_GELU_UNROLL=4; do env $s python scripts/elementwise_sweep.py; done`
`--backward` times the backward instead (`bias_gelu_bwd`: dx and the fp32 bias gradient, fp32 bias as the model holds it)
at the same shapes and at MiniLM's 9,830 tokens, for A/B runs of trees (BERTACCEL_AB, as scripts/ab_runs.sh sets it, tags
the lines); against torch.compile's backward: `python -m benchmarks.bench_ops --ops gelu`."""
import argparse
import os

import torch
import torch.nn.functional as F

from benchmarks.bench_gelu import SHAPES
from benchmarks.common import compile_static, copy_bandwidth_gbs, graph_time_ms, rotations, run_tag
from bertaccel.ops.gelu import bias_gelu

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--backward", action="store_true")
args = ap.parse_args()
ceil = copy_bandwidth_gbs()
if args.backward:
    from bertaccel.ops import build

    assert build.load(), build.unavailable_reason()
    for n, f in [*SHAPES, (9830, 1536)]:
        sets = [(torch.randn(n, f, device="cuda", dtype=torch.bfloat16), torch.randn(f, device="cuda"),
                 torch.randn(n, f, device="cuda", dtype=torch.bfloat16)) for _ in range(rotations(3 * n * f * 2))]
        ours = graph_time_ms(lambda x, b, dy: torch.ops.bertaccel.bias_gelu_bwd(dy, x, b, False), sets) * 1e3
        pct = lambda us: 100 * 3 * n * f * 2 / us / 1e3 / ceil  # noqa: E731 - read x and dy, write dx
        print(f"GELU_BWD {run_tag()} {n}x{f}: bertaccel {ours:.1f}us {pct(ours):.0f}%", flush=True)
    raise SystemExit
setting = f"BERTACCEL_GELU_UNROLL={os.environ['BERTACCEL_GELU_UNROLL']}" if "BERTACCEL_GELU_UNROLL" in os.environ else "default"
compiled = compile_static(lambda x, b: F.gelu(x + b))
for n, f in SHAPES:
    sets = [(torch.randn(n, f, device="cuda", dtype=torch.bfloat16), torch.randn(f, device="cuda", dtype=torch.bfloat16))
            for _ in range(rotations(2 * n * f * 2))]
    with torch.no_grad():
        copy_us = graph_time_ms(lambda x, b: x.clone(), sets) * 1e3
        ours = graph_time_ms(bias_gelu, sets) * 1e3
        comp = graph_time_ms(compiled, sets) * 1e3
    pct = lambda us: 100 * 2 * n * f * 2 / us / 1e3 / ceil  # noqa: E731 - read x, write y
    print(f"GELU {setting} {n}x{f}: clone {copy_us:.1f}us ({pct(copy_us):.0f}%) | bertaccel {ours:.1f}us {pct(ours):.0f}% | "
          f"compile {comp:.1f}us {pct(comp):.0f}%")
