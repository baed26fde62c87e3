"""`query_rows_attention`: a few query rows per sequence over all of its keys (the last layer at [CLS] only). CPU: the
reference against float64 SDPA (forward and gradients), a row with no key, the dropout mask the kernel draws,
gradcheck, opcheck. CUDA: the kernel against the reference with the same dropout mask, every dtype and head dim, odd
key counts, masked and empty rows, error at most 2x SDPA's against float64, a CUDA graph drawing new masks per replay.
The varlen form (packed K / V rows, `cu_seqlens`): the padded form's values and gradients (CPU reference: exactly;
kernel: bit for bit, dropout included), zero gradients at the rows past the last sequence, opcheck, CUDA graphs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bertaccel.ops.attention import (
    query_rows_attention,
    query_rows_attention_varlen,
    query_rows_keep,
    query_rows_unavailable,
)
from tests.ops.conftest import capture_graph, poison, rel_err


def _inputs(B=3, Q=1, S=11, heads=4, d=8, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Q, heads * d, generator=g, dtype=torch.float64).to(device, dtype)
    kv = torch.randn(B, S, 2 * heads * d, generator=g, dtype=torch.float64).to(device, dtype)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, S // 2:] = False
    if B > 2:
        mask[2] = False  # a row with no key
    return q, kv, mask.to(device)


def _sdpa(q, kv, mask, heads, dropout_factors=None):
    """SDPA in q's dtype, rows with no key zero (SDPA gives NaN there)."""
    B, Q, H = q.shape
    S, d = kv.shape[1], H // heads
    k, v = kv.view(B, S, 2, heads, d).unbind(2)
    qh, k, v = q.view(B, Q, heads, d).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if dropout_factors is None:
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask[:, None, None, :])
    else:  # the same mask as the kernel's, as explicit factors
        s = (qh @ k.transpose(-1, -2) / d ** 0.5).masked_fill(~mask[:, None, None, :], float("-inf"))
        out = (torch.softmax(s, -1) * dropout_factors) @ v
    out = out.transpose(1, 2).reshape(B, Q, H)
    return torch.where(mask.any(1)[:, None, None], out, 0)


