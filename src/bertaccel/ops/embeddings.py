"""BERT's embeddings in one kernel (csrc/embeddings.cu): word + position + token-type lookup, sum,
LayerNorm and dropout; the backward is the LayerNorm backward kernel plus PyTorch's embedding
scatter."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bertaccel.ops import library
from bertaccel.ops._dispatch import compute_dtype, note_fallback, why_not


def embeddings_reference(ids, position_ids, token_type_ids, word, position, token_type, weight, ln_bias, eps) -> Tensor:
    """Plain PyTorch, as HF's BertEmbeddings computes it (without dropout)."""
    h = F.embedding(ids, word) + F.embedding(token_type_ids, token_type) + F.embedding(position_ids, position)
    return F.layer_norm(h, (h.shape[-1],), weight, ln_bias, eps)


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
                past_key_values_length: int = 0) -> Tensor:
        reason = self._why_not(input_ids)
        if reason is not None:
            note_fallback("embeddings", reason)
            # the original's forward, not its __call__: the hooks it shares with this module fire once
            return type(self._original).forward(self._original, input_ids, token_type_ids, position_ids, inputs_embeds,
                                                past_key_values_length)
        batch, seq = input_ids.shape
        if position_ids is None:
            position_ids = self.position_ids[:, past_key_values_length: seq + past_key_values_length]
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
        return library.embedding_layer_norm_fwd(
            input_ids.contiguous(), position_ids, token_type_ids, self.word_embeddings.weight,
            self.position_embeddings.weight, self.token_type_embeddings.weight, self.LayerNorm.weight,
            self.LayerNorm.bias, float(self.dropout.p) if self.training else 0.0, self.LayerNorm.eps, out_bf16,
            -1 if pad is None else pad,
        )[0]
