"""Fused variable-length attention: softmax(Q K^T * scale) V within each packed sequence, with dropout.

`varlen_attention(q, k, v, cu_seqlens, max_seqlen, dropout_p, scale)` takes packed rows [T, heads, d]
(the real tokens of a batch, sequence b at rows cu_seqlens[b] .. cu_seqlens[b + 1]; rows past
cu_seqlens[-1] are fillers whose output and gradients are zero) and returns [T, heads, d]. With
`seqused` (FlashAttention-3's name) sequence b is the first seqused[b] rows of its slot and the rest of
the slot are fillers too: a right-padded [batch, seq] batch is read in place (cu_seqlens b * seq, seqused
the lengths), with no gather of its real tokens. On a GPU
(sm_80+, bf16 / fp16, head dim 32 / 64 / 128) it runs our FlashAttention-2-style kernels
(csrc/attention.cu, the `bertaccel_attention` extension): nothing of size seq x seq is written, the
forward saves the log-sum-exp and the backward recomputes. Elsewhere the CPU kernels below run: the
reference, in fp32, per sequence, with the *same* dropout mask as the GPU kernel for the same
(seed, offset) - `dropout_keep` implements the kernel's Philox draw - so a test can check the GPU's
masked output element by element.

Ops: `varlen_attention_fwd -> (out, lse [heads, T] fp32, rng (seed, offset) int64)` and
`varlen_attention_bwd -> (dq, dk, dv)`; autograd connects them (`torch.library.register_autograd`),
so the op works under `torch.compile(fullgraph=True)` and inside CUDA graphs (the dropout seed and
offset come from PyTorch's graph-safe Philox state and are handed to the backward in `rng`).

The packed pair `varlen_attention_packed_fwd / _bwd` takes one qkv [T, 3, heads, d] (a fused QKV
projection's output, viewed) and returns its gradient as one tensor of that shape: the kernels write dq,
dk and dv into its three parts (token stride 3 x heads x d), where separate q, k, v split from the
projection cost autograd a cat of the three gradients (3 x T x hidden elements read and written per
layer). Same kernels, same results (`varlen_attention_packed`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from bertaccel.ops.registration import MASK32, NS, SEEDED, check_dropout, dropout_threshold, lib, philox4x32

CUDA_SOURCES = ["attention.cu", "query_rows_attention.cu"]
HEAD_DIMS = (32, 64, 128)
KERNEL_DTYPES = (torch.bfloat16, torch.float16)

lib.define(
    "varlen_attention_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, int max_seqlen, float dropout_p,"
    " float scale, Tensor? seqused=None) -> (Tensor, Tensor, Tensor)",
    tags=SEEDED,
)
lib.define(
    "varlen_attention_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu_seqlens,"
    " int max_seqlen, float dropout_p, float scale, Tensor rng, Tensor? seqused=None) -> (Tensor, Tensor, Tensor)"
)
lib.define(
    "varlen_attention_packed_fwd(Tensor qkv, Tensor cu_seqlens, int max_seqlen, float dropout_p, float scale,"
    " Tensor? seqused=None) -> (Tensor, Tensor, Tensor)",
    tags=SEEDED,
)
lib.define(
    "varlen_attention_packed_bwd(Tensor grad_out, Tensor qkv, Tensor out, Tensor lse, Tensor cu_seqlens,"
    " int max_seqlen, float dropout_p, float scale, Tensor rng, Tensor? seqused=None) -> Tensor"
)

lib.define(
    "query_rows_attention_fwd(Tensor q, Tensor kv, Tensor key_mask, int heads, float dropout_p, float scale)"
    " -> (Tensor, Tensor, Tensor)",
    tags=SEEDED,
)
lib.define(
    "query_rows_attention_bwd(Tensor grad_out, Tensor q, Tensor kv, Tensor key_mask, Tensor out, Tensor lse, int heads,"
    " float dropout_p, float scale, Tensor rng) -> (Tensor, Tensor)"
)
lib.define(
    "query_rows_attention_varlen_fwd(Tensor q, Tensor kv, Tensor cu_seqlens, int max_seqlen, int heads,"
    " float dropout_p, float scale) -> (Tensor, Tensor, Tensor)",
    tags=SEEDED,
)
lib.define(
    "query_rows_attention_varlen_bwd(Tensor grad_out, Tensor q, Tensor kv, Tensor cu_seqlens, Tensor out, Tensor lse,"
    " int max_seqlen, int heads, float dropout_p, float scale, Tensor rng) -> (Tensor, Tensor)"
)

# ------------------------------------------------------------------------------ the dropout draw
# (philox4x32 and dropout_threshold: bertaccel.ops.registration, shared with the row ops' dropout)
def dropout_keep(start: int, length: int, head: int, p: float, seed: int, offset: int) -> Tensor:
    """The kernels' keep mask [length, length] of one sequence (rows from packed row `start`) and head:
    element (q, k) uses 16 bits of Philox at counter (token of the first row of q's 16-row tile + q % 8,
    (k - k % 16 + 2 * ((k % 8) // 2)) | head << 16, offset low, offset high), the word and half picked
    by (q % 16 >= 8, k % 16 >= 8) and k % 2."""
    q = torch.arange(length, dtype=torch.int64)[:, None]
    k = torch.arange(length, dtype=torch.int64)[None, :]
    r16, kk = q % 16, k % 16
    row_token = (start + q - r16 + r16 % 8).expand(length, length)
    key = (k - kk + 2 * ((kk % 8) // 2)) | (head << 16)
    c = (row_token, key.expand(length, length), torch.full_like(row_token, offset & MASK32),
         torch.full_like(row_token, (offset >> 32) & MASK32))
    words = torch.stack(philox4x32(c, seed % (1 << 64)))  # [4, length, length]
    word = 2 * (r16 >= 8).long() + (kk >= 8).long()
    draw = (words.gather(0, word.expand(length, length)[None]).squeeze(0) >> (16 * (kk % 2))) & 0xFFFF
    return draw >= dropout_threshold(p)


# ------------------------------------------------------------------------------ CPU reference
def _sequences(cu_seqlens: Tensor, seqused: Tensor | None = None):
    """(start, length) of each sequence: its slot cu_seqlens[b] .. cu_seqlens[b + 1], or the first seqused[b]
    rows of it."""
    cu = cu_seqlens.tolist()
    if seqused is None:
        return [(cu[b], cu[b + 1] - cu[b]) for b in range(len(cu) - 1)]
    used = seqused.tolist()
    if len(used) != len(cu) - 1:
        raise ValueError(f"varlen_attention: seqused has {len(used)} entries for {len(cu) - 1} sequences")
    if any(u < 0 for u in used):
        raise ValueError("varlen_attention: a padding mask row is not right-padded (its tokens are not one run from "
                         "position 0; seqused < 0); pad on the right (tokenizer padding_side='right') or use "
                         "attn_implementation='sdpa'")
    return [(cu[b], min(used[b], cu[b + 1] - cu[b])) for b in range(len(cu) - 1)]


def _reference_probs(q, k, start, length, h, scale, p, seed, offset):
    """fp32 softmax probabilities of one (sequence, head), the dropout factors (keep / (1 - p)) and the
    rows' log-sum-exp."""
    qs, ks = q[start:start + length, h].float(), k[start:start + length, h].float()
    scores = qs @ ks.T * scale
    factors = dropout_keep(start, length, h, p, seed, offset) / (1 - p) if p > 0 else torch.ones_like(scores)
    return torch.softmax(scores, dim=-1), factors, torch.logsumexp(scores, dim=-1)


def _cpu_rng(p: float) -> Tensor:
    if p == 0:
        return torch.zeros(2, dtype=torch.int64)
    return torch.tensor([int(torch.randint(0, 2**62, ()).item()), 0], dtype=torch.int64)


@torch.library.impl(lib, "varlen_attention_fwd", "CPU")
def _fwd_cpu(q, k, v, cu_seqlens, max_seqlen, dropout_p, scale, seqused=None):
    check_dropout(dropout_p)
    rng = _cpu_rng(dropout_p)
    seed, offset = int(rng[0]), int(rng[1])
    out = torch.zeros(q.shape, dtype=q.dtype)
    lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32)
    for start, length in _sequences(cu_seqlens, seqused):
        if length == 0:
            continue
        for h in range(q.shape[1]):
            probs, factors, row_lse = _reference_probs(q, k, start, length, h, scale, dropout_p, seed, offset)
            out[start:start + length, h] = (probs * factors @ v[start:start + length, h].float()).to(q.dtype)
            lse[h, start:start + length] = row_lse
    return out, lse, rng


@torch.library.impl(lib, "varlen_attention_bwd", "CPU")
def _bwd_cpu(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, dropout_p, scale, rng, seqused=None):
    seed, offset = int(rng[0]), int(rng[1])
    dq, dk, dv = (torch.zeros(q.shape, dtype=torch.float32) for _ in range(3))
    for start, length in _sequences(cu_seqlens, seqused):
        if length == 0:
            continue
        rows = slice(start, start + length)
        for h in range(q.shape[1]):
            qs, ks, vs = (t[rows, h].float() for t in (q, k, v))
            do = grad_out[rows, h].float()
            probs, factors, _ = _reference_probs(q, k, start, length, h, scale, dropout_p, seed, offset)
            dv[rows, h] = (probs * factors).T @ do
            d_probs = (do @ vs.T) * factors
            ds = probs * (d_probs - (d_probs * probs).sum(-1, keepdim=True))
            dq[rows, h] = ds @ ks * scale
            dk[rows, h] = ds.T @ qs * scale
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)


@torch.library.register_fake(f"{NS}::varlen_attention_fwd")
def _fwd_fake(q, k, v, cu_seqlens, max_seqlen, dropout_p, scale, seqused=None):
    return (q.new_empty(q.shape), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32),
            q.new_empty(2, dtype=torch.int64))


