"""The graphed step body (bertaccel.modules.train_step), run eagerly on CPU: transient gradients give
the update that adding into the static buffers gives, leave the static buffers in place and zero,
and skip a parameter the forward did not use, as Lightning's eager loop does."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from bertaccel.modules.train_step import build_train_step, make_static_grads


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.norm = nn.LayerNorm(5)
        self.b = nn.Linear(5, 3)
        self.unused = nn.Linear(3, 3)

    def forward(self, x, y):
        return {"loss": nn.functional.cross_entropy(self.b(self.norm(self.a(x))), y)}


def _run(transient: bool, clip=None, steps=3):
    torch.manual_seed(0)
    net = _Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    statics = make_static_grads(net.parameters())
    step = build_train_step(net, opt, transient_grads=transient, clip=clip)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        step(x=torch.randn(8, 6, generator=g), y=torch.randint(0, 3, (8,), generator=g))
        assert all(p.grad is buf for p, buf in statics), "a static gradient buffer was replaced"
        assert all(torch.count_nonzero(buf) == 0 for _, buf in statics), "static buffers not left zeroed"
    return net


@pytest.mark.parametrize("clip", [None, (0.05, "norm"), (0.01, "value")], ids=["plain", "clip-norm", "clip-value"])
def test_transient_gradients_update_like_static_buffers(clip):
    static, transient = _run(False, clip), _run(True, clip)
    # the norm of the static run also sums the unused parameter's zeros: its rounding may move a last bit
    tol = 1e-6 if clip and clip[1] == "norm" else 0.0
    for (name, a), b in zip(static.named_parameters(), transient.parameters()):
        if not name.startswith("unused"):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=name)


def test_a_parameter_without_gradient_is_not_updated():
    """Static buffers hand AdamW a zero gradient (weight decay moves the weight); transient gradients
    hand it none, as Lightning's `zero_grad(set_to_none=True)` eager loop does."""
    torch.manual_seed(0)
    before = _Net().unused.weight.detach().clone()
    assert torch.equal(_run(True).unused.weight, before)
    assert not torch.equal(_run(False).unused.weight, before)


def test_missing_static_gradients_are_an_error():
    net = _Net()
    opt = torch.optim.AdamW(net.parameters())
    with pytest.raises(RuntimeError, match="no static .grad buffer"):
        build_train_step(net, opt)


