"""The 768-1024-wide LayerNorm backward with its accumulators in shared memory (layer_norm_bwd.cuh's
ln_bwd_prefetch_kernel with NEXT = false, three blocks per SM at 768 wide, two at 1024; the plain LayerNorm's and the
embeddings' form): by default at 1024 wide (at 768 wide from 10,240 rows until session 71, when the register kernel
on two blocks per SM measured faster there; the plain LayerNorm's below 8,192 rows only since session 72, the
two-block register kernel from there), `BERTACCEL_LN_BWD_SMEM_ACC=1` everywhere in that range, `=0` never. The
switch is read once per process, so each setting runs in a child process: the kernel the rule names must be the one
that ran, its gradients within twice PyTorch's error of the float64 reference (1 to 16,384 rows, bf16 activations
with fp32 and bf16 weights), the same bits on a second call, and narrower rows untouched (the register kernel)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.ops.conftest import (assert_passes_in_child, check_embeddings_layer_norm_backward, check_layer_norm_backward,
                                cuda_test)

# the default's row count from which the plain LayerNorm's 1024-wide rows take the two-block register kernel instead
# (layer_norm_bwd.cuh: kTwoBlocks32RowsPlain; the embeddings' form keeps the accumulators)
TWO_BLOCKS_32_ROWS_PLAIN = 8192


def expect_smem_accumulators(setting: str | None, rows: int, H: int, embeddings: bool = False) -> bool:
    """Whether the shared-memory-accumulator kernel should run for bf16 rows x H under that switch setting (the plain
    LayerNorm's backward, or with `embeddings` the embeddings' form)."""
    if H < 768 or setting == "0":
        return False
    return setting == "1" or (H > 768 and (embeddings or rows < TWO_BLOCKS_32_ROWS_PLAIN))


def check_smem_accumulators() -> None:
    """Run in a child process with BERTACCEL_LN_BWD_SMEM_ACC set or not (see the test below)."""
    setting = os.environ.get("BERTACCEL_LN_BWD_SMEM_ACC")
    import bertaccel.ops.swap  # noqa: F401 - imports every op family
    from bertaccel.ops import build

    assert build.load(), build.unavailable_reason()

    def expect(rows: int, H: int, embeddings: bool = False):
        def assert_kernels(names: list[str]) -> None:
            smem = [n for n in names if "ln_bwd_prefetch_kernel" in n and "false, false>" in n]
            want = expect_smem_accumulators(setting, rows, H, embeddings)
            assert bool(smem) == want, (setting, rows, H, names)
            if setting is None and H > 768 and not want:  # the plain LayerNorm's rule: the two-block register kernel
                registers = [n for n in names if "ln_bwd_kernel<" in n]
                assert registers and all(", 2>(" in n for n in registers), (rows, H, names)
        return assert_kernels

    for rows, H, wdtype in [(1, 1024, torch.float32), (7, 1024, torch.float32), (1023, 1024, torch.bfloat16),
                            (16384, 1024, torch.float32), (4099, 1024, torch.bfloat16), (8191, 1024, torch.float32),
                            (8192, 1024, torch.bfloat16), (12289, 1000, torch.float32), (300, 768, torch.float32),
                            (16384, 768, torch.float32), (10239, 768, torch.bfloat16), (10240, 768, torch.bfloat16),
                            (5, 768, torch.bfloat16), (300, 384, torch.float32)]:
        check_layer_norm_backward(rows, H, wdtype, expect(rows, H))
    # the embeddings' form (kEmb) without dropout (test_embeddings.py, run under the switch by the GPU check, covers the
    # dropout and the tables)
    for rows, H in [(4096, 768), (16384, 768), (300, 1024), (16384, 1024)]:
        check_embeddings_layer_norm_backward(rows, H, expect(rows, H, embeddings=True))
    print("smem accumulators ok")


@cuda_test
@pytest.mark.parametrize("setting", [None, "1", "0"], ids=["default", "always", "never"])
def test_layer_norm_backward_with_the_accumulators_in_shared_memory(setting):
    assert_passes_in_child(check_smem_accumulators, {"BERTACCEL_LN_BWD_SMEM_ACC": setting}, "smem accumulators ok")