@pytest.mark.parametrize("Q", [1, 3])
def test_cpu_reference_equals_sdpa_in_float64_with_gradients(Q):
    heads = 4
    q, kv, mask = _inputs(Q=Q)
    q.requires_grad_(), kv.requires_grad_()
    out = query_rows_attention(q, kv, mask, heads)
    ref = _sdpa(q, kv, mask, heads)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert out[2].abs().max() == 0  # no key: zeros
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, kv), g)
    refs = torch.autograd.grad(ref, (q, kv), g)
    for a, b in zip(grads, refs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_gradcheck_and_opcheck_on_cpu():
    heads = 2
    q, kv, mask = _inputs(B=2, Q=2, S=5, heads=heads, d=4)
    q.requires_grad_(), kv.requires_grad_()
    torch.autograd.gradcheck(lambda q, kv: query_rows_attention(q, kv, mask, heads), (q, kv))
    q32, kv32 = q.detach().float().requires_grad_(), kv.detach().float().requires_grad_()
    torch.library.opcheck(torch.ops.bertaccel.query_rows_attention_fwd.default, (q32, kv32, mask, heads, 0.0, 0.5))
    out, lse, rng = torch.ops.bertaccel.query_rows_attention_fwd(q32, kv32, mask, heads, 0.0, 0.5)
    torch.library.opcheck(torch.ops.bertaccel.query_rows_attention_bwd.default,
                          (torch.randn_like(out), q32.detach(), kv32.detach(), mask, out.detach(), lse, heads, 0.0, 0.5, rng))


def test_cpu_dropout_uses_the_kernels_mask():
    heads, p = 4, 0.3
    q, kv, mask = _inputs(Q=2, S=37)
    out, lse, rng = torch.ops.bertaccel.query_rows_attention_fwd(q, kv, mask, heads, p, 8 ** -0.5)
    keep = query_rows_keep(3, 2, heads, 37, p, int(rng[0]), int(rng[1]))
    assert 0.6 < keep.float().mean() < 0.8
    torch.testing.assert_close(out, _sdpa(q, kv, mask, heads, keep / (1 - p)), rtol=1e-10, atol=1e-12)


def test_unavailable_says_why():
    q, kv, mask = _inputs()
    assert query_rows_unavailable(q, kv, 4) == "not a CUDA tensor"
    assert query_rows_unavailable(q, kv.flatten(0, 1), 4, max_seqlen=11) == "not a CUDA tensor"


def _packed(kv, mask, tail=3):
    """The padded kv [B, S, 2H] / mask [B, S] (right-padded) as packed rows [T, 2H] with `tail` filler rows of garbage
    after the last sequence, and cu_seqlens (int32)."""
    lengths = mask.sum(1)
    assert torch.equal(mask, torch.arange(mask.shape[1], device=mask.device) < lengths[:, None])
    rows = kv[mask]
    fill = torch.full((tail, kv.shape[2]), 7.0, dtype=kv.dtype, device=kv.device)
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    return torch.cat((rows, fill)), cu


def _right_padded(B=4, Q=1, S=11, heads=4, d=8, dtype=torch.float64, device="cpu", seed=0):
    q, kv, _ = _inputs(B=B, Q=Q, S=S, heads=heads, d=d, dtype=dtype, device=device, seed=seed)
    lengths = torch.tensor([S, S // 2, 0, 1, 3, S - 1][:B])  # a full row, an empty one, [CLS] alone
    return q, kv, (torch.arange(S) < lengths[:, None]).to(device)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_cpu_varlen_equals_the_padded_form_with_gradients(p):
    heads, S = 4, 11
    q, kv, mask = _right_padded(S=S)
    packed, cu = _packed(kv, mask)
    q1, kv1 = q.clone().requires_grad_(), kv.clone().requires_grad_()
    q2, packed2 = q.clone().requires_grad_(), packed.clone().requires_grad_()
    out, lse, rng = torch.ops.bertaccel.query_rows_attention_fwd(q1, kv1, mask, heads, p, 0.3)
    torch.manual_seed(0)  # (the CPU reference draws its seed from the default generator)
    got, got_lse, got_rng = torch.ops.bertaccel.query_rows_attention_varlen_fwd(q2, packed2, cu, S, heads, p, 0.3)
    if p > 0:  # the same draw needs the same seed: rerun the padded form with the varlen form's
        torch.manual_seed(0)
        out, lse, rng = torch.ops.bertaccel.query_rows_attention_fwd(q1, kv1, mask, heads, p, 0.3)
    torch.testing.assert_close(got, out, rtol=0, atol=0)
    torch.testing.assert_close(got_lse, lse, rtol=0, atol=0)
    g = torch.randn_like(out)
    dq, dkv = torch.autograd.grad(out, (q1, kv1), g)
    dq2, dpacked = torch.autograd.grad(got, (q2, packed2), g)
    torch.testing.assert_close(dq2, dq, rtol=0, atol=0)
    torch.testing.assert_close(dpacked[:-3], dkv[mask], rtol=0, atol=0)
    assert dpacked[-3:].abs().max() == 0  # the rows past the last sequence
    assert got[2].abs().max() == 0 and dq2[2].abs().max() == 0  # the empty sequence


def test_varlen_gradcheck_and_opcheck_on_cpu():
    heads = 2
    q, kv, mask = _right_padded(B=3, Q=2, S=5, heads=heads, d=4)
    packed, cu = _packed(kv, mask, tail=2)
    q.requires_grad_(), packed.requires_grad_()
    torch.autograd.gradcheck(lambda q, kv: query_rows_attention_varlen(q, kv, cu, 5, heads), (q, packed))
    q32, kv32 = q.detach().float(), packed.detach().float()
    torch.library.opcheck(torch.ops.bertaccel.query_rows_attention_varlen_fwd.default, (q32, kv32, cu, 5, heads, 0.0, 0.5))
    out, lse, rng = torch.ops.bertaccel.query_rows_attention_varlen_fwd(q32, kv32, cu, 5, heads, 0.0, 0.5)
    torch.library.opcheck(torch.ops.bertaccel.query_rows_attention_varlen_bwd.default,
                          (torch.randn_like(out), q32, kv32, cu, out, lse, 5, heads, 0.0, 0.5, rng))


@pytest.mark.parametrize("varlen", [False, True])
def test_under_torch_compile_fullgraph(varlen):
    """Both forms trace whole (their fake kernels give the shapes) and give eager's output and gradients."""
    heads = 2
    q, kv, mask = _right_padded(B=3, Q=1, S=6, heads=heads, d=4, dtype=torch.float32)
    if varlen:
        kv, cu = _packed(kv, mask)
        fn = lambda q, kv: query_rows_attention_varlen(q, kv, cu, 6, heads)  # noqa: E731
    else:
        fn = lambda q, kv: query_rows_attention(q, kv, mask, heads)  # noqa: E731

    def loss(q, kv):
        return fn(q, kv).square().sum()

    grads = []
    for f in (loss, torch.compile(loss, backend="aot_eager", fullgraph=True)):
        qg, kvg = q.clone().requires_grad_(), kv.clone().requires_grad_()
        out = f(qg, kvg)
        grads.append((out.detach(), *torch.autograd.grad(out, (qg, kvg))))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------------------------ CUDA
def _kernel_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from bertaccel.ops import build

    assert build.load_attention(), f"the attention kernels did not build: {build.attention_reason()}"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("Q,S", [(1, 512), (1, 37), (1, 1000), (3, 200), (4, 129), (2, 1)])
def test_kernel_against_float64_within_twice_sdpas_error(dtype, d, Q, S):
    """The rows with keys against float64 and against SDPA in the same dtype (SDPA's kernels may give NaN for a row
    with no key: those rows are checked to be zeros, outputs and gradients, on their own)."""
    _kernel_or_skip()
    heads = 4
    q, kv, mask = _inputs(B=5, Q=Q, S=S, heads=heads, d=d, dtype=dtype, device="cuda", seed=d + S)
    assert query_rows_unavailable(q, kv, heads) is None
    dout = torch.randn(q.shape, device="cuda", dtype=torch.float64)
    poison()
    qk, kvk = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out = query_rows_attention(qk, kvk, mask, heads)
    dq, dkv = torch.autograd.grad(out, (qk, kvk), dout.to(dtype))
    keyed = mask.any(1)
    assert out[~keyed].abs().max() == 0 and dq[~keyed].abs().max() == 0 and dkv[~keyed].abs().max() == 0
    assert (dkv * ~mask[:, :, None]).abs().max() == 0  # masked keys: zero dK, dV
    rows = keyed.nonzero().flatten()
    q64, kv64 = q[rows].double().requires_grad_(), kv[rows].double().requires_grad_()
    ref = _sdpa(q64, kv64, mask[rows], heads)
    ref_grads = torch.autograd.grad(ref, (q64, kv64), dout[rows])
    qs, kvs = q[rows].clone().requires_grad_(), kv[rows].clone().requires_grad_()
    sdpa = _sdpa(qs, kvs, mask[rows], heads)
    sdpa_grads = torch.autograd.grad(sdpa, (qs, kvs), dout[rows].to(dtype))
    floor = 1e-3 if dtype != torch.float32 else 1e-6
    for name, ours, theirs, r in (("out", out[rows], sdpa, ref), ("dq", dq[rows], sdpa_grads[0], ref_grads[0]),
                                  ("dkv", dkv[rows], sdpa_grads[1], ref_grads[1])):
        e_ours, e_sdpa = rel_err(ours, r), rel_err(theirs, r)
        assert e_ours <= 2 * e_sdpa + floor, f"{name}: {e_ours:.2e} vs SDPA {e_sdpa:.2e}"


@pytest.mark.cuda
@pytest.mark.parametrize("Q,S", [(1, 200), (2, 200), (1, 1000)])  # the one-query kernel and the 2-4 query one
def test_kernel_dropout_mask_equals_the_reference(Q, S):
    _kernel_or_skip()
    heads, p = 12, 0.1
    q, kv, mask = _inputs(B=4, Q=Q, S=S, heads=heads, d=64, dtype=torch.float32, device="cuda")
    q.requires_grad_(), kv.requires_grad_()
    out, lse, rng = torch.ops.bertaccel.query_rows_attention_fwd(q, kv, mask, heads, p, 0.125)
    ref_out, ref_lse, _ = torch.ops.bertaccel.query_rows_attention_fwd(q.detach().cpu(), kv.detach().cpu(), mask.cpu(),
                                                                       heads, 0.0, 0.125)
    keep = query_rows_keep(4, Q, heads, S, p, int(rng[0]), int(rng[1]))
    want = _sdpa(q.detach().cpu().double(), kv.detach().cpu().double(), mask.cpu(), heads, keep.double() / (1 - p))
    torch.testing.assert_close(out.cpu().double(), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse.cpu(), ref_lse, rtol=1e-5, atol=1e-5)
    dout = torch.randn_like(out)
    got = torch.ops.bertaccel.query_rows_attention_bwd(dout, q.detach(), kv.detach(), mask, out, lse, heads, p, 0.125, rng)
    ref = torch.ops.bertaccel.query_rows_attention_bwd(dout.cpu(), q.detach().cpu(), kv.detach().cpu(), mask.cpu(),
                                                       out.cpu(), lse.cpu(), heads, p, 0.125, rng.cpu())
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-5)


def _replays_draw_new_masks(attend, q, kv):
    """`attend(q, kv)` with dropout, forward + backward captured in a CUDA graph: two replays give other outputs
    (new dropout masks), everything finite. Returns the graph's (output, dq, dkv)."""
    q.requires_grad_(), kv.requires_grad_()

    def step():
        out = attend(q, kv)
        return (out.detach(), *torch.autograd.grad(out.float().square().sum(), (q, kv)))

    graph, static = capture_graph(step)
    graph.replay()
    first = static[0].clone()
    graph.replay()
    assert not torch.equal(first, static[0])
    assert all(torch.isfinite(t).all() for t in static)
    return static


@pytest.mark.cuda
def test_cuda_graph_replays_draw_new_masks():
    _kernel_or_skip()
    heads = 12
    q, kv, mask = _inputs(B=4, Q=1, S=128, heads=heads, d=64, dtype=torch.bfloat16, device="cuda")
    _replays_draw_new_masks(lambda q, kv: query_rows_attention(q, kv, mask, heads, 0.1), q, kv)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("Q,S,p", [(1, 512, 0.0), (1, 37, 0.1), (3, 200, 0.1), (1, 1000, 0.0)])
def test_kernel_varlen_equals_the_padded_kernel_bit_for_bit(dtype, d, Q, S, p):
    """The varlen form reads the packed rows where the padded form reads the padded ones: from the same generator
    state the same output, lse and rng, dq and dK / dV (at the packed rows) bit for bit, dropout included, and zero
    dK / dV at the filler rows past the last sequence (poisoned memory beforehand)."""
    _kernel_or_skip()
    heads = 4
    q, kv, mask = _right_padded(B=6, Q=Q, S=S, heads=heads, d=d, dtype=dtype, device="cuda", seed=d + S)
    packed, cu = _packed(kv, mask, tail=5)
    assert query_rows_unavailable(q, packed, heads, max_seqlen=S) is None
    scale = d ** -0.5
    state = torch.cuda.get_rng_state()
    poison()
    got, got_lse, rng = torch.ops.bertaccel.query_rows_attention_varlen_fwd(q, packed, cu, S, heads, p, scale)
    torch.cuda.set_rng_state(state)
    ref, ref_lse, ref_rng = torch.ops.bertaccel.query_rows_attention_fwd(q, kv, mask, heads, p, scale)
    assert torch.equal(got, ref) and torch.equal(got_lse, ref_lse) and torch.equal(rng, ref_rng)
    if p > 0:
        free = torch.ops.bertaccel.query_rows_attention_varlen_fwd(q, packed, cu, S, heads, 0.0, scale)[0]
        assert not torch.equal(got, free)
    dout = torch.randn(q.shape, device="cuda", dtype=dtype)
    poison()
    dq, dpacked = torch.ops.bertaccel.query_rows_attention_varlen_bwd(dout, q, packed, cu, got, got_lse, S, heads, p,
                                                                      scale, rng)
    ref_dq, ref_dkv = torch.ops.bertaccel.query_rows_attention_bwd(dout, q, kv, mask, ref, ref_lse, heads, p, scale,
                                                                   ref_rng)
    assert torch.equal(dq, ref_dq)
    assert torch.equal(dpacked[:-5], ref_dkv[mask])
    assert dpacked[-5:].abs().max() == 0
    assert got[2].abs().max() == 0 and dq[2].abs().max() == 0 and torch.isinf(got_lse[2]).all()


@pytest.mark.cuda
def test_kernel_varlen_in_a_cuda_graph():
    _kernel_or_skip()
    heads = 12
    q, kv, mask = _right_padded(B=5, Q=1, S=128, heads=heads, d=32, dtype=torch.bfloat16, device="cuda")
    packed, cu = _packed(kv, mask)
    static = _replays_draw_new_masks(lambda q, kv: query_rows_attention_varlen(q, kv, cu, 128, heads, 0.1), q, packed)
    assert static[2][-3:].abs().max() == 0  # the filler rows' dK / dV
