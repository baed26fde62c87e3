"""The op families, in the kernel swap's order: `linear` (our GEMM) first, so that the coarser
families that replace a dense layer's parent keep the swapped layer and route their matmul through
it (`gemm.dense_matmul`); then coarse to fine (a module inside one a coarser family replaced is left
to its parent). Each family module defines its ops and declares `CUDA_SOURCES`
(its files under csrc/) and `SWAP` (a `SwapEntry`); the build, the swap, the benchmark list and
the docs (`describe()`) derive from this list. Adding an op family: its module here, its .cu
files, a `benchmarks/bench_<module>.py`, a `tests/ops/test_<module>.py`."""

from __future__ import annotations

import importlib
from types import ModuleType

FAMILY_MODULES = ["gemm", "ffn", "embeddings", "softmax", "qkv", "residual_layer_norm", "gelu", "layer_norm", "rms_norm"]


def modules() -> list[ModuleType]:
    return [importlib.import_module(f"bertaccel.ops.{name}") for name in FAMILY_MODULES]


def cuda_sources() -> list[str]:
    """Every family's CUDA sources, each once, in family order."""
    out: list[str] = []
    for m in modules():
        out += [s for s in m.CUDA_SOURCES if s not in out]
    return out


def swap_entries() -> dict:
    """Swap name (what configs list under the kernel swap's ops) -> SwapEntry, in swap order."""
    return {m.SWAP.name: m.SWAP for m in modules()}


def default_families() -> list[str]:
    """What `ops: [all]` means: every family but the opt-in ones."""
    return [name for name, e in swap_entries().items() if not e.opt_in]


def expand(ops: list[str]) -> list[str]:
    """A config's op list with `all` replaced by the default families (other names kept, in order)."""
    out: list[str] = []
    for name in ops:
        for f in default_families() if name == "all" else [name]:
            if f not in out:
                out.append(f)
    return out


def describe() -> str:
    """One line per swap family: the table in the swap module's docs and the CLI's help."""
    entries = swap_entries()
    width = max(map(len, entries))
    return "\n".join(f"{name.ljust(width)}  {e.covers}" for name, e in entries.items())