@torch.library.register_fake(f"{NS}::varlen_attention_bwd")
def _bwd_fake(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, dropout_p, scale, rng, seqused=None):
    return q.new_empty(q.shape), q.new_empty(q.shape), q.new_empty(q.shape)


def _setup(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, dropout_p, scale, seqused = inputs
    out, lse, rng = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, rng, seqused)
    ctx.max_seqlen, ctx.dropout_p, ctx.scale = max_seqlen, dropout_p, scale
    # lse's gradient is never used: without this autograd fills a [heads, T] fp32 zero tensor per call
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out, grad_lse, grad_rng):
    if grad_out is None:  # the output took no part in what is differentiated
        return None, None, None, None, None, None, None, None
    q, k, v, out, lse, cu_seqlens, rng, seqused = ctx.saved_tensors
    dq, dk, dv = torch.ops.bertaccel.varlen_attention_bwd(
        grad_out.contiguous(), q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.dropout_p, ctx.scale, rng, seqused)
    return dq, dk, dv, None, None, None, None, None


torch.library.register_autograd(f"{NS}::varlen_attention_fwd", _backward, setup_context=_setup)


# ------------------------------------------------------------------------------ packed qkv [T, 3, heads, d]
def _parts(qkv):
    return qkv.select(1, 0), qkv.select(1, 1), qkv.select(1, 2)