def _run_synced(world: int, copies: bool, fused: bool, accumulate: int = 1, clip=None, steps=4):
    """`steps` updates; with world > 1 the gradient sync stands in for `world` ranks that saw the same
    batch (an all-reduce sum of identical gradients: each times `world`). It records what it was given."""
    from bertaccel.modules.weight_copies import Bf16WeightCopies

    torch.manual_seed(0)
    net = _Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    make_static_grads(net.parameters())
    wc = Bf16WeightCopies(net) if copies else None
    synced: list[list[torch.dtype]] = []

    def sync(grads):
        synced.append([g.dtype for g in grads])
        for g in grads:
            g.mul_(world)

    kw = dict(copies=wc, accumulate=accumulate, clip=clip, fused_copies_update=fused,
              autocast=(lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if copies else contextlib.nullcontext,
              grad_sync=sync if world > 1 else None, world_size=world)
    mid, last = build_train_step(net, opt, last=False, **kw), build_train_step(net, opt, last=True, **kw)
    g = torch.Generator().manual_seed(1)
    for i in range(steps * accumulate):
        (last if (i + 1) % accumulate == 0 else mid)(x=torch.randn(8, 6, generator=g), y=torch.randint(0, 3, (8,), generator=g))
    return net, synced


@pytest.mark.parametrize("copies,fused,accumulate,clip", [
    (False, False, 1, None), (False, False, 1, (0.05, "norm")), (False, False, 3, None),
    (True, False, 1, None), (True, True, 1, None), (True, False, 2, (0.05, "norm"))],
    ids=["fp32", "fp32-clip", "fp32-accumulate", "copies", "copies-fused-adamw", "copies-accumulate-clip"])
def test_synced_gradients_are_the_mean_over_ranks(copies, fused, accumulate, clip):
    """The step scales the loss by 1 / world and sums over the ranks: with every rank on the same batch
    the update is the one-process update, on every path (a gradient the sync missed would be halved)."""
    one, _ = _run_synced(1, copies, fused, accumulate, clip)
    two, synced = _run_synced(2, copies, fused, accumulate, clip)
    assert len(synced) == 4  # once per update, not per micro-batch
    if copies and fused:  # the fused AdamW reads the copies' bf16 gradients: synced in bf16
        assert torch.bfloat16 in synced[0] and torch.float32 in synced[0]
    for (name, a), b in zip(one.named_parameters(), two.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_uncopied_parameters_in_our_kernel_update_as_pytorchs_adamw(monkeypatch):
    """By default (BERTACCEL_ADAMW_ALL unset; =0 turns it off) the parameters without bf16 copies (here the LayerNorm
    and the biases) are updated by `bertaccel::adamw_` instead of PyTorch's AdamW, to the same values over four steps (the CPU reference is its
    arithmetic; the moments and step counts it keeps in the optimizer's state carry from step to step)."""
    monkeypatch.setenv("BERTACCEL_ADAMW_ALL", "0")
    theirs, _ = _run_synced(1, copies=True, fused=True)
    calls = []
    real = torch.ops.bertaccel.adamw_

    def counting(*args):
        calls.append(len(args[0]))
        return real(*args)

    monkeypatch.delenv("BERTACCEL_ADAMW_ALL")  # the default
    import bertaccel.ops.adamw  # noqa: F401 - the op

    monkeypatch.setattr(torch.ops.bertaccel, "adamw_", counting)
    ours, _ = _run_synced(1, copies=True, fused=True)
    assert calls and all(n > 0 for n in calls), "the uncopied parameters did not go through adamw_"
    for (name, a), b in zip(theirs.named_parameters(), ours.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def _run_overlapped(overlap: bool, bucket_bytes: int = 64, steps: int = 4):
    """Two-rank stand-in as in `_run_synced` (bf16 copies, fused AdamW), the sync bucket by bucket during the
    backward when `overlap`; records each sync call's size and whether it ran inside the backward."""
    from bertaccel.modules.weight_copies import Bf16WeightCopies

    torch.manual_seed(0)
    net = _Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    make_static_grads(net.parameters())
    wc = Bf16WeightCopies(net)
    calls: list[tuple[int, bool]] = []

    def sync(grads):
        calls.append((len(grads), torch._C._current_graph_task_id() != -1))
        for g in grads:
            g.mul_(2)

    step = build_train_step(net, opt, copies=wc, autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16),
                            grad_sync=sync, world_size=2, overlap_order=list(net.parameters()) if overlap else None,
                            bucket_bytes=bucket_bytes)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        step(x=torch.randn(8, 6, generator=g), y=torch.randint(0, 3, (8,), generator=g))
    step.close()
    return net, calls, step


def test_overlapped_sync_sums_every_gradient_once_and_starts_inside_the_backward():
    """The bucketed sync during the backward gives the one-call sync's update bit for bit (every gradient summed
    once), and from the second step (the first shows that the unused layer gets no gradient: it would hold its
    bucket and every later one back) buckets go while the backward still runs."""
    one, one_calls, _ = _run_overlapped(False)
    over, calls, step = _run_overlapped(True)
    assert len(one_calls) == 4 and not any(inside for _, inside in one_calls)
    per_step = len(calls) // 4
    assert per_step > 2 and len(calls) == 4 * per_step
    assert not any(inside for _, inside in calls[:per_step])  # step 1: the unused layer's bucket comes first
    assert step.overlap.launched_in_backward > 0 and any(inside for _, inside in calls[-2:])  # later steps
    assert all(sum(n for n, _ in calls[k * per_step:(k + 1) * per_step]) == one_calls[0][0] for k in range(4))
    for (name, a), b in zip(one.named_parameters(), over.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    # close() removed the hooks: another backward sends nothing
    calls.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        over(torch.randn(2, 6), torch.tensor([0, 1]))["loss"].backward()
    assert calls == []


def test_overlapped_sync_buckets_one_dtype_each_in_reverse_registration_order():
    from bertaccel.modules.train_step import OverlappedGradSync

    a = torch.zeros(4, requires_grad=True)  # fp32, 16 bytes
    b = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)  # 8 bytes
    c = torch.zeros(4, requires_grad=True)
    d = torch.zeros(8, dtype=torch.bfloat16, requires_grad=True)  # 16 bytes
    sync = OverlappedGradSync([a, b, c, d], lambda grads: None, positions=[0, 1, 2, 3], bucket_bytes=40)
    assert sync.buckets == [[3, 1], [2, 0]]  # d + b (bf16, 24 bytes), c + a (fp32, 32 bytes), last registered first
    sync.start()
    (a.sum() + b.float().sum() + d.float().sum()).backward()  # c gets no gradient
    sync.finish()
    assert sync.buckets == [[3, 1], [0]]  # made again without it
    sync.close()


@pytest.mark.cuda
def test_overlapped_sync_inside_a_captured_step_on_a_gpu():
    """One GPU, the step captured and replayed by StepGraphs, a stand-in for the all-reduce (each gradient times 2
    on the side stream, as a 2-rank sum of equal gradients): the buckets forked from the backward's hooks onto a
    side stream and joined back are captured into the graph, and the replays train exactly as the step with the
    one sync after the backward does (bf16 copies, our fused AdamW)."""
    from bertaccel.modules.graphs import StepGraphs
    from bertaccel.modules.weight_copies import Bf16WeightCopies

    def run(overlap: bool):
        torch.manual_seed(0)
        net = _Net().cuda()
        opt = torch.optim.AdamW(net.parameters(), lr=torch.tensor(1e-2, device="cuda"), weight_decay=0.1, fused=True)
        make_static_grads(net.parameters())
        wc = Bf16WeightCopies(net)
        sent_from = []

        def sync(grads):
            sent_from.append(torch.cuda.current_stream().cuda_stream)
            torch._foreach_mul_(grads, 2.0)

        step = build_train_step(net, opt, copies=wc, autocast=lambda: torch.autocast("cuda", dtype=torch.bfloat16),
                                grad_sync=sync, world_size=2, bucket_bytes=64,
                                overlap_order=list(net.parameters()) if overlap else None)
        runner = StepGraphs("t", warmup=2)
        g = torch.Generator().manual_seed(1)
        for _ in range(8):
            runner.run("k", step, {"x": torch.randn(8, 6, generator=g).cuda(), "y": torch.randint(0, 3, (8,), generator=g).cuda()})
        torch.cuda.synchronize()
        assert runner.stats.replays >= 4 and runner.disabled_reason is None
        step.close()
        return net, step, set(sent_from)

    after, _, _ = run(False)
    over, step, streams = run(True)
    # every bucket went on the overlap's own side stream, some of them from the backward's hooks
    assert step.overlap.launched_in_backward > 0 and streams == {step.overlap._stream.cuda_stream}
    for (name, a), b in zip(after.named_parameters(), over.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
