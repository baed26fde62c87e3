"""Tests of our tensor-core GEMM (gemm.py, csrc/gemm.cu).

CPU tests (everywhere): the reference op for every epilogue, opcheck of `gemm` / `linear` /
`linear_gelu`, their autograd formulas against `F.linear`, the swap's `linear` family (opt-in,
fallback to `F.linear`). `cuda` tests (Hopper; the kernel is sm_90a): every layout (forward, dgrad,
wgrad), tile width and K split, odd and prime M, N and K not multiples of the tile, every epilogue,
against a float64 reference from the bf16 inputs; the error is at most twice cuBLAS's bf16 error
against the same reference; fallback for shapes the copy engine cannot take; gradients, opcheck,
`torch.compile(fullgraph=True)` and CUDA-graph capture.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import bertaccel.ops.swap  # noqa: F401 - imports every op family
from bertaccel.ops import registry
from bertaccel.ops.gemm import (
    EPILOGUES,
    GemmLinear,
    apply_epilogue,
    gemm_reference,
    linear,
    linear_gelu,
)
from tests.conftest import run_in_child
from tests.ops.conftest import assert_replay_matches_eager, check_vs_cublas, cuda_kernel_names, hopper_test, poison

GEMM = torch.ops.bertaccel.gemm.default


def _operands(M, N, K, trans_a, trans_b, device="cpu", dtype=torch.float32, gen=None):
    a = torch.randn((K, M) if trans_a else (M, K), device=device, generator=gen).to(dtype)
    b = (torch.randn((K, N) if trans_b else (N, K), device=device, generator=gen) * K**-0.5).to(dtype)
    return a, b


# ----------------------------------------------------------------------------------- CPU tests
@pytest.mark.parametrize("epilogue", list(EPILOGUES))
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, True)])
def test_reference_epilogues(epilogue, trans_a, trans_b):
    M, N, K = 6, 10, 12
    a, b = _operands(M, N, K, trans_a, trans_b)
    bias, aux = torch.randn(N), torch.randn(M, N)
    e = EPILOGUES[epilogue]
    out, pre = GEMM(a, b, bias, aux, e, trans_a, trans_b, False, True)
    acc = (a.t() if trans_a else a) @ (b.t() if trans_b else b).t()
    expect = {
        "none": acc, "bias": acc + bias, "bias_gelu": F.gelu(acc + bias),
        "bias_gelu_tanh": F.gelu(acc + bias, approximate="tanh"), "bias_residual": acc + bias + aux,
    }
    if epilogue.startswith("dgelu"):
        h = aux.clone().requires_grad_(True)
        (d,) = torch.autograd.grad(F.gelu(h, approximate="tanh" if "tanh" in epilogue else "none").sum(), h)
        expect[epilogue] = acc * d
    torch.testing.assert_close(out, expect[epilogue], rtol=1e-5, atol=1e-5)
    assert pre.numel() == (M * N if "gelu" in epilogue and not epilogue.startswith("d") else 0)


def test_residual_epilogue_without_bias():
    """The residual epilogue's bias is optional: out = op(a) op(b)^T + aux (the fused FFN's input gradient)."""
    a, b = _operands(6, 10, 12, False, True)
    aux = torch.randn(6, 10)
    out, _ = GEMM(a, b, None, aux, EPILOGUES["bias_residual"], False, True, False, False)
    torch.testing.assert_close(out, a @ b + aux, rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception):  # the bias epilogues themselves still need one
        GEMM(a, b, None, None, EPILOGUES["bias"], False, True, False, False)


def test_gemm_opcheck_cpu():
    a, b = _operands(5, 16, 24, False, False)
    for e in (0, 1, 2):
        torch.library.opcheck(GEMM, (a, b, torch.randn(16), None, e, False, False, False, True))
    x = torch.randn(7, 24, requires_grad=True)
    w = torch.randn(16, 24, requires_grad=True)
    bias = torch.randn(16, requires_grad=True)
    torch.library.opcheck(torch.ops.bertaccel.linear.default, (x, w, bias))
    torch.library.opcheck(torch.ops.bertaccel.linear_gelu.default, (x, w, bias, False))


@pytest.mark.parametrize("gelu", [None, "none", "tanh"])
def test_linear_autograd_matches_f_linear(gelu):
    x = torch.randn(9, 24, requires_grad=True)
    w = torch.randn(16, 24, requires_grad=True)
    bias = torch.randn(16, requires_grad=True)
    ours = linear(x, w, bias) if gelu is None else linear_gelu(x, w, bias, gelu)
    xr, wr, br = (t.detach().clone().requires_grad_(True) for t in (x, w, bias))
    ref = F.linear(xr, wr, br)
    ref = ref if gelu is None else F.gelu(ref, approximate=gelu)
    torch.testing.assert_close(ours, ref)
    dy = torch.randn_like(ref)
    torch.testing.assert_close(torch.autograd.grad(ours, (x, w, bias), dy), torch.autograd.grad(ref, (xr, wr, br), dy))


@pytest.mark.parametrize("gelu", [None, "none"])
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_hands_the_kernel_its_bias(monkeypatch, gelu, bias_dtype):
    """The public functions' path to the op (`_on_kernel`), run on CPU with the kernel's eligibility forced (the op's CPU
    reference computes): the bias reaches the op - an fp32 one as it is, another cast to the compute dtype - and its
    gradient comes back in the bias's dtype."""
    import bertaccel.ops.gemm as gemm

    monkeypatch.setattr(gemm, "why_not", lambda *a, **k: None)
    x = torch.randn(5, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=True)
    bias = (torch.randn(8) * 4).to(bias_dtype).requires_grad_(True)
    y = linear(x, w, bias) if gelu is None else linear_gelu(x, w, bias, gelu)
    want = F.linear(x.float(), w.float(), bias.float())
    want = want if gelu is None else F.gelu(want)
    # within bf16 rounding (of the output and, cast, of the bias); a dropped bias (|bias| ~ 4) is far outside
    torch.testing.assert_close(y.float(), want, rtol=2e-2, atol=0.1)
    (db,) = torch.autograd.grad(y.float().sum(), bias)
    assert db.dtype == bias_dtype


def test_linear_family_is_opt_in_and_falls_back_on_cpu():
    assert "linear" in registry.swap_entries() and "linear" not in registry.default_families()
    assert registry.expand(["all"]) == registry.default_families()
    assert registry.expand(["all", "linear"]) == registry.default_families() + ["linear"]
    from bertaccel.ops.swap import swap

    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 3))
    x = torch.randn(4, 16)
    ref = model(x)
    report = swap(model, ["linear"])
    assert isinstance(model[0], GemmLinear) and type(model[2]) is nn.Linear  # 3 outputs: not a multiple of 8
    assert any("multiples of 8" in reason for _, _, reason in report.skipped)
    torch.testing.assert_close(model(x), ref)
    assert set(model.state_dict()) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    report.revert()
    assert type(model[0]) is nn.Linear

def test_gemm_build_defines_are_parsed_and_refused_when_malformed(monkeypatch):
    from bertaccel.ops import build

    assert build.gemm_defines("") == []
    assert build.gemm_defines("BERTACCEL_GEMM_HEAVY_EPILOGUE=2 BERTACCEL_X") == [
        "-DBERTACCEL_GEMM_HEAVY_EPILOGUE=2", "-DBERTACCEL_X"]
    for bad in ("NDEBUG", "BERTACCEL_X=1;rm", "-O0", "BERTACCEL_X=a b=c"):
        with pytest.raises(ValueError, match="BERTACCEL_GEMM_DEFINES"):
            build.gemm_defines(bad)
    monkeypatch.setenv("BERTACCEL_GEMM_DEFINES", "BERTACCEL_A=1")
    assert build.gemm_defines() == ["-DBERTACCEL_A=1"]
    # each set of macros builds into its own folder
    assert build.build_key(["gemm.h"], "9.0a", build.gemm_defines()) != build.build_key(["gemm.h"], "9.0a", [])



# ---------------------------------------------------------------------------------- CUDA tests
LAYOUTS = {"fwd": (False, False), "dgrad": (False, True), "wgrad": (True, True)}
# every (schedule, tile width) the kernel is built for: 1 cooperative, 2 ping-pong, 4 192-row tiles
SCHEDULE_WIDTHS = [(1, 64), (1, 96), (1, 128), (1, 192), (1, 256), (2, 64), (2, 128), (4, 64), (4, 128), (4, 192)]


def _config_id(v):
    return {1: "cooperative", 2: "pingpong", 4: "rows192"}.get(v, str(v)) if v in (1, 2, 4) else str(v)


SHAPES = [(1, 8, 8), (77, 776, 200), (128, 256, 64), (2049, 768, 768), (1000, 2304, 3072), (33, 40, 4104),
          (16384, 768, 3072)]


@hopper_test
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_gemm_layouts_and_shapes(layout, M, N, K):
    trans_a, trans_b = LAYOUTS[layout]
    if (trans_a and M % 8) or (trans_b and N % 8):
        pytest.skip("an MN-major operand's rows need a multiple of 8 elements")
    gen = torch.Generator(device="cuda").manual_seed(M * 7 + N + K)
    a, b = _operands(M, N, K, trans_a, trans_b, "cuda", torch.bfloat16, gen)
    A, B = (a.t() if trans_a else a), (b.t() if trans_b else b)
    ref = A.double() @ B.double().t()
    poison()
    ours = GEMM(a, b, None, None, 0, trans_a, trans_b, False, False)[0]
    check_vs_cublas(ours, A @ B.t(), ref, f"{layout} {M}x{N}x{K}")
    ours32 = GEMM(a, b, None, None, 0, trans_a, trans_b, True, False)[0]
    assert ours32.dtype == torch.float32
    check_vs_cublas(ours32, (A.float() @ B.float().t()), ref, f"{layout} fp32 out")


@hopper_test
@pytest.mark.parametrize("schedule,tile_n", [(1, 64), (1, 128), (1, 192), (1, 256), (2, 64), (2, 128), (4, 64), (4, 128),
                                             (4, 192)],
                         ids=_config_id)
@pytest.mark.parametrize("splits", [1, 2, 3, 8])
def test_every_schedule_tile_width_and_k_split(schedule, tile_n, splits):
    M, N, K = 333, 520, 2056  # no dimension a multiple of a tile
    for layout, (trans_a, trans_b) in LAYOUTS.items():
        if trans_a and M % 8:
            M = 336
        a, b = _operands(M, N, K, trans_a, trans_b, "cuda", torch.bfloat16)
        A, B = (a.t() if trans_a else a), (b.t() if trans_b else b)
        bias = torch.randn(N, device="cuda")
        poison()
        ours = GEMM(a, b, bias, None, 1, trans_a, trans_b, False, False, tile_n, splits, schedule)[0]
        check_vs_cublas(ours, torch.addmm(bias.bfloat16(), A, B.t()), A.double() @ B.double().t() + bias.double(),
               f"{layout} schedule {schedule} tile {tile_n} splits {splits}")


@hopper_test
@pytest.mark.parametrize("schedule,tile_n", [(1, 128), (1, 256), (4, 128), (4, 192)], ids=str)
@pytest.mark.parametrize("splits", [2, 3, 8])
@pytest.mark.parametrize("layout", ["fwd", "wgrad"])
def test_split_k_summed_in_kernel_matches_the_workspace_sum(layout, splits, schedule, tile_n, monkeypatch):
    """K splits summed inside the kernel (the last split of a tile to finish adds the others' partials,
    in split order) give the same bits as the workspace path (every slice written, summed in order by a
    second kernel), run after run, bf16 and fp32 out; and both are within 2x cuBLAS's error. 768 x 3072 x
    4104 in the weight-gradient layout is one of BERT's wgrads with a ragged K."""
    trans_a, trans_b = LAYOUTS[layout]
    M, N, K = (768, 3072, 4104) if layout == "wgrad" else (333, 520, 2056)
    a, b = _operands(M, N, K, trans_a, trans_b, "cuda", torch.bfloat16)
    A, B = (a.t() if trans_a else a), (b.t() if trans_b else b)
    bias = torch.randn(N, device="cuda")
    ref = A.double() @ B.double().t() + bias.double()
    monkeypatch.setenv("BERTACCEL_GEMM_SPLIT", "kernel")
    for out_fp32 in (False, True):
        poison()
        fixed = GEMM(a, b, bias, None, 1, trans_a, trans_b, out_fp32, False, tile_n, splits, schedule)[0]
        cub = torch.addmm(bias, A.float(), B.float().t()) if out_fp32 else torch.addmm(bias.bfloat16(), A, B.t())
        check_vs_cublas(fixed, cub, ref, f"split-K in kernel {layout} s{splits} schedule {schedule} n{tile_n}")
        for _ in range(2):
            assert torch.equal(GEMM(a, b, bias, None, 1, trans_a, trans_b, out_fp32, False, tile_n, splits, schedule)[0], fixed)
        monkeypatch.setenv("BERTACCEL_GEMM_SPLIT", "workspace")
        slices = GEMM(a, b, bias, None, 1, trans_a, trans_b, out_fp32, False, tile_n, splits, schedule)[0]
        monkeypatch.setenv("BERTACCEL_GEMM_SPLIT", "kernel")
        assert torch.equal(fixed, slices), f"in-kernel and workspace split sums differ ({layout}, {splits} splits)"


@hopper_test
@pytest.mark.parametrize("tile_n", [128, 192, 256])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_streamk_tiles_shared_by_many_blocks(layout, tile_n):
    """Stream-K (schedule 3): 333 x 520 x 2056 has 9-15 tiles over 33 K-blocks, so each tile is shared by
    up to 15 blocks and finished by the one holding its first K-blocks; bf16 and fp32 out, and the same
    bits on a second run (the partials are added in K order, not as they arrive)."""
    trans_a, trans_b = LAYOUTS[layout]
    M, N, K = (336 if trans_a else 333), 520, 2056
    a, b = _operands(M, N, K, trans_a, trans_b, "cuda", torch.bfloat16)
    A, B = (a.t() if trans_a else a), (b.t() if trans_b else b)
    bias = torch.randn(N, device="cuda")
    ref = A.double() @ B.double().t() + bias.double()
    poison()
    ours = GEMM(a, b, bias, None, 1, trans_a, trans_b, False, False, tile_n, 1, 3)[0]
    check_vs_cublas(ours, torch.addmm(bias.bfloat16(), A, B.t()), ref, f"stream-K {layout} tile {tile_n}")
    ours32 = GEMM(a, b, bias, None, 1, trans_a, trans_b, True, False, tile_n, 1, 3)[0]
    check_vs_cublas(ours32, torch.addmm(bias, A.float(), B.float().t()), ref, f"stream-K {layout} tile {tile_n} fp32 out")
    for _ in range(3):
        assert torch.equal(GEMM(a, b, bias, None, 1, trans_a, trans_b, True, False, tile_n, 1, 3)[0], ours32)


def _check_epilogue(M, N, K, epilogue, name, *config, bias_dtype=torch.float32, check_pre=True):
    """One forward GEMM with `epilogue` at M x N x K (`config`: tile width, splits, schedule, or the
    model's pick when empty), its output and pre-activation checked against the float64 reference from
    the same bf16 inputs, beside cuBLAS's bf16 product with the epilogue in fp32. Returns the operands
    and the reference output, for further checks."""
    a, b = _operands(M, N, K, False, False, "cuda", torch.bfloat16)
    bias = torch.randn(N, device="cuda").to(bias_dtype)
    aux = torch.randn(M, N, device="cuda").bfloat16()
    e = EPILOGUES[epilogue]
    poison()
    out, pre = GEMM(a, b, bias, aux, e, False, False, False, True, *config)
    ref_out, ref_pre = gemm_reference(a.double(), b.double(), bias.double(), aux.double(), e, False, False, False, True)
    cub = apply_epilogue((a @ b.t()).float(), bias, aux, e, False, torch.bfloat16)[0].bfloat16()
    check_vs_cublas(out, cub, ref_out, name)
    if check_pre and e in (2, 3):
        check_vs_cublas(pre, ref_pre.bfloat16(), a.double() @ b.double().t() + bias.double(), f"{name} pre-activation")
    return a, b, bias, aux, ref_out


@hopper_test
@pytest.mark.parametrize("epilogue", list(EPILOGUES))
def test_streamk_epilogues_at_a_bert_shape(epilogue):
    """Every epilogue after the stream-K fix-up (2048 x 768 x 3072: 96 tiles of 128 x 128 over 132 blocks)."""
    _check_epilogue(2048, 768, 3072, epilogue, f"stream-K {epilogue}", 128, 1, 3)


@hopper_test
@pytest.mark.parametrize("schedule,tile_n", [(0, 0), (1, 128), (1, 256), (2, 128), (4, 192)])
@pytest.mark.parametrize("M,N,K", [(2048, 768, 3072), (1031, 136, 264)])
def test_residual_epilogue_without_bias_in_the_dgrad_layout(M, N, K, schedule, tile_n):
    """dx = dy W + residual-gradient (b stored [K, N], no bias), as the fused FFN's backward runs it: against
    the float64 reference from the same bf16 inputs, beside cuBLAS's product plus the add in fp32."""
    g = torch.Generator(device="cuda").manual_seed(M + N + K)
    a, b = _operands(M, N, K, False, True, "cuda", torch.bfloat16, g)
    aux = torch.randn(M, N, device="cuda", generator=g).bfloat16()
    poison()
    out, _ = GEMM(a, b, None, aux, EPILOGUES["bias_residual"], False, True, False, False, tile_n, 1, schedule)
    ref = a.double() @ b.double() + aux.double()
    cub = ((a @ b).float() + aux.float()).bfloat16()
    check_vs_cublas(out, cub, ref, f"residual without bias {M}x{N}x{K} schedule {schedule} n{tile_n}")


@hopper_test
@pytest.mark.parametrize("epilogue", ["bias_gelu", "bias_residual", "dgelu"])
def test_pingpong_epilogues_and_many_units(epilogue):
    """Ping-pong at a BERT shape (many units per block, both warpgroups alternating)."""
    _check_epilogue(16384, 768, 768, epilogue, f"pingpong {epilogue}", 128, 1, 2, check_pre=False)


@hopper_test
@pytest.mark.parametrize("tile_n", [64, 128, 192])
@pytest.mark.parametrize("epilogue", list(EPILOGUES))
def test_192_row_tiles_every_epilogue(epilogue, tile_n):
    """Three consumer warpgroups (schedule 4, 192-row tiles) with every epilogue: 2048 x 2304 is 11 x 12
    tiles of 192 x 192 (the last row of tiles ends at row 2048 = 10 x 192 + 128, mid-tile); 16384 rows
    give each block several tiles."""
    for M, N, K in [(2048, 2304, 768), (16384, 768, 200)]:
        _check_epilogue(M, N, K, epilogue, f"192-row tiles {epilogue} n{tile_n} {M}x{N}x{K}", tile_n, 1, 4)


@hopper_test
@pytest.mark.parametrize("store", ["tma", "staged"])
@pytest.mark.parametrize("epilogue", list(EPILOGUES))
def test_96_wide_tiles_every_epilogue(epilogue, store, monkeypatch):
    """96-wide tiles (cooperative, K-major B): a 64-column chunk and a 32-column tail chunk stored through
    their own 32-column tensor maps. 2048 x 768 is 16 x 8 whole tiles; 272 = 2 x 96 + 80 ends inside the
    last tile's tail chunk, 1000 = 10 x 96 + 40 inside its first chunk (the tail wholly past N); bf16 and
    fp32 out; the staged stores (N % 8 != 0, or BERTACCEL_GEMM_STORE=staged) too."""
    if store == "staged":
        monkeypatch.setenv("BERTACCEL_GEMM_STORE", "staged")
    e = EPILOGUES[epilogue]
    for M, N, K in [(2048, 768, 768), (200, 272, 192), (131, 1000, 136), (77, 1002, 200)]:
        a, b, bias, aux, ref_out = _check_epilogue(M, N, K, epilogue, f"n96 {store} {epilogue} {M}x{N}x{K}", 96, 1, 1)
        out32 = GEMM(a, b, bias, aux, e, False, False, True, False, 96, 1, 1)[0]
        cub32 = apply_epilogue((a.float() @ b.float().t()), bias, aux, e, False, torch.bfloat16)[0]
        check_vs_cublas(out32, cub32, ref_out, f"n96 {store} {epilogue} fp32 out {M}x{N}x{K}")


@hopper_test
@pytest.mark.parametrize("split_sum", ["workspace", "kernel"])
@pytest.mark.parametrize("splits", [2, 3])
def test_96_wide_tiles_with_k_splits(splits, split_sum, monkeypatch):
    """96-wide tiles with K splits summed either way (the same bits), bf16 and fp32 out, ragged N."""
    monkeypatch.setenv("BERTACCEL_GEMM_SPLIT", split_sum)
    M, N, K = 333, 560, 2056  # 560 = 5 x 96 + 80
    a, b = _operands(M, N, K, False, False, "cuda", torch.bfloat16)
    bias = torch.randn(N, device="cuda")
    ref = a.double() @ b.double().t() + bias.double()
    for out_fp32 in (False, True):
        poison()
        ours = GEMM(a, b, bias, None, 1, False, False, out_fp32, False, 96, splits, 1)[0]
        cub = torch.addmm(bias, a.float(), b.float().t()) if out_fp32 else torch.addmm(bias.bfloat16(), a, b.t())
        check_vs_cublas(ours, cub, ref, f"n96 s{splits} {split_sum} fp32={out_fp32}")
        monkeypatch.setenv("BERTACCEL_GEMM_SPLIT", "workspace" if split_sum == "kernel" else "kernel")
        assert torch.equal(GEMM(a, b, bias, None, 1, False, False, out_fp32, False, 96, splits, 1)[0], ours)
        monkeypatch.setenv("BERTACCEL_GEMM_SPLIT", split_sum)


@hopper_test
def test_96_wide_tiles_refused_where_not_built():
    """96-wide tiles read B in one K-major box: asked for with an MN-major B (trans_b) or another schedule,
    the op says so."""
    a = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(512, 192, device="cuda", dtype=torch.bfloat16)  # stored [K, N]
    with pytest.raises(RuntimeError, match="96-wide"):
        GEMM(a, b, None, None, 0, False, True, False, False, 96, 1, 1)
    with pytest.raises(RuntimeError, match="96-wide"):
        GEMM(a, b.t().contiguous(), None, None, 0, False, False, False, False, 96, 1, 2)


@hopper_test
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_192_row_tiles_layouts_and_fp32_out(layout):
    """Schedule 4 with each operand layout (MN-major A is loaded as three 64-row chunks) and fp32 out."""
    trans_a, trans_b = LAYOUTS[layout]
    M, N, K = 1000, 776, 520
    a, b = _operands(M, N, K, trans_a, trans_b, "cuda", torch.bfloat16)
    A, B = (a.t() if trans_a else a), (b.t() if trans_b else b)
    ref = A.double() @ B.double().t()
    for tile_n in (64, 128, 192):
        poison()
        ours = GEMM(a, b, None, None, 0, trans_a, trans_b, False, False, tile_n, 1, 4)[0]
        check_vs_cublas(ours, A @ B.t(), ref, f"192-row tiles {layout} n{tile_n}")
        ours32 = GEMM(a, b, None, None, 0, trans_a, trans_b, True, False, tile_n, 1, 4)[0]
        check_vs_cublas(ours32, A.float() @ B.float().t(), ref, f"192-row tiles {layout} n{tile_n} fp32 out")


@hopper_test
@pytest.mark.parametrize("epilogue", list(EPILOGUES))
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_epilogues(epilogue, bias_dtype):
    _check_epilogue(1031, 3072, 768, epilogue, epilogue, bias_dtype=bias_dtype)


@hopper_test
@pytest.mark.parametrize("store", ["tma", "staged"])
@pytest.mark.parametrize("schedule", [1, 2, 4], ids=["cooperative", "pingpong", "rows192"])
@pytest.mark.parametrize("epilogue", list(EPILOGUES))
def test_both_store_paths_at_ragged_edges(epilogue, schedule, store, monkeypatch):
    """Outputs leave through TMA stores (bf16: 64 x 64 chunks; fp32: 64 x 32), or (BERTACCEL_GEMM_STORE=staged,
    and always when N is not a multiple of 8) through the threads' staged stores. M and N end mid-tile and
    mid-chunk here (1000 = 15 x 64 + 40), with 1002 columns the staged path's element-wise tail."""
    if store == "staged":
        monkeypatch.setenv("BERTACCEL_GEMM_STORE", "staged")
    e = EPILOGUES[epilogue]
    for M, N, K in [(200, 1000, 192), (131, 1002, 136)]:
        a, b, bias, aux, ref_out = _check_epilogue(M, N, K, epilogue, f"{store} {epilogue} {M}x{N}x{K}", 128, 1, schedule)
        out32 = GEMM(a, b, bias, aux, e, False, False, True, False, 128, 1, schedule)[0]  # fp32 out: 64 x 32 boxes
        assert out32.dtype == torch.float32
        cub32 = apply_epilogue((a.float() @ b.float().t()), bias, aux, e, False, torch.bfloat16)[0]
        check_vs_cublas(out32, cub32, ref_out, f"{store} {epilogue} fp32 out {M}x{N}x{K}")


@hopper_test
@pytest.mark.parametrize("gelu", [None, "none", "tanh"])
def test_linear_gradients(gelu):
    M, K, N = 515, 768, 3072
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(N, K, device="cuda") * K**-0.5).requires_grad_(True)  # fp32 master weight
    bias = torch.randn(N, device="cuda", requires_grad=True)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)

    def run(fn, x, w, bias, dtype):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fn(x, w, bias)
        return [y] + list(torch.autograd.grad(y, (x, w, bias), dy.to(y.dtype)))

    ours_fn = (lambda x, w, b: linear(x, w, b)) if gelu is None else (lambda x, w, b: linear_gelu(x, w, b, gelu))
    hf_fn = (lambda x, w, b: F.linear(x, w, b)) if gelu is None else (lambda x, w, b: F.gelu(F.linear(x, w, b), approximate=gelu))
    ours = run(ours_fn, x, w, bias, torch.bfloat16)
    cublas = run(hf_fn, x, w, bias, torch.bfloat16)
    xd, wd, bd = (t.detach().double().requires_grad_(True) for t in (x, w.bfloat16(), bias.bfloat16()))
    yd = hf_fn(xd, wd, bd)
    ref = [yd] + list(torch.autograd.grad(yd, (xd, wd, bd), dy.double()))
    for name, o, c, r in zip(["y", "dx", "dw", "dbias"], ours, cublas, ref):
        assert o.dtype == c.dtype, f"{name}: {o.dtype} vs {c.dtype}"
        check_vs_cublas(o, c, r, f"linear {gelu} {name}")


@hopper_test
@pytest.mark.parametrize("gelu", [None, "none"])
def test_linear_reads_an_fp32_bias_as_it_is(gelu):
    """bf16 operands beside an fp32 master bias (the bf16 weight copies' case): the epilogue reads the bias as it is,
    so forward and backward launch no cast kernel, and the bias gradient comes back in fp32."""
    x = torch.randn(515, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(1024, 768, device="cuda") * 768**-0.5).bfloat16().requires_grad_(True)
    bias = torch.randn(1024, device="cuda", requires_grad=True)
    dy = torch.randn(515, 1024, device="cuda", dtype=torch.bfloat16)

    def step():
        y = linear(x, w, bias) if gelu is None else linear_gelu(x, w, bias, gelu)
        step.grads = torch.autograd.grad(y, (x, w, bias), dy)

    step()
    kernels = cuda_kernel_names(step)
    assert not [k for k in kernels if "copy" in k.lower()], kernels
    assert step.grads[2].dtype == torch.float32
    want = dy.float().sum(0) if gelu is None else None
    if want is not None:  # the plain linear's bias gradient: the fp32 column sums of dy
        torch.testing.assert_close(step.grads[2], want, rtol=1e-5, atol=1e-3)


