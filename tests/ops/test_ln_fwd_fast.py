"""The forward ring's FAST kernels (layer_norm_fwd.cu: ln_fwd_ring_kernel<..., FAST = true, FEATS>): rows that fill
their lanes' items exactly (384 wide on half warps, 768 and 1024 bf16; 384 / 768 / 1024 float32) compile without the
per-item width tests, with dropout and the saved sum known at compile time - the plain LayerNorm and RMSNorm, and BERT's
residual LayerNorm with float32 weights (bias + residual; + the saved sum in training; + dropout), except the residual
kernels that would spill (1024 wide with dropout, float32 1024 inference, float32 768 dropout without the saved sum).
`BERTACCEL_LN_RING_FAST=0` turns them off, `=plain` keeps the plain ones only; the switch is read once per process, so
each setting runs in a child process, which saves its outputs for the comparison here. The FAST kernel must run exactly where the rule says (not at 776 or
1000 wide, nor for the bf16 RMSNorm 384, which measured faster on the general kernel, nor for the bf16 residual form
at 384 wide below 4,096 rows, which runs on whole warps), be as accurate as PyTorch against float64, and agree
with the general kernel: outputs to one unit in the last place of the output dtype (four in float32) plus sixteen
float32 units of the row's output scale, the saved mean and rstd to sixteen float32 units. The two kernels' arithmetic
is compiled differently (a constant width against a run-time one, sums in another order: in session 77 the LayerNorm
768 outputs differed in some bits), and an output where x_hat * w + b cancels near zero keeps the float32 rounding of
its terms, not of itself: a purely relative tolerance failed there on the H200 in session 80."""

from __future__ import annotations

import functools
import os
import re

import torch

from tests.conftest import run_in_child
from tests.ops.conftest import cuda_test, outputs_in_child

CASES = [(16384, 768, "bfloat16"), (4101, 1024, "bfloat16"), (4099, 384, "bfloat16"), (999, 776, "bfloat16"),
         (333, 1000, "bfloat16"), (2047, 768, "float32"), (513, 1024, "float32"), (77, 384, "float32")]


def fast_outputs(path: str) -> None:
    """Run in a child process with BERTACCEL_LN_RING_FAST set or not (see the test below); saves to `path`."""
    import torch.nn.functional as F

    from bertaccel.ops import build
    from bertaccel.ops.layer_norm import layer_norm
    from bertaccel.ops.residual_layer_norm import bias_dropout_add_layer_norm
    from bertaccel.ops.rms_norm import rms_norm
    from tests.ops.conftest import check, cuda_kernel_names, poison

    assert build.load(), build.unavailable_reason()
    setting = os.environ.get("BERTACCEL_LN_RING_FAST")
    fast_on, residual_on = setting != "0", setting not in ("0", "plain")

    def ring_kernel(fn) -> str:
        names = [n for n in cuda_kernel_names(fn) if "ln_fwd_ring_kernel" in n]
        assert len(names) == 1, names
        return names[0]

    def is_fast(name: str) -> bool:
        m = re.search(r"ln_fwd_ring_kernel<.*, (true|false), \d+>", name)
        return m is not None and m.group(1) == "true"

    g = torch.Generator(device="cuda").manual_seed(0)
    saved = {}
    for rows, H, dtype in CASES:
        dt = getattr(torch, dtype)
        x = (torch.randn(rows, H, device="cuda", generator=g) * 2 + 1).to(dt)
        w, b = torch.randn(H, device="cuda", generator=g), torch.randn(H, device="cuda", generator=g)
        exact = H in (384, 768, 1024)
        with torch.no_grad():
            for name, fn, th, ref in [
                ("layer_norm", lambda: layer_norm(x, w, b, 1e-5), F.layer_norm(x, (H,), w.to(dt), b.to(dt), 1e-5),
                 F.layer_norm(x.double(), (H,), w.double(), b.double(), 1e-5)),
                ("rms_norm", lambda: rms_norm(x, w, 1e-5), F.rms_norm(x, (H,), w.to(dt), 1e-5),
                 F.rms_norm(x.double(), (H,), w.double(), 1e-5)),
            ]:
                kernel = ring_kernel(fn)
                fast_rule = fast_on and exact and not (name == "rms_norm" and H == 384 and dtype == "bfloat16")
                assert is_fast(kernel) == fast_rule, (name, rows, H, dtype, kernel)
                poison()
                out = fn()
                check(out, th, ref, dt, f"{name} {rows}x{H} {dtype}")
                saved[f"{name} {rows}x{H} {dtype}"] = out.cpu()
            # the residual forms with a bf16 linear bias (the weights' dtype) never take FAST
            kernel = ring_kernel(lambda: bias_dropout_add_layer_norm(x, w.to(dt), x, w.to(dt), b.to(dt), 0.0, 1e-5))
            assert not is_fast(kernel) or dt == torch.float32, kernel
        # BERT's residual forms, float32 weights: inference (y), training (y, z, mean, rstd), training with dropout,
        # and dropout without a backward (training mode under no_grad: y)
        res, lb = torch.randn(rows, H, device="cuda", generator=g).to(dt), torch.randn(H, device="cuda", generator=g)
        with torch.no_grad():
            for form, p, train in (("inference", 0.0, False), ("training", 0.0, True), ("training p=0.1", 0.1, True),
                                   ("no grad p=0.1", 0.1, False)):
                def fn(p=p, train=train):
                    if train:
                        return torch.ops.bertaccel.layer_norm_fwd(x, lb, res, w, b, p, 1e-5)
                    return torch.ops.bertaccel.layer_norm(x, lb, res, w, b, p, 1e-5)
                kernel = ring_kernel(fn)
                # (layer_norm_fwd.cu fast_residual_fits: the kernels that would spill keep the general one)
                fits = not (H == 1024 and (p > 0 or (dtype == "float32" and not train))) and \
                    not (H == 768 and dtype == "float32" and p > 0 and not train)
                whole_warps = H == 384 and dtype == "bfloat16" and rows < 4096
                want = residual_on and exact and fits and not whole_warps
                assert is_fast(kernel) == want, (form, rows, H, dtype, kernel)
                torch.cuda.manual_seed(1234)  # the same dropout offset in every child process
                poison()
                out = fn()
                outs = out[:4] if train else (out,)
                if p == 0:
                    th = F.layer_norm(x + lb.to(dt) + res, (H,), w.to(dt), b.to(dt), 1e-5)
                    ref = F.layer_norm(x.double() + lb.double() + res.double(), (H,), w.double(), b.double(), 1e-5)
                    check(outs[0], th, ref, dt, f"residual {form} {rows}x{H} {dtype}")
                for k, t in zip(("y", "z", "mean", "rstd"), outs):
                    saved[f"residual {form} {k} {rows}x{H} {dtype}"] = t.cpu()
        # the training forward: the same kernel writes the mean and rstd the backward reads
        y, _, mean, rstd, _ = torch.ops.bertaccel.layer_norm_fwd(x, None, None, w, b, 0.0, 1e-5)
        y2, rstd2 = torch.ops.bertaccel.rms_norm_fwd(x, w, 1e-5)
        for k, t in (("y", y), ("mean", mean), ("rstd", rstd), ("rms y", y2), ("rms rstd", rstd2)):
            saved[f"saved {k} {rows}x{H} {dtype}"] = t.detach().cpu()
    torch.save(saved, path)


