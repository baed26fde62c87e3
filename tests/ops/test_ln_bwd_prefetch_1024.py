"""The fused residual LayerNorm backward of 776-1024-wide bf16 rows through the prefetching kernel (layer_norm_bwd.cuh's
ln_bwd_prefetch_kernel at 32 elements a thread, two blocks per SM) in place of the ring kernel (and, for the
two-gradient form layer_norm_bwd2, of the add kernel before it): by default for two gradients at every row count and
for one from kPrefetch1024Rows (4,096) rows; `BERTACCEL_LN_BWD_PREFETCH_1024=1` always, `=0` never. The switch is read
once per process, so each setting runs in a child process: the kernel the rule names must be the one that ran, the
one-gradient backward's gradients within twice PyTorch's error of the float64 reference (bf16 activations, fp32 and
bf16 weights), and layer_norm_bwd2 the same bits as layer_norm_bwd on the added gradient where the two run the same
kernel, with dropout and without (by default below 4,096 rows they do not: the two-gradient form takes the prefetching
kernel and the one-gradient form the ring, whose sums run in another order - there within a bf16 rounding)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.ops.conftest import (assert_passes_in_child, check, cuda_kernel_grids, cuda_kernel_names, cuda_test, leaves,
                                poison, rand)


def check_prefetch_1024() -> None:
    """Run in a child process with BERTACCEL_LN_BWD_PREFETCH_1024 set or not (see the test below)."""
    import torch.nn.functional as F

    setting = os.environ.get("BERTACCEL_LN_BWD_PREFETCH_1024")
    import bertaccel.ops.swap  # noqa: F401 - imports every op family
    from bertaccel.ops import build
    from bertaccel.ops.residual_layer_norm import bias_dropout_add_layer_norm

    assert build.load(), build.unavailable_reason()
    ops = torch.ops.bertaccel

    def expect_prefetch(rows: int, two: bool) -> bool:  # layer_norm_bwd.cuh's bwd_prefetch_1024 (kPrefetch1024Rows)
        return setting == "1" or (setting is None and (two or rows >= 4096))

    def assert_kernels(names: list[str], rows: int, H: int, two: bool) -> None:
        prefetch = [n for n in names if "ln_bwd_prefetch_kernel" in n]
        if expect_prefetch(rows, two) and H > 768:
            assert prefetch and all(", 8, 4, 1, " in n for n in prefetch), (H, names)
            assert not any("ln_bwd_ring_kernel" in n for n in names), (H, names)
            adds = [n for n in names if "elementwise" in n.lower() and "add" in n.lower()]  # PyTorch's dy + dy2
            assert not (two and adds), ("an add kernel ran", H, names)
        elif H > 768:
            assert not prefetch and any("ln_bwd_ring_kernel" in n for n in names), (rows, H, names)

    # the one-gradient backward through the public function, against float64 and PyTorch's bf16
    for rows, H, wdtype in [(1, 1024, torch.float32), (7, 1000, torch.bfloat16), (2053, 1024, torch.float32),
                            (16384, 1024, torch.bfloat16), (4099, 800, torch.float32), (300, 768, torch.float32)]:
        x, r = torch.randn(rows, H, device="cuda"), torch.randn(rows, H, device="cuda") * 2
        bias, w, b = (torch.randn(H, device="cuda") for _ in range(3))
        dy = torch.randn(rows, H, device="cuda")

        def run(fn, dt, wdt):
            ins = leaves(x.to(dt), bias.to(dt), r.to(dt), w.to(wdt), b.to(wdt))
            out = fn(*ins)
            return torch.autograd.grad(out, ins, dy.to(out.dtype))

        def torch_form(a, bi, rr, ww, bb):
            return F.layer_norm(a + bi + rr, (H,), ww, bb, 1e-12)

        ref = run(torch_form, torch.float64, torch.float64)
        th = run(torch_form, torch.bfloat16, torch.bfloat16)
        poison()
        ours = run(lambda a, bi, rr, ww, bb: bias_dropout_add_layer_norm(a, bi, rr, ww, bb, 0.0, 1e-12), torch.bfloat16,
                   wdtype)
        for name, a, t, rf in zip(("dx", "dbias", "dresidual", "dweight", "dln_bias"), ours, th, ref):
            check(a, t, rf, torch.bfloat16, f"{rows}x{H} weights {wdtype} {name}")
        ins = leaves(x.bfloat16(), bias.bfloat16(), r.bfloat16(), w.to(wdtype), b.to(wdtype))
        out = bias_dropout_add_layer_norm(*ins, 0.0, 1e-12)
        assert_kernels(cuda_kernel_names(lambda: torch.autograd.grad(out, ins, dy.bfloat16(), retain_graph=True)), rows,
                       H, False)

    # the two-gradient form: layer_norm_bwd's bits on dy + dy2 (same kernel), dropout on and off
    for rows, H, p in [(2053, 1024, 0.1), (16384, 1024, 0.0), (5, 1000, 0.1), (4099, 800, 0.0)]:
        for wdtype in (torch.float32, torch.bfloat16):
            x, res, bias = (rand(*shape, device="cuda", dtype=torch.bfloat16) for shape in ((rows, H), (rows, H), (H,)))
            w, b = rand(H, device="cuda").to(wdtype), rand(H, device="cuda").to(wdtype)
            _, z, mean, rstd, rng = ops.layer_norm_fwd(x, bias, res, w, b, p, 1e-5)
            dy, dy2 = (rand(rows, H, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            poison()
            two = ops.layer_norm_bwd2(dy, dy2, z, w, mean, rstd, rng, p)
            one = ops.layer_norm_bwd(dy + dy2, z, w, mean, rstd, rng, p, True)
            same_kernel = H <= 768 or expect_prefetch(rows, True) == expect_prefetch(rows, False)
            for name, a, c in zip(["dz", "dh", "dweight", "dln_bias", "dbias"], two, one):
                if same_kernel:
                    assert torch.equal(a, c), f"{name} {rows}x{H} weights {wdtype} p={p}"
                else:  # each kernel is checked against float64 above; here they agree to a bf16 rounding
                    tol = 2**-8 * c.float().abs().max().item()
                    torch.testing.assert_close(a.float(), c.float(), rtol=2**-7, atol=tol,
                                               msg=lambda m: f"{name} {rows}x{H} weights {wdtype} p={p}: {m}")
            assert_kernels(cuda_kernel_names(lambda: ops.layer_norm_bwd2(dy, dy2, z, w, mean, rstd, rng, p)), rows, H,
                           True)
            if expect_prefetch(rows, True) and rows >= 16384:  # two blocks a SM: 128 registers, 2 x 113 KiB of smem
                sms = torch.cuda.get_device_properties(0).multi_processor_count
                grids = [g for n, g in cuda_kernel_grids(lambda: ops.layer_norm_bwd2(dy, dy2, z, w, mean, rstd, rng, p))
                         if "ln_bwd_prefetch_kernel" in n]
                assert grids and grids[0][0] == min(-(-rows // 8), 2 * sms), ("not two blocks per SM", sms, grids)
    print("prefetch 1024 ok")


@cuda_test
@pytest.mark.parametrize("setting", [None, "1", "0"], ids=["default", "always", "never"])
def test_fused_backward_at_1024_wide_through_the_prefetching_kernel(setting):
    assert_passes_in_child(check_prefetch_1024, {"BERTACCEL_LN_BWD_PREFETCH_1024": setting}, "prefetch 1024 ok")
