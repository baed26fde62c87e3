"""BERT on real tokens only: the encoder runs on the packed [tokens, hidden] rows of a padded batch.

`Unpadded.from_mask(attention_mask)` records, once per batch, where the real tokens are (their flat
indices, per-sequence offsets `cu_seqlens` as FlashAttention's varlen API takes them, the longest
length as a host int). `encoder_forward` then runs the embeddings, every linear layer, LayerNorm and
FFN of HF's BertModel on those T real tokens instead of B x S padded ones (IMDB at max_length 256 is
~81% real tokens, at 512 ~55%), through the model's own submodules, so parameters, state_dict keys
and swapped (fused) submodules are the same as in the padded model. Attention is the one place that
needs the sequence structure: `varlen_attention` runs our fused varlen kernel (or PyTorch's
FlashAttention-2 varlen kernel) on the packed rows (bf16 / fp16 on a GPU), or else scatters q/k/v back into [B, S] for SDPA with the
key-padding mask and gathers the output (exact; CPU and fp32). The pooler and classifier read each
sequence's first ([CLS]) token.

Where the real tokens are comes with the batch when the data module packs it (`packed_indices`,
`cu_seqlens`: `bertaccel.data.collate.packed_layout`, computed by the collator on the CPU; the
classifier asks for it): no host read, and with static shapes a token count rounded up to a few
buckets, so the step runs inside a whole-step CUDA graph (`model.cuda_graphs`). Without it,
`Unpadded.from_mask` finds them on the device with one host read per batch. Classification only (the
masked-LM head already runs on masked positions only). The profiler's regions are kept: the feed-forward blocks and the
classifier through their module hooks, the embeddings, attention and pooler through the same labels.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bertaccel.modules.last_layer import cls_layer_forward_packed, is_cls_only


@dataclass
class Unpadded:
    """Where the real tokens of a padded [batch, seq] batch are."""

    indices: Tensor  # [T] flat positions (b * seq + s) of the real tokens, in order
    cu_seqlens: Tensor  # [batch + 1] int32 offsets of each sequence in the packed rows
    max_seqlen: int  # the padded length (an upper bound of every sequence's length)
    batch: int
    seq: int
    key_padding: Tensor  # [batch, 1, 1, seq] bool, True where a key is a real token

    @classmethod
    def from_mask(cls, attention_mask: Tensor) -> Unpadded:
        mask = attention_mask.bool()
        batch, seq = mask.shape
        lengths = mask.sum(1, dtype=torch.int32)
        misplaced = (mask != (torch.arange(seq, device=mask.device) < lengths[:, None])).any()
        # the one host read of the batch: the token count (for a static-size nonzero) and the check
        bad, tokens = torch.stack([misplaced.to(torch.int64), lengths.sum(dtype=torch.int64)]).tolist()
        if bad:
            # each sequence's real tokens must come first ([CLS] at position 0); rows may be empty
            # (the padding rows of static-shape batches)
            raise ValueError("unpadded BERT needs right-padded batches (real tokens first in every row)")
        cu = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
        indices = torch.nonzero_static(mask.reshape(-1), size=tokens).squeeze(1)
        return cls(indices, cu, seq, batch, seq, mask[:, None, None, :])

    @classmethod
    def from_packed(cls, packed_indices: Tensor, cu_seqlens: Tensor, attention_mask: Tensor) -> Unpadded:
        """The layout the collator computed (`packed_layout`): no host read, static shapes. Rows past
        cu_seqlens[-1] are fillers (padding positions) that run along and are never read back."""
        batch, seq = attention_mask.shape
        mask = attention_mask.bool()
        return cls(packed_indices, cu_seqlens, seq, batch, seq, mask[:, None, None, :])

    @property
    def tokens(self) -> int:
        return self.indices.numel()

    def pack(self, x: Tensor) -> Tensor:
        """[batch, seq, ...] -> [T, ...]: the real tokens' rows."""
        return x.reshape(self.batch * self.seq, *x.shape[2:]).index_select(0, self.indices)

    def unpack(self, x: Tensor) -> Tensor:
        """[T, ...] -> [batch, seq, ...] with zeros at the padding."""
        out = x.new_zeros(self.batch * self.seq, *x.shape[1:])
        return out.index_copy(0, self.indices, x).view(self.batch, self.seq, *x.shape[1:])

    def first_tokens(self, x: Tensor) -> Tensor:
        """[T, ...] -> [batch, ...]: each sequence's first token ([CLS]); zeros for empty rows."""
        if x.shape[0] == 0:
            return x.new_zeros(self.batch, *x.shape[1:])
        starts = self.cu_seqlens[:-1].long()
        empty = (self.cu_seqlens[1:] == self.cu_seqlens[:-1]).view(-1, *([1] * (x.dim() - 1)))
        return x.index_select(0, starts.clamp(max=x.shape[0] - 1)).masked_fill(empty, 0)


