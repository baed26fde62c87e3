"""Shared helpers for the op tests.

CUDA tests (`@cuda_test`: marked `cuda`, skipped without a GPU) check every kernel with fresh random
inputs, the caching allocator poisoned with NaN first (an element the kernel forgets to write shows
as NaN), forward and every gradient, error at most twice PyTorch's own error in the same dtype
against the same float64 reference (plus a small floor)."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bertaccel.ops import build

ROWS = [1, 7, 1023, 16384]
HIDDEN = [128, 384, 768, 1001, 1004, 1024, 4096]  # 1001 / 1004: the scalar and 4-wide vector paths
DTYPES = [torch.float32, torch.bfloat16]
FLOOR = {torch.float32: 1e-6, torch.bfloat16: 1e-3}




@pytest.fixture(scope="session")
def kernels():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    assert build.load(), f"the CUDA ops did not build: {build.unavailable_reason()}"


def cuda_test(fn):
    """Mark a test `cuda` and give it the built kernels (skipped without a GPU)."""
    return pytest.mark.cuda(pytest.mark.usefixtures("kernels")(fn))


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture(scope="session")
def gemm_kernel():
    if not _hopper():
        pytest.skip("our GEMM kernel needs a Hopper GPU (sm_90)")
    assert build.load(), build.unavailable_reason()
    assert build.load_gemm(), f"the GEMM did not build: {build.gemm_reason()}"
    return os.environ.get("BERTACCEL_CACHE")  # where the extensions were built (a test's child process reuses them)


def hopper_test(fn):
    """Mark a test `cuda` and give it the built GEMM extension (skipped off Hopper)."""
    return pytest.mark.cuda(pytest.mark.usefixtures("gemm_kernel")(fn))


def check_vs_cublas(ours, cublas, ref, name):
    """Our error against the float64 reference at most twice cuBLAS's (plus a small floor)."""
    e_ours, e_cublas = rel_err(ours, ref), rel_err(cublas, ref)
    assert e_ours <= 2 * e_cublas + 1e-4, f"{name}: error {e_ours:.2e} vs cuBLAS {e_cublas:.2e}"


def capture_graph(step, *args):
    """`step(*args)` captured in a CUDA graph after one warm-up call on a side stream (the kernels'
    one-time setup outside the capture): (graph, the captured call's outputs)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(*args)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(*args)
    return graph, out


def replayed_output_and_grads(step, model):
    """`step()` (a forward + backward of `model` returning its output) captured in a CUDA graph, then replayed once on
    zeroed gradients: (the output, {parameter name: gradient}), in float64. Every parameter needs a `.grad` buffer."""
    graph, out = capture_graph(step)
    for p in model.parameters():
        p.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    return out.double(), {n: p.grad.double() for n, p in model.named_parameters()}


def assert_within_twice(ours, theirs, ref_out, ref_grads, floor=1e-3):
    """(output, {name: gradient}) pairs against the float64 reference: our output's and each nonzero reference
    gradient's error at most twice theirs (plus `floor`)."""
    assert rel_err(ours[0], ref_out) <= 2 * rel_err(theirs[0], ref_out) + floor
    for n, g in ref_grads.items():
        if g.abs().sum() == 0:
            continue
        e_ours, e_theirs = rel_err(ours[1][n], g), rel_err(theirs[1][n], g)
        assert e_ours <= 2 * e_theirs + floor, (n, e_ours, e_theirs)


def assert_replay_matches_eager(step, static_x, *static):
    """Capture `step(static_x, *static)` (-> (output, gradients)) in a CUDA graph after a warm-up on a
    side stream, give static_x new values, replay, and compare with an eager step on the same inputs."""
    graph, out = capture_graph(step, static_x, *static)
    with torch.no_grad():
        static_x.copy_(torch.randn_like(static_x))
    graph.replay()
    fresh = step(static_x, *static)
    for g, f in zip([out[0], *out[1]], [fresh[0], *fresh[1]]):
        torch.testing.assert_close(g, f)


def rand(*shape, **kw):
    return torch.randn(*shape, **kw)


def poison():
    """Fill free allocator blocks with NaN so outputs that reuse them start as NaN."""
    blob = torch.empty(64 * 1024 * 1024, device="cuda", dtype=torch.float32).fill_(float("nan"))
    del blob


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    assert not torch.isnan(a).any(), "NaN in output (unwritten element?)"
    return ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check(ours, torch_same_dtype, ref, dtype, name):
    e_ours, e_torch = rel_err(ours, ref), rel_err(torch_same_dtype, ref)
    assert e_ours <= 2 * e_torch + FLOOR[dtype], f"{name}: error {e_ours:.2e} vs PyTorch {e_torch:.2e}"


