"""An FP8 linear layer for the masked-LM head's vocabulary projection (`BertMLM(lm_head_fp8=True)`).

y = x W^T + b with both operands in float8 through `torch._scaled_mm` (cuBLASLt on Hopper/Ada; a
CPU kernel exists too, which is what the tests run): x and W in e4m3 forward; the gradient in e5m2
for dx = dy W and dW = dy^T x. Per-tensor scales come from an amax history (delayed scaling, as in
Transformer Engine): each tensor is scaled by fp8_max / max(last `history` amaxes), and its current
amax is pushed afterwards; the first call, with an empty history, scales by its own amax. Everything
stays on the device (no host reads): the step can be captured in a CUDA graph.

`_scaled_mm` needs every matrix dimension to be a multiple of 16: the rows (masked positions) are
padded with zeros, the vocabulary's last `V % 16` rows (30,522 = 30,512 + 10 for BERT) run in the
input's precision, and a hidden size that is not a multiple of 16 runs the whole layer unscaled.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
E4M3_MAX, E5M2_MAX = torch.finfo(E4M3).max, torch.finfo(E5M2).max


def fp8_supported(device: torch.device) -> bool:
    """FP8 matmuls: compute capability 8.9+ (Ada, Hopper) on CUDA; PyTorch's CPU kernel otherwise."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return device.type == "cpu"


class AmaxHistory(nn.Module):
    """Rolling amax histories of the three tensors of an FP8 linear layer: input, weight, gradient."""

    def __init__(self, length: int = 16) -> None:
        super().__init__()
        self.register_buffer("amax", torch.zeros(3, length), persistent=False)

    def scale(self, which: int, x: Tensor, fp8_max: float) -> Tensor:
        """fp8_max / amax (history max, or this tensor's own amax while the history is empty), as a
        float32 scalar tensor; then pushes this tensor's amax. Device ops only."""
        current = x.detach().abs().amax().float()
        past = self.amax[which].amax()
        amax = torch.where(past > 0, past, current).clamp(min=1e-12)
        with torch.no_grad():
            self.amax[which].copy_(torch.cat([current.view(1), self.amax[which, :-1]]))
        return fp8_max / amax


def _to_fp8(x: Tensor, scale: Tensor, dtype: torch.dtype, fp8_max: float) -> Tensor:
    return (x.float() * scale).clamp(-fp8_max, fp8_max).to(dtype)


def _pad_rows(x: Tensor, multiple: int = 16) -> Tensor:
    extra = (-x.shape[0]) % multiple
    return F.pad(x, (0, 0, 0, extra)) if extra else x


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, history: AmaxHistory) -> Tensor:
        m, v = x.shape[0], weight.shape[0]
        v16 = v - v % 16
        out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32
        sx, sw = history.scale(0, x, E4M3_MAX), history.scale(1, weight[:v16], E4M3_MAX)
        x8 = _pad_rows(_to_fp8(x, sx, E4M3, E4M3_MAX))
        w8 = _to_fp8(weight[:v16], sw, E4M3, E4M3_MAX)
        y = torch._scaled_mm(x8, w8.t(), scale_a=sx.reciprocal(), scale_b=sw.reciprocal(), out_dtype=out_dtype)[:m]
        if v16 < v:  # the vocabulary's last rows, in the input's precision
            y = torch.cat([y, (x @ weight[v16:].t().to(x.dtype)).to(out_dtype)], dim=1)
        if bias is not None:
            y = y + bias.to(out_dtype)
        ctx.save_for_backward(x8, w8, sx, sw, weight[v16:], x if v16 < v else None)
        ctx.m, ctx.v16, ctx.history, ctx.has_bias = m, v16, history, bias is not None
        ctx.dtypes = (x.dtype, weight.dtype)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x8, w8, sx, sw, w_rest, x = ctx.saved_tensors
        m, v16 = ctx.m, ctx.v16
        x_dtype, w_dtype = ctx.dtypes
        head, rest = dy[:, :v16], dy[:, v16:]
        sg = ctx.history.scale(2, head, E5M2_MAX)
        g8 = _pad_rows(_to_fp8(head, sg, E5M2, E5M2_MAX))  # (M16, V16)
        # dx = dy W: (M16, V16) x (V16, H), the weight as a column-major operand
        dx = torch._scaled_mm(g8, w8.t().contiguous().t(), scale_a=sg.reciprocal(), scale_b=sw.reciprocal(),
                              out_dtype=torch.float32)[:m]
        # dW = dy^T x: (V16, M16) x (M16, H)
        dw = torch._scaled_mm(g8.t().contiguous(), x8.t().contiguous().t(), scale_a=sg.reciprocal(),
                              scale_b=sx.reciprocal(), out_dtype=torch.float32)
        if rest.shape[1]:
            dx = dx + rest.float() @ w_rest.float()
            dw = torch.cat([dw, rest.float().t() @ x.float()], dim=0)
        dbias = dy.sum(0, dtype=torch.float32) if ctx.has_bias else None
        return dx.to(x_dtype), dw.to(w_dtype), dbias, None


def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None, history: AmaxHistory) -> Tensor:
    """`F.linear(x, weight, bias)` for 2-d x with both matmuls (and the backward's) in FP8; plain
    `F.linear` where FP8 cannot run (hidden size not a multiple of 16, no FP8 on the device)."""
    if x.dim() != 2 or x.shape[1] % 16 or not fp8_supported(x.device) or weight.shape[0] < 16:
        return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
    return _Fp8Linear.apply(x, weight, bias, history)
