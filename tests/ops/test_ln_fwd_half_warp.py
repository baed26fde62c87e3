"""The forward ring's half-warp rows (layer_norm_fwd.cu: ln_fwd_ring_kernel with TPR = 16): a bf16 row of 48 vectors or
fewer that idles lanes on a whole warp (384, 328 and 128 wide here) runs on half a warp - LayerNorm and RMSNorm at every
row count, the fused residual form from kHalfWarpResidualRows (4,096) rows; `BERTACCEL_LN_RING_HALF_WARP=0` never, `=1`
the residual form at every row count too. The switch is read once per process, so each setting runs in a child
process: the ring kernel the rule names must be the one that ran, and its output (and the residual form's saved sum and
statistics) within twice PyTorch's bf16 error of the float64 reference, at row counts that leave the last half-warp
row slot empty."""

from __future__ import annotations

import os
import re

import pytest
import torch

from tests.ops.conftest import assert_passes_in_child, check, cuda_kernel_names, cuda_test, poison


def check_half_warp() -> None:
    """Run in a child process with BERTACCEL_LN_RING_HALF_WARP set or not (see the test below)."""
    import torch.nn.functional as F

    setting = os.environ.get("BERTACCEL_LN_RING_HALF_WARP")
    from bertaccel.ops import build
    from bertaccel.ops.layer_norm import layer_norm
    from bertaccel.ops.residual_layer_norm import bias_dropout_add_layer_norm
    from bertaccel.ops.rms_norm import rms_norm

    assert build.load(), build.unavailable_reason()

    def ring_lanes(fn) -> int:  # lanes per row of the one forward ring kernel fn launched
        names = [n for n in cuda_kernel_names(fn) if "ln_fwd_ring_kernel" in n]
        assert len(names) == 1, names
        # <T, W, VEC, ITEMS, RMS, RES, TPR, FAST, FEATS>: the seventh argument, whatever follows it
        m = re.search(r"ln_fwd_ring_kernel<(?:[^,<>]+, ){6}(16|32)[,>]", names[0])
        assert m, names
        return int(m.group(1))

    def expect_lanes(residual: bool, rows: int) -> int:  # layer_norm_fwd.cu's ring_half_warp
        half = setting == "1" or (setting != "0" and (not residual or rows >= 4096))
        return 16 if half else 32

    g = torch.Generator(device="cuda").manual_seed(0)
    for rows, H in [(7, 384), (2047, 384), (4101, 384), (4099, 328), (33, 128)]:
        x = torch.randn(rows, H, device="cuda", generator=g) * 2 + 1
        r = torch.randn(rows, H, device="cuda", generator=g)
        bias, w, b = (torch.randn(H, device="cuda", generator=g) for _ in range(3))
        xb, rb = x.bfloat16(), r.bfloat16()
        with torch.no_grad():
            cases = [
                ("layer_norm", False, lambda: layer_norm(xb, w, b, 1e-5),
                 F.layer_norm(xb, (H,), w.bfloat16(), b.bfloat16(), 1e-5),
                 F.layer_norm(xb.double(), (H,), w.double(), b.double(), 1e-5)),
                ("rms_norm", False, lambda: rms_norm(xb, w, 1e-5),
                 F.rms_norm(xb, (H,), w.bfloat16(), 1e-5), F.rms_norm(xb.double(), (H,), w.double(), 1e-5)),
                ("residual", True, lambda: bias_dropout_add_layer_norm(xb, bias, rb, w, b, 0.0, 1e-5),
                 F.layer_norm(xb + bias.bfloat16() + rb, (H,), w.bfloat16(), b.bfloat16(), 1e-5),
                 F.layer_norm(xb.double() + bias.double() + rb.double(), (H,), w.double(), b.double(), 1e-5)),
            ]
            for name, residual, fn, th, ref in cases:
                lanes = ring_lanes(fn)
                assert lanes == expect_lanes(residual, rows), (setting, name, rows, H, lanes)
                poison()
                check(fn(), th, ref, torch.bfloat16, f"{name} {rows}x{H} on {lanes} lanes")
            # the saving form (what autograd runs): the pre-norm sum, mean and rstd of every row
            poison()
            y, z, mean, rstd, _ = torch.ops.bertaccel.layer_norm_fwd(xb, bias, rb, w, b, 0.0, 1e-5)
            ref_z = xb.double() + bias.double() + rb.double()
            check(z, xb + bias.bfloat16() + rb, ref_z, torch.bfloat16, f"z {rows}x{H}")
            zd = z.double()
            torch.testing.assert_close(mean.double(), zd.mean(-1), rtol=1e-5, atol=1e-5)
            ref_rstd = torch.rsqrt(zd.var(-1, unbiased=False) + 1e-5)
            torch.testing.assert_close(rstd.double(), ref_rstd, rtol=1e-4, atol=1e-4)
    print("half-warp ok")


@cuda_test
@pytest.mark.parametrize("setting", [None, "0", "1"], ids=["default", "never", "always"])
def test_ln_fwd_half_warp(setting):
    assert_passes_in_child(check_half_warp, {"BERTACCEL_LN_RING_HALF_WARP": setting}, "half-warp ok")
