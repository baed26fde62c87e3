"""BERT's embeddings in one kernel (csrc/embeddings.cu): word + position + token-type lookup, sum,
LayerNorm and dropout; the backward is the LayerNorm backward kernel plus one scatter of the sum's
gradient into the three tables (`embedding_tables_bwd`, fp32 atomics; PyTorch's sorted embedding
backward under `torch.use_deterministic_algorithms(True)`)."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bertaccel.ops.eligibility import compute_dtype, note_fallback, why_not
from bertaccel.ops.layer_norm import layer_norm_grads_cpu
from bertaccel.ops.registration import NS, SEEDED, SwapEntry, check_dropout, cpu_dropout_keep, define_public, lib

# the backward is the LayerNorm backward kernel (dropout after the norm) plus the tables' scatter
CUDA_SOURCES = ["embeddings.cu", "embeddings_bwd.cu"]

# ------------------------------------------------------------------------------------ schemas
lib.define(
    "embedding_layer_norm_fwd(Tensor ids, Tensor position_ids, Tensor token_type_ids, Tensor word, Tensor position,"
    " Tensor token_type, Tensor weight, Tensor ln_bias, float p, float eps, bool out_bf16, int padding_idx)"
    " -> (Tensor y, Tensor z, Tensor mean, Tensor rstd, Tensor rng)",
    tags=SEEDED,
)
lib.define(
    "embedding_layer_norm_bwd(Tensor dy, Tensor z, Tensor weight, Tensor mean, Tensor rstd, Tensor rng, float p)"
    " -> (Tensor dz, Tensor dweight, Tensor dln_bias)"
)
lib.define(
    "embedding_tables_bwd(Tensor dz, Tensor ids, Tensor position_ids, Tensor token_type_ids, int word_rows,"
    " int position_rows, int token_type_rows, int padding_idx) -> (Tensor dword, Tensor dposition, Tensor dtoken_type)"
)


# ------------------------------------------------------------------------------ CPU reference
@torch.library.impl(lib, "embedding_layer_norm_fwd", "CPU")
def _fwd_cpu(ids, position_ids, token_type_ids, word, position, token_type, weight, ln_bias, p, eps, out_bf16,
             padding_idx):
    check_dropout(p)
    dtype = torch.bfloat16 if out_bf16 else torch.float32
    z = (word[ids] + token_type[token_type_ids] + position[position_ids]).to(dtype)
    var, mean = torch.var_mean(z.float(), dim=-1, correction=0)
    rstd = torch.rsqrt(var + eps)
    y = (z.float() - mean[..., None]) * rstd[..., None] * weight + ln_bias
    rng = torch.zeros(2, dtype=torch.long)
    if p > 0:
        rng[0] = int(torch.randint(0, 2**62, (1,)))
        y = y * cpu_dropout_keep(y.shape, p, rng) / (1 - p)
    return y.to(dtype), z, mean.reshape(-1), rstd.reshape(-1), rng


@torch.library.impl(lib, "embedding_layer_norm_bwd", "CPU")
def _bwd_cpu(dy, z, weight, mean, rstd, rng, p):
    dyf = dy.float()
    if p > 0:  # dropout came after the norm: its mask applies to the incoming gradient
        dyf = dyf * cpu_dropout_keep(z.shape, p, rng) / (1 - p)
    return layer_norm_grads_cpu(dyf, z, weight, mean, rstd)


@torch.library.impl(lib, "embedding_tables_bwd", "CPU")
def _tables_bwd_cpu(dz, ids, position_ids, token_type_ids, word_rows, position_rows, token_type_rows, padding_idx):
    """nn.Embedding's backward for each table, in fp32 (the padding row of the word table gets none)."""
    dzf = dz.float().reshape(-1, dz.shape[-1])
    return tuple(
        torch.ops.aten.embedding_dense_backward(dzf, idx.reshape(-1), n, pad, False)
        for idx, n, pad in ((ids, word_rows, padding_idx), (position_ids, position_rows, -1),
                            (token_type_ids, token_type_rows, -1))
    )


