"""The plain LayerNorm's and the embeddings' register backward kernel at 24 elements a thread (bf16 rows 384 wide, two a
warp, and 768 wide, one a warp) held to 128 registers, two blocks per SM: by default from 7,168 rows at 384 wide (the
embeddings' form from 12,288) and from 4,096 at 768 (layer_norm_bwd.cuh, bwd_two_blocks);
`BERTACCEL_LN_BWD_TWO_BLOCKS_24=1` at every row count, `=0` never. The switch is read once per process, so each setting
runs in a child process: the kernel instantiation the setting names must be the one that ran (`ln_bwd_kernel<..., 2>`
for two blocks, `<..., 1>` for one) on as many blocks as that many per SM allow (the one-block instantiation of the
plain LayerNorm fits two by its registers, so the launch caps it), its gradients within twice PyTorch's error of the
float64 reference (bf16 activations, fp32 and bf16 weights), the same bits on a second call; the embeddings' form
(kEmb) likewise without dropout."""

from __future__ import annotations

import os

import pytest
import torch

from tests.ops.conftest import (assert_passes_in_child, check_embeddings_layer_norm_backward, check_layer_norm_backward,
                                cuda_kernel_grids, cuda_test)


# the default's row thresholds (layer_norm_bwd.cuh: kTwoBlocks24Rows384, kTwoBlocks24Rows384Emb, kTwoBlocks24Rows768)
TWO_BLOCKS_ROWS_384, TWO_BLOCKS_ROWS_384_EMB, TWO_BLOCKS_ROWS_768 = 7168, 12288, 4096


def threshold(H: int, embeddings: bool = False) -> int:
    return TWO_BLOCKS_ROWS_768 if H == 768 else TWO_BLOCKS_ROWS_384_EMB if embeddings else TWO_BLOCKS_ROWS_384


def register_kernels(names: list[str]) -> list[str]:
    return [n for n in names if "ln_bwd_kernel<" in n]


def check_two_blocks_24() -> None:
    """Run in a child process with BERTACCEL_LN_BWD_TWO_BLOCKS_24 set or not (see the test below)."""
    setting = os.environ.get("BERTACCEL_LN_BWD_TWO_BLOCKS_24")
    import bertaccel.ops.swap  # noqa: F401 - imports every op family
    from bertaccel.ops import build

    assert build.load(), build.unavailable_reason()

    def two_blocks(rows: int, H: int, embeddings: bool = False) -> bool:  # what the setting (or the default) says
        return setting == "1" if setting is not None else rows >= threshold(H, embeddings)

    def expect(rows: int, H: int, embeddings: bool = False):
        want = ", 2>(" if two_blocks(rows, H, embeddings) else ", 1>("

        def assert_kernels(names: list[str]) -> None:
            ran = register_kernels(names)
            assert ran and all(want in n for n in ran), (rows, H, want, ran)
        return assert_kernels

    for rows, H, wdtype in [(1, 384, torch.float32), (7, 384, torch.bfloat16), (2048, 384, torch.float32),
                            (16384, 384, torch.float32), (4097, 384, torch.bfloat16), (7167, 384, torch.float32),
                            (7168, 384, torch.bfloat16), (12288, 384, torch.bfloat16),
                            (2048, 768, torch.float32), (4095, 768, torch.bfloat16), (4096, 768, torch.float32),
                            (8191, 768, torch.bfloat16), (10240, 768, torch.bfloat16), (16384, 768, torch.float32)]:
        check_layer_norm_backward(rows, H, wdtype, expect(rows, H))
    for rows, H in [(16384, 384), (300, 384), (8192, 384), (12288, 384), (4096, 768), (16384, 768)]:
        check_embeddings_layer_norm_backward(rows, H, expect(rows, H, embeddings=True))
    # Blocks per SM, not only the instantiation: the plain LayerNorm's one-block instantiation fits two blocks by its
    # registers (120), so the launch must cap its grid at one block per SM where the rule says one.
    from bertaccel.ops.layer_norm import layer_norm

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for rows, H in [(7167, 384), (7168, 384), (16384, 384), (2048, 768), (4096, 768), (16384, 768)]:
        per_sm = 2 if two_blocks(rows, H) else 1
        x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w, b = torch.randn(H, device="cuda"), torch.randn(H, device="cuda")
        y = layer_norm(x, w, b, 1e-5)
        dy = torch.randn_like(y)
        grids = [g for n, g in cuda_kernel_grids(lambda: torch.autograd.grad(y, x, dy, retain_graph=True))
                 if "ln_bwd_kernel<" in n]
        rows_a_block = 8 * 32 // (H // 24)  # 8 warps, H / 24 threads a row
        want = min(-(-rows // rows_a_block), sms * per_sm)
        assert grids and all(g[0] == want for g in grids), (rows, H, per_sm, want, grids)
    print("two blocks at 24 elements ok")


@cuda_test
@pytest.mark.parametrize("setting", [None, "1", "0"], ids=["default", "two-blocks", "one-block"])
def test_layer_norm_backward_at_24_elements_a_thread_on_two_blocks_per_sm(setting):
    env = {"BERTACCEL_LN_BWD_TWO_BLOCKS_24": setting, "BERTACCEL_LN_BWD_SMEM_ACC": None}
    assert_passes_in_child(check_two_blocks_24, env, "two blocks at 24 elements ok")
