"""The embeddings backward's scatter (`embedding_tables_bwd`: the sum's gradient dz added into the word, position and
token-type tables' fp32 gradients) at BERT shapes, graph-timed, for whichever `bertaccel` is first on PYTHONPATH (tag
the lines with BERTACCEL_AB; BERTACCEL_EMB_SCATTER=tokens|positions is named when set). Beside it, in the same
process: the zeroing of the three fp32 tables alone (`torch.zeros`, which the op does first: 94 MB for BERT-base's
30,522 x 768 word table) and PyTorch's sorted `embedding_dense_backward` (three calls, as HF's backward runs them).
Positions are a padded batch's (0 .. seq - 1 in every sequence), ids uniform over the vocabulary, token types 0.
  for t in A B; do BERTACCEL_AB=$t PYTHONPATH=... python scripts/emb_scatter_sweep.py; done"""
import os

import torch

from bertaccel.ops import build
from benchmarks.common import graph_time_ms
import bertaccel.ops.embeddings  # noqa: F401 - defines the embedding ops

SHAPES = [(16, 128, 768), (128, 128, 384), (128, 128, 768), (32, 512, 1024), (32, 256, 384)]
VOCAB, POSITIONS, TYPES = 30522, 512, 2

assert build.load(), build.unavailable_reason()
tag = " ".join([os.environ.get("BERTACCEL_AB", "")]
               + [f"{k}={os.environ[k]}" for k in ("BERTACCEL_EMB_SCATTER",) if k in os.environ])
for bsz, seq, h in SHAPES:
    ids = torch.randint(1, VOCAB, (bsz, seq), device="cuda")
    pos = torch.arange(seq, device="cuda").expand(bsz, seq).contiguous()
    tt = torch.zeros_like(ids)
    sets = [(torch.randn(bsz, seq, h, device="cuda").bfloat16(),) for _ in range(4)]
    scatter = torch.ops.bertaccel.embedding_tables_bwd
    ours = graph_time_ms(lambda dz: scatter(dz, ids, pos, tt, VOCAB, POSITIONS, TYPES, 0), sets) * 1e3
    zeros = graph_time_ms(lambda dz: [torch.zeros(n, h, device="cuda") for n in (VOCAB, POSITIONS, TYPES)], sets) * 1e3

    def pytorch(dz):
        dzf = dz.float().reshape(-1, h)
        return [torch.ops.aten.embedding_dense_backward(dzf, i.reshape(-1), n, pad, False)
                for i, n, pad in ((ids, VOCAB, 0), (pos, POSITIONS, -1), (tt, TYPES, -1))]

    sorted_us = graph_time_ms(pytorch, sets) * 1e3
    print(f"SCATTER {tag} {bsz}x{seq}x{h}: bertaccel {ours:.1f}us (zeroing the tables alone {zeros:.1f}us, "
          f"the scatter {ours - zeros:.1f}) | PyTorch sorted {sorted_us:.1f}us", flush=True)