# ----------------------------------------------------------------------------------------- fake
@torch.library.register_fake(f"{NS}::embedding_layer_norm_fwd")
def _fwd_fake(ids, position_ids, token_type_ids, word, position, token_type, weight, ln_bias, p, eps, out_bf16,
              padding_idx):
    check_dropout(p)
    dtype = torch.bfloat16 if out_bf16 else torch.float32
    shape = (*ids.shape, word.shape[-1])
    f = word.new_empty(ids.numel(), dtype=torch.float32)
    return (word.new_empty(shape, dtype=dtype), word.new_empty(shape, dtype=dtype), f, torch.empty_like(f),
            word.new_empty(2, dtype=torch.long))


@torch.library.register_fake(f"{NS}::embedding_layer_norm_bwd")
def _bwd_fake(dy, z, weight, mean, rstd, rng, p):
    w = z.new_empty(z.shape[-1], dtype=torch.float32)
    return torch.empty_like(z), w, torch.empty_like(w)


@torch.library.register_fake(f"{NS}::embedding_tables_bwd")
def _tables_bwd_fake(dz, ids, position_ids, token_type_ids, word_rows, position_rows, token_type_rows, padding_idx):
    H = dz.shape[-1]
    return tuple(dz.new_empty((n, H), dtype=torch.float32) for n in (word_rows, position_rows, token_type_rows))


# ------------------------------------------------------------------------------------ autograd
def _setup(ctx, inputs, output):
    ids, position_ids, token_type_ids, word, position, token_type, weight, ln_bias, p, eps, out_bf16, padding_idx = inputs
    y, z, mean, rstd, rng = output
    ctx.p, ctx.padding_idx = p, padding_idx
    ctx.tables = [(t.shape[0], t.dtype) for t in (word, position, token_type)]
    ctx.save_for_backward(ids, position_ids, token_type_ids, z, weight, mean, rstd, rng)


def _backward(ctx, dy, _dz, _dmean, _drstd, _drng):
    ids, position_ids, token_type_ids, z, weight, mean, rstd, rng = ctx.saved_tensors
    dz, dweight, dln_bias = torch.ops.bertaccel.embedding_layer_norm_bwd(dy, z, weight, mean, rstd, rng, ctx.p)
    # the word table's padding row gets no gradient, as with nn.Embedding(padding_idx=...)
    (n_word, _), (n_pos, _), (n_type, _) = ctx.tables
    grads = [
        g.to(dtype) for g, (_, dtype) in zip(torch.ops.bertaccel.embedding_tables_bwd(
            dz, ids, position_ids, token_type_ids, n_word, n_pos, n_type, ctx.padding_idx), ctx.tables)
    ]
    return (None, None, None, *grads, dweight, dln_bias, None, None, None, None)


torch.library.register_autograd(f"{NS}::embedding_layer_norm_fwd", _backward, setup_context=_setup)
define_public(
    "embedding_layer_norm(Tensor ids, Tensor position_ids, Tensor token_type_ids, Tensor word, Tensor position,"
    " Tensor token_type, Tensor weight, Tensor ln_bias, float p, float eps, bool out_bf16, int padding_idx) -> Tensor",
    "embedding_layer_norm_fwd", tags=SEEDED,
)


# ------------------------------------------------------------------------------ public function
# the overload itself: calling it skips the packet's overload resolution on every eager call
_EMBEDDING_LAYER_NORM = torch.ops.bertaccel.embedding_layer_norm.default




def embeddings_reference(ids, position_ids, token_type_ids, word, position, token_type, weight, ln_bias, eps) -> Tensor:
    """Plain PyTorch, as HF's BertEmbeddings computes it (without dropout)."""
    h = F.embedding(ids, word) + F.embedding(token_type_ids, token_type) + F.embedding(position_ids, position)
    return F.layer_norm(h, (h.shape[-1],), weight, ln_bias, eps)


