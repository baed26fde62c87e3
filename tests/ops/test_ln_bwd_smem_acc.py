"""The 768-1024-wide LayerNorm backward with its accumulators in shared memory (layer_norm_bwd.cuh's
ln_bwd_prefetch_kernel with NEXT = false, three blocks per SM at 768 wide, two at 1024; the plain LayerNorm's and the
embeddings' form): by default at 1024 wide and at 768 wide from 10,240 rows, `BERTACCEL_LN_BWD_SMEM_ACC=1` everywhere
in that range, `=0` never. The switch is read once per process, so each setting runs in a child process: the kernel the rule names must be the one that ran, its
gradients within twice PyTorch's error of the float64 reference (1 to 16,384 rows, bf16 activations with fp32 and
bf16 weights), the same bits on a second call, and narrower rows untouched (the register kernel)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import run_in_child
from tests.ops.conftest import check, cuda_kernel_names, cuda_test, leaves, poison

def expect_smem_accumulators(setting: str | None, rows: int, H: int) -> bool:
    """Whether the shared-memory-accumulator kernel should run for bf16 rows x H under that switch setting (the plain
    LayerNorm's and the embeddings' backward alike)."""
    if H < 768 or setting == "0":
        return False
    return setting == "1" or H > 768 or rows >= 10240


def check_smem_accumulators() -> None:
    """Run in a child process with BERTACCEL_LN_BWD_SMEM_ACC set or not (see the test below)."""
    setting = os.environ.get("BERTACCEL_LN_BWD_SMEM_ACC")
    import bertaccel.ops.swap  # noqa: F401 - imports every op family
    from bertaccel.ops import build
    from bertaccel.ops.layer_norm import layer_norm

    assert build.load(), build.unavailable_reason()
    for rows, H, wdtype in [(1, 1024, torch.float32), (7, 1024, torch.float32), (1023, 1024, torch.bfloat16),
                            (16384, 1024, torch.float32), (4099, 1024, torch.bfloat16), (300, 768, torch.float32),
                            (16384, 768, torch.float32), (10239, 768, torch.bfloat16), (10240, 768, torch.bfloat16),
                            (5, 768, torch.bfloat16), (300, 384, torch.float32)]:
        x = torch.randn(rows, H, device="cuda") * 3 + 1
        w, b = torch.randn(H, device="cuda"), torch.randn(H, device="cuda")
        dy = torch.randn(rows, H, device="cuda")
        # the float64 reference from the inputs as the kernel sees them (bf16 activations, weights in wdtype)
        ref_in = leaves(x.bfloat16().double(), w.to(wdtype).double(), b.to(wdtype).double())
        ref = torch.autograd.grad(F.layer_norm(ref_in[0], (H,), ref_in[1], ref_in[2], 1e-5), ref_in,
                                  dy.bfloat16().double())
        th_in = leaves(x.bfloat16(), w.bfloat16(), b.bfloat16())
        th = torch.autograd.grad(F.layer_norm(th_in[0], (H,), th_in[1], th_in[2], 1e-5), th_in, dy.bfloat16())
        poison()
        ins = leaves(x.bfloat16(), w.to(wdtype), b.to(wdtype))

        def ours():
            return torch.autograd.grad(layer_norm(ins[0], ins[1], ins[2], 1e-5), ins, dy.bfloat16())

        names = cuda_kernel_names(ours)
        smem = [n for n in names if "ln_bwd_prefetch_kernel" in n and "false, false>" in n]
        assert bool(smem) == expect_smem_accumulators(setting, rows, H), (setting, rows, H, names)
        got = ours()
        for name, a, t, r in zip(("dx", "dweight", "dbias"), got, th, ref):
            check(a, t, r, torch.bfloat16, f"{rows}x{H} weights {wdtype} {name}")
        for a, a2 in zip(got, ours()):
            assert torch.equal(a, a2), f"{rows}x{H}: a second call gave other bits"
    # the embeddings' form (kEmb) without dropout: its LayerNorm backward against the float64 one (test_embeddings.py,
    # run under the switch by the GPU check, covers the dropout and the tables)
    ops = torch.ops.bertaccel
    for rows, H in [(4096, 768), (16384, 768), (300, 1024), (16384, 1024)]:
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

        names = cuda_kernel_names(ours_emb)
        smem = [n for n in names if "ln_bwd_prefetch_kernel" in n and "false, false>" in n]
        assert bool(smem) == expect_smem_accumulators(setting, rows, H), (setting, rows, H, names)
        for name, a, t, r in zip(("dz", "dweight", "dbias"), ours_emb(), th, ref):
            check(a, t, r, torch.bfloat16, f"embeddings {rows}x{H} {name}")
    print("smem accumulators ok")


@cuda_test
@pytest.mark.parametrize("setting", [None, "1", "0"], ids=["default", "always", "never"])
def test_layer_norm_backward_with_the_accumulators_in_shared_memory(setting):
    code = "from tests.ops.test_ln_bwd_smem_acc import check_smem_accumulators; check_smem_accumulators()"
    r = run_in_child(code, {"BERTACCEL_LN_BWD_SMEM_ACC": setting})
    assert r.returncode == 0 and "smem accumulators ok" in r.stdout, r.stdout[-3000:] + r.stderr[-5000:]