@torch.library.impl(lib, "varlen_attention_packed_fwd", "CPU")
def _packed_fwd_cpu(qkv, cu_seqlens, max_seqlen, dropout_p, scale, seqused=None):
    return _fwd_cpu(*_parts(qkv), cu_seqlens, max_seqlen, dropout_p, scale, seqused)


@torch.library.impl(lib, "varlen_attention_packed_bwd", "CPU")
def _packed_bwd_cpu(grad_out, qkv, out, lse, cu_seqlens, max_seqlen, dropout_p, scale, rng, seqused=None):
    return torch.stack(_bwd_cpu(grad_out, *_parts(qkv), out, lse, cu_seqlens, max_seqlen, dropout_p, scale, rng,
                                seqused), 1)


@torch.library.register_fake(f"{NS}::varlen_attention_packed_fwd")
def _packed_fwd_fake(qkv, cu_seqlens, max_seqlen, dropout_p, scale, seqused=None):
    t, _, heads, d = qkv.shape
    return (qkv.new_empty(t, heads, d), qkv.new_empty(heads, t, dtype=torch.float32),
            qkv.new_empty(2, dtype=torch.int64))


@torch.library.register_fake(f"{NS}::varlen_attention_packed_bwd")
def _packed_bwd_fake(grad_out, qkv, out, lse, cu_seqlens, max_seqlen, dropout_p, scale, rng, seqused=None):
    return qkv.new_empty(qkv.shape)