# ---------------------------------------------------------------------------------------- module
class FusedBertEmbeddings(nn.Module):
    """Replaces an HF `BertEmbeddings`: the three lookups, their sum, LayerNorm and dropout in one
    kernel. Holds the original submodules and buffers (same Parameter objects, same state_dict keys)
    and runs the original module when the kernel cannot: inputs_embeds given, tables not fp32,
    no GPU. Under bf16 autocast the output is bf16 (HF's is fp32: its LayerNorm runs in fp32)."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        self.word_embeddings = original.word_embeddings
        self.position_embeddings = original.position_embeddings
        self.token_type_embeddings = original.token_type_embeddings
        self.LayerNorm, self.dropout = original.LayerNorm, original.dropout
        self.register_buffer("position_ids", original.position_ids, persistent=False)
        if hasattr(original, "token_type_ids"):
            self.register_buffer("token_type_ids", original.token_type_ids, persistent=False)
        object.__setattr__(self, "_original", original)  # not a submodule: its children are ours
        # the name transformers gives the position offset (of a KV cache) changed within 5.x:
        # `past_key_values_length` in 5.17, `cache_length` in 5.24; the fallback passes it on by the
        # name this original takes
        params = inspect.signature(type(original).forward).parameters
        self._offset_name = next((n for n in ("cache_length", "past_key_values_length") if n in params), None)
        self.train(original.training)

    def _why_not(self, input_ids: Tensor | None) -> str | None:
        if input_ids is None:
            return "inputs_embeds given"
        word = self.word_embeddings.weight
        if word.dtype != torch.float32 or any(
            m.weight.dtype != torch.float32 for m in (self.position_embeddings, self.token_type_embeddings, self.LayerNorm)
        ):
            return f"embedding tables are {word.dtype} (the kernel reads float32 tables)"
        if not input_ids.is_cuda:
            return "input is not on a CUDA device"
        return why_not(word, dtype=compute_dtype(word))

    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                cache_length: int = 0, past_key_values_length: int = 0) -> Tensor:
        """HF's signature, under either name of the position offset (see `__init__`)."""
        offset = cache_length or past_key_values_length
        reason = self._why_not(input_ids)
        if reason is not None:
            note_fallback("embeddings", reason)
            # the original's forward, not its __call__: the hooks it shares with this module fire once
            extra = {self._offset_name: offset} if self._offset_name is not None and offset else {}
            return type(self._original).forward(self._original, input_ids, token_type_ids, position_ids, inputs_embeds,
                                                **extra)
        batch, seq = input_ids.shape
        if position_ids is None:
            position_ids = self.position_ids[:, offset: seq + offset]
        if token_type_ids is None:
            if hasattr(self, "token_type_ids"):  # HF's buffered (all-zero) token types, read as HF reads them
                buffered = self.token_type_ids.expand(position_ids.shape[0], -1)
                token_type_ids = torch.gather(buffered, dim=1, index=position_ids)
            else:
                token_type_ids = torch.zeros_like(input_ids)
        position_ids = position_ids.expand(batch, seq).contiguous()
        token_type_ids = token_type_ids.expand(batch, seq).contiguous()
        out_bf16 = compute_dtype(self.word_embeddings.weight) == torch.bfloat16
        pad = self.word_embeddings.padding_idx
        return _EMBEDDING_LAYER_NORM(
            input_ids.contiguous(), position_ids, token_type_ids, self.word_embeddings.weight,
            self.position_embeddings.weight, self.token_type_embeddings.weight, self.LayerNorm.weight,
            self.LayerNorm.bias, float(self.dropout.p) if self.training else 0.0, self.LayerNorm.eps, out_bf16,
            -1 if pad is None else pad,
        )


def _skip_reason(m: nn.Module) -> str | None:
    is_bert = type(m).__name__ == "BertEmbeddings" and all(
        isinstance(getattr(m, a, None), nn.Embedding) for a in ("word_embeddings", "position_embeddings", "token_type_embeddings")
    ) and isinstance(getattr(m, "LayerNorm", None), nn.LayerNorm)
    return None if is_bert else ""


SWAP = SwapEntry("embeddings", _skip_reason, FusedBertEmbeddings,
                 "BertEmbeddings -> FusedBertEmbeddings (lookups + sum + LayerNorm + dropout)")
