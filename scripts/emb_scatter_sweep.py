"""The embeddings backward's scatter (`embedding_tables_bwd`: the sum's gradient dz added into the word, position and
token-type tables' fp32 gradients) beside PyTorch's sorted `embedding_dense_backward` (bench_embeddings' scatter rows:
a padded batch's positions, ids uniform over the vocabulary, token types 0, bf16 dz), at bench_embeddings' shapes and
MiniLM's 32 x 256 x 384, for whichever `bertaccel` is first on PYTHONPATH (tag the lines with BERTACCEL_AB;
BERTACCEL_EMB_SCATTER=tokens|positions is named when set). Both ops zero the three fp32 tables first (94 MB for
BERT-base's 30,522 x 768 word table): that zeroing is timed alone beside them, so the scatter's own time is the rest.
  for t in A B; do BERTACCEL_AB=$t PYTHONPATH=... python scripts/emb_scatter_sweep.py; done"""
import torch

from bertaccel.ops import build
from benchmarks.bench_embeddings import SHAPES as BENCH_SHAPES, VOCAB, scatter_rows
from benchmarks.common import graph_time_ms, run_tag

SHAPES = [*BENCH_SHAPES, (32, 256, 384)]
TABLE_ROWS = (VOCAB, 512, 2)  # word, position, token type (scatter_rows' tables)

assert build.load(), build.unavailable_reason()
tag = run_tag("BERTACCEL_EMB_SCATTER")
for bsz, seq, h in SHAPES:
    us = {row["impl"]: row["bwd_us"] for row in scatter_rows(bsz, seq, h, torch.bfloat16)}
    zeros = graph_time_ms(lambda: [torch.zeros(n, h, device="cuda") for n in TABLE_ROWS], [()]) * 1e3
    print(f"SCATTER {tag} {bsz}x{seq}x{h}: bertaccel {us['bertaccel']:.1f}us (zeroing the tables alone {zeros:.1f}us, "
          f"the scatter {us['bertaccel'] - zeros:.1f}) | PyTorch sorted {us['pytorch']:.1f}us", flush=True)