def _packed_setup(ctx, inputs, output):
    qkv, cu_seqlens, max_seqlen, dropout_p, scale, seqused = inputs
    out, lse, rng = output
    ctx.save_for_backward(qkv, out, lse, cu_seqlens, rng, seqused)
    ctx.max_seqlen, ctx.dropout_p, ctx.scale = max_seqlen, dropout_p, scale
    ctx.set_materialize_grads(False)  # (as _setup)


def _packed_backward(ctx, grad_out, grad_lse, grad_rng):
    if grad_out is None:
        return None, None, None, None, None, None
    qkv, out, lse, cu_seqlens, rng, seqused = ctx.saved_tensors
    dqkv = torch.ops.bertaccel.varlen_attention_packed_bwd(
        grad_out.contiguous(), qkv, out, lse, cu_seqlens, ctx.max_seqlen, ctx.dropout_p, ctx.scale, rng, seqused)
    return dqkv, None, None, None, None, None


torch.library.register_autograd(f"{NS}::varlen_attention_packed_fwd", _packed_backward, setup_context=_packed_setup)


# ------------------------------------------------------------------------------ public function
def _extension_unavailable() -> str | None:
    """Why the attention extension cannot run (None: it can): built and loaded on the first call; while torch.compile
    traces, only whether it is loaded already (no build inside a trace)."""
    from bertaccel.ops import build

    if torch.compiler.is_compiling():
        return None if build.attention_loaded() else (build.attention_reason() or "attention kernels not built")
    if not build.load_attention():
        return build.attention_reason()
    return None


def kernel_unavailable(q: Tensor, k: Tensor, v: Tensor) -> str | None:
    """Why the CUDA kernel cannot take these packed q, k, v (None: it can). Builds the extension on
    the first CUDA call (never while torch.compile traces)."""
    if not q.is_cuda:
        return "not a CUDA tensor"
    if q.dtype not in KERNEL_DTYPES:
        return f"{q.dtype} (the kernel takes bfloat16 / float16)"
    if q.shape[-1] not in HEAD_DIMS:
        return f"head dim {q.shape[-1]} (the kernel takes {', '.join(map(str, HEAD_DIMS))})"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3 or t.shape != q.shape or t.dtype != q.dtype:
            return f"{name} is not [tokens, heads, head_dim] like q"
        if t.stride(2) != 1 or t.stride(0) % 8 or t.stride(1) % 8 or t.data_ptr() % 16:
            return f"{name}'s strides {tuple(t.stride())} or alignment (needs a contiguous head dim, 16-byte rows)"
    if torch.are_deterministic_algorithms_enabled() and torch.is_grad_enabled() and q.requires_grad:
        return "deterministic algorithms are on (the backward adds dQ up with atomics)"
    return _extension_unavailable()


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                     dropout_p: float = 0.0, scale: float | None = None, seqused: Tensor | None = None) -> Tensor:
    """Attention within each sequence of packed [T, heads, d] rows (sequence b: rows cu_seqlens[b] ..
    cu_seqlens[b + 1]; `max_seqlen` at least the longest, a host int). With `seqused` (int32 [batch], on
    the device) sequence b is the first seqused[b] rows of that slot and the rest of the slot are fillers
    (zero output and gradients): a padded [batch, seq] layout read in place, with cu_seqlens b * seq and
    `max_seqlen` at least the longest slot. The caller checks `kernel_unavailable` on CUDA; on CPU this
    runs the reference."""
    check_dropout(dropout_p)
    scale = float(scale) if scale is not None else q.shape[-1] ** -0.5
    return torch.ops.bertaccel.varlen_attention_fwd(q, k, v, cu_seqlens, int(max_seqlen), float(dropout_p), scale,
                                                    seqused)[0]


