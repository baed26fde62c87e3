"""The `bertaccel` op namespace and the helpers every op family uses to register into it.

Each family file (`layer_norm.py`, `rms_norm.py`, `gelu.py`, `softmax.py`, `embeddings.py`) holds, in
order: its schemas, CPU reference kernels, fake (meta) kernels, the Python autograd formulas, the
public function and the `nn.Module`. Defining the schemas in Python means the ops exist on every
machine: on CPU they run the PyTorch references, so `torch.library.opcheck` and the autograd
formulas are tested in CI without a GPU. The CUDA kernels (`csrc/*.cu`) and their autograd
(`csrc/autograd.cpp`, registered at AutogradCUDA, ahead of the Python formulas) come from the
extension that `bertaccel.ops.build.load()` builds.

Public ops (`layer_norm`, `rms_norm`, `bias_gelu`, `softmax`, `embedding_layer_norm`) return only
their output; their `*_fwd` forms also return what the backward needs and are what the autograd
formulas run. Not autocast-aware: the ops compute in fp32 internally and return the dtype of their
activation input; norm weights may be fp32 or the activation's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

NS = "bertaccel"
lib = torch.library.Library(NS, "DEF")
# ops that draw dropout masks: tagged so that torch.compile never merges or reorders two calls
SEEDED = (torch.Tag.nondeterministic_seeded,)


def check_dropout(p: float) -> None:
    """Dropout probabilities outside [0, 1) would give a silently wrong 1/(1-p) scale."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}.")


# ------------------------------------------------------------------------------ the kernels' dropout draw
# Python mirrors of csrc/philox.cuh and common.cuh's dropout_keep, for tests that check a kernel's mask
# exactly: the row ops (LayerNorm, residual LayerNorm, embeddings) and the attention
# (bertaccel.ops.attention.dropout_keep) draw 16-bit numbers from Philox4x32 with DROPOUT_PHILOX_ROUNDS
# rounds (csrc/philox.cuh kDropoutPhiloxRounds: 7, as FlashAttention-2's dropout; curand's default is 10).
MASK32 = 0xFFFFFFFF
DROPOUT_PHILOX_ROUNDS = 7


def _mulhilo(a: int, b: Tensor) -> tuple[Tensor, Tensor]:
    """(hi, lo) 32-bit halves of a * b for uint32 values held in int64 tensors, without overflow."""
    p_lo = a * (b & 0xFFFF)  # < 2^48
    p_hi = a * (b >> 16)
    mid = p_lo + ((p_hi & 0xFFFF) << 16)
    return ((p_hi >> 16) + (mid >> 32)) & MASK32, mid & MASK32


def philox4x32(c: tuple[Tensor, Tensor, Tensor, Tensor], seed: int,
               rounds: int = DROPOUT_PHILOX_ROUNDS) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox4x32-`rounds` (Random123's; curand's with rounds 10) of counters c (uint32 in int64 tensors)
    under a 64-bit key. The default is the kernels' dropout draw (csrc/philox.cuh)."""
    c0, c1, c2, c3 = c
    k0, k1 = seed & MASK32, (seed >> 32) & MASK32
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(0xD2511F53, c0)
        hi1, lo1 = _mulhilo(0xCD9E8D57, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + 0x9E3779B9) & MASK32, (k1 + 0xBB67AE85) & MASK32
    return c0, c1, c2, c3


def dropout_threshold(p: float) -> int:
    """A 16-bit draw keeps its element when >= this (the kernel's __float2uint_rn(p * 65536.f))."""
    return int(torch.tensor(p, dtype=torch.float32).mul(65536).round().item())


def row_dropout_keep(numel: int, p: float, seed: int, offset: int) -> Tensor:
    """The CUDA row ops' keep mask of a launch's elements 0 .. numel - 1 (flat, row-major): element i
    keeps when 16-bit half i % 2 of word (i % 8) / 2 of Philox (philox4x32) at counter (i / 8 low, i / 8 high,
    offset low, offset high), key `seed`, is >= dropout_threshold(p)."""
    i = torch.arange(numel, dtype=torch.int64)
    group = i // 8
    c = (group & MASK32, group >> 32, torch.full_like(i, offset & MASK32), torch.full_like(i, (offset >> 32) & MASK32))
    words = torch.stack(philox4x32(c, seed % (1 << 64)))  # [4, numel]
    e = i % 8
    draw = (words.gather(0, (e // 2)[None]).squeeze(0) >> (16 * (e % 2))) & 0xFFFF
    return draw >= dropout_threshold(p)


def cpu_dropout_keep(shape, p: float, rng: Tensor) -> Tensor:
    """The CPU reference's dropout mask: a pure function of the seed saved in `rng`."""
    g = torch.Generator().manual_seed(int(rng[0]))
    return torch.rand(shape, generator=g) >= p


def define_public(schema: str, saving_op: str, tags: tuple = ()) -> None:
    """Define a public op `name(args) -> Tensor` whose saving form `saving_op(args)` returns its
    output first. Without the CUDA extension (CPU) it runs as the saving form's first output, with
    the saving form's autograd (a Python kernel at the Autograd alias, which AutogradCUDA's C++
    kernel overrides on GPUs); the fake kernel and the CPU kernel derive from the saving form's."""
    name = schema.split("(", 1)[0]
    lib.define(schema, tags=tags)
    saving = getattr(torch.ops.bertaccel, saving_op).default

    def through_saving_form(*args):
        return saving(*args)[0]

    lib.impl(name, through_saving_form, "Autograd")
    lib.impl(name, through_saving_form, "CPU")
    torch.library.register_fake(f"{NS}::{name}", lib=lib)(through_saving_form)


@dataclass(frozen=True)
class SwapEntry:
    """How the kernel swap finds and replaces a family's modules.

    `skip_reason(module)`: "" when the module is not one this family covers, None to take it, else
    why a module of its kind stays PyTorch (logged and reported). `from_module(module)` builds the
    replacement around the same submodules and Parameters. `covers`: one line for docs and logs.
    `opt_in`: left out of `ops: [all]`; named explicitly to be used (`ops: [all, linear]`).
    `claims`: the children of a replaced module that the family takes over (the finer families leave
    them alone); empty = the whole sub-tree."""

    name: str
    skip_reason: Callable[[nn.Module], str | None]
    from_module: Callable[[nn.Module], nn.Module]
    covers: str
    opt_in: bool = False
    claims: tuple[str, ...] = ()
