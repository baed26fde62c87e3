"""Fused bias + GELU (csrc/gelu.cu): exact erf GELU (HF's "gelu") or the tanh approximation
("gelu_new", "gelu_pytorch_tanh"), forward and backward (dbias reduced without atomics)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bertaccel.ops import library
from bertaccel.ops._dispatch import compute_dtype, note_fallback, why_not

TANH_ACTIVATIONS = {"NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "FastGELUActivation"}
ERF_ACTIVATIONS = {"GELUActivation"}


def bias_gelu_reference(x: Tensor, bias: Tensor | None, approximate: str = "none") -> Tensor:
    return F.gelu(x if bias is None else x + bias, approximate=approximate)


def bias_gelu(x: Tensor, bias: Tensor | None = None, approximate: str = "none") -> Tensor:
    """GELU(x + bias) in one pass (`approximate` as in `F.gelu`); PyTorch when the kernel cannot run."""
    reason = why_not(x)
    if reason is not None:
        note_fallback("bias_gelu", reason)
        return bias_gelu_reference(x, bias, approximate)
    b = None if bias is None else bias.to(x.dtype).contiguous()
    return library.bias_gelu_fwd(x.contiguous(), b, approximate == "tanh")


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    return bias_gelu(x, None, approximate)


def activation_kind(act: nn.Module) -> str | None:
    """"none" / "tanh" for the GELU modules HF uses, None for anything else."""
    name = type(act).__name__
    if name in ERF_ACTIVATIONS and not getattr(act, "use_gelu_python", False):
        return "none"
    if name in TANH_ACTIVATIONS:
        return "tanh"
    if isinstance(act, nn.GELU):
        return act.approximate
    return None


class FusedBertIntermediate(nn.Module):
    """Replaces an HF `BertIntermediate` (dense -> GELU): the matmul without bias, then bias + GELU
    in one kernel. Same submodules and state_dict keys; the original computation when the kernel
    cannot run."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        kind = activation_kind(original.intermediate_act_fn)
        if kind is None:
            raise ValueError(f"activation {type(original.intermediate_act_fn).__name__} is not a GELU")
        self.dense, self.intermediate_act_fn, self.approximate = original.dense, original.intermediate_act_fn, kind
        self.train(original.training)

    def forward(self, hidden_states: Tensor) -> Tensor:
        # The dtype the matmul will produce (bf16 under autocast) decides eligibility.
        dtype = compute_dtype(hidden_states)
        if self.dense.bias is None or why_not(hidden_states, self.dense.out_features, dtype) is not None:
            return self.intermediate_act_fn(self.dense(hidden_states))
        return bias_gelu(F.linear(hidden_states, self.dense.weight), self.dense.bias, self.approximate)
