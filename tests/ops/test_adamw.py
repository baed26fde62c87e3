"""Tests of AdamW on fp32 masters from bf16 copies' gradients (ops/adamw.py, csrc/adamw.cu), and of `adamw_`
(the same kernel for parameters without copies, from fp32 gradients).

CPU: opcheck, and the reference op against PyTorch's AdamW (bit for bit: the same fp32 arithmetic).
CUDA: the kernel against PyTorch's fused capturable AdamW over several steps, for sizes that take
the 4-wide and the scalar paths, several chunks, more tensors than one launch holds, and two groups'
worth of hyperparameters; the copies are the masters rounded to bf16; it captures in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

import bertaccel.ops.adamw  # noqa: F401 - the op
from tests.conftest import run_in_child
from tests.ops.conftest import cuda_test

SIZES = [1000, 37, 2 * 65536 + 5, 4, 1]


def _case(device, sizes, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    masters = [torch.randn(n, device=device, generator=g) for n in sizes]
    grads = [[torch.randn(n, device=device, generator=g).bfloat16() for n in sizes] for _ in range(3)]
    return masters, grads


def _ours(masters, grads_per_step, lr, wd, betas=(0.9, 0.999), eps=1e-8, copies=True):
    """Our AdamW over the steps: `adamw_bf16_copies_` from the bf16 gradients, writing bf16 copies, or (copies=False)
    `adamw_` from the same gradients widened to fp32. (params, exp_avgs, exp_avg_sqs, copies or None)."""
    p = [m.clone() for m in masters]
    m = [torch.zeros_like(x) for x in p]
    v = [torch.zeros_like(x) for x in p]
    steps = [torch.zeros((), device=x.device) for x in p]
    out = [torch.empty_like(x, dtype=torch.bfloat16) for x in p] if copies else None
    for grads in grads_per_step:
        torch._foreach_add_(steps, 1)
        if copies:
            torch.ops.bertaccel.adamw_bf16_copies_(p, grads, m, v, steps, out, lr, betas[0], betas[1], wd, eps)
        else:
            torch.ops.bertaccel.adamw_(p, [g.float() for g in grads], m, v, steps, lr, betas[0], betas[1], wd, eps)
    return p, m, v, out


def _torch(masters, grads_per_step, lr, wd, **kw):
    params = [torch.nn.Parameter(x.clone()) for x in masters]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=wd, **kw)
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.float()
        opt.step()
    return params, opt


def test_adamw_bf16_copies_opcheck_cpu():
    masters, grads = _case("cpu", [12, 5])
    args = ([m.clone() for m in masters], grads[0], [torch.zeros_like(m) for m in masters],
            [torch.zeros_like(m) for m in masters], [torch.ones(()) for _ in masters],
            [torch.empty_like(m, dtype=torch.bfloat16) for m in masters], torch.tensor(1e-3, dtype=torch.float64),
            0.9, 0.999, 0.01, 1e-8)
    torch.library.opcheck(torch.ops.bertaccel.adamw_bf16_copies_.default, args)


def test_reference_is_pytorchs_adamw_bit_for_bit():
    masters, grads = _case("cpu", SIZES[:3])
    p, m, v, copies = _ours(masters, grads, torch.tensor(3e-3, dtype=torch.float64), 0.01)
    params, opt = _torch(masters, grads, 3e-3, 0.01, foreach=True)
    for a, b, c in zip(p, params, copies):
        assert torch.equal(a, b.detach())
        assert torch.equal(c, a.bfloat16())


def test_adamw_plain_opcheck_and_reference_is_pytorchs_adamw_bit_for_bit():
    masters, grads = _case("cpu", [12, 5])
    args = ([m.clone() for m in masters], [g.float() for g in grads[0]], [torch.zeros_like(m) for m in masters],
            [torch.zeros_like(m) for m in masters], [torch.ones(()) for _ in masters],
            torch.tensor(1e-3, dtype=torch.float64), 0.9, 0.999, 0.01, 1e-8)
    torch.library.opcheck(torch.ops.bertaccel.adamw_.default, args)
    masters, grads = _case("cpu", SIZES[:3])
    p, m, v, _ = _ours(masters, grads, torch.tensor(3e-3, dtype=torch.float64), 0.01, copies=False)
    params, opt = _torch(masters, grads, 3e-3, 0.01, foreach=True)
    for a, b in zip(p, params):
        assert torch.equal(a, b.detach())


@cuda_test
@pytest.mark.parametrize("wd", [0.0, 0.01])
@pytest.mark.parametrize("tensors", [len(SIZES), 53], ids=lambda n: f"{n}-tensors")
@pytest.mark.parametrize("with_copies", [True, False], ids=["adamw_bf16_copies_", "adamw_"])
def test_kernel_matches_pytorchs_fused_adamw(wd, tensors, with_copies):
    """Both ops (the copies' from bf16 gradients; `adamw_` from fp32 ones, no copies) against PyTorch's fused
    capturable AdamW."""
    sizes = (SIZES * 11)[:tensors]
    masters, grads = _case("cuda", sizes)
    lr = torch.tensor(3e-3, device="cuda")
    p, m, v, copies = _ours(masters, grads, lr, wd, copies=with_copies)
    params, opt = _torch(masters, grads, lr, wd, fused=True, capturable=True)
    for i, (a, b) in enumerate(zip(p, params)):
        st = opt.state[b]
        # same fp32 formula; the bias corrections' powers may differ in the last bit (powf vs pow)
        torch.testing.assert_close(a, b.detach(), rtol=2e-6, atol=1e-7, msg=f"param {i} ({sizes[i]})")
        # (a moment near zero is a difference of nearby terms: compare on the moments' own scale)
        torch.testing.assert_close(m[i], st["exp_avg"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(v[i], st["exp_avg_sq"], rtol=1e-6, atol=1e-10)
        if with_copies:
            assert torch.equal(copies[i], a.bfloat16()), "the copy is not the master rounded to bf16"
    if not with_copies:
        with pytest.raises(RuntimeError, match="float32"):  # bf16 gradients are the copies' op's
            torch.ops.bertaccel.adamw_(p[:1], [grads[0][0]], m[:1], v[:1], [torch.ones((), device="cuda")], lr,
                                       0.9, 0.999, 0.0, 1e-8)


@cuda_test
def test_kernel_captures_and_reads_the_learning_rate_at_replay():
    masters, grads = _case("cuda", [1000, 37])
    lr = torch.tensor(1e-3, device="cuda")
    p = [x.clone() for x in masters]
    m, v = [torch.zeros_like(x) for x in p], [torch.zeros_like(x) for x in p]
    steps = [torch.zeros((), device="cuda") for _ in p]
    copies = [torch.empty_like(x, dtype=torch.bfloat16) for x in p]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.ops.bertaccel.adamw_bf16_copies_(p, grads[0], m, v, [torch.ones((), device="cuda")] * 2, copies, lr,
                                               0.9, 0.999, 0.0, 1e-8)
    torch.cuda.current_stream().wait_stream(s)
    before = [x.clone() for x in p]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch._foreach_add_(steps, 1)
        torch.ops.bertaccel.adamw_bf16_copies_(p, grads[0], m, v, steps, copies, lr, 0.9, 0.999, 0.0, 1e-8)
    for x, b in zip(p, before):  # capture ran nothing
        assert torch.equal(x, b)
    lr.fill_(0.0)
    graph.replay()
    for x, b in zip(p, before):  # a zero learning rate at replay: no change
        assert torch.equal(x, b)
    lr.fill_(1e-2)
    graph.replay()
    assert all(not torch.equal(x, b) for x, b in zip(p, before))
    assert all(torch.equal(c, x.bfloat16()) for c, x in zip(copies, p))


@cuda_test
@pytest.mark.parametrize("with_copies", [True, False], ids=["adamw_bf16_copies_", "adamw_"])
def test_chunk_size_does_not_change_a_bit(monkeypatch, with_copies):
    """Blocks of 1,024 elements (BERTACCEL_ADAMW_CHUNK) and of 65,536 give the default's result bit for bit: the
    chunks only split the work, and a tensor's last chunk (2 x 65,536 + 5 elements: a partial one) is complete."""
    masters, grads = _case("cuda", SIZES, seed=3)
    lr = torch.tensor(3e-3, device="cuda")
    want = _ours(masters, grads, lr, 0.01, copies=with_copies)
    for chunk in ("1024", "65536"):
        monkeypatch.setenv("BERTACCEL_ADAMW_CHUNK", chunk)
        got = _ours(masters, grads, lr, 0.01, copies=with_copies)
        for a, b in zip(got, want):
            if a is not None:
                assert all(torch.equal(x, y) for x, y in zip(a, b)), f"chunk {chunk}"


BAD_CHUNK = """
import os, sys, torch
import bertaccel.ops.adamw
from bertaccel.ops import build
assert build.load(), build.unavailable_reason()
p, g = [torch.zeros(8, device="cuda")], [torch.zeros(8, device="cuda")]
m, v, t = [torch.zeros(8, device="cuda")], [torch.zeros(8, device="cuda")], [torch.ones((), device="cuda")]
try:
    torch.ops.bertaccel.adamw_(p, g, m, v, t, torch.tensor(1e-3, device="cuda"), 0.9, 0.999, 0.0, 1e-8)
except RuntimeError as e:
    print("raised:", str(e).splitlines()[0], flush=True)
else:
    print("no error", flush=True)
"""


@cuda_test
@pytest.mark.parametrize("value", ["1000", "0", "-1024", "16k"])
def test_a_bad_chunk_size_says_what_it_must_be(value):
    """In a child process: the first version's TORCH_CHECK with a number in its message segfaulted on the GPU host
    (csrc/check.h); a crash fails this test instead of ending the run."""
    r = run_in_child(BAD_CHUNK, {"BERTACCEL_ADAMW_CHUNK": value}, timeout=300)
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
    assert f"raised: BERTACCEL_ADAMW_CHUNK must be a positive multiple of 1024 (elements per block), got '{value}'" \
        in r.stdout, r.stdout + r.stderr[-2000:]
