"""`BERTACCEL_LN_BWD_PREFETCH_PLAIN=1` (layer_norm_bwd.cuh, bwd_prefetch_plain; off by default, built in session 81 for
measuring): the plain LayerNorm's and RMSNorm's backward of bf16 rows within a warp (384-1024 wide, odd widths with
a part-filled last vector too) through the prefetching kernel with its next rows (`ln_bwd_prefetch_kernel<..., false,
true>`). The switch is read once per process, so each setting runs in a child process: under it that kernel must run,
unset it must not; the gradients within twice PyTorch's error of the float64 reference (bf16 activations, fp32 and bf16
weights), the same bits on a second call."""

from __future__ import annotations

import os

import pytest
import torch

from tests.ops.conftest import (assert_passes_in_child, check_layer_norm_backward, check_rms_norm_backward,
                                cuda_test)

PREFETCH_NEXT = "ln_bwd_prefetch_kernel<"


def check_prefetch_plain() -> None:
    """Run in a child process with BERTACCEL_LN_BWD_PREFETCH_PLAIN set or not (see the test below)."""
    on = os.environ.get("BERTACCEL_LN_BWD_PREFETCH_PLAIN") == "1"
    import bertaccel.ops.swap  # noqa: F401 - imports every op family
    from bertaccel.ops import build

    assert build.load(), build.unavailable_reason()

    def expect(rows: int, H: int):
        def assert_kernels(names: list[str]) -> None:
            next_rows = [n for n in names if PREFETCH_NEXT in n and ", false, true>(" in n]
            if on:
                assert next_rows, (rows, H, names)
            else:
                assert not next_rows, (rows, H, names)
        return assert_kernels

    for rows, H, wdtype in [(16384, 384, torch.float32), (7, 384, torch.bfloat16), (4097, 768, torch.float32),
                            (16384, 768, torch.bfloat16), (2048, 1024, torch.float32), (16385, 1024, torch.float32),
                            (333, 1000, torch.float32), (1, 128, torch.float32)]:
        check_layer_norm_backward(rows, H, wdtype, expect(rows, H))
        check_rms_norm_backward(rows, H, wdtype, expect(rows, H))
    print("prefetch plain ok")


@cuda_test
@pytest.mark.parametrize("setting", [None, "1"], ids=["default", "prefetch-plain"])
def test_plain_backward_through_the_prefetching_kernel(setting):
    env = {"BERTACCEL_LN_BWD_PREFETCH_PLAIN": setting, "BERTACCEL_LN_BWD_SMEM_ACC": None,
           "BERTACCEL_LN_BWD_TWO_BLOCKS": None}
    assert_passes_in_child(check_prefetch_plain, env, "prefetch plain ok")
