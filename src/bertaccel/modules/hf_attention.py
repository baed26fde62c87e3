"""`attn_implementation: bertaccel`: our fused attention kernel inside Hugging Face's BERT.

Registered the transformers way (`AttentionInterface` / `AttentionMaskInterface`), so every
`BertSelfAttention` - and the kernel swap's `FusedQKVSelfAttention` - calls `attention_forward`
with q, k, v of shape [batch, heads, seq, head_dim] and the mask `padding_mask` made.

How a padded batch meets a varlen kernel, without a host sync (so the step stays capturable in a
CUDA graph) and without moving a token: q, k, v [B, H, S, D] are views of the projection's [B, S, H * D]
output, read in place as B slots of S rows (cu_seqlens b * S) of which sequence b uses the first
seqused[b] = (its mask row's token count) - the right-padded layout BERT tokenizers produce. The rest of
each slot are fillers the kernels write as zeros (and skip: a padded key or query block costs nothing).
Nothing depends on the number of real tokens on the host; the shapes are the padded batch's. A mask row
whose tokens are not one run from position 0 (left padding, holes) has no such layout: its seqused is
marked -1 and the kernel stops with that reason (the CPU reference raises it). Until session 43 the
interface gathered the real tokens into a packed order (a sort of the mask) and scattered the outputs
back - q, k, v, the output and both their gradients through HBM once more per layer. Reading in place,
graphed BERT train steps on one H100 (session 43, lengths uniform in [0.2, 1] x seq): BERT-base 32x512
23.03 against 24.65 ms, MiniLM 32x256 3.23 against 3.56, BERT-base 16x128 5.26 against 5.57. A batch
without a mask (attention_mask None) is B full sequences of S. The layout is computed once per forward:
`padding_mask` (called once per model forward, inside a captured one too) returns a new mask tensor that
every layer gets, and the first layer stores the layout on it. A mask handed to `attention_forward` directly gets no such slot and is
read on every call: the same tensor may be refilled between calls, e.g. a CUDA graph's static input,
whose layout must be computed inside the capture.

Padding query positions come out as zeros (SDPA gives them an average over the real keys); nothing
reads them - the pooler takes [CLS], the losses skip padding - and the real positions match SDPA.

Falls back to PyTorch's SDPA, said once per reason: not on a GPU, a GPU other than a Hopper (sm_90: the
warpgroup-MMA kernels; elsewhere only the mma.sync kernels run, not measured on such a GPU, and on an H100
slower than cuDNN's SDPA on full batches), a dtype or head dim the kernel does not take, causal or
cross attention, a 4-D mask (as transformers passes a caller's own), `output_attentions` (then eager,
which returns weights). The Hopper rule makes the option safe to name in a preset: our kernel runs where
it was measured faster than SDPA (an H100); elsewhere `BERTACCEL_HF_ATTENTION_ANY_GPU=1` runs its mma.sync
kernels anyway (on an H100 they beat cuDNN on padded batches with much padding and lost to it on full
ones: docs/attention.md).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

from bertaccel.ops.eligibility import note_fallback, note_once

NAME = "bertaccel"


_HOPPER: dict[int, bool] = {}


def hopper(device: torch.device) -> bool:
    """Whether `device` is a Hopper GPU (compute capability 9.0), where our attention kernels run as
    warpgroup MMAs, or BERTACCEL_HF_ATTENTION_ANY_GPU=1 asks for them on any GPU; cached per device index."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _HOPPER:
        _HOPPER[index] = (torch.cuda.get_device_capability(index) == (9, 0)
                          or os.environ.get("BERTACCEL_HF_ATTENTION_ANY_GPU", "") == "1")
    return _HOPPER[index]


