"""Tests of RMSNorm (rms_norm.py): CPU tests (opcheck, autograd formulas, fallback) run everywhere; `cuda` tests check
the kernels against float64 references on the GPU (see conftest.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import bertaccel.ops.swap  # noqa: F401 - imports every op family
from bertaccel.ops.rms_norm import rms_norm
from tests.ops.conftest import DTYPES, ROWS, check, cuda_test, leaves, poison, rand


@cuda_test
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 128, 768, 1000, 4096, 8192])
@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm(rows, hidden, dtype):
    x = torch.randn(rows, hidden, device="cuda") * 3 + 1
    w, dy = torch.randn(hidden, device="cuda"), torch.randn(rows, hidden, device="cuda")

    def run(fn, dt, wdt):
        ins = leaves(x.to(dt), w.to(wdt))
        out = fn(*ins)
        return out, torch.autograd.grad(out, ins, dy.to(dt))

    ref, ref_g = run(lambda a, b: F.rms_norm(a, (hidden,), b, 1e-6), torch.float64, torch.float64)
    th, th_g = run(lambda a, b: F.rms_norm(a, (hidden,), b, 1e-6), dtype, dtype)
    poison()
    ours, our_g = run(lambda a, b: rms_norm(a, b, 1e-6), dtype, torch.float32)
    assert ours.dtype == dtype
    check(ours, th, ref, dtype, "y")
    for name, a, t, r in zip(("dx", "dweight"), our_g, th_g, ref_g):
        check(a, t, r, dtype, name)


def test_rms_norm_falls_back_to_pytorch_exactly_on_cpu():
    x, w = rand(5, 33), rand(33)
    assert torch.equal(rms_norm(x, w, 1e-6), F.rms_norm(x, (33,), w, 1e-6))
    assert torch.equal(rms_norm(x, None, 1e-6), F.rms_norm(x, (33,), None, 1e-6))


def test_rms_norm_public_op_matches_the_reference_cpu():
    x, w = rand(6, 40, requires_grad=True), rand(40, requires_grad=True)
    torch.library.opcheck(torch.ops.bertaccel.rms_norm.default, (x, w, 1e-6))
    y = torch.ops.bertaccel.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(y, F.rms_norm(x, (40,), w, 1e-6))
