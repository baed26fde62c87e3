"""`KernelSwap`: put the fused CUDA ops into the model at setup, take them out at teardown."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from bertaccel.ops import registry
from bertaccel.ops.swap import SwapReport, swap


class KernelSwap(pl.Callback):
    """Swap BERT submodules for fused equivalents for the length of a run (fit/validate/test/predict).

    Args:
        ops: Op families to swap (`bertaccel.ops.registry.describe()` lists them: linear, ffn, embeddings,
            softmax, qkv, residual_layer_norm, bias_gelu, layer_norm, rms_norm); "all" is every family but the
            opt-in `linear` (our Hopper GEMM) and `ffn` (the feed-forward block on it): `[all, linear]` or `[all, linear, ffn]` add them. Empty: no swap (the default).
        only: fnmatch patterns over module names; when given, only the modules they match are swapped
            (e.g. ["bert.encoder.layer.1[01].*"] for the last two layers of BERT-base).
        exclude: fnmatch patterns over module names that stay PyTorch.
    """

    def __init__(self, ops: list[str] | None = None, only: list[str] | None = None,
                 exclude: list[str] | None = None) -> None:
        ops = list(ops or [])
        self.ops = registry.expand(ops)
        self.only, self.exclude = list(only or []), list(exclude or [])
        self.report: SwapReport | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not self.ops or self.report is not None:
            return
        self.report = swap(pl_module, self.ops, self.only, self.exclude)
        rank_zero_info(self.report.summary())

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.report is not None:
            self.report.revert()
            self.report = None
