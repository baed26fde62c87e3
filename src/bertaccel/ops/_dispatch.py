"""When the CUDA kernels can run for a tensor, and the one-time messages when they cannot."""

from __future__ import annotations

import warnings

import torch

from bertaccel.ops import build

KERNEL_DTYPES = (torch.float32, torch.bfloat16)
MAX_HIDDEN = 8192
_warned: set[str] = set()


def kernels_loaded() -> bool:
    """True when the CUDA ops are registered. Never builds while torch.compile traces: the swap
    (or the first eager call) builds them first."""
    if torch.compiler.is_compiling():
        return bool(build._state["loaded"])
    return build.load()


def why_not(x: torch.Tensor, hidden: int | None = None, dtype: torch.dtype | None = None) -> str | None:
    """None when `x` (or, with `dtype`, x computed in that dtype) can go through the kernels, else
    the reason it takes the PyTorch path."""
    if not x.is_cuda:
        return "input is not on a CUDA device"
    dtype = dtype or x.dtype
    if dtype not in KERNEL_DTYPES:
        return f"dtype {dtype} (kernels take bfloat16 and float32)"
    hidden = hidden or x.shape[-1]
    if hidden > MAX_HIDDEN:
        return f"last dimension {hidden} is above {MAX_HIDDEN}"
    if not kernels_loaded():
        return build._state["reason"] or "kernels not built"
    return None


def note_fallback(op: str, reason: str) -> None:
    """Warn once per (op, reason) that PyTorch runs instead; CPU inputs are expected and stay quiet."""
    key = f"{op}: {reason}"
    if key in _warned or torch.compiler.is_compiling() or reason.startswith("input is not on a CUDA"):
        return
    _warned.add(key)
    warnings.warn(f"bertaccel {op} uses PyTorch: {reason}.", stacklevel=3)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on `x` produces here: the autocast dtype when autocast is on."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype
