"""The column sums of the partial rows (common.cuh's `launch_column_sums`: every LayerNorm-family backward's weight
gradients, the bias gradients of bias + GELU and `column_sum`), under each block shape of
`column_sums_kernel<COLS, SLICES, BATCH>`: 8 columns x 64 row slices, and for `column_sum`'s partial rows 32 x 8 up to
128 of them, 32 x 32 from 2,048 columns (each shape everywhere under `BERTACCEL_COLSUM=narrow|wide|32x8`, the comparison
shapes it takes, and `by-width`: column_sum's rule before 32 x 8), `column_sum`'s row chunks under
`BERTACCEL_COLSUM_CHUNK_ROWS` and `BERTACCEL_COLSUM_CHUNK_ROUND`, and its column
blocks under `BERTACCEL_COLSUM_LANES` (16 column vectors a block where 32 would leave lanes idle, or 32 everywhere).
The switches are read once per process, so each setting runs in a child process: the kernels the setting names must
be the ones that ran, and `column_sum` (a few to ~800 partial rows, column counts that are not multiples of 8 or 32,
row counts that leave each thread a part-round) and the LayerNorm backward's dweight / dbias within twice PyTorch's
error of the float64 sums, the same bits on a second call."""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import run_in_child
from tests.ops.conftest import check, cuda_kernel_grids, cuda_kernel_names, cuda_test, leaves

# the partial-row kernel's two block shapes; `column_sum`'s row chunks by the default rule, by one wave of blocks only
# (the rule before session 77), 256 rows long, and 40 rows (rounded up to a whole round: more chunks than one wave)
SETTINGS = {"default": {}, "wide": {"BERTACCEL_COLSUM": "wide"},
            "one-wave-chunks": {"BERTACCEL_COLSUM_CHUNK_ROWS": "-1"},
            "256-row-chunks": {"BERTACCEL_COLSUM_CHUNK_ROWS": "256"},
            "40-row-chunks": {"BERTACCEL_COLSUM_CHUNK_ROWS": "40"},
            "narrow": {"BERTACCEL_COLSUM": "narrow"},
            **{f"shape-{k}": {"BERTACCEL_COLSUM": k} for k in ("16x32", "16x64", "32x16", "32x8", "8x32")},
            "by-width": {"BERTACCEL_COLSUM": "by-width"},
            "chunks-rounded-down": {"BERTACCEL_COLSUM_CHUNK_ROUND": "down"},
            "chunks-rounded-up": {"BERTACCEL_COLSUM_CHUNK_ROUND": "up"},
            "chunks-not-rounded": {"BERTACCEL_COLSUM_CHUNK_ROUND": "none"},
            "32-lane-blocks": {"BERTACCEL_COLSUM_LANES": "32"}}
# every column-sums switch unset: each child process runs its setting alone
UNSET = dict.fromkeys(("BERTACCEL_COLSUM", "BERTACCEL_COLSUM_CHUNK_ROWS", "BERTACCEL_COLSUM_LANES",
                       "BERTACCEL_COLSUM_CHUNK_ROUND"))
# the template arguments of each shape (the wide shape takes 12 or 16 loads by the partial-row count); the comparison
# shapes BERTACCEL_COLSUM also takes (columns x row slices)
NARROW, WIDE = ("column_sums_kernel<8, 64, 8>",), ("column_sums_kernel<32, 32, 12>", "column_sums_kernel<32, 32, 16>")
FEW = ("column_sums_kernel<32, 8, 16>",)  # 32 x 8: column_sum's partial rows where one round of loads takes them all
FEW_ROWS = 128
SHAPES = {"narrow": NARROW, "wide": WIDE, "16x32": ("column_sums_kernel<16, 32, 12>",),
          "16x64": ("column_sums_kernel<16, 64, 8>",), "32x16": ("column_sums_kernel<32, 16, 16>",),
          "32x8": FEW, "8x32": ("column_sums_kernel<8, 32, 12>",)}


def partial_sums_kernels(column_sum_cols: int | None, partial_rows: int = 0) -> tuple[str, ...]:
    """The kernels the setting must launch for the partial rows: BERTACCEL_COLSUM's shape where set; unset, for
    column_sum's partial rows 32 x 8 where there are at most 128 of them (session 81), else the wide shape from 2,048
    columns (session 80) and the narrow one below (`by-width`: that rule without 32 x 8); the narrow shape for every
    LayerNorm backward (column_sum_cols None)."""
    forced = os.environ.get("BERTACCEL_COLSUM", "")
    if forced and forced != "by-width":
        return SHAPES[forced]
    if column_sum_cols is None:
        return NARROW
    if not forced and partial_rows <= FEW_ROWS:
        return FEW
    return WIDE if column_sum_cols >= 2048 else NARROW