@hopper_test
def test_a_threads_first_cuda_call():
    """The GEMM as the first CUDA work of a thread (autograd's device thread when a backward starts with
    it): the tensor maps need a current context (CUDA_ERROR_INVALID_CONTEXT, 201, before bind_primary_context)."""
    import threading

    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    result: dict = {}

    def run():
        try:
            result["y"] = GEMM(x, w, None, None, 0, False, False, False, False)[0]
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            result["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert "error" not in result, result.get("error")
    torch.testing.assert_close(result["y"], GEMM(x, w, None, None, 0, False, False, False, False)[0])


@hopper_test
def test_fallback_for_shapes_the_copy_engine_cannot_take():
    x = torch.randn(10, 7, device="cuda", dtype=torch.bfloat16)  # 7 in-features: 14-byte rows
    w = torch.randn(16, 7, device="cuda", dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="multiples of 8"):
        y = linear(x, w)
    torch.testing.assert_close(y, F.linear(x, w))
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        GEMM(x, w, None, None, 0, False, False, False, False)
    x_odd = torch.randn(10, 17, device="cuda", dtype=torch.bfloat16)[:, 1:]  # 16 wide, misaligned start
    with pytest.raises(RuntimeError, match="16-byte aligned|unit inner stride"):
        GEMM(x_odd, w[:, :1].expand(16, 16).contiguous(), None, None, 0, False, False, False, False)


@hopper_test
def test_opcheck_compile_and_cuda_graphs():
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.library.opcheck(torch.ops.bertaccel.linear.default, (x, w, bias))
    torch.library.opcheck(torch.ops.bertaccel.linear_gelu.default, (x, w, bias, True))
    dy = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16)
    torch.library.opcheck(GEMM, (dy, w.detach(), None, None, 0, False, True, False, False),  # dgrad: dy W
                          test_utils=("test_schema", "test_faketensor"))

    def forward(x, w, bias):
        return linear_gelu(x, w, bias, "tanh")

    def step(x, w, bias, fn=forward):
        y = fn(x, w, bias)
        return y, torch.autograd.grad(y.float().square().sum(), (x, w, bias))

    eager = step(x, w, bias)
    # dynamo does not trace torch.autograd.grad: compile the forward, fullgraph; AOTAutograd compiles its backward
    compiled = step(x, w, bias, fn=torch.compile(forward, fullgraph=True))
    for e, c in zip([eager[0], *eager[1]], [compiled[0], *compiled[1]]):
        torch.testing.assert_close(c, e)
    # Fresh leaves for the capture: the eager outputs above keep autograd nodes of x, w and bias that
    # were made on the default stream, and the backward would make the capture wait on that stream.
    del eager, compiled
    assert_replay_matches_eager(step, *(t.detach().clone().requires_grad_(True) for t in (x, w, bias)))


@hopper_test
@pytest.mark.parametrize("with_ffn", [False, True], ids=["linear", "linear_and_ffn"])
def test_swapped_bert_layer_matches_hf(with_ffn):
    """Every family with our GEMM under the linear layers (the coarser families route their matmul
    through it), with or without the ffn family's fused feed-forward block."""
    from transformers import BertConfig, BertForSequenceClassification

    from bertaccel.ops.swap import ORDER, swap

    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=1024, num_labels=2)
    model = BertForSequenceClassification(cfg).cuda().train()
    ids = torch.randint(1000, 30000, (8, 96), device="cuda")
    labels = torch.randint(0, 2, (8,), device="cuda")

    def grads():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        return loss.detach().float(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}

    model.eval()  # no dropout: the comparison is deterministic
    loss_hf, g_hf = grads()
    report = swap(model, ORDER if with_ffn else [f for f in ORDER if f != "ffn"])
    assert report.counts().get("linear", 0) >= 2 * 4  # Q, K, V, attention output... per layer
    assert report.counts().get("ffn", 0) == (2 if with_ffn else 0)
    loss_ours, g_ours = grads()
    report.revert()
    assert abs(loss_ours - loss_hf) <= 2e-2 * abs(loss_hf) + 1e-3
    for n in g_hf:
        if n.endswith("attention.self.key.bias"):
            continue  # softmax ignores a shift shared by a query's logits: this gradient is rounding noise
        err = ((g_ours[n] - g_hf[n]).norm() / g_hf[n].norm().clamp_min(1e-12)).item()
        assert err < 5e-2, f"{n}: relative gradient difference {err:.2e}"


ERROR_PATHS = """
import torch
import bertaccel.ops.swap
from bertaccel.ops import build
assert build.load() and build.load_gemm()
G = torch.ops.bertaccel.gemm.default
x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
# messages carrying numbers, from both extensions (such a message segfaulted in session 5)
cases = [(G, (x, w, None, None, 0, False, True, False, False), "inner dimensions differ (256 and 512)"),
         (G, (x.float(), w, None, None, 0, False, False, False, False), "bfloat16"),
         (G, (x, w, None, None, 1, False, False, False, False), "needs a contiguous fp32 or bf16 bias of 512 elements"),
         (torch.ops.bertaccel.bias_gelu.default, (x, torch.zeros(7, device="cuda", dtype=torch.bfloat16), False),
          "of size 256"),
         (torch.ops.bertaccel.softmax.default, (torch.randn(2, 3, 4, device="cuda"), torch.ones(2, 3, 4, device="cuda"), 1.0),
          "got 3-d")]
for op, args, message in cases:
    try:
        op(*args)
    except RuntimeError as e:
        assert message in str(e), (message, str(e))
        print("raised:", message, flush=True)
    else:
        raise AssertionError("no error for " + message)
bias = torch.randn(513, device="cuda")[1:]  # a misaligned view: copied, same result
torch.testing.assert_close(G(x, w, bias, None, 1, False, False, False, False)[0],
                           G(x, w, bias.clone(), None, 1, False, False, False, False)[0])
print("ok")
"""


@hopper_test
def test_clear_errors_for_bad_operands(gemm_kernel):
    """The C++ entry point's error paths, in a child process: a crash there (a segfault was seen on
    the inner-dimension check, session 4) fails this test instead of ending the whole run."""
    # the child loads the extensions already built, not a fresh build in this test's cache
    proc = run_in_child(ERROR_PATHS, {"BERTACCEL_CACHE": gemm_kernel}, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
        f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


@hopper_test
def test_unknown_split_sum_mode_is_refused(monkeypatch):
    """BERTACCEL_GEMM_SPLIT takes 'workspace' or 'kernel': a typo is an error naming the variable, not a
    silent fallback to the model's pick."""
    a = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(128, 4096, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setenv("BERTACCEL_GEMM_SPLIT", "kernal")
    with pytest.raises(RuntimeError, match="BERTACCEL_GEMM_SPLIT"):
        GEMM(a, b, None, None, 0, False, False, False, False, 128, 2, 1)


@hopper_test
@pytest.mark.parametrize("schedule,tile_n", SCHEDULE_WIDTHS, ids=_config_id)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_clusters_of_two_give_the_single_block_bits(layout, splits, schedule, tile_n, monkeypatch):
    """BERTACCEL_GEMM_CLUSTER=2: blocks in clusters of two along M, each loading half of the shared B tile
    and multicasting it to both. Same tiles, same K order: the output has the single-block kernel's bits
    (bf16 and fp32 out, every layout, K splits through the workspace and, where built, in the kernel),
    and is within 2x cuBLAS's error. M = 333 is 3 tile rows (128) or 2 (192): the last pair has a row of
    tiles wholly past M; 16384 x 768 x 768 gives each cluster many units."""
    trans_a, trans_b = LAYOUTS[layout]
    if tile_n == 96 and trans_b:
        pytest.skip("96-wide tiles take a K-major B only")
    for M, N, K in [(333 if not trans_a else 336, 520, 2056), (16384, 768, 768)]:
        a, b = _operands(M, N, K, trans_a, trans_b, "cuda", torch.bfloat16)
        A, B = (a.t() if trans_a else a), (b.t() if trans_b else b)
        bias = torch.randn(N, device="cuda")
        ref = A.double() @ B.double().t() + bias.double()
        for out_fp32 in (False, True):
            for split_sum in ("workspace", "kernel") if splits > 1 and schedule != 2 else ("workspace",):
                monkeypatch.setenv("BERTACCEL_GEMM_SPLIT", split_sum)
                monkeypatch.setenv("BERTACCEL_GEMM_CLUSTER", "1")
                single = GEMM(a, b, bias, None, 1, trans_a, trans_b, out_fp32, False, tile_n, splits, schedule)[0]
                monkeypatch.setenv("BERTACCEL_GEMM_CLUSTER", "2")
                poison()
                pair = GEMM(a, b, bias, None, 1, trans_a, trans_b, out_fp32, False, tile_n, splits, schedule)[0]
                name = f"cluster {layout} {M}x{N}x{K} schedule {schedule} n{tile_n} s{splits} {split_sum} fp32={out_fp32}"
                cub = torch.addmm(bias, A.float(), B.float().t()) if out_fp32 else torch.addmm(bias.bfloat16(), A, B.t())
                check_vs_cublas(pair, cub, ref, name)
                assert torch.equal(pair, single), f"{name}: differs from the single-block kernel"
            if M > 1000:
                break  # the BERT shape: bf16 out only


@hopper_test
@pytest.mark.parametrize("epilogue", list(EPILOGUES))
@pytest.mark.parametrize("schedule,tile_n", [(1, 256), (1, 96), (2, 128), (4, 192)], ids=str)
def test_clusters_of_two_every_epilogue(epilogue, schedule, tile_n, monkeypatch):
    """Every epilogue in clusters of two (TMA-store epilogues, the auxiliary input read ahead), at a
    ragged shape and at 2048 x 2304 (192-row tiles: 11 tile rows, the 12th of the last pair past M)."""
    monkeypatch.setenv("BERTACCEL_GEMM_CLUSTER", "2")
    for M, N, K in [(2048, 2304, 768), (131, 1000, 136)]:
        _check_epilogue(M, N, K, epilogue, f"cluster {epilogue} schedule {schedule} n{tile_n} {M}x{N}x{K}", tile_n, 1,
                        schedule)


@hopper_test
def test_clusters_of_two_config_capture_and_bad_setting(monkeypatch):
    """gemm_config reports the cluster size the call runs; a cluster launch (cudaLaunchKernelEx) captured
    into a CUDA graph replays to the eager bits; stream-K has no cluster kernel (it runs single blocks);
    a value other than 1 or 2 is an error naming the variable."""
    a, b = _operands(2048, 768, 3072, False, False, "cuda", torch.bfloat16)
    monkeypatch.setenv("BERTACCEL_GEMM_CLUSTER", "2")
    assert torch.ops.bertaccel.gemm_config(a, b, 0, False, False, False, False)[6] == 2
    eager = GEMM(a, b, None, None, 0, False, False, False, False)[0]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    static = {}
    with torch.cuda.graph(g, stream=s):
        static["y"] = GEMM(a, b, None, None, 0, False, False, False, False)[0]
    for _ in range(2):
        static["y"].fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(static["y"], eager)
    check_vs_cublas(GEMM(a, b, None, None, 0, False, False, False, False, 128, 1, 3)[0], a @ b.t(),
                    a.double() @ b.double().t(), "stream-K with BERTACCEL_GEMM_CLUSTER=2")
    monkeypatch.setenv("BERTACCEL_GEMM_CLUSTER", "1")
    assert torch.ops.bertaccel.gemm_config(a, b, 0, False, False, False, False)[6] == 1
    monkeypatch.setenv("BERTACCEL_GEMM_CLUSTER", "4")
    with pytest.raises(RuntimeError, match="BERTACCEL_GEMM_CLUSTER"):
        GEMM(a, b, None, None, 0, False, False, False, False)


@hopper_test
def test_tuning_follows_cudnn_benchmark_unless_the_variable_says(monkeypatch):
    """BERTACCEL_GEMM_TUNE unset: the GEMM tunes when torch.backends.cudnn.benchmark is on (Lightning's
    Trainer(benchmark=True)) and keeps the model's pick when it is off; BERTACCEL_GEMM_TUNE=0 keeps the model's pick
    with benchmark on."""
    monkeypatch.delenv("BERTACCEL_GEMM_TUNE", raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    a, b = _operands(1856, 648, 1160, False, False, "cuda", torch.bfloat16)  # problems no other test tunes
    GEMM(a, b, None, None, 0, False, False, False, False)
    assert torch.ops.bertaccel.gemm_config(a, b, 0, False, False, False, False)[5] == 0
    monkeypatch.setenv("BERTACCEL_GEMM_TUNE", "0")
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    GEMM(a, b, None, None, 0, False, False, False, False)
    assert torch.ops.bertaccel.gemm_config(a, b, 0, False, False, False, False)[5] == 0
    monkeypatch.delenv("BERTACCEL_GEMM_TUNE")
    assert torch.ops.bertaccel.gemm_config(a, b, 0, False, False, False, False)[5] == 0  # not tuned yet
    ours = GEMM(a, b, None, None, 0, False, False, False, False)[0]
    assert torch.ops.bertaccel.gemm_config(a, b, 0, False, False, False, False)[5] == 1
    check_vs_cublas(ours, a @ b.t(), a.double() @ b.double().t(), "tuned through cudnn.benchmark")


@hopper_test
def test_tuning_keeps_a_timed_pick_and_never_times_during_capture(monkeypatch):
    """BERTACCEL_GEMM_TUNE=1: the first eager call of a problem times the model's closest candidates and
    keeps the fastest (gemm_config then reports it as tuned), the output is right either way; a call
    captured into a CUDA graph for a problem never tuned does not time (no synchronisation inside a
    capture) and its replay matches the eager result."""
    monkeypatch.setenv("BERTACCEL_GEMM_TUNE", "1")
    M, N, K = 1920, 776, 1544  # a problem no other test tunes
    a, b = _operands(M, N, K, False, False, "cuda", torch.bfloat16)
    ref = a.double() @ b.double().t()
    assert torch.ops.bertaccel.gemm_config(a, b, 0, False, False, False, False)[5] == 0
    ours = GEMM(a, b, None, None, 0, False, False, False, False)[0]
    check_vs_cublas(ours, a @ b.t(), ref, "tuned")
    cfg = torch.ops.bertaccel.gemm_config(a, b, 0, False, False, False, False)
    assert cfg[5] == 1 and cfg[1] in (64, 96, 128, 192, 256) and cfg[3] in (1, 2, 4)
    assert torch.equal(GEMM(a, b, None, None, 0, False, False, False, False)[0], ours)  # the kept pick, same bits

    x, w = _operands(1000, 1032, 520, False, False, "cuda", torch.bfloat16)  # never tuned: captured first
    static = {}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        static["y"] = GEMM(x, w, None, None, 0, False, False, False, False)[0]
    g.replay()
    torch.cuda.synchronize()
    monkeypatch.delenv("BERTACCEL_GEMM_TUNE")
    assert torch.equal(static["y"], GEMM(x, w, None, None, 0, False, False, False, False)[0])  # the model's pick


@hopper_test
def test_programmatic_dependent_launch_chain_reads_the_previous_output(monkeypatch):
    """Each GEMM is launched so that it may start while the previous kernel finishes (BERTACCEL_PDL): a chain
    in which every GEMM reads the one before it (each with a different schedule / tile, the previous output
    poisoned first, a bias in the epilogue, a split-K sum) gives the same bits as with PDL off, eager and
    replayed from a CUDA graph."""
    torch.manual_seed(0)
    x = torch.randn(2048, 768, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(768, 768, device="cuda", dtype=torch.bfloat16) * 768**-0.5 for _ in range(6)]
    bias = torch.randn(768, device="cuda", dtype=torch.float32)
    configs = [(0, 0, 0), (128, 1, 2), (192, 1, 4), (256, 1, 1), (128, 2, 1), (64, 1, 2)]  # tile_n, splits, schedule

    def chain(h):
        for w, (tile, splits, schedule) in zip(ws, configs):
            h = GEMM(h, w, bias, None, 1, False, False, False, False, tile, splits, schedule)[0]
        return h

    monkeypatch.setenv("BERTACCEL_PDL", "0")
    ref = chain(x)
    monkeypatch.setenv("BERTACCEL_PDL", "1")
    for _ in range(3):
        poison()
        assert torch.equal(chain(x), ref)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = chain(x)
    for _ in range(3):
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)


@hopper_test
@pytest.mark.parametrize("schedule,tile_n", SCHEDULE_WIDTHS, ids=_config_id)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_plain_kernels_give_the_general_kernels_bits(layout, schedule, tile_n, monkeypatch):
    """A plain call (no epilogue, bf16 out, one K split) runs the PLAIN kernels (gemm_plain.cu: the options fixed at
    compile time); BERTACCEL_GEMM_SPECIALISED=0 runs it on the general ones. Same tiles, same K order: the same bits,
    within 2x cuBLAS's error, at ragged shapes (M, N, K off the tile; N ending inside a 96-wide tile's tail) and a
    BERT shape, eager and replayed from a CUDA graph."""
    trans_a, trans_b = LAYOUTS[layout]
    if tile_n == 96 and trans_b:
        pytest.skip("96-wide tiles take a K-major B only")
    for M, N, K in [(333 if not trans_a else 336, 520, 2056), (2048, 744, 776), (2048, 768, 3072)]:
        a, b = _operands(M, N, K, trans_a, trans_b, "cuda", torch.bfloat16)
        A, B = (a.t() if trans_a else a), (b.t() if trans_b else b)
        ref = A.double() @ B.double().t()
        monkeypatch.setenv("BERTACCEL_GEMM_SPECIALISED", "0")
        general = GEMM(a, b, None, None, 0, trans_a, trans_b, False, False, tile_n, 1, schedule)[0]
        monkeypatch.setenv("BERTACCEL_GEMM_SPECIALISED", "1")
        poison()
        plain = GEMM(a, b, None, None, 0, trans_a, trans_b, False, False, tile_n, 1, schedule)[0]
        name = f"plain {layout} {M}x{N}x{K} schedule {schedule} n{tile_n}"
        check_vs_cublas(plain, A @ B.t(), ref, name)
        assert torch.equal(plain, general), f"{name}: differs from the general kernel"
        monkeypatch.delenv("BERTACCEL_GEMM_SPECIALISED")
        assert_replay_matches_eager(lambda x, w: (GEMM(x, w, None, None, 0, trans_a, trans_b, False, False, tile_n, 1,
                                                       schedule)[0], []), a, b)


def _gemm_kernel_names(fn) -> list[str]:
    """The names of the GEMM kernels `fn()` launches: which instantiation ran."""
    return [name for name in cuda_kernel_names(fn) if "gemm_kernel" in name]


def _general_then_specialised(run, monkeypatch):
    """`run()` on the general kernels (BERTACCEL_GEMM_SPECIALISED=0), then, over poisoned free memory, with the
    specialised ones: (general output, its kernel names, specialised output, its kernel names)."""
    monkeypatch.setenv("BERTACCEL_GEMM_SPECIALISED", "0")
    general, general_names = run(), _gemm_kernel_names(run)
    monkeypatch.setenv("BERTACCEL_GEMM_SPECIALISED", "1")
    poison()
    ours, names = run(), _gemm_kernel_names(run)
    return general, general_names, ours, names


EPILOGUE_SPECS = {  # epilogue, bias dtype, save_pre: calls the epilogue specialisations (gemm_bias.cu, gemm_gelu.cu) take
    "bias_fp32": (1, torch.float32, False), "bias_bf16": (1, torch.bfloat16, False),
    "gelu": (2, torch.float32, False), "gelu_pre": (2, torch.float32, True)}


@hopper_test
@pytest.mark.parametrize("schedule,tile_n", SCHEDULE_WIDTHS, ids=_config_id)
@pytest.mark.parametrize("call", list(EPILOGUE_SPECS))
def test_epilogue_specialisations_give_the_general_kernels_bits(call, schedule, tile_n, monkeypatch):
    """A forward call (K-major operands, one K split, bf16 out) with a bias or bias + GELU (erf) epilogue runs a
    specialised kernel (the epilogue fixed at compile time; the profiler sees another kernel than with
    BERTACCEL_GEMM_SPECIALISED=0) that gives the general kernel's bits - output and saved pre-activation - within
    2x cuBLAS's error, at ragged shapes and a BERT shape, eager and replayed from a CUDA graph."""
    epilogue, bias_dtype, save_pre = EPILOGUE_SPECS[call]
    for M, N, K in [(333, 520, 2056), (2048, 744, 776), (2048, 3072, 768)]:
        a, b = _operands(M, N, K, False, False, "cuda", torch.bfloat16)
        bias = torch.randn(N, device="cuda").to(bias_dtype)

        def run():
            return GEMM(a, b, bias, None, epilogue, False, False, False, save_pre, tile_n, 1, schedule)

        general, general_names, ours, names = _general_then_specialised(run, monkeypatch)
        name = f"{call} {M}x{N}x{K} schedule {schedule} n{tile_n}"
        assert len(names) == 1 and len(general_names) == 1 and names != general_names, f"{name}: {names} {general_names}"
        ref, ref_pre = apply_epilogue(a.double() @ b.double().t(), bias, None, epilogue, save_pre, torch.float64)
        cublas, _ = apply_epilogue((a @ b.t()).float(), bias, None, epilogue, False, torch.float32)
        check_vs_cublas(ours[0], cublas.to(torch.bfloat16), ref, name)
        assert torch.equal(ours[0], general[0]), f"{name}: output differs from the general kernel"
        assert torch.equal(ours[1], general[1]), f"{name}: pre-activation differs from the general kernel"
        if save_pre:
            check_vs_cublas(ours[1], ((a @ b.t()).float() + bias.float()).bfloat16(), ref_pre, name + " pre")
        monkeypatch.delenv("BERTACCEL_GEMM_SPECIALISED")
        assert_replay_matches_eager(lambda x, w: (GEMM(x, w, bias, None, epilogue, False, False, False, save_pre, tile_n,
                                                       1, schedule)[0], []), a, b)


@hopper_test
@pytest.mark.parametrize("schedule,tile_n", SCHEDULE_WIDTHS, ids=_config_id)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_split_k_specialisation_gives_the_general_kernels_bits(layout, schedule, tile_n, monkeypatch):
    """K-split calls without an epilogue (the weight gradients at many tokens) run the kSpecSplitK kernel (another
    kernel than with BERTACCEL_GEMM_SPECIALISED=0), summed through the workspace and in the kernel (not ping-pong),
    bf16 and fp32 out: the general kernel's bits, within 2x cuBLAS's error, eager and replayed."""
    trans_a, trans_b = LAYOUTS[layout]
    if tile_n == 96 and trans_b:
        pytest.skip("96-wide tiles take a K-major B only")
    M, N, K = (768, 520, 4104) if layout != "wgrad" else (768, 776, 4104)
    a, b = _operands(M, N, K, trans_a, trans_b, "cuda", torch.bfloat16)
    A, B = (a.t() if trans_a else a), (b.t() if trans_b else b)
    ref = A.double() @ B.double().t()
    for split_sum in ("workspace", "kernel") if schedule != 2 else ("workspace",):
        monkeypatch.setenv("BERTACCEL_GEMM_SPLIT", split_sum)
        for out_fp32 in (False, True):
            def run():
                return GEMM(a, b, None, None, 0, trans_a, trans_b, out_fp32, False, tile_n, 3, schedule)[0]

            general, general_names, ours, names = _general_then_specialised(run, monkeypatch)
            name = f"split-K {layout} {split_sum} fp32 {out_fp32} schedule {schedule} n{tile_n}"
            assert len(names) == 1 and names != general_names, f"{name}: {names} {general_names}"
            cublas = A.float() @ B.float().t() if out_fp32 else (A @ B.t()).float()
            check_vs_cublas(ours.float(), cublas, ref, name)
            assert torch.equal(ours, general), f"{name}: differs from the general kernel"
        monkeypatch.delenv("BERTACCEL_GEMM_SPECIALISED")
        assert_replay_matches_eager(lambda x, w: (GEMM(x, w, None, None, 0, trans_a, trans_b, False, False, tile_n, 3,
                                                       schedule)[0], []), a, b)


@hopper_test
@pytest.mark.parametrize("schedule,tile_n", SCHEDULE_WIDTHS, ids=_config_id)
@pytest.mark.parametrize("layout", ["fwd", "dgrad"])
def test_residual_specialisation_gives_the_general_kernels_bits(layout, schedule, tile_n, monkeypatch):
    """The residual epilogue without a bias (the fused FFN's input gradient: dgrad layout) runs the kSpecResidual
    kernel (another kernel than with BERTACCEL_GEMM_SPECIALISED=0): the general kernel's bits, within 2x the error
    of cuBLAS's product plus the add, at a ragged shape and a BERT one, eager and replayed."""
    trans_a, trans_b = LAYOUTS[layout]
    if tile_n == 96 and trans_b:
        pytest.skip("96-wide tiles take a K-major B only")
    for M, N, K in [(333, 520, 2056), (2048, 768, 3072)]:
        a, b = _operands(M, N, K, trans_a, trans_b, "cuda", torch.bfloat16)
        aux = torch.randn(M, N, device="cuda").bfloat16()
        B = b.t() if trans_b else b

        def run():
            return GEMM(a, b, None, aux, EPILOGUES["bias_residual"], trans_a, trans_b, False, False, tile_n, 1, schedule)[0]

        general, general_names, ours, names = _general_then_specialised(run, monkeypatch)
        name = f"residual {layout} {M}x{N}x{K} schedule {schedule} n{tile_n}"
        assert len(names) == 1 and len(general_names) == 1 and names != general_names, f"{name}: {names} {general_names}"
        check_vs_cublas(ours, ((a @ B.t()).float() + aux.float()).bfloat16(), a.double() @ B.double().t() + aux.double(), name)
        assert torch.equal(ours, general), f"{name}: differs from the general kernel"
        monkeypatch.delenv("BERTACCEL_GEMM_SPECIALISED")
        assert_replay_matches_eager(lambda x, w: (GEMM(x, w, None, aux, EPILOGUES["bias_residual"], trans_a, trans_b, False,
                                                       False, tile_n, 1, schedule)[0], []), a, b)


@hopper_test
def test_specialised_switch_leaves_other_calls_alone_and_refuses_bad_values(monkeypatch):
    """Calls no specialisation takes (fp32 out with one split, a transposed operand with a bias, the tanh GELU, a bias
    with K splits, bias + residual) run the same kernel with the switch on or off; plain, bias, K-split and residual
    (no bias) calls run another one."""
    a, b = _operands(1000, 768, 768, False, False, "cuda", torch.bfloat16)
    bias = torch.randn(768, device="cuda")
    aux = torch.randn(1000, 768, device="cuda").bfloat16()
    calls = {"bias": lambda: GEMM(a, b, bias, None, 1, False, False, False, False, 0, 0, 0),
             "plain": lambda: GEMM(a, b, None, None, 0, False, False, False, False, 0, 0, 0),
             "fp32 out": lambda: GEMM(a, b, None, None, 0, False, False, True, False, 0, 0, 0),
             "K splits": lambda: GEMM(a, b, None, None, 0, False, False, False, False, 128, 3, 1),
             "bias, K splits": lambda: GEMM(a, b, bias, None, 1, False, False, False, False, 128, 3, 1),
             "bias, B^T": lambda: GEMM(a, b.t().contiguous(), bias, None, 1, False, True, False, False, 0, 0, 0),
             "tanh GELU": lambda: GEMM(a, b, bias, None, 3, False, False, False, True, 0, 0, 0),
             "residual": lambda: GEMM(a, b, None, aux, 4, False, False, False, False, 0, 0, 0),
             "bias + residual": lambda: GEMM(a, b, bias, aux, 4, False, False, False, False, 0, 0, 0)}
    outs, names = {}, {}
    for setting in ("0", "1"):
        monkeypatch.setenv("BERTACCEL_GEMM_SPECIALISED", setting)
        outs[setting] = {k: f() for k, f in calls.items()}
        names[setting] = {k: _gemm_kernel_names(f) for k, f in calls.items()}
    for k in calls:
        assert all(torch.equal(x, y) for x, y in zip(outs["0"][k], outs["1"][k])), k
        assert (names["0"][k] != names["1"][k]) == (k in ("bias", "plain", "K splits", "residual")), (k, names["0"][k], names["1"][k])
    monkeypatch.setenv("BERTACCEL_GEMM_SPECIALISED", "yes")
    with pytest.raises(RuntimeError, match="BERTACCEL_GEMM_SPECIALISED"):
        GEMM(a, b, None, None, 0, False, False, False, False, 0, 0, 0)
