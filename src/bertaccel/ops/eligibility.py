"""When the CUDA kernels can run for a tensor, and the one-time messages when they cannot.

The device part of the answer (a CUDA tensor, a kernel dtype, the extension loaded) is cached per
(device, dtype) once the build has settled, so an eager call pays a dictionary lookup for it."""

from __future__ import annotations

import warnings

import torch

from bertaccel.ops import build

KERNEL_DTYPES = (torch.float32, torch.bfloat16)
MAX_HIDDEN = 8192
_warned: set[str] = set()
_device_reasons: dict[tuple[torch.device, torch.dtype], str | None] = {}


def kernels_loaded() -> bool:
    """True when the CUDA ops are registered. Never builds while torch.compile traces: the swap
    (or the first eager call) builds them first."""
    if torch.compiler.is_compiling():
        return bool(build.loaded())
    return build.load()


def _device_reason(x: torch.Tensor, dtype: torch.dtype) -> str | None:
    key = (x.device, dtype)
    if key in _device_reasons:
        return _device_reasons[key]
    if not x.is_cuda:
        reason = "input is not on a CUDA device"
    elif dtype not in KERNEL_DTYPES:
        reason = f"dtype {dtype} (kernels take bfloat16 and float32)"
    elif not kernels_loaded():
        reason = build.reason() or "kernels not built"
    else:
        reason = None
    if build.loaded() is not None or not x.is_cuda:  # settled: the answer will not change
        _device_reasons[key] = reason
    return reason


def why_not(x: torch.Tensor, hidden: int | None = None, dtype: torch.dtype | None = None,
            params: tuple[torch.Tensor | None, ...] = ()) -> str | None:
    """None when `x` (or, with `dtype`, x computed in that dtype) can go through the kernels, else
    the reason it takes the PyTorch path. `params` (norm weights) must be float32 or that dtype."""
    dtype = dtype or x.dtype
    reason = _device_reason(x, dtype)
    if reason is not None:
        return reason
    hidden = hidden or x.shape[-1]
    if hidden > MAX_HIDDEN:
        return f"last dimension {hidden} is above {MAX_HIDDEN}"
    for p in params:
        if p is not None and p.dtype != torch.float32 and p.dtype != dtype:
            return f"parameters are {p.dtype} beside {dtype} activations (kernels take float32 or the activation dtype)"
        if p is not None and p.device != x.device:
            return f"parameters are on {p.device}, the input on {x.device}"
    return None


_has_torch_function = torch._C._has_torch_function_variadic


def direct_entry(*args):
    """The extension's direct Python entry points (csrc/eager.cpp: the eligibility test and an unboxed op call in
    C++; a function returns None where the kernel cannot take its inputs), or None where an eager call must go
    through torch.ops: while torch.compile traces, under a __torch_function__ mode or with an argument that
    overrides __torch_function__, and before the extension has loaded."""
    if torch.compiler.is_compiling() or _has_torch_function(*args):
        return None
    return build.entry


def note_once(key: str, message: str, stacklevel: int = 2) -> None:
    """Warn `message` the first time `key` is noted in this process (never while compiling)."""
    if key in _warned or torch.compiler.is_compiling():
        return
    _warned.add(key)
    warnings.warn(message, stacklevel=stacklevel + 1)


def note_fallback(op: str, reason: str) -> None:
    """Warn once per (op, reason) that PyTorch runs instead; CPU inputs are expected and stay quiet."""
    if reason.startswith("input is not on a CUDA"):
        return
    note_once(f"{op}: {reason}", f"bertaccel {op} uses PyTorch: {reason}.", stacklevel=3)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on `x` produces here: the autocast dtype when autocast is on."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def bias_as_read(bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A linear bias as the bias-reading kernels take it (bias + GELU, our GEMM's epilogues): an fp32 (master) bias as
    it is - no cast kernel per call, and its gradient comes back in fp32 unrounded - another cast to `dtype`."""
    return bias if bias is None or bias.dtype == torch.float32 else bias.to(dtype)