@functools.lru_cache(maxsize=None)
def child_outputs(setting: str | None, folder: str) -> dict[str, torch.Tensor]:
    return outputs_in_child("tests.ops.test_ln_fwd_fast", "fast_outputs", {"BERTACCEL_LN_RING_FAST": setting},
                            os.path.join(folder, f"fast_{setting}.pt"))


@cuda_test
def test_ln_fwd_fast_agrees_with_the_general_kernel(tmp_path):
    fast, general = child_outputs(None, str(tmp_path)), child_outputs("0", str(tmp_path))
    assert fast.keys() == general.keys() and len(fast) == 17 * len(CASES)
    for key, a in fast.items():
        b = general[key]
        assert a.dtype == b.dtype and a.shape == b.shape, key
        eps32 = torch.finfo(torch.float32).eps
        if "mean" in key or "rstd" in key:
            rtol, atol = 16 * eps32, 0.0
        else:
            # one unit in the last place (bf16: 2^-7 of the value at most; float32: four), plus the float32 rounding
            # of the terms of x_hat * w + b where they cancel (the output's scale: its largest magnitude)
            rtol = torch.finfo(a.dtype).eps * (1 if a.dtype == torch.bfloat16 else 4)
            atol = 16 * eps32 * b.float().abs().max().item()
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol, msg=lambda m, key=key: f"{key}: {m}")


@cuda_test
def test_ln_fwd_fast_plain_setting_keeps_the_residual_forms_on_the_general_kernel(tmp_path):
    """`BERTACCEL_LN_RING_FAST=plain` (the rule before session 81): the residual forms' outputs are the general
    kernel's bit for bit (its child asserts where each kernel ran), the plain forms' the FAST kernel's."""
    plain, general = child_outputs("plain", str(tmp_path)), child_outputs("0", str(tmp_path))
    fast = child_outputs(None, str(tmp_path))
    for key, a in plain.items():
        other = general[key] if key.startswith("residual") else fast[key]
        assert torch.equal(a, other), key


@cuda_test
def test_an_unknown_fast_setting_is_refused_with_the_values_it_takes():
    code = ("import torch; from bertaccel.ops import build, layer_norm; assert build.load()\n"
            "x = torch.randn(64, 768, device='cuda')\n"
            "try:\n    layer_norm.layer_norm(x, torch.ones(768, device='cuda'), torch.zeros(768, device='cuda'), 1e-5)\n"
            "except RuntimeError as e:\n    print('refused:', e)\n")
    r = run_in_child(code, {"BERTACCEL_LN_RING_FAST": "residual"})
    assert r.returncode == 0 and "refused:" in r.stdout, r.stdout[-3000:] + r.stderr[-5000:]
    assert "BERTACCEL_LN_RING_FAST=residual is not a setting" in r.stdout and "plain" in r.stdout, r.stdout[-3000:]
