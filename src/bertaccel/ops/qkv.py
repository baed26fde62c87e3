"""One GEMM for the query, key and value projections of a BERT self-attention.

HF's `BertSelfAttention` runs three `nn.Linear` layers on the same input: three GEMMs of N = hidden
in the forward, three weight-gradient GEMMs, three input-gradient GEMMs whose results two adds sum,
and three bias-gradient reductions in the backward. `FusedQKVSelfAttention` concatenates the three
weights (and biases) and runs one GEMM of N = 3 x hidden: one of each in the backward, no adds.
The attention itself is HF's (SDPA, flash, ...) on views of the one output; the eager-attention
module of the softmax family (`FusedBertSelfAttention`) takes the same projection.

The weights are read in place where they lie one after another in one buffer: the graphed steps' bf16
weight copies (`modules/weight_copies.py`) put each attention's three in one [3 x hidden, hidden] block,
and `adjacent_rows` hands that block to the GEMM whole, its gradient split back into three views (no
copy either way). Elsewhere (fp32 masters, autocast's casts, torch.compile) the concatenation costs one
small copy of the weights per forward (3 x hidden^2 elements); the biases are concatenated (3 x hidden).
No CUDA code of its own: the matmul is cuBLAS, with the bias gradient from our column-sum kernel
(`bertaccel.ops.bias_grad.dense`: PyTorch's `dy.sum(0)` reached ~35% of the copy bandwidth there), or
our GEMM when the `linear` family made the projections `GemmLinear`s. The unpadded encoder
(`bertaccel.modules.unpadded`) runs the same projection on packed rows.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn

from bertaccel.ops.eligibility import compute_dtype, note_fallback, why_not
from bertaccel.ops.registration import SwapEntry

CUDA_SOURCES: list[str] = []


def can_fuse(*layers: nn.Module) -> str | None:
    """None when the projections (query, key, value; or key, value) can run as one GEMM, else why not."""
    if not all(isinstance(m, nn.Linear) for m in layers):
        return "a projection is not an nn.Linear"
    if len({m.in_features for m in layers}) != 1:
        return "the projections take inputs of different sizes"
    if len({m.bias is None for m in layers}) != 1:
        return "some projections have a bias and some do not"
    return None


class _AdjacentRows(torch.autograd.Function):
    """[sum(rows), cols] over 2-D tensors that lie one after another in one storage: the same memory, no
    copy; the gradient goes back as row slices of the incoming one (views, no copy)."""

    @staticmethod
    def forward(ctx, *parts):
        ctx.rows = [t.shape[0] for t in parts]
        first = parts[0]
        whole = first.new_empty(0)
        whole.set_(first.untyped_storage(), first.storage_offset(), (sum(ctx.rows), first.shape[1]), (first.shape[1], 1))
        return whole

    @staticmethod
    def backward(ctx, grad):
        return tuple(grad.split(ctx.rows, 0))


def adjacent_rows(*parts: Tensor) -> Tensor | None:
    """`torch.cat(parts)` without the copy where the 2-D `parts` are contiguous row blocks lying back to back in one
    storage (the bf16 weight copies' Q/K/V blocks), else None. None under torch.compile (which traces the cat) and
    with BERTACCEL_QKV_IN_PLACE=0 (read per call: the concatenation, for comparing both in one run)."""
    first = parts[0]
    if (torch.compiler.is_compiling() or first.dim() != 2 or not first.is_contiguous()
            or os.environ.get("BERTACCEL_QKV_IN_PLACE") == "0"):
        return None
    at = first.storage_offset() + first.numel()
    for t in parts[1:]:
        if (t.dim() != 2 or not t.is_contiguous() or t.shape[1] != first.shape[1] or t.dtype != first.dtype
                or t.device != first.device or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or t.storage_offset() != at):
            return None
        at += t.numel()
    return _AdjacentRows.apply(*parts)


def fused_projection(layers: tuple[nn.Linear, ...], x: Tensor) -> Tensor:
    """`cat([layer(x) for layer in layers], -1)` as one GEMM (`can_fuse` layers; weights read in place where they lie
    back to back, else concatenated on the fly): our GEMM when the `linear` family made them `GemmLinear`s, else
    cuBLAS with the bias gradient summed by our column-sum kernel (`bias_grad.dense`)."""
    from bertaccel.ops.bias_grad import dense
    from bertaccel.ops.gemm import GemmLinear, linear

    weights = [m.weight for m in layers]
    w = adjacent_rows(*weights)
    if w is None:
        w = torch.cat(weights)
    b = None if layers[0].bias is None else torch.cat([m.bias for m in layers])
    if isinstance(layers[0], GemmLinear):
        return linear(x, w, b)
    return dense(x, w, b)


def qkv_projection(query: nn.Linear, key: nn.Linear, value: nn.Linear, x: Tensor) -> Tensor:
    """`cat([query(x), key(x), value(x)], -1)` as one GEMM (`fused_projection`)."""
    return fused_projection((query, key, value), x)


def split_heads(qkv: Tensor, sizes: tuple[int, int, int], head_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """The projection's output [..., T, q + k + v] as query, key, value [..., heads, T, head_size] views."""
    shape = qkv.shape[:-1]
    q, k, v = qkv.split(sizes, dim=-1)
    return tuple(t.view(*shape, -1, head_size).transpose(-3, -2) for t in (q, k, v))


# ---------------------------------------------------------------------------------------- modules
# What HF passes a BertSelfAttention as its KV cache: `past_key_values` (third positional) in
# transformers 5.17, `cache` (keyword) in 5.24. The replacements take either and pass it on as given.
CACHE_ARGUMENTS = ("cache", "past_key_values")


def kv_cache(args: tuple, kwargs: dict):
    """The KV cache a self-attention call was given (None without one), under either name."""
    if args:
        return args[0]
    return next((kwargs[n] for n in CACHE_ARGUMENTS if kwargs.get(n) is not None), None)


def without_cache(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if k not in CACHE_ARGUMENTS}


class SelfAttentionReplacement(nn.Module):
    """What the replacements of an HF `BertSelfAttention` share (this family's and the softmax
    family's `FusedBertSelfAttention`): the original's `query`, `key`, `value` and `dropout` (same
    Parameters and state_dict keys) and attributes, the original's forward for what a replacement
    does not cover, and the projection to heads (one GEMM when the three can be fused)."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        self.query, self.key, self.value, self.dropout = original.query, original.key, original.value, original.dropout
        self.config = original.config
        self.num_attention_heads, self.attention_head_size = original.num_attention_heads, original.attention_head_size
        self.all_head_size, self.scaling = original.all_head_size, original.scaling
        self.is_decoder, self.is_causal, self.layer_idx = original.is_decoder, original.is_causal, original.layer_idx
        object.__setattr__(self, "_original", original)  # not a submodule: its children are ours
        self.train(original.training)

    def run_original(self, hidden_states: Tensor, attention_mask: Tensor | None, *args, **kwargs):
        # not a submodule, so model.train()/eval() did not reach it: its attention dropout follows ours
        self._original.training = self.training
        # the original's forward, not its __call__: the hooks it shares with this module fire once
        return type(self._original).forward(self._original, hidden_states, attention_mask, *args, **kwargs)

    def packed_qkv(self, hidden_states: Tensor) -> Tensor | None:
        """The one projection's output as [..., T, 3, heads, head_size] (query, key, value), or None where the
        three cannot run as one GEMM (`can_fuse`) or differ in size (the unpadded encoder's packed attention)."""
        heads, d = self.num_attention_heads, self.attention_head_size
        if can_fuse(self.query, self.key, self.value) is not None or not (
                self.query.out_features == self.key.out_features == self.value.out_features == heads * d):
            return None
        qkv = qkv_projection(self.query, self.key, self.value, hidden_states)
        return qkv.view(*hidden_states.shape[:-1], 3, heads, d)

    def heads(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Query, key, value as [..., heads, T, head_size]: one GEMM when `can_fuse`, else HF's three."""
        if can_fuse(self.query, self.key, self.value) is None:
            qkv = qkv_projection(self.query, self.key, self.value, hidden_states)
            sizes = (self.query.out_features, self.key.out_features, self.value.out_features)
            return split_heads(qkv, sizes, self.attention_head_size)
        hidden_shape = (*hidden_states.shape[:-1], -1, self.attention_head_size)
        return tuple(p(hidden_states).view(hidden_shape).transpose(-3, -2) for p in (self.query, self.key, self.value))


class FusedQKVSelfAttention(SelfAttentionReplacement):
    """Replaces an HF `BertSelfAttention` that runs SDPA / flash attention: the three projections as
    one GEMM, then HF's attention function on the split heads. Runs the original module where the
    fused path does not apply (a KV cache, a tensor the kernels' eligibility rules turn away: CPU)."""

    # its q, k, v are views of one projection output: `attn_implementation: bertaccel` hands that tensor to the
    # kernel whole (one gradient written, no cat) and says so once where it cannot
    projects_qkv_as_one = True

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, *args, **kwargs):
        reason = "a KV cache is in use" if kv_cache(args, kwargs) is not None else why_not(
            hidden_states, hidden=1, dtype=compute_dtype(hidden_states))
        if reason is None:
            reason = can_fuse(self.query, self.key, self.value)
        if reason is not None:
            note_fallback("qkv", reason)
            return self.run_original(hidden_states, attention_mask, *args, **kwargs)
        kwargs = without_cache(kwargs)
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from transformers.models.bert.modeling_bert import eager_attention_forward

        q, k, v = self.heads(hidden_states)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, weights = attention(self, q, k, v, attention_mask, dropout=self.dropout.p if self.training else 0.0,
                                 scaling=self.scaling, **kwargs)
        return out.reshape(*hidden_states.shape[:-1], -1).contiguous(), weights


def _skip_reason(m: nn.Module) -> str | None:
    if type(m).__name__ != "BertSelfAttention" or not all(hasattr(m, a) for a in ("query", "key", "value", "scaling")):
        return ""
    impl = getattr(m.config, "_attn_implementation", None) or "eager"
    if impl == "eager":
        return "runs eager attention: the softmax family takes it (with the same fused projection)"
    return can_fuse(m.query, m.key, m.value)


SWAP = SwapEntry("qkv", _skip_reason, FusedQKVSelfAttention,
                 "BertSelfAttention (SDPA, flash) -> FusedQKVSelfAttention (Q, K, V projections in one GEMM)")
