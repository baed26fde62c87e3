"""The forward rings' grid (common.cuh `ring_grid_blocks`): persistent, either as many blocks as fit (`fill`) or
balanced (every warp walks the same number of rows, every W-th) - each op's rule picks one,
`BERTACCEL_RING_ROWS_PER_WARP` overrides it (0 balanced, -1 fill, R > 0 ceil(rows / R) warps: more blocks than fit
at once, each warp walking far fewer rows with a stride that is no longer a whole number of resident warps). The
kernels are the same grid-stride loops, so every row must come out bit for bit under every grid: LayerNorm, RMSNorm,
the residual form with dropout (its Philox draws are keyed by element, not by warp), and the softmax ring (whose
bf16 warps step their mask rows by the grid's stride). The switch is read once per process: each setting runs in a
child process that prints a digest of every output; the digests must agree across settings, and each child checks
its outputs against float64 references too."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from tests.conftest import run_in_child
from tests.ops.conftest import cuda_test


def ring_grid_digests() -> None:
    """Run in a child process with BERTACCEL_RING_ROWS_PER_WARP set or not (see the test below)."""
    import hashlib

    import torch.nn.functional as F

    from bertaccel.ops import build
    from bertaccel.ops.layer_norm import layer_norm
    from bertaccel.ops.rms_norm import rms_norm
    from bertaccel.ops.softmax import softmax
    from tests.ops.conftest import check, cuda_kernel_grids, poison

    assert build.load(), build.unavailable_reason()

    def digest(name: str, *ts: torch.Tensor) -> None:
        h = hashlib.sha256()
        for t in ts:
            h.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
        print(f"DIGEST {name} {h.hexdigest()}")

    setting = os.environ.get("BERTACCEL_RING_ROWS_PER_WARP")
    per_warp = int(setting) if setting is not None else None
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def ring_ran(fn, kernel: str, rows: int, rows_per_block: int, balanced_by_default: bool) -> None:
        """fn() launched `kernel` on the grid the setting asks for (common.cuh ring_grid_blocks)."""
        grids = [grid for name, grid in cuda_kernel_grids(fn) if kernel in name]
        assert len(grids) == 1, (kernel, cuda_kernel_grids(fn))
        need, blocks = -(-rows // rows_per_block), grids[0][0]
        if per_warp is not None and per_warp > 0:
            assert blocks == -(-need // per_warp), (kernel, grids, need, per_warp)
        elif need > 8 * sms:  # more row groups than blocks fit (at most 8 of 256 threads on an SM)
            if per_warp == 0 or (per_warp is None and balanced_by_default):  # every block walks the same rounds
                rounds = -(-need // blocks)
                assert blocks * (rounds - 1) < need <= blocks * rounds and -(-need // rounds) == blocks, (grids, need)
            else:  # fill: every slot that fits
                assert blocks % sms == 0, (kernel, grids, sms)
        else:
            assert blocks <= need, (kernel, grids, need)

    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        # the LayerNorm rule: balanced above 768 wide on two ring stages (bf16 here; float32 1024-wide rows run three)
        for rows, H, dt in [(16384, 768, torch.bfloat16), (16384, 1024, torch.bfloat16), (4101, 384, torch.bfloat16),
                            (9999, 1024, torch.float32)]:
            x = (torch.randn(rows, H, device="cuda", generator=g) * 2 + 1).to(dt)
            w, b = torch.randn(H, device="cuda", generator=g), torch.randn(H, device="cuda", generator=g)
            ring_ran(lambda: layer_norm(x, w, b, 1e-5), "ln_fwd_ring_kernel", rows, 16 if H == 384 else 8,
                     H > 768 and dt == torch.bfloat16)
            poison()
            y = layer_norm(x, w, b, 1e-5)
            check(y, F.layer_norm(x, (H,), w.to(dt), b.to(dt), 1e-5),
                  F.layer_norm(x.double(), (H,), w.double(), b.double(), 1e-5), dt, f"layer_norm {rows}x{H}")
            poison()
            r = rms_norm(x, w, 1e-5)
            check(r, F.rms_norm(x, (H,), w.to(dt), 1e-5), F.rms_norm(x.double(), (H,), w.double(), 1e-5), dt,
                  f"rms_norm {rows}x{H}")
            digest(f"norms {rows}x{H}", y, r)
        for rows, H in [(4101, 384), (2047, 768), (16384, 1024)]:
            x, res = (torch.randn(rows, H, device="cuda", generator=g).bfloat16() for _ in range(2))
            bias, w, b = (torch.randn(H, device="cuda", generator=g) for _ in range(3))
            torch.manual_seed(1)
            y, z, mean, rstd, _ = torch.ops.bertaccel.layer_norm_fwd(x, bias, res, w, b, 0.1, 1e-5)
            torch.testing.assert_close(mean.double(), z.double().mean(-1), rtol=1e-5, atol=1e-5)
            digest(f"residual p=0.1 {rows}x{H}", y, z, mean, rstd)
        for shape, kind, dt in [((3, 5, 1031, 256), "key_padding", torch.bfloat16),
                                ((4, 7, 333, 512), "bool", torch.bfloat16),
                                ((2, 3, 333, 512), "full", torch.float32)]:
            bsz, h, q, k = shape
            x = (torch.randn(shape, device="cuda", generator=g) * 4).to(dt)
            if kind == "full":
                mask = torch.randn(bsz, h, q, k, device="cuda", generator=g).to(dt)
                add = mask.double()
            else:
                keep = torch.rand(bsz, 1, 1, k, device="cuda", generator=g) > 0.3
                keep[..., 0] = True
                mask = keep if kind == "bool" else torch.zeros(bsz, 1, 1, k, device="cuda", dtype=dt).masked_fill(
                    ~keep, torch.finfo(dt).min)
                add = torch.zeros(keep.shape, dtype=torch.float64, device="cuda").masked_fill(~keep, float("-inf"))
            ring_ran(lambda: softmax(x, mask, 0.125), "softmax_fwd_ring_kernel", bsz * h * q, 8, False)
            poison()
            p = softmax(x, mask, 0.125)
            ref = torch.softmax(x.double() * 0.125 + add, dim=-1)
            check(p, torch.softmax(x * 0.125 + add.to(dt), dim=-1), ref, dt, f"softmax {shape} {kind}")
            digest(f"softmax {shape} {kind}", p)
    print("ring grid ok")


@functools.lru_cache(maxsize=None)
def child_digests(setting: str | None) -> dict[str, str]:
    r = run_in_child("from tests.ops.test_ring_grid import ring_grid_digests; ring_grid_digests()",
                     {"BERTACCEL_RING_ROWS_PER_WARP": setting})
    assert r.returncode == 0 and "ring grid ok" in r.stdout, r.stdout[-3000:] + r.stderr[-5000:]
    return {line.rsplit(" ", 1)[0]: line.rsplit(" ", 1)[1] for line in r.stdout.splitlines()
            if line.startswith("DIGEST ")}


@cuda_test
@pytest.mark.parametrize("setting", ["0", "-1", "3"], ids=["balanced", "fill", "3-rows-a-warp"])
def test_ring_grids_give_the_same_bits(setting):
    default, other = child_digests(None), child_digests(setting)
    assert len(default) == 10 and other == default, (default, other)
