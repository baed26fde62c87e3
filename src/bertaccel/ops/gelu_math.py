"""GELU and its derivative as PyTorch expressions: the CPU references of the two families whose kernels
apply them - `gelu` (bias + GELU and its backward) and `gemm` (the GELU and dGELU epilogues). A module of
its own because gelu.py imports gemm.py (`dense_matmul`), so neither can hold what the other uses."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def gelu(h: Tensor, tanh: bool) -> Tensor:
    """GELU(h): erf form, or the tanh approximation."""
    return F.gelu(h, approximate="tanh" if tanh else "none")


def gelu_derivative(h: Tensor, tanh: bool) -> Tensor:
    """d GELU(h) / dh, written out (a kernel that ran autograd inside would record nothing below the autograd
    key, e.g. under a TorchDispatchMode)."""
    if tanh:
        k = math.sqrt(2.0 / math.pi)
        t = torch.tanh(k * (h + 0.044715 * h**3))
        return 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * k * (1 + 3 * 0.044715 * h * h)
    return 0.5 * (1 + torch.erf(h * math.sqrt(0.5))) + h * torch.exp(-0.5 * h * h) / math.sqrt(2 * math.pi)