def flash_varlen_unavailable(q: Tensor) -> str | None:
    """Why PyTorch's FlashAttention-2 varlen kernel cannot take these packed queries (None: it can)."""
    if not q.is_cuda:
        return "not a CUDA tensor"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"{q.dtype} (FlashAttention takes bf16 / fp16)"
    if q.shape[-1] % 8 or q.shape[-1] > 256:
        return f"head dim {q.shape[-1]} (FlashAttention takes multiples of 8 up to 256)"
    if torch.cuda.get_device_capability(q.device) < (8, 0):
        return "a GPU older than sm_80"
    return None


class _FlashVarlen(torch.autograd.Function):
    """PyTorch's FlashAttention-2 varlen kernels (`aten._flash_attention_forward/backward`) on packed
    [T, heads, d] rows, dropout from PyTorch's Philox generator (graph-safe: seed and offset live in
    a device tensor that the backward reads). Rows past cu_seqlens[-1] (the fillers of a rounded-up
    token count) belong to no sequence: the kernels leave them unwritten, so their output and
    gradients are set to zero here (a filler's garbage would otherwise reach the weight gradients)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, dropout_p, scale):
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, False, False, scale=scale)
        live = (torch.arange(q.shape[0], device=q.device) < cu_seqlens[-1])[:, None, None]
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, rng_state, unused, live)
        ctx.max_seqlen, ctx.dropout_p, ctx.scale = max_seqlen, dropout_p, scale
        return torch.where(live, out, 0)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu, rng_state, unused, live = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q, k, v, out, lse, cu, cu, ctx.max_seqlen, ctx.max_seqlen, ctx.dropout_p, False,
            rng_state, unused, scale=ctx.scale)
        return torch.where(live, dq, 0), torch.where(live, dk, 0), torch.where(live, dv, 0), None, None, None, None


VARLEN_BACKENDS = ("bertaccel", "flash", "sdpa")


def varlen_backend() -> str:
    """The attention kernel that packed rows go to first: `bertaccel` (ours, csrc/attention.cu; the
    default), `flash` (PyTorch's FlashAttention-2 varlen) or `sdpa` (re-padded); set by the
    environment variable BERTACCEL_VARLEN_ATTENTION (benchmarks compare them in one run). A backend
    that cannot take the inputs passes them on down that order, saying why once."""
    name = os.environ.get("BERTACCEL_VARLEN_ATTENTION", "bertaccel")
    if name not in VARLEN_BACKENDS:
        raise ValueError(f"BERTACCEL_VARLEN_ATTENTION={name!r}: choose one of {', '.join(VARLEN_BACKENDS)}")
    return name


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, layout: Unpadded, dropout_p: float = 0.0,
                     scale: float | None = None) -> Tensor:
    """Attention within each sequence of packed [T, heads, head_dim] queries, keys and values, the
    sequences given by `layout`; returns [T, heads, head_dim].

    On a GPU with bf16 / fp16 inputs: our fused varlen kernel (`bertaccel.ops.attention`), else
    PyTorch's FlashAttention-2 varlen kernel, on the packed rows (no padding computed, no mask).
    Otherwise (CPU, fp32): PyTorch's SDPA on the re-padded tensors with the key-padding mask (the
    padded queries' rows are computed and dropped)."""
    from bertaccel.ops import attention
    from bertaccel.ops.eligibility import note_fallback

    scale = scale if scale is not None else q.shape[-1] ** -0.5
    backend = varlen_backend() if q.is_cuda else "sdpa"
    if backend == "bertaccel":
        reason = attention.kernel_unavailable(q, k, v)
        if reason is None:
            return attention.varlen_attention(q, k, v, layout.cu_seqlens, layout.max_seqlen, dropout_p, scale)
        note_fallback("unpadded attention", f"{reason} (FlashAttention varlen instead of bertaccel's kernel)")
        backend = "flash"
    if backend == "flash":
        reason = flash_varlen_unavailable(q)
        if reason is None:
            return _FlashVarlen.apply(q, k, v, layout.cu_seqlens, layout.max_seqlen, dropout_p, scale)
        note_fallback("unpadded attention", f"{reason} (re-padded SDPA instead of FlashAttention varlen)")
    qp, kp, vp = (layout.unpack(t).transpose(1, 2) for t in (q, k, v))  # [B, heads, S, d]
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=layout.key_padding, dropout_p=dropout_p, scale=scale)
    return layout.pack(out.transpose(1, 2))