def outputs_in_child(module: str, function: str, env: dict[str, str | None], path: str) -> dict[str, torch.Tensor]:
    """`function(path)` from `module`, run in a child process under `env` (kernel switches are read once per
    process, so each setting needs its own), and the tensors it saved to `path` - for comparing kernels across
    settings."""
    from tests.conftest import run_in_child

    r = run_in_child(f"from {module} import {function}; {function}({path!r}); print('outputs saved')", env)
    assert r.returncode == 0 and "outputs saved" in r.stdout, r.stdout[-3000:] + r.stderr[-5000:]
    return torch.load(path)


def _cuda_profile(fn) -> torch.profiler.profile:
    """torch.profiler's CUDA activity over fn(), synchronized."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return prof


def cuda_kernel_names(fn) -> list[str]:
    """The names of the CUDA kernels fn() launches, in launch order (torch.profiler, synchronized)."""
    return [e.name for e in _cuda_profile(fn).events() if e.device_type == torch.autograd.DeviceType.CUDA]


def cuda_kernel_grids(fn) -> list[tuple[str, tuple[int, ...]]]:
    """(name, grid) of each CUDA kernel fn() launches, in launch order: torch.profiler's Chrome trace (its kernel
    events carry the launch's grid as args.grid)."""
    import json
    import tempfile

    prof = _cuda_profile(fn)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    assert kernels and all("grid" in e.get("args", {}) for e in kernels), "the trace's kernel events carry no grid"
    return [(e["name"], tuple(e["args"]["grid"])) for e in kernels]


def assert_passes_in_child(check, env: dict[str, str | None], ok_line: str) -> None:
    """check() - a module-level function of a test module - in a fresh process with `env` on top of this one's (the
    kernels' switches are read once per process): it must exit 0 having printed ok_line."""
    from tests.conftest import run_in_child

    r = run_in_child(f"from {check.__module__} import {check.__name__}; {check.__name__}()", env)
    assert r.returncode == 0 and ok_line in r.stdout, r.stdout[-3000:] + r.stderr[-5000:]


def leaves(*ts):
    return [t.detach().clone().requires_grad_(True) for t in ts]


def check_layer_norm_backward(rows: int, H: int, wdtype: torch.dtype, assert_kernels) -> None:
    """The plain LayerNorm's backward at rows x H (bf16 activations, weights in wdtype), for the tests that run it under
    a kernel switch: `assert_kernels(names)` on the CUDA kernels it launched, its gradients within twice PyTorch's bf16
    error of the float64 reference built from the inputs as the kernel sees them, the same bits on a second call."""
    import torch.nn.functional as F

    from bertaccel.ops.layer_norm import layer_norm

    x = torch.randn(rows, H, device="cuda") * 3 + 1
    w, b = torch.randn(H, device="cuda"), torch.randn(H, device="cuda")
    dy = torch.randn(rows, H, device="cuda")
    ref_in = leaves(x.bfloat16().double(), w.to(wdtype).double(), b.to(wdtype).double())
    ref = torch.autograd.grad(F.layer_norm(ref_in[0], (H,), ref_in[1], ref_in[2], 1e-5), ref_in, dy.bfloat16().double())
    th_in = leaves(x.bfloat16(), w.bfloat16(), b.bfloat16())
    th = torch.autograd.grad(F.layer_norm(th_in[0], (H,), th_in[1], th_in[2], 1e-5), th_in, dy.bfloat16())
    poison()
    ins = leaves(x.bfloat16(), w.to(wdtype), b.to(wdtype))

    def ours():
        return torch.autograd.grad(layer_norm(ins[0], ins[1], ins[2], 1e-5), ins, dy.bfloat16())

    assert_kernels(cuda_kernel_names(ours))
    got = ours()
    for name, a, t, r in zip(("dx", "dweight", "dbias"), got, th, ref):
        check(a, t, r, torch.bfloat16, f"{rows}x{H} weights {wdtype} {name}")
    for a, a2 in zip(got, ours()):
        assert torch.equal(a, a2), f"{rows}x{H}: a second call gave other bits"