def varlen_attention_packed(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float = 0.0,
                            scale: float | None = None, seqused: Tensor | None = None) -> Tensor:
    """`varlen_attention` of the three parts of one qkv [T, 3, heads, d] (e.g. a fused QKV projection's
    [T, 3 * hidden] output viewed so), whose gradient comes back as one [T, 3, heads, d] tensor written by
    the kernels in place of the cat autograd would make of three separate ones. The caller checks
    `kernel_unavailable(*qkv.unbind(1))` on CUDA; on CPU this runs the reference."""
    check_dropout(dropout_p)
    if qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"varlen_attention_packed: qkv must be [tokens, 3, heads, head_dim], got {tuple(qkv.shape)}")
    scale = float(scale) if scale is not None else qkv.shape[-1] ** -0.5
    return torch.ops.bertaccel.varlen_attention_packed_fwd(qkv, cu_seqlens, int(max_seqlen), float(dropout_p), scale,
                                                           seqused)[0]


# ------------------------------------------------------------------------------ a few query rows over all keys
# `query_rows_attention`: the last layer at [CLS] only (bertaccel.modules.last_layer) - Q <= 4 queries per sequence
# over its S keys, one CTA per (sequence, head) reading each K / V row once (csrc/query_rows_attention.cu).
QUERY_ROWS_MAX = 4


