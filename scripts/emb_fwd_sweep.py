"""Embeddings forward time at BERT shapes (ids int64, fp32 tables and LayerNorm params as the model holds them,
bf16 output as under autocast), graph-timed, for whichever `bertaccel` is first on PYTHONPATH, so that two trees
alternate under scripts/ab_runs.sh:
  inference  `embedding_layer_norm` with p = 0 under no_grad (y only)
  training   `embedding_layer_norm_fwd` with p = 0.1 (y, the saved sum z, mean, rstd and the dropout's offsets)
`--compile` adds torch.compile of HF's computation (three lookups, two adds, LayerNorm) twice: as HF runs it under
autocast (fp32 output, 4-byte writes) and with the output cast to bf16 inside the compiled function (the same bytes
ours writes: the fair line for the inference form).
  bash scripts/ab_runs.sh --build ops /tmp/b/src 2 -- python scripts/emb_fwd_sweep.py
`BERTACCEL_EMB_WARP_ROWS=0` (where the kernel has it) is named in each line.
The share of copy counts the least bytes: three fp32 table rows read and one output row written a token."""
import argparse

import torch

from bertaccel.ops import build
from bertaccel.ops.embeddings import embeddings_reference
from benchmarks.bench_embeddings import SHAPES, VOCAB
from benchmarks.common import compile_static, copy_bandwidth_gbs, graph_time_ms, rotations, run_tag

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--compile", action="store_true")
args = ap.parse_args()
assert build.load(), build.unavailable_reason()
tag = run_tag("BERTACCEL_EMB_WARP_ROWS")
ceil = copy_bandwidth_gbs()
ops = torch.ops.bertaccel
if args.compile:  # HF's computation (the sets' order: ids, positions, token types, the three tables, weight, bias)
    compiled_fp32 = compile_static(lambda *a: embeddings_reference(*a, 1e-12))
    compiled_bf16 = compile_static(lambda *a: embeddings_reference(*a, 1e-12).to(torch.bfloat16))

for bsz, seq, h in SHAPES:
    n = bsz * seq
    sets = []
    for _ in range(rotations(n * h * (3 * 4 + 2))):
        ids = torch.randint(1, VOCAB, (bsz, seq), device="cuda")
        pos = torch.arange(seq, device="cuda").expand(bsz, seq).contiguous()
        sets.append((ids, pos, torch.randint(0, 2, (bsz, seq), device="cuda"), torch.randn(VOCAB, h, device="cuda"),
                     torch.randn(512, h, device="cuda"), torch.randn(2, h, device="cuda"),
                     torch.randn(h, device="cuda"), torch.randn(h, device="cuda")))
    with torch.no_grad():
        inf = graph_time_ms(lambda *a: ops.embedding_layer_norm(*a, 0.0, 1e-12, True, 0), sets) * 1e3
        train = graph_time_ms(lambda *a: ops.embedding_layer_norm_fwd(*a, 0.1, 1e-12, True, 0), sets) * 1e3
        if args.compile:
            c32 = graph_time_ms(compiled_fp32, sets) * 1e3
            c16 = graph_time_ms(compiled_bf16, sets) * 1e3
    pct = lambda us, out: 100 * n * h * (12 + out) / us / 1e3 / ceil  # noqa: E731
    print(f"EMB {tag} {bsz}x{seq}x{h}: inference {inf:.1f}us {pct(inf, 2):.0f}% | training p=0.1 {train:.1f}us"
          + (f" | compile fp32-out {c32:.1f}us {pct(c32, 4):.0f}% bf16-out {c16:.1f}us {pct(c16, 2):.0f}%"
             if args.compile else ""), flush=True)