def not_hopper_reason(query) -> str | None:
    """Why a CUDA query goes to SDPA on this GPU (None on a Hopper, or off the GPU: the kernel checks say why)."""
    if not query.is_cuda or hopper(query.device):
        return None
    return ("not a Hopper GPU: SDPA serves padded batches (our kernel was measured faster only on an H100; "
            "BERTACCEL_HF_ATTENTION_ANY_GPU=1 runs it here)")


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                 mask_function=None, attention_mask: Tensor | None = None, **kwargs) -> Tensor | None:
    """The mask `attention_forward` takes: the 2-D padding mask (bool, True = token) as given, or None.
    Unlike transformers' flash-attention mask this does not ask the GPU whether there is padding (that
    `.all()` is a host sync, which a CUDA graph cannot capture)."""
    if attention_mask is None:
        return None
    mask = attention_mask[:, -kv_length:].bool()  # a new tensor on every call (a view at least)
    if not torch.compiler.is_compiling():
        mask._bertaccel_layout = None  # this forward's: its layers share one layout (padded_layout_of)
    return mask


def _broadcast_mask(attention_mask: Tensor | None) -> Tensor | None:
    """The mask as SDPA takes it: a 2-D padding mask as bool [B, 1, 1, S]; a 4-D mask (bool, or additive
    floats - what transformers passes on unchanged when the caller gives one) as it is."""
    if attention_mask is None or attention_mask.dim() == 4:
        return attention_mask
    return attention_mask.bool()[:, None, None, :]


def _fallback(module, query, key, value, attention_mask, dropout, scaling, is_causal, output_attentions):
    mask = _broadcast_mask(attention_mask)
    if output_attentions:
        from transformers.models.bert.modeling_bert import eager_attention_forward

        additive = mask
        if mask is not None and mask.dtype == torch.bool:
            additive = torch.zeros(mask.shape, dtype=query.dtype, device=query.device)
            additive = additive.masked_fill(~mask, torch.finfo(query.dtype).min)
        return eager_attention_forward(module, query, key, value, additive, dropout=dropout, scaling=scaling)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                         is_causal=bool(is_causal) and mask is None and query.shape[2] > 1)
    return out.transpose(1, 2), None


def slot_bounds(batch: int, seq: int, device: torch.device) -> Tensor:
    """cu_seqlens of `batch` slots of `seq` rows: b * seq, int32 [batch + 1]."""
    return torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=device)


def padded_layout(attention_mask: Tensor) -> tuple[Tensor, Tensor]:
    """For a [B, S] padding mask: (cu_seqlens, seqused), int32 on the mask's device - B slots of S rows
    (cu_seqlens b * S) of which sequence b uses the first seqused[b]: its row's token count, or -1 where
    the row is not right-padded (the kernels stop with that reason). No host sync."""
    B, S = attention_mask.shape
    mask = attention_mask if attention_mask.dtype == torch.bool else attention_mask.bool()
    lengths = mask.sum(1, dtype=torch.int32)
    right_padded = (mask[:, 1:] <= mask[:, :-1]).all(1)  # ones then zeros: never a token after a padding position
    seqused = torch.where(right_padded, lengths, -1)
    return slot_bounds(B, S, mask.device), seqused  # five small kernels per forward (shared by its layers)


def padded_layout_of(attention_mask: Tensor) -> tuple[Tensor, Tensor]:
    """`padded_layout(attention_mask)`, once per forward: stored on a mask `padding_mask` made (one
    forward's, shared by its layers); any other mask is read on every call. Under torch.compile computed
    every call (the compiler merges the repeats)."""
    if torch.compiler.is_compiling() or not hasattr(attention_mask, "_bertaccel_layout"):
        return padded_layout(attention_mask)
    if attention_mask._bertaccel_layout is None:
        attention_mask._bertaccel_layout = padded_layout(attention_mask)
    return attention_mask._bertaccel_layout


