"""The plain LayerNorm's and the embeddings' register backward kernel at 24 elements a thread (bf16 rows 384 wide, two a
warp, and 768 wide below the shared-memory accumulators' 10,240 rows) held to 128 registers, two blocks per SM
(`BERTACCEL_LN_BWD_TWO_BLOCKS_24=1`; off by default). The switch is read once per process, so each setting runs in a
child process: the kernel instantiation the setting names must be the one that ran (`ln_bwd_kernel<..., 2>` with it,
`<..., 1>` without), its gradients within twice PyTorch's error of the float64 reference (bf16 activations, fp32 and
bf16 weights), the same bits on a second call; the embeddings' form (kEmb) likewise without dropout."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import run_in_child
from tests.ops.conftest import check, cuda_kernel_names, cuda_test, leaves, poison


def register_kernels(names: list[str]) -> list[str]:
    return [n for n in names if "ln_bwd_kernel<" in n]


def check_two_blocks_24() -> None:
    """Run in a child process with BERTACCEL_LN_BWD_TWO_BLOCKS_24 set or not (see the test below)."""
    want = ", 2>(" if os.environ.get("BERTACCEL_LN_BWD_TWO_BLOCKS_24") == "1" else ", 1>("
    import bertaccel.ops.swap  # noqa: F401 - imports every op family
    from bertaccel.ops import build
    from bertaccel.ops.layer_norm import layer_norm

    assert build.load(), build.unavailable_reason()
    for rows, H, wdtype in [(1, 384, torch.float32), (7, 384, torch.bfloat16), (2048, 384, torch.float32),
                            (16384, 384, torch.float32), (4097, 384, torch.bfloat16), (2048, 768, torch.float32),
                            (8191, 768, torch.bfloat16)]:
        x = torch.randn(rows, H, device="cuda") * 3 + 1
        w, b = torch.randn(H, device="cuda"), torch.randn(H, device="cuda")
        dy = torch.randn(rows, H, device="cuda")
        ref_in = leaves(x.bfloat16().double(), w.to(wdtype).double(), b.to(wdtype).double())
        ref = torch.autograd.grad(F.layer_norm(ref_in[0], (H,), ref_in[1], ref_in[2], 1e-5), ref_in,
                                  dy.bfloat16().double())
        th_in = leaves(x.bfloat16(), w.bfloat16(), b.bfloat16())
        th = torch.autograd.grad(F.layer_norm(th_in[0], (H,), th_in[1], th_in[2], 1e-5), th_in, dy.bfloat16())
        poison()
        ins = leaves(x.bfloat16(), w.to(wdtype), b.to(wdtype))

        def ours():
            return torch.autograd.grad(layer_norm(ins[0], ins[1], ins[2], 1e-5), ins, dy.bfloat16())

        ran = register_kernels(cuda_kernel_names(ours))
        assert ran and all(want in n for n in ran), (rows, H, want, ran)
        got = ours()
        for name, a, t, r in zip(("dx", "dweight", "dbias"), got, th, ref):
            check(a, t, r, torch.bfloat16, f"{rows}x{H} weights {wdtype} {name}")
        for a, a2 in zip(got, ours()):
            assert torch.equal(a, a2), f"{rows}x{H}: a second call gave other bits"
    ops = torch.ops.bertaccel
    for rows, H in [(16384, 384), (300, 384), (4096, 768)]:
        seq = 256 if rows % 256 == 0 else rows
        ids = torch.randint(0, 1000, (rows // seq, seq), device="cuda")
        pos = torch.arange(seq, device="cuda").expand(rows // seq, seq) % 512
        tables = [torch.randn(n, H, device="cuda") for n in (1000, 512, 2)]
        w, b = torch.randn(H, device="cuda"), torch.randn(H, device="cuda")
        _, z, mean, rstd, rng = ops.embedding_layer_norm_fwd(ids, pos, torch.zeros_like(ids), *tables, w, b, 0.0, 1e-12,
                                                             True, -1)
        dy = torch.randn(z.shape, device="cuda").bfloat16()
        ref_in = leaves(z.double(), w.double(), b.double())
        ref = torch.autograd.grad(F.layer_norm(ref_in[0], (H,), ref_in[1], ref_in[2], 1e-12), ref_in, dy.double())
        th_in = leaves(z, w.bfloat16(), b.bfloat16())
        th = torch.autograd.grad(F.layer_norm(th_in[0], (H,), th_in[1], th_in[2], 1e-12), th_in, dy)

        def ours_emb():
            return ops.embedding_layer_norm_bwd(dy, z, w, mean, rstd, rng, 0.0)

        ran = register_kernels(cuda_kernel_names(ours_emb))
        assert ran and all(want in n for n in ran), (rows, H, want, ran)
        for name, a, t, r in zip(("dz", "dweight", "dbias"), ours_emb(), th, ref):
            check(a, t, r, torch.bfloat16, f"embeddings {rows}x{H} {name}")
    print("two blocks at 24 elements ok")


@cuda_test
@pytest.mark.parametrize("setting", [None, "1"], ids=["default", "two-blocks"])
def test_layer_norm_backward_at_24_elements_a_thread_on_two_blocks_per_sm(setting):
    code = "from tests.ops.test_ln_bwd_two_blocks_24 import check_two_blocks_24; check_two_blocks_24()"
    r = run_in_child(code, {"BERTACCEL_LN_BWD_TWO_BLOCKS_24": setting, "BERTACCEL_LN_BWD_SMEM_ACC": None})
    assert r.returncode == 0 and "two blocks at 24 elements ok" in r.stdout, r.stdout[-3000:] + r.stderr[-5000:]