def check_column_sums() -> None:
    """Run in a child process under one setting (see the test below)."""
    import bertaccel.ops.swap  # noqa: F401 - imports every op family
    from bertaccel.ops import build
    from bertaccel.ops.layer_norm import layer_norm

    assert build.load(), build.unavailable_reason()
    ops = torch.ops.bertaccel
    lanes32 = os.environ.get("BERTACCEL_COLSUM_LANES") == "32"
    # (rows, cols, dtype, the column vectors' lanes a block by default): 16 where the 16-byte column vectors are a
    # multiple of 16 but not of 32 (384 and 1,152 bf16: 48 and 144; 64 float32: 16)
    for rows, cols, dtype, lanes in [(16384, 768, torch.bfloat16, 32), (200000, 8, torch.float32, 32),
                                     (65536, 37, torch.float32, 32), (4099, 1000, torch.bfloat16, 32),
                                     (100000, 3, torch.bfloat16, 32), (16383, 384, torch.bfloat16, 16),
                                     (9830, 1152, torch.bfloat16, 16), (5001, 64, torch.float32, 16),
                                     (16385, 2304, torch.bfloat16, 32)]:
        x = torch.randn(rows, cols, device="cuda").to(dtype)
        grids = cuda_kernel_grids(lambda: ops.column_sum(x))
        names = [n for n, _ in grids]
        sums = [n for n in names if "column_sums" in n]
        main = [n for n in names if "column_sum_kernel" in n]
        partial_rows = [g[1] for n, g in grids if "column_sum_kernel" in n][0]  # the main kernel's row chunks
        want = partial_sums_kernels(cols, partial_rows)
        assert sums and all(any(k in n for k in want) for n in sums), (rows, cols, partial_rows, names)
        got_lanes = re.search(r"column_sum_kernel<[^>]*, (\d+)>", main[0]) if len(main) == 1 else None
        assert got_lanes and int(got_lanes.group(1)) == (32 if lanes32 else lanes), (rows, cols, main)
        got = ops.column_sum(x)
        check(got, x.float().sum(0), x.double().sum(0), torch.float32, f"column_sum {rows}x{cols}")
        assert torch.equal(got, ops.column_sum(x)), f"{rows}x{cols}: a second call gave other bits"
    for rows, H in [(16384, 768), (16384, 1024), (300, 384), (7, 1000)]:
        x, dy = torch.randn(rows, H, device="cuda").bfloat16(), torch.randn(rows, H, device="cuda").bfloat16()
        w, b = torch.randn(H, device="cuda"), torch.randn(H, device="cuda")
        ref_in = leaves(x.double(), w.double(), b.double())
        ref = torch.autograd.grad(F.layer_norm(ref_in[0], (H,), ref_in[1], ref_in[2], 1e-5), ref_in, dy.double())
        th_in = leaves(x, w.bfloat16(), b.bfloat16())
        th = torch.autograd.grad(F.layer_norm(th_in[0], (H,), th_in[1], th_in[2], 1e-5), th_in, dy)
        ins = leaves(x, w, b)

        def ours():
            return torch.autograd.grad(layer_norm(ins[0], ins[1], ins[2], 1e-5), ins, dy)

        names = cuda_kernel_names(ours)
        assert any(k in n for n in names for k in partial_sums_kernels(None)), (rows, H, names)
        got = ours()
        for name, a, t, r in list(zip(("dx", "dweight", "dbias"), got, th, ref))[1:]:
            check(a, t, r, torch.bfloat16, f"layer_norm {rows}x{H} {name}")
    print("column sums ok")


@cuda_test
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_column_sums_under_each_kernel_setting(setting):
    code = "from tests.ops.test_column_sums import check_column_sums; check_column_sums()"
    r = run_in_child(code, {**UNSET, **SETTINGS[setting]})
    assert r.returncode == 0 and "column sums ok" in r.stdout, r.stdout[-3000:] + r.stderr[-5000:]


@cuda_test
@pytest.mark.parametrize("env, says", [
    ({"BERTACCEL_COLSUM": "8x128"}, ("BERTACCEL_COLSUM=8x128 is not a column-sums shape", "32x8")),
    ({"BERTACCEL_COLSUM_LANES": "24"}, ("BERTACCEL_COLSUM_LANES=24 is not a column block",)),
    ({"BERTACCEL_COLSUM_CHUNK_ROUND": "nearest"}, ("BERTACCEL_COLSUM_CHUNK_ROUND=nearest is not a rounding", "none")),
], ids=["shape", "lanes", "chunk-rounding"])
def test_an_unknown_column_sums_setting_is_refused_with_the_values_it_takes(env, says):
    code = ("import torch, bertaccel.ops.swap; from bertaccel.ops import build; assert build.load()\n"
            "try:\n    torch.ops.bertaccel.column_sum(torch.randn(4096, 64, device='cuda'))\n"
            "except RuntimeError as e:\n    print('refused:', e)\n")
    r = run_in_child(code, {**UNSET, **env})
    assert r.returncode == 0 and "refused:" in r.stdout, r.stdout[-3000:] + r.stderr[-5000:]
    assert all(text in r.stdout for text in says), r.stdout[-3000:]
