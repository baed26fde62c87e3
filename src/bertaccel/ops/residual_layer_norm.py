"""The fused tail of BERT's sub-layers (csrc/layer_norm_fwd.cu, layer_norm_bwd.cu; schemas in layer_norm.py): LayerNorm(dropout(x + bias) + residual)
in one kernel, dropout drawn from PyTorch's CUDA generator (Philox) and regenerated in backward."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import bertaccel.ops.layer_norm  # noqa: F401 - defines the op this family runs
from bertaccel.ops.eligibility import compute_dtype, note_fallback, why_not
from bertaccel.ops.gemm import dense_matmul
from bertaccel.ops.registration import SwapEntry

CUDA_SOURCES = ["layer_norm_fwd.cu", "layer_norm_bwd.cu"]
# the overload itself: calling it skips the packet's overload resolution on every eager call
_LAYER_NORM = torch.ops.bertaccel.layer_norm.default


def bias_dropout_add_layer_norm_reference(x, bias, residual, weight, ln_bias, p, eps, training=True) -> Tensor:
    """Plain PyTorch: the computation HF's BertSelfOutput / BertOutput do after their matmul."""
    return F.layer_norm(F.dropout(x + bias, p, training) + residual, (x.shape[-1],), weight, ln_bias, eps)


def bias_dropout_add_layer_norm(
    x: Tensor, bias: Tensor, residual: Tensor, weight: Tensor, ln_bias: Tensor, p: float, eps: float, training: bool = True
) -> Tensor:
    """LayerNorm(dropout(x + bias, p) + residual). Runs in x's dtype (residual and bias are cast to
    it); the reference computation when the kernel cannot run."""
    reason = why_not(x, params=(weight, ln_bias))
    if reason is not None:
        note_fallback("residual_layer_norm", reason)
        return bias_dropout_add_layer_norm_reference(x, bias, residual, weight, ln_bias, p, eps, training)
    shape = x.shape
    H = shape[-1]
    y = _LAYER_NORM(
        x.contiguous().view(-1, H),
        bias.to(x.dtype).contiguous(),
        residual.to(x.dtype).contiguous().view(-1, H),
        weight,
        ln_bias,
        float(p) if training else 0.0,
        eps,
    )
    return y.view(shape)


class FusedBertOutput(nn.Module):
    """Replaces an HF `BertSelfOutput` / `BertOutput` (dense -> dropout -> LayerNorm(. + input)):
    the matmul without its bias, then bias + dropout + residual + LayerNorm in one kernel. Keeps the
    original submodules (`dense`, `dropout`, `LayerNorm`), so parameters and state_dict keys are
    unchanged, and runs the original computation exactly when the kernel cannot run."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        self.dense, self.dropout, self.LayerNorm = original.dense, original.dropout, original.LayerNorm
        self.train(original.training)

    def forward(self, hidden_states: Tensor, input_tensor: Tensor) -> Tensor:
        # The dtype the matmul will produce (bf16 under autocast) decides eligibility.
        dtype = compute_dtype(hidden_states)
        if self.dense.bias is None or why_not(hidden_states, self.dense.out_features, dtype,
                                              (self.LayerNorm.weight, self.LayerNorm.bias)) is not None:
            return self.LayerNorm(self.dropout(self.dense(hidden_states)) + input_tensor)
        h = dense_matmul(self.dense, hidden_states)
        return bias_dropout_add_layer_norm(
            h, self.dense.bias, input_tensor, self.LayerNorm.weight, self.LayerNorm.bias,
            self.dropout.p, self.LayerNorm.eps, self.training,
        )


def _skip_reason(m: nn.Module) -> str | None:
    is_output = type(m).__name__ in ("BertSelfOutput", "BertOutput") and all(
        hasattr(m, a) for a in ("dense", "dropout", "LayerNorm")
    ) and isinstance(m.LayerNorm, nn.LayerNorm)
    return None if is_output else ""


SWAP = SwapEntry("residual_layer_norm", _skip_reason, FusedBertOutput,
                 "BertSelfOutput / BertOutput -> FusedBertOutput (bias + dropout + residual + LayerNorm)")
