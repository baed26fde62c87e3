"""BERT embeddings forward/backward: HF's BertEmbeddings computation (3 lookups, 2 adds, LayerNorm;
fp32 as under autocast) vs torch.compile vs bertaccel's one kernel (bf16 output under autocast).

Bytes (the least any implementation must move): forward reads 3 fp32 table rows per token and
writes the output; backward reads dy and the saved sum and writes the grad of the sum, plus the
scatter into the tables (not counted). Shapes: tokens 2,048 and 16,384, hidden 384/768/1024."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.common import compile_static, graph_time_ms, measure_op
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

    impls = {"pytorch": hf, "compile": compile_static(hf), "bertaccel": ours}
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
        rows += scatter_rows(bsz, seq, h, dtype)
    return rows


def scatter_rows(bsz: int, seq: int, h: int, dtype) -> list[dict]:
    """The backward's scatter of dz into the word, position and token-type tables alone: PyTorch's
    sorted nn.Embedding backward (three calls, as HF's backward runs them) vs `embedding_tables_bwd`
    (one pass, fp32 atomics). Zeroing the fp32 tables is in both. GPU time from graph replays."""
    ids = torch.randint(1, VOCAB, (bsz, seq), device="cuda")
    pos = torch.arange(seq, device="cuda").expand(bsz, seq).contiguous()
    tt = torch.zeros_like(ids)
    dz = torch.randn(bsz, seq, h, device="cuda").to(dtype)

    def pytorch(dz):
        dzf = dz.float().reshape(-1, h)
        return [torch.ops.aten.embedding_dense_backward(dzf, i.reshape(-1), n, pad, False)
                for i, n, pad in ((ids, VOCAB, 0), (pos, 512, -1), (tt, 2, -1))]

    def ours(dz):
        return torch.ops.bertaccel.embedding_tables_bwd(dz, ids, pos, tt, VOCAB, 512, 2, 0)

    shape = f"{bsz}x{seq}x{h} dz {str(dtype)[6:]}"
    return [{"op": "embedding_scatter", "shape": shape, "impl": name, "bwd_us": round(1e3 * graph_time_ms(fn, [(dz,)]), 2),
             "bwd_timing": "graph replays"} for name, fn in (("pytorch", pytorch), ("bertaccel", ours))]