def varlen_attention_qkv(qkv: Tensor, layout: Unpadded, dropout_p: float = 0.0, scale: float | None = None) -> Tensor:
    """`varlen_attention` of one packed qkv [T, 3, heads, head_dim] (a fused QKV projection's output,
    viewed). On our kernel the gradient comes back as one tensor of that shape, written in place by the
    kernels (`bertaccel.ops.attention.varlen_attention_packed`): no cat of three gradients in the backward.
    Other backends take the three parts as `varlen_attention` does; so does ours with
    BERTACCEL_ATTENTION_PACKED=0 (the two forms timed against each other)."""
    from bertaccel.ops import attention

    packed = os.environ.get("BERTACCEL_ATTENTION_PACKED", "1") != "0"
    if packed and qkv.is_cuda and varlen_backend() == "bertaccel" and attention.kernel_unavailable(*qkv.unbind(1)) is None:
        return attention.varlen_attention_packed(qkv, layout.cu_seqlens, layout.max_seqlen, dropout_p, scale)
    return varlen_attention(*qkv.unbind(1), layout, dropout_p, scale)


def _region(label: str):
    """The profiler's region of the padded model (`embeddings`, `layer{i}.attention`, `head`), whose
    module hooks this path does not pass through; nothing when no profiler runs."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(label)
    return contextlib.nullcontext()


def _self_attention(sa: nn.Module, h: Tensor, layout: Unpadded) -> Tensor:
    from bertaccel.ops.qkv import SelfAttentionReplacement

    heads, d = sa.num_attention_heads, sa.attention_head_size
    p = sa.dropout.p if sa.training else 0.0
    if isinstance(sa, SelfAttentionReplacement):  # the kernel swap's: Q, K, V in one GEMM
        qkv = sa.packed_qkv(h)  # [T, 3, heads, d]
        if qkv is not None:
            return varlen_attention_qkv(qkv, layout, p, sa.scaling).reshape(h.shape[0], heads * d)
        q, k, v = (t.transpose(0, 1) for t in sa.heads(h))  # [heads, T, d] -> [T, heads, d]
    else:
        q, k, v = (proj(h).view(-1, heads, d) for proj in (sa.query, sa.key, sa.value))
    return varlen_attention(q, k, v, layout, p, sa.scaling).reshape(h.shape[0], heads * d)


def encoder_forward(bert: nn.Module, input_ids: Tensor, token_type_ids: Tensor | None, layout: Unpadded) -> Tensor:
    """HF `BertModel`'s embeddings and encoder on the real tokens only: [T, hidden] ([batch, hidden], each sequence's
    [CLS] row, with `last_layer_cls_only`)."""
    emb = bert.embeddings
    ids = layout.pack(input_ids)
    positions = layout.pack(torch.arange(layout.seq, device=ids.device).expand(layout.batch, -1))
    types = layout.pack(token_type_ids) if token_type_ids is not None else torch.zeros_like(ids)
    # the model's own embeddings module on the packed tokens as one row of T (HF's BertEmbeddings, or the
    # kernel swap's fused lookup + LayerNorm + dropout kernel): its hooks open the `embeddings` region
    h = emb(input_ids=ids[None], token_type_ids=types[None], position_ids=positions[None])[0]
    cls_only = is_cls_only(bert)
    for i, layer in enumerate(bert.encoder.layer):
        if cls_only and i == len(bert.encoder.layer) - 1:  # model.last_layer_cls_only: [B, hidden], [CLS] rows
            return cls_layer_forward_packed(layer, h, layout, lambda i=i: _region(f"layer{i}.attention"))
        attention = layer.attention
        with _region(f"layer{i}.attention"):
            a = attention.output(_self_attention(attention.self, h, layout), h)  # dense, dropout, LayerNorm(. + h)
        h = layer.feed_forward_chunk(a)  # HF's: output(intermediate(a), a); the ffn family's fused block
    return h


def classifier_logits(model: nn.Module, input_ids: Tensor, attention_mask: Tensor,
                      token_type_ids: Tensor | None = None, layout: Unpadded | None = None) -> Tensor:
    """`BertForSequenceClassification(...).logits` computed on the real tokens only (`layout`: where
    they are, from the batch; found from the mask when not given)."""
    layout = layout if layout is not None else Unpadded.from_mask(attention_mask)
    h = encoder_forward(model.bert, input_ids, token_type_ids, layout)
    pooler = model.bert.pooler
    with _region("head"):
        cls = h if is_cls_only(model.bert) else layout.first_tokens(h)  # (the [CLS] rows already)
        pooled = pooler.activation(pooler.dense(cls))
    return model.classifier(model.dropout(pooled))