def check_rms_norm_backward(rows: int, H: int, wdtype: torch.dtype, assert_kernels) -> None:
    """RMSNorm's backward at rows x H (bf16 activations, weights in wdtype), as check_layer_norm_backward: the kernels it
    launched, its gradients within twice PyTorch's bf16 error of the float64 reference, the same bits on a second call."""
    import torch.nn.functional as F

    from bertaccel.ops.rms_norm import rms_norm

    x = torch.randn(rows, H, device="cuda") * 3 + 1
    w, dy = torch.randn(H, device="cuda"), torch.randn(rows, H, device="cuda")
    ref_in = leaves(x.bfloat16().double(), w.to(wdtype).double())
    ref = torch.autograd.grad(F.rms_norm(ref_in[0], (H,), ref_in[1], 1e-6), ref_in, dy.bfloat16().double())
    th_in = leaves(x.bfloat16(), w.bfloat16())
    th = torch.autograd.grad(F.rms_norm(th_in[0], (H,), th_in[1], 1e-6), th_in, dy.bfloat16())
    poison()
    ins = leaves(x.bfloat16(), w.to(wdtype))

    def ours():
        return torch.autograd.grad(rms_norm(ins[0], ins[1], 1e-6), ins, dy.bfloat16())

    assert_kernels(cuda_kernel_names(ours))
    got = ours()
    for name, a, t, r in zip(("dx", "dweight"), got, th, ref):
        check(a, t, r, torch.bfloat16, f"rms_norm {rows}x{H} weights {wdtype} {name}")
    for a, a2 in zip(got, ours()):
        assert torch.equal(a, a2), f"rms_norm {rows}x{H}: a second call gave other bits"


def check_embeddings_layer_norm_backward(rows: int, H: int, assert_kernels) -> None:
    """The embeddings' form (kEmb) of the LayerNorm backward at rows x H without dropout (test_embeddings.py covers the
    dropout and the tables): `assert_kernels(names)` on the CUDA kernels it launched, its gradients within twice
    PyTorch's bf16 error of the float64 LayerNorm backward."""
    import torch.nn.functional as F

    ops = torch.ops.bertaccel
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

    def ours():
        return ops.embedding_layer_norm_bwd(dy, z, w, mean, rstd, rng, 0.0)

    assert_kernels(cuda_kernel_names(ours))
    for name, a, t, r in zip(("dz", "dweight", "dbias"), ours(), th, ref):
        check(a, t, r, torch.bfloat16, f"embeddings {rows}x{H} {name}")


# the small CPU model (the ops' references) and the BERT-base-wide GPU model of the residual fan-out tests
FANOUT_CPU_BERT = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                       attn_implementation="eager")
FANOUT_GPU_BERT = dict(hidden_size=768, num_hidden_layers=2, num_attention_heads=12, intermediate_size=3072)


def bert_fanout_off_and_on(monkeypatch, families, config, device="cpu", checkpointing=None):
    """A 2-layer BertModel (dropout off) with `families` (a config's list: `all` allowed) swapped, one forward + backward with
    BERTACCEL_RESIDUAL_FANOUT=0, then with the default (on) counting layer_norm_bwd2's calls: (off, on, calls), off and on each
    [output, every parameter's gradient]. CPU: batch 3 x 9, loss sum(out^2); CUDA: 4 x 128 under bf16 autocast,
    loss mean(out^2) in fp32. checkpointing: {"use_reentrant": ...} to run the layers under HF's gradient
    checkpointing."""
    from transformers import BertConfig, BertModel

    from bertaccel.ops.registry import expand
    from bertaccel.ops.swap import swap

    cfg = BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **config)
    torch.manual_seed(0)
    model = BertModel(cfg, add_pooling_layer=False).to(device)
    swap(model, expand(families))  # `all` as a config means it
    if checkpointing is not None:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
    cuda = device != "cpu"
    ids = torch.randint(0, cfg.vocab_size, (4, 128) if cuda else (3, 9), device=device)

    def step():
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            out = model(input_ids=ids).last_hidden_state
        (out.float().square().mean() if cuda else out.square().sum()).backward()
        return [out.detach().float() if cuda else out.detach(), *[p.grad.clone() for p in model.parameters()
                                                                  if p.grad is not None]]

    monkeypatch.setenv("BERTACCEL_RESIDUAL_FANOUT", "0")
    off = step()
    monkeypatch.delenv("BERTACCEL_RESIDUAL_FANOUT")  # the default: on
    # (counted at the dispatcher: the C++ fan-out of eager CUDA calls reaches the op without Python's torch.ops)
    with CountCalls(torch.ops.bertaccel.layer_norm_bwd2.default) as counter:
        on = step()
    return off, on, counter.calls


class CountCalls(TorchDispatchMode):
    """Counts the calls of one op overload that reach the dispatcher (from Python or C++) while active."""

    def __init__(self, op) -> None:
        super().__init__()
        self.op, self.calls = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is self.op
        return func(*args, **(kwargs or {}))
