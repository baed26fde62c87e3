"""Softmax over the last dimension with a scale and an additive or boolean mask (csrc/softmax.cu),
and the BERT self-attention that uses it in place of eager attention's scale, mask-add and softmax."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bertaccel.ops.eligibility import compute_dtype, note_fallback, why_not
from bertaccel.ops.qkv import SelfAttentionReplacement, kv_cache
from bertaccel.ops.registration import NS, SwapEntry, lib

__all__ = ["softmax", "softmax_reference", "FusedBertSelfAttention"]

CUDA_SOURCES = ["softmax.cu"]

# ------------------------------------------------------------------------------------ schemas
lib.define("softmax(Tensor x, Tensor? mask, float scale) -> Tensor")
lib.define("softmax_bwd(Tensor dy, Tensor y, float scale) -> Tensor")


# ------------------------------------------------------------------------------ CPU reference
def softmax_reference(x: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """softmax(x * scale + mask) in fp32; boolean masks mark the keys to attend; rows with every key
    masked give zeros."""
    v = x.float() * scale
    if mask is not None:
        v = v.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else v + mask.float()
    return torch.softmax(v, dim=-1).nan_to_num(0.0)


@torch.library.impl(lib, "softmax", "CPU")
def _fwd_cpu(x, mask, scale):
    return softmax_reference(x, mask, scale).to(x.dtype)


@torch.library.impl(lib, "softmax_bwd", "CPU")
def _bwd_cpu(dy, y, scale):
    yf, dyf = y.float(), dy.float()
    return (scale * yf * (dyf - (dyf * yf).sum(-1, keepdim=True))).to(y.dtype)


# ----------------------------------------------------------------------------------------- fake
@torch.library.register_fake(f"{NS}::softmax")
def _fwd_fake(x, mask, scale):
    return torch.empty_like(x)


@torch.library.register_fake(f"{NS}::softmax_bwd")
def _bwd_fake(dy, y, scale):
    return torch.empty_like(y)


# ------------------------------------------------------------------------------------ autograd
def _setup(ctx, inputs, output):
    ctx.scale = inputs[2]
    ctx.save_for_backward(output)


def _backward(ctx, dy):
    (y,) = ctx.saved_tensors
    return torch.ops.bertaccel.softmax_bwd(dy, y, ctx.scale), None, None


torch.library.register_autograd(f"{NS}::softmax", _backward, setup_context=_setup)


# ------------------------------------------------------------------------------ public function
# the overload itself: calling it skips the packet's overload resolution on every eager call
_SOFTMAX = torch.ops.bertaccel.softmax.default




def softmax(x: Tensor, mask: Tensor | None = None, scale: float = 1.0) -> Tensor:
    """softmax(x * scale + mask, dim=-1) in one pass. `mask`: None, additive (any float dtype) or
    boolean (True = attend), 4-d and broadcastable to x [batch, heads, query, key]. A row whose keys
    are all masked gives zeros. Runs PyTorch (same result) where the kernel cannot."""
    reason = why_not(x, hidden=1)  # rows of any length up to 8192 are fine; check the length below
    if reason is None and x.shape[-1] > 8192:
        reason = f"rows of {x.shape[-1]} are above 8192"
    if reason is None and mask is not None and (x.dim() != 4 or mask.dim() != 4 or not mask.is_cuda):
        reason = "mask is not a 4-d CUDA tensor beside 4-d scores"
    if reason is not None:
        note_fallback("softmax", reason)
        return softmax_reference(x, mask, scale).to(x.dtype)
    return _SOFTMAX(x.contiguous(), mask, float(scale))


# ---------------------------------------------------------------------------------------- module
class FusedBertSelfAttention(SelfAttentionReplacement):
    """Replaces an HF `BertSelfAttention` that runs *eager* attention: the Q, K, V projections as one
    GEMM (ops/qkv.py), the scores matmul, then scale + mask + softmax in one kernel (eager runs
    three), dropout, and the values matmul. Runs the original module for what it does not cover (a
    KV cache, no GPU). SDPA and flash attention never materialise the softmax, so this family leaves
    those modules to the `qkv` family."""

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, *args, **kwargs):
        reason = "a KV cache is in use" if kv_cache(args, kwargs) is not None else why_not(
            hidden_states, hidden=1, dtype=compute_dtype(hidden_states))
        if reason is not None:
            note_fallback("attention softmax", reason)
            return self.run_original(hidden_states, attention_mask, *args, **kwargs)
        q, k, v = self.heads(hidden_states)
        probs = softmax(torch.matmul(q, k.transpose(2, 3)), attention_mask, self.scaling)
        probs = F.dropout(probs, p=self.dropout.p, training=self.training)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(*hidden_states.shape[:-1], -1).contiguous()
        return out, probs


def _skip_reason(m: nn.Module) -> str | None:
    """Only attention modules that run eager attention: SDPA and flash attention never materialise
    the softmax (and are faster than any separate softmax kernel)."""
    if type(m).__name__ != "BertSelfAttention" or not all(hasattr(m, a) for a in ("query", "key", "value", "scaling")):
        return ""
    impl = getattr(m.config, "_attn_implementation", None) or "eager"
    return None if impl == "eager" else f"runs {impl} attention, which never materialises the softmax"


SWAP = SwapEntry("softmax", _skip_reason, FusedBertSelfAttention,
                 "BertSelfAttention (eager) -> FusedBertSelfAttention (Q, K, V in one GEMM; scale + mask + softmax)")
