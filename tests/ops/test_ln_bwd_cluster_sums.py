"""The LayerNorm / RMSNorm backward with its column sums done in clusters inside the kernel
(`BERTACCEL_LN_BWD_SUMS=cluster|cluster4|cluster2`, layer_norm_bwd.cuh's cluster_column_sums).

The switch is read once per process, so each setting runs `check_cluster_sums` in a child process: the
cluster kernel must be the one that ran (kernel name), its gradients within twice PyTorch's error of the
float64 reference (odd row counts, fewer row groups than a cluster, a width that falls back), the same
bits on a second call (the ticket counter reset by the last cluster), under CUDA-graph replay and on a
second stream (its own counter)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.ops.conftest import check, cuda_kernel_names, cuda_test, leaves, poison

ROOT = Path(__file__).resolve().parents[2]


def _grads(op, x, w, b, dy):
    if op == "layer_norm":
        y = F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)
        return torch.autograd.grad(y, (x, w, b), dy)
    y = F.rms_norm(x, (x.shape[-1],), w, 1e-6)
    return torch.autograd.grad(y, (x, w), dy)


def _ours(op, x, w, b, dy):
    from bertaccel.ops.layer_norm import layer_norm
    from bertaccel.ops.rms_norm import rms_norm

    if op == "layer_norm":
        return torch.autograd.grad(layer_norm(x, w, b, 1e-5), (x, w, b), dy)
    return torch.autograd.grad(rms_norm(x, w, 1e-6), (x, w), dy)


def check_cluster_sums() -> None:
    """Run in a child process with BERTACCEL_LN_BWD_SUMS set (see the test below)."""
    import bertaccel.ops.swap  # noqa: F401 - imports every op family
    from bertaccel.ops import build

    assert build.load(), build.unavailable_reason()
    for op in ("layer_norm", "rms_norm"):
        for rows, H in [(1, 768), (7, 384), (1023, 1024), (16384, 768), (4099, 384), (300, 1000), (64, 1001)]:
            for dtype in (torch.bfloat16, torch.float32):
                x = torch.randn(rows, H, device="cuda") * 3 + 1
                w, b = torch.randn(H, device="cuda"), torch.randn(H, device="cuda")
                dy = torch.randn(rows, H, device="cuda")
                ref = _grads(op, *leaves(x.double(), w.double(), b.double()), dy.double())
                th = _grads(op, *leaves(x.to(dtype), w.to(dtype), b.to(dtype)), dy.to(dtype))
                poison()
                ins = leaves(x.to(dtype), w, b)
                names = cuda_kernel_names(lambda: _ours(op, *ins, dy.to(dtype)))
                ours = _ours(op, *ins, dy.to(dtype))
                clustered = [n for n in names if "ln_bwd_kernel" in n and "true>" in n]
                if H % 4 == 0:  # (a width not a multiple of 4 keeps the two-kernel sums)
                    assert clustered and not any("column_sums" in n for n in names), (op, rows, H, names)
                else:
                    assert not clustered, names
                for name, a, t, r in zip(("dx", "dweight", "dbias"), ours, th, ref):
                    check(a, t, r, dtype, f"{op} {rows}x{H} {dtype} {name}")
                again = _ours(op, *ins, dy.to(dtype))
                for a, a2 in zip(ours, again):
                    assert torch.equal(a, a2), f"{op} {rows}x{H}: a second call gave other bits"

    # captured once, replayed on new gradients: each replay equals an eager call on them
    x = torch.randn(2048, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w, b = torch.randn(768, device="cuda", requires_grad=True), torch.randn(768, device="cuda", requires_grad=True)
    dy = torch.randn(2048, 768, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            _ours("layer_norm", x, w, b, dy)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = _ours("layer_norm", x, w, b, dy)
    for _ in range(3):
        with torch.no_grad():
            dy.copy_(torch.randn_like(dy))
        g.replay()
        torch.cuda.synchronize()
        for got, want in zip(out, _ours("layer_norm", x, w, b, dy)):
            assert torch.equal(got, want)
    # on another stream (a counter of its own), then back on this one
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        there = _ours("layer_norm", x, w, b, dy)
    torch.cuda.current_stream().wait_stream(side)
    for got, want in zip(there, _ours("layer_norm", x, w, b, dy)):
        assert torch.equal(got, want)
    print("cluster sums ok")


@cuda_test
@pytest.mark.parametrize("setting", ["cluster", "cluster4", "cluster2"])
def test_layer_norm_backward_with_the_column_sums_in_clusters(setting):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters need a Hopper or later GPU")
    env = dict(os.environ, BERTACCEL_LN_BWD_SUMS=setting,
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    code = "from tests.ops.test_ln_bwd_cluster_sums import check_cluster_sums; check_cluster_sums()"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "cluster sums ok" in r.stdout, r.stdout[-3000:] + r.stderr[-5000:]
