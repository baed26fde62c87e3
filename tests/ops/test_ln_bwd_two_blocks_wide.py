"""The plain LayerNorm's and RMSNorm's register backward kernel for bf16 rows wider than a warp (1032-8192 wide: 32
elements a thread on 64-256 threads a row) on two blocks per SM from 8,192 rows, one below (layer_norm_bwd.cuh,
bwd_two_blocks, session 81: one block - 8 warps a SM - before); `BERTACCEL_LN_BWD_TWO_BLOCKS=1` two at every row
count, `=0` one. The switch is read once per process, so each setting runs in a child process: the instantiation the
setting names must be the one that ran (`ln_bwd_kernel<..., 2>` two blocks, `<..., 1>` one) on as many blocks as that
many per SM allow, its gradients within twice PyTorch's error of the float64 reference (bf16 activations, fp32 and bf16
weights), the same bits on a second call."""

from __future__ import annotations

import os

import pytest
import torch

from tests.ops.conftest import (assert_passes_in_child, check_layer_norm_backward, check_rms_norm_backward,
                                cuda_kernel_grids, cuda_test)

TWO_BLOCKS_WIDE_ROWS = 8192  # layer_norm_bwd.cuh kTwoBlocksWideRows


def threads_a_row(H: int) -> int:  # 32 elements a thread (4 vectors of 8), a power of two
    need = -(-H // 32)
    return 1 << (need - 1).bit_length()


def check_two_blocks_wide() -> None:
    """Run in a child process with BERTACCEL_LN_BWD_TWO_BLOCKS set or not (see the test below)."""
    setting = os.environ.get("BERTACCEL_LN_BWD_TWO_BLOCKS")
    import bertaccel.ops.swap  # noqa: F401 - imports every op family
    from bertaccel.ops import build
    from bertaccel.ops.layer_norm import layer_norm
    from bertaccel.ops.rms_norm import rms_norm

    assert build.load(), build.unavailable_reason()

    def two_blocks(rows: int) -> bool:
        return setting == "1" if setting is not None else rows >= TWO_BLOCKS_WIDE_ROWS

    def expect(rows: int, H: int):
        want = ", 2>(" if two_blocks(rows) else ", 1>("

        def assert_kernels(names: list[str]) -> None:
            ran = [n for n in names if "ln_bwd_kernel<" in n]
            assert ran and all(want in n for n in ran), (setting, rows, H, want, ran)
        return assert_kernels

    cases = [(8192, 4096, torch.float32), (8191, 4096, torch.bfloat16), (16384, 1536, torch.bfloat16),
             (4096, 2048, torch.float32), (9000, 8192, torch.float32), (33, 3000, torch.float32)]
    for rows, H, wdtype in cases:
        check_layer_norm_backward(rows, H, wdtype, expect(rows, H))
        check_rms_norm_backward(rows, H, wdtype, expect(rows, H))
    # blocks per SM, not only the instantiation: as many as that many per SM allow (or as there are row groups)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for rows, H in [(8191, 4096), (8192, 4096), (16384, 2048)]:
        per_sm = 2 if two_blocks(rows) else 1
        x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w, b = torch.randn(H, device="cuda"), torch.randn(H, device="cuda")
        for y in (layer_norm(x, w, b, 1e-5), rms_norm(x, w, 1e-6)):
            dy = torch.randn_like(y)
            grids = [g for n, g in cuda_kernel_grids(lambda: torch.autograd.grad(y, x, dy, retain_graph=True))
                     if "ln_bwd_kernel<" in n]
            rows_a_block = 256 // threads_a_row(H)
            want = min(-(-rows // rows_a_block), sms * per_sm)
            assert grids and all(g[0] == want for g in grids), (setting, rows, H, per_sm, want, grids)
    print("two blocks for wide rows ok")


@cuda_test
@pytest.mark.parametrize("setting", [None, "1", "0"], ids=["default", "two-blocks", "one-block"])
def test_wide_rows_backward_on_two_blocks_per_sm(setting):
    assert_passes_in_child(check_two_blocks_wide, {"BERTACCEL_LN_BWD_TWO_BLOCKS": setting}, "two blocks for wide rows ok")