def attention_forward(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                      **kwargs) -> tuple[Tensor, Tensor | None]:
    """transformers' attention-function signature: q, k, v [B, H, S, D] -> ([B, S, H, D], weights)."""
    from bertaccel.ops.attention import kernel_unavailable, varlen_attention, varlen_attention_packed

    output_attentions = bool(kwargs.pop("output_attentions", False) or
                             getattr(getattr(module, "config", None), "output_attentions", False))
    if is_causal is None:
        is_causal = getattr(module, "is_causal", False)
    B, H, S, D = query.shape
    reason = None
    if output_attentions:
        reason = "output_attentions asks for the attention weights (eager attention)"
    elif is_causal:
        reason = "causal attention (BERT as a decoder)"
    elif key.shape[2] != S:
        reason = "cross attention (keys of another length)"
    elif attention_mask is not None and attention_mask.dim() != 2:
        reason = f"a {attention_mask.dim()}-D attention mask (the kernel takes 2-D padding masks)"
    else:
        reason = not_hopper_reason(query)
    if reason is None:
        # [B, H, S, D] -> [B*S, H, D]: views of the projection's [B, S, H*D] output (no copy)
        q, k, v = (t.transpose(1, 2).reshape(B * S, H, D) for t in (query, key, value))
        reason = kernel_unavailable(q, k, v)
    if reason is not None:
        note_fallback("attention", reason)
        return _fallback(module, query, key, value, attention_mask, dropout, scaling, is_causal, output_attentions)
    if attention_mask is None:  # B sequences of S
        cu_seqlens, seqused = slot_bounds(B, S, q.device), None
    else:
        cu_seqlens, seqused = padded_layout_of(attention_mask)
    qkv = fused_qkv_of(query, key, value)
    if qkv is None and getattr(module, "projects_qkv_as_one", False):
        note_separate_parts()
    if qkv is not None:  # one [T, 3, H, D] gradient written by the kernels, no cat of three
        out = varlen_attention_packed(qkv, cu_seqlens, S, dropout, scaling, seqused)
    else:
        out = varlen_attention(q, k, v, cu_seqlens, S, dropout, scaling, seqused)
    return out.view(B, S, H, D), None


def note_separate_parts() -> None:
    """Say once that a fused QKV projection's q, k, v reached the kernel as separate tensors (session 44's
    `dense` bug: a projection output outside the autograd graph), where autograd then joins their three
    gradients with a cat - correct, but a full pass over [T, 3 x hidden] per layer that went unnoticed."""
    note_once("attention: separate q, k, v parts",
              "bertaccel attention: the fused QKV projection's query, key and value are not views of its one "
              "output here, so they go to the kernel as three tensors and autograd joins their gradients with "
              "a cat (slower, same result)", stacklevel=3)


def fused_qkv_of(query: Tensor, key: Tensor, value: Tensor) -> Tensor | None:
    """When query, key and value [B, H, S, D] are the three parts of one fused projection's output
    [B, S, 3 * H * D] or [B * S, 3 * H * D] (the kernel swap's `FusedQKVSelfAttention`: `split_heads` views of it), that output
    as [B * S, 3, H, D] - the tensor autograd differentiates, so its gradient arrives as one tensor
    written by the kernels (no cat of three) - else None. Eager only: under torch.compile the views'
    `_base` is not traced."""
    base = query._base
    if base is None or key._base is not base or value._base is not base or torch.compiler.is_compiling():
        return None
    if any(t.requires_grad != base.requires_grad or (t.requires_grad and t.is_leaf) for t in (query, key, value)):
        return None  # gradients asked of the views themselves (made leaves): keep them separate
    B, H, S, D = query.shape
    size = query.element_size()
    if (base.shape[-1] != 3 * H * D or base.numel() != B * S * 3 * H * D or not base.is_contiguous()
            or base.dtype != query.dtype):
        return None
    first = base.data_ptr()
    if (query.data_ptr(), key.data_ptr(), value.data_ptr()) != (first, first + H * D * size, first + 2 * H * D * size):
        return None
    expected = (S * 3 * H * D, D, 3 * H * D, 1)  # [B, H, S, D] strides of views into [B, S, 3, H, D]
    if any(t.stride() != expected for t in (query, key, value)):
        return None
    return base.view(B * S, 3, H, D)


def register() -> None:
    """Make `attn_implementation="bertaccel"` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, padding_mask)
