"""BERT embeddings forward/backward: HF's BertEmbeddings computation (3 lookups, 2 adds, LayerNorm;
fp32 as under autocast) vs torch.compile vs bertaccel's one kernel (bf16 output under autocast).

Bytes (the least any implementation must move): forward reads 3 fp32 table rows per token and
writes the output; backward reads dy and the saved sum and writes the grad of the sum, plus the
scatter into the tables (not counted). Shapes: tokens 2,048 and 16,384, hidden 384/768/1024."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.common import measure_op
import bertaccel.ops.embeddings  # noqa: F401 - defines the embedding ops

SHAPES = [(16, 128, 768), (128, 128, 384), (128, 128, 768), (32, 512, 1024)]
VOCAB = 30522


def run(ceiling_gbs: float, dtype=torch.bfloat16) -> list[dict]:
    def hf(ids, pos, tt, word, position, token_type, w, b):
        h = F.embedding(ids, word) + F.embedding(tt, token_type) + F.embedding(pos, position)
        return F.layer_norm(h, (h.shape[-1],), w, b, 1e-12)

    def ours(ids, pos, tt, word, position, token_type, w, b):
        return torch.ops.bertaccel.embedding_layer_norm(ids, pos, tt, word, position, token_type, w, b, 0.0, 1e-12,
                                                        dtype == torch.bfloat16, 0)

    impls = {"pytorch": hf, "compile": torch.compile(hf), "bertaccel": ours}
    rows = []
    for bsz, seq, h in SHAPES:
        n = bsz * seq
        out = torch.finfo(dtype).bits // 8

        def make():
            ids = torch.randint(0, VOCAB, (bsz, seq), device="cuda")
            pos = torch.arange(seq, device="cuda").expand(bsz, seq).contiguous()
            return (ids, pos, torch.zeros_like(ids), torch.randn(VOCAB, h, device="cuda"),
                    torch.randn(512, h, device="cuda"), torch.randn(2, h, device="cuda"),
                    torch.randn(h, device="cuda"), torch.randn(h, device="cuda"))

        rows += measure_op("embeddings", f"{bsz}x{seq}x{h} out {str(dtype)[6:]}", impls, make, (3, 4, 5, 6, 7),
                           n * h * (3 * 4 + out), n * h * 3 * out, ceiling_gbs)
    return rows