def query_rows_keep(batch: int, queries: int, heads: int, keys: int, p: float, seed: int, offset: int) -> Tensor:
    """The kernel's keep mask [batch, heads, queries, keys]: element (b, h, q, j) uses 16-bit half j % 8 (word
    (j % 8) // 2, the high half for odd j) of Philox at counter (b * queries + q, j // 8 | h << 16, offset low,
    offset high)."""
    b = torch.arange(batch, dtype=torch.int64)[:, None, None, None]
    h = torch.arange(heads, dtype=torch.int64)[None, :, None, None]
    q = torch.arange(queries, dtype=torch.int64)[None, None, :, None]
    j = torch.arange(keys, dtype=torch.int64)[None, None, None, :]
    shape = (batch, heads, queries, keys)
    row = (b * queries + q).expand(shape)
    c = (row, ((j // 8) | (h << 16)).expand(shape), torch.full(shape, offset & MASK32, dtype=torch.int64),
         torch.full(shape, (offset >> 32) & MASK32, dtype=torch.int64))
    words = torch.stack(philox4x32(c, seed % (1 << 64)))  # [4, B, h, Q, S]
    i = (j % 8).expand(shape)
    draw = (words.gather(0, (i // 2)[None]).squeeze(0) >> (16 * (i % 2))) & 0xFFFF
    return draw >= dropout_threshold(p)


def _query_rows_probs(q, kv, key_mask, heads, dropout_p, scale, rng):
    """Probabilities [B, h, Q, S] (0 at masked keys; rows with no key all 0), dropout factors, lse [B, h, Q], and
    q, K, V as [B, h, *, d], in fp32 (fp64 for fp64 inputs)."""
    B, Q, H = q.shape
    S, d = kv.shape[1], H // heads
    ct = torch.promote_types(q.dtype, torch.float32)  # fp32 math (fp64 for fp64 inputs: gradcheck)
    qh = q.to(ct).view(B, Q, heads, d).transpose(1, 2)
    k, v = kv.to(ct).view(B, S, 2, heads, d).unbind(2)
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    scores = (qh @ k.transpose(-1, -2) * scale).masked_fill(~key_mask[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, -1)  # -inf for a row with no key
    probs = torch.where(torch.isfinite(lse)[..., None], torch.exp(scores - lse[..., None]), 0.0)
    if dropout_p > 0:
        factors = query_rows_keep(B, Q, heads, S, dropout_p, int(rng[0]), int(rng[1])) / (1 - dropout_p)
    else:
        factors = torch.ones_like(probs)
    return qh, k, v, probs, factors, lse


@torch.library.impl(lib, "query_rows_attention_fwd", "CPU")
def _query_rows_fwd_cpu(q, kv, key_mask, heads, dropout_p, scale):
    check_dropout(dropout_p)
    rng = _cpu_rng(dropout_p)
    _, _, v, probs, factors, lse = _query_rows_probs(q, kv, key_mask, heads, dropout_p, scale, rng)
    out = (probs * factors) @ v  # [B, h, Q, d]
    return out.transpose(1, 2).reshape(q.shape).to(q.dtype), lse.float().contiguous(), rng


@torch.library.impl(lib, "query_rows_attention_bwd", "CPU")
def _query_rows_bwd_cpu(grad_out, q, kv, key_mask, out, lse, heads, dropout_p, scale, rng):
    B, Q, H = q.shape
    d = H // heads
    qh, k, v, probs, factors, _ = _query_rows_probs(q, kv, key_mask, heads, dropout_p, scale, rng)
    do = grad_out.to(qh.dtype).view(B, Q, heads, d).transpose(1, 2)
    o = out.to(qh.dtype).view(B, Q, heads, d).transpose(1, 2)
    dv = (probs * factors).transpose(-1, -2) @ do  # [B, h, S, d]
    dprobs = (do @ v.transpose(-1, -2)) * factors
    ds = probs * (dprobs - (do * o).sum(-1, keepdim=True)) * scale  # delta = dout . out, as the kernel
    dq = ds @ k
    dk = ds.transpose(-1, -2) @ qh
    dkv = torch.stack((dk.transpose(1, 2), dv.transpose(1, 2)), 2).reshape(kv.shape)
    return dq.transpose(1, 2).reshape(q.shape).to(q.dtype), dkv.to(kv.dtype)


@torch.library.register_fake(f"{NS}::query_rows_attention_fwd")
def _query_rows_fwd_fake(q, kv, key_mask, heads, dropout_p, scale):
    return (q.new_empty(q.shape), q.new_empty(q.shape[0], heads, q.shape[1], dtype=torch.float32),
            q.new_empty(2, dtype=torch.int64))


@torch.library.register_fake(f"{NS}::query_rows_attention_bwd")
def _query_rows_bwd_fake(grad_out, q, kv, key_mask, out, lse, heads, dropout_p, scale, rng):
    return q.new_empty(q.shape), kv.new_empty(kv.shape)


def _query_rows_setup(ctx, inputs, output):
    q, kv, key_mask, heads, dropout_p, scale = inputs
    out, lse, rng = output
    ctx.save_for_backward(q, kv, key_mask, out, lse, rng)
    ctx.heads, ctx.dropout_p, ctx.scale = heads, dropout_p, scale
    ctx.set_materialize_grads(False)  # (as _setup)


def _query_rows_backward(ctx, grad_out, grad_lse, grad_rng):
    if grad_out is None:
        return None, None, None, None, None, None
    q, kv, key_mask, out, lse, rng = ctx.saved_tensors
    dq, dkv = torch.ops.bertaccel.query_rows_attention_bwd(
        grad_out.contiguous(), q, kv, key_mask, out, lse, ctx.heads, ctx.dropout_p, ctx.scale, rng)
    return dq, dkv, None, None, None, None


torch.library.register_autograd(f"{NS}::query_rows_attention_fwd", _query_rows_backward,
                                setup_context=_query_rows_setup)


def query_rows_unavailable(q: Tensor, kv: Tensor, heads: int, max_seqlen: int | None = None) -> str | None:
    """Why the CUDA kernel cannot take these q [B, Q, H], kv [B, S, 2H] - or, given `max_seqlen`, the packed kv
    [T, 2H] of `query_rows_attention_varlen` - (None: it can). Builds the attention extension on the first CUDA call
    (never while torch.compile traces)."""
    if not q.is_cuda:
        return "not a CUDA tensor"
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or kv.dtype != q.dtype:
        return f"{q.dtype} / {kv.dtype} (the kernel takes one of bfloat16, float16, float32)"
    if max_seqlen is not None:
        if q.dim() != 3 or kv.dim() != 2 or kv.shape[1] != 2 * q.shape[2]:
            return f"q {tuple(q.shape)} / kv {tuple(kv.shape)} are not [batch, queries, hidden] / [tokens, 2 x hidden]"
        if max_seqlen >= 2 ** 31 or kv.shape[0] >= 2 ** 31:
            return f"{max_seqlen} keys per sequence / {kv.shape[0]} tokens (the kernel counts in int32)"
    elif q.dim() != 3 or kv.dim() != 3 or kv.shape[0] != q.shape[0] or kv.shape[2] != 2 * q.shape[2]:
        return f"q {tuple(q.shape)} / kv {tuple(kv.shape)} are not [batch, queries, hidden] / [batch, keys, 2 x hidden]"
    if not 1 <= q.shape[1] <= QUERY_ROWS_MAX:
        return f"{q.shape[1]} queries per sequence (the kernel takes 1 to {QUERY_ROWS_MAX})"
    if q.shape[2] % heads or q.shape[2] // heads not in HEAD_DIMS:
        return f"head dim {q.shape[2] / heads:g} (the kernel takes {', '.join(map(str, HEAD_DIMS))})"
    for name, t in (("q", q), ("kv", kv)):
        if t.is_contiguous() and t.data_ptr() % 16:
            return f"{name} does not start on a 16-byte boundary (the kernel reads its rows as vectors)"
    keys = kv.shape[1] if max_seqlen is None else max_seqlen
    if q.shape[1] * -(-keys // 32) * 4 > 200 * 1024:
        return f"{q.shape[1]} queries x {keys} keys' dropout bits (more shared memory than a CTA has)"
    return _extension_unavailable()


def query_rows_attention(q: Tensor, kv: Tensor, key_mask: Tensor, heads: int, dropout_p: float = 0.0,
                         scale: float | None = None) -> Tensor:
    """Attention of q [B, Q, H] (Q <= 4 query rows per sequence) over the keys and values kv [B, S, 2H] (K then V,
    heads x head_dim each) where key_mask [B, S] (bool) is True; [B, Q, H]. A row with no key gets zeros. The
    caller checks `query_rows_unavailable` on CUDA; on CPU this runs the reference (fp32 math, the kernel's
    dropout mask)."""
    check_dropout(dropout_p)
    scale = float(scale) if scale is not None else (q.shape[-1] // heads) ** -0.5
    return torch.ops.bertaccel.query_rows_attention_fwd(q.contiguous(), kv.contiguous(), key_mask.contiguous(),
                                                        int(heads), float(dropout_p), scale)[0]


# The varlen form: the unpadded encoder's packed K / V rows read in place (no padded copy of them, forward or
# backward). Sequence b's keys are kv rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1; its key j is its j-th row, as in
# the padded form, so both forms draw the same dropout mask and the kernel gives them the same bits. The CPU reference
# re-pads and runs the padded reference.
def _varlen_rows(cu_seqlens: Tensor, max_seqlen: int) -> tuple[Tensor, Tensor]:
    """Each sequence's packed row per key position [B, max_seqlen] (clamped into range) and which are keys."""
    cu = cu_seqlens.long()
    starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    j = torch.arange(max_seqlen, device=cu.device)
    return (starts[:, None] + j).clamp(max=max(int(cu[-1]) - 1, 0)), j < lengths[:, None]


def _varlen_padded(kv: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> tuple[Tensor, Tensor, Tensor]:
    """kv [T, 2H] re-padded to [B, max_seqlen, 2H] (zeros past each sequence), its key mask, and `_varlen_rows`'s
    rows (where each padded key came from)."""
    rows, mask = _varlen_rows(cu_seqlens, max_seqlen)
    if kv.shape[0] == 0:
        return kv.new_zeros(*rows.shape, kv.shape[1]), mask, rows
    return kv[rows].masked_fill(~mask[..., None], 0), mask, rows


@torch.library.impl(lib, "query_rows_attention_varlen_fwd", "CPU")
def _query_rows_varlen_fwd_cpu(q, kv, cu_seqlens, max_seqlen, heads, dropout_p, scale):
    padded, mask, _ = _varlen_padded(kv, cu_seqlens, max_seqlen)
    return _query_rows_fwd_cpu(q, padded, mask, heads, dropout_p, scale)


@torch.library.impl(lib, "query_rows_attention_varlen_bwd", "CPU")
def _query_rows_varlen_bwd_cpu(grad_out, q, kv, cu_seqlens, out, lse, max_seqlen, heads, dropout_p, scale, rng):
    padded, mask, rows = _varlen_padded(kv, cu_seqlens, max_seqlen)
    dq, dpadded = _query_rows_bwd_cpu(grad_out, q, padded, mask, out, lse, heads, dropout_p, scale, rng)
    dkv = kv.new_zeros(kv.shape)
    dkv[rows[mask]] = dpadded[mask]  # the rows past the last sequence stay zero
    return dq, dkv


@torch.library.register_fake(f"{NS}::query_rows_attention_varlen_fwd")
def _query_rows_varlen_fwd_fake(q, kv, cu_seqlens, max_seqlen, heads, dropout_p, scale):
    return _query_rows_fwd_fake(q, kv, None, heads, dropout_p, scale)


@torch.library.register_fake(f"{NS}::query_rows_attention_varlen_bwd")
def _query_rows_varlen_bwd_fake(grad_out, q, kv, cu_seqlens, out, lse, max_seqlen, heads, dropout_p, scale, rng):
    return q.new_empty(q.shape), kv.new_empty(kv.shape)


def _query_rows_varlen_setup(ctx, inputs, output):
    q, kv, cu_seqlens, max_seqlen, heads, dropout_p, scale = inputs
    out, lse, rng = output
    ctx.save_for_backward(q, kv, cu_seqlens, out, lse, rng)
    ctx.max_seqlen, ctx.heads, ctx.dropout_p, ctx.scale = max_seqlen, heads, dropout_p, scale
    ctx.set_materialize_grads(False)


def _query_rows_varlen_backward(ctx, grad_out, grad_lse, grad_rng):
    if grad_out is None:
        return None, None, None, None, None, None, None
    q, kv, cu_seqlens, out, lse, rng = ctx.saved_tensors
    dq, dkv = torch.ops.bertaccel.query_rows_attention_varlen_bwd(
        grad_out.contiguous(), q, kv, cu_seqlens, out, lse, ctx.max_seqlen, ctx.heads, ctx.dropout_p, ctx.scale, rng)
    return dq, dkv, None, None, None, None, None


torch.library.register_autograd(f"{NS}::query_rows_attention_varlen_fwd", _query_rows_varlen_backward,
                                setup_context=_query_rows_varlen_setup)


def query_rows_attention_varlen(q: Tensor, kv: Tensor, cu_seqlens: Tensor, max_seqlen: int, heads: int,
                                dropout_p: float = 0.0, scale: float | None = None) -> Tensor:
    """Attention of q [B, Q, H] (Q <= 4 query rows per sequence) over the packed keys and values kv [T, 2H] (K then
    V, heads x head_dim each): sequence b's keys are rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1 (int32 [B + 1]),
    none longer than `max_seqlen` (the keys past it are not read); [B, Q, H], zeros for an empty sequence. The
    gradient of kv is zero at the rows past cu_seqlens[B]. The caller checks `query_rows_unavailable(q, kv, heads,
    max_seqlen)` on CUDA; on CPU this runs the reference."""
    check_dropout(dropout_p)
    scale = float(scale) if scale is not None else (q.shape[-1] // heads) ** -0.5
    return torch.ops.bertaccel.query_rows_attention_varlen_fwd(q.contiguous(), kv.contiguous(), cu_seqlens.contiguous(),
                                                               int(max_seqlen), int(heads), float(dropout_p), scale)[0]
