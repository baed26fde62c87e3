"""The fused varlen attention (bertaccel.ops.attention, csrc/attention.cu).

CPU: the Philox draw against Random123's known answers, the CPU kernels (the reference) against
float64 attention per sequence and against autograd, the dropout mask's rate, opcheck.
CUDA: forward and every gradient against a float64 reference from the same bf16 / fp16 inputs, error
at most twice SDPA's; dropout element for element against the CPU reference's mask for the kernel's
own (seed, offset); fillers zero; strided views of one fused QKV output; CUDA graphs; compile.
"""

from __future__ import annotations

import pytest
import torch

from bertaccel.ops import attention
from bertaccel.ops.attention import dropout_keep, philox4x32, varlen_attention, varlen_attention_packed
from tests.ops.conftest import capture_graph


def _cu(lengths, fillers=0):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return cu, int(cu[-1]) + fillers


def _reference(q, k, v, cu, scale, p=0.0, rng=None, seqused=None):
    """float64 attention per sequence and head (dropout mask from `dropout_keep` for the seed and
    offset in `rng`); fillers (past cu[-1], and with `seqused` a slot's rows past it) zero. Differentiable."""
    pieces = []
    cu = cu.tolist()
    used = seqused.tolist() if seqused is not None else [cu[b + 1] - cu[b] for b in range(len(cu) - 1)]
    zeros = lambda n: q.new_zeros(n, *q.shape[1:]).double()  # noqa: E731
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b] + min(used[b], cu[b + 1] - cu[b])
        if e > s:
            qs, ks, vs = (t[s:e].double() for t in (q, k, v))
            probs = torch.softmax(torch.einsum("qhd,khd->hqk", qs, ks) * scale, -1)
            if p > 0:
                keep = torch.stack([dropout_keep(s, e - s, h, p, int(rng[0]), int(rng[1])) for h in range(q.shape[1])])
                probs = probs * keep.to(probs.device) / (1 - p)
            pieces.append(torch.einsum("hqk,khd->qhd", probs, vs))
        pieces.append(zeros(cu[b + 1] - e))
    pieces.append(zeros(q.shape[0] - cu[-1]))
    return torch.cat(pieces)


def _slots(lengths, S):
    """A right-padded [len(lengths), S] batch as slots: (cu_seqlens b * S, seqused, the real rows' mask)."""
    cu = torch.arange(0, (len(lengths) + 1) * S, S, dtype=torch.int32)
    used = torch.tensor(lengths, dtype=torch.int32)
    real = (torch.arange(S)[None, :] < used[:, None]).reshape(-1)
    return cu, used, real


# ------------------------------------------------------------------------------ CPU
def test_philox_matches_random123_known_answers():
    """The mirror's round function at Random123's ten-round answers (the kernels' dropout runs the same
    rounds, seven of them: csrc/philox.cuh)."""
    def run(counter, key):
        c = tuple(torch.tensor([x], dtype=torch.int64) for x in counter)
        return [int(w) for w in philox4x32(c, key[0] | key[1] << 32, rounds=10)]

    assert run((0, 0, 0, 0), (0, 0)) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    ones = 0xFFFFFFFF
    assert run((ones,) * 4, (ones, ones)) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    assert run((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == [
        0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_dropout_philox_draws_are_uniform_and_uncorrelated():
    """The dropouts' seven-round Philox (csrc/philox.cuh): over 2^16 consecutive counters its 16-bit draws
    fill the 16 bins of their top nibble evenly, and neither neighbouring counters' words nor a word's two
    halves correlate (chi-square and correlation bounds several standard errors wide)."""
    from bertaccel.ops.registration import DROPOUT_PHILOX_ROUNDS

    assert DROPOUT_PHILOX_ROUNDS == 7
    n = 1 << 16
    i = torch.arange(n, dtype=torch.int64)
    zero = torch.zeros_like(i)
    words = torch.stack(philox4x32((i, zero, zero + 5, zero), 0x243F6A8885A308D3))  # [4, n]
    halves = torch.cat([words & 0xFFFF, words >> 16]).double()  # [8, n] draws
    counts = torch.bincount((halves.long() >> 12).reshape(-1), minlength=16).double()
    expected = halves.numel() / 16
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 50, chi2  # 15 degrees of freedom: P(chi2 > 50) ~ 1e-5
    u = (halves - 32767.5) / 18918.6  # unit variance
    bound = 5 / n ** 0.5
    assert abs((u[0, 1:] * u[0, :-1]).mean().item()) < bound  # neighbouring counters, same word
    assert abs((u[0] * u[4]).mean().item()) < bound  # low and high half of word 0
    assert abs((u[1] * u[2]).mean().item()) < bound  # two words of one call


def test_dropout_mask_keeps_one_minus_p_and_differs_by_head_offset_and_row():
    p = 0.1
    a = dropout_keep(0, 256, 0, p, seed=1234, offset=8)
    assert abs(a.float().mean().item() - (1 - p)) < 0.01
    assert not torch.equal(a, dropout_keep(0, 256, 1, p, seed=1234, offset=8))
    assert not torch.equal(a, dropout_keep(0, 256, 0, p, seed=1234, offset=12))
    assert not torch.equal(a, dropout_keep(0, 256, 0, p, seed=1235, offset=8))
    assert not torch.equal(a[:64], a[64:128])  # distinct tiles draw distinct bits
    # the same (token, key) of a longer sequence starting at the same row draws the same bit
    assert torch.equal(a[:100, :100], dropout_keep(0, 100, 0, p, seed=1234, offset=8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernels_equal_float64_attention_with_zero_fillers(dtype):
    lengths, heads, d = [5, 1, 0, 17], 2, 32
    cu, T = _cu(lengths, fillers=3)
    q, k, v = (torch.randn(T, heads, d).to(dtype) for _ in range(3))
    out, lse, rng = torch.ops.bertaccel.varlen_attention_fwd(q, k, v, cu, 17, 0.0, 0.3)
    ref = _reference(q, k, v, cu, 0.3)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    assert not out[-3:].any() and not lse[:, -3:].any()
    s = torch.einsum("qhd,khd->hqk", q[6:23].double(), k[6:23].double()) * 0.3
    torch.testing.assert_close(lse[:, 6:23].double(), s.logsumexp(-1), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("p", [0.0, 0.25])
def test_cpu_backward_equals_autograd_of_the_reference(p):
    lengths, heads, d = [9, 1, 20], 2, 16
    cu, T = _cu(lengths, fillers=2)
    q, k, v = (torch.randn(T, heads, d, dtype=torch.float32) for _ in range(3))
    out, lse, rng = torch.ops.bertaccel.varlen_attention_fwd(q, k, v, cu, 20, p, 0.25)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = _reference(*leaves, cu, 0.25, p, rng)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    dout = torch.randn(T, heads, d)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    grads = torch.ops.bertaccel.varlen_attention_bwd(dout, q, k, v, out, lse, cu, 20, p, 0.25, rng)
    for name, g, r in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(g.double(), r, atol=1e-5, rtol=1e-4, msg=f"d{name}")
        assert not g[-2:].any(), f"d{name} of the fillers"
    # and through autograd of the public function (the seed is redrawn: compare p = 0 only)
    if p == 0:
        qs = [t.clone().requires_grad_() for t in (q, k, v)]
        grads2 = torch.autograd.grad(varlen_attention(*qs, cu, 20, 0.0, 0.25), qs, dout)
        for g, r in zip(grads2, ref_grads):
            torch.testing.assert_close(g.double(), r, atol=1e-5, rtol=1e-4)


def test_opcheck_on_cpu():
    cu, T = _cu([3, 6], fillers=1)
    q, k, v = (torch.randn(T, 2, 16, requires_grad=True) for _ in range(3))
    torch.library.opcheck(torch.ops.bertaccel.varlen_attention_fwd.default, (q, k, v, cu, 6, 0.0, 0.25))
    out, lse, rng = torch.ops.bertaccel.varlen_attention_fwd(q, k, v, cu, 6, 0.0, 0.25)
    torch.library.opcheck(torch.ops.bertaccel.varlen_attention_bwd.default,
                          (torch.randn(T, 2, 16), q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), cu, 6, 0.0,
                           0.25, rng))


def test_packed_qkv_equals_its_parts_and_opchecks_on_cpu():
    """The packed pair (qkv [T, 3, heads, d] in, its gradient as one tensor out) is the separate op on
    the three parts: the same output, and the gradient the three gradients stacked."""
    cu, T = _cu([3, 6, 1], fillers=2)
    qkv = torch.randn(T, 3, 2, 16, requires_grad=True)
    parts = [t.detach().clone().requires_grad_() for t in qkv.unbind(1)]
    dout = torch.randn(T, 2, 16)
    torch.manual_seed(3)
    out = varlen_attention_packed(qkv, cu, 6, 0.3, 0.25)
    torch.manual_seed(3)  # the same dropout seed
    out2 = varlen_attention(*parts, cu, 6, 0.3, 0.25)
    assert torch.equal(out, out2)
    (grad,) = torch.autograd.grad(out, qkv, dout)
    assert torch.equal(grad, torch.stack(torch.autograd.grad(out2, parts, dout), 1))
    assert not grad[int(cu[-1]):].any()
    torch.library.opcheck(torch.ops.bertaccel.varlen_attention_packed_fwd.default, (qkv, cu, 6, 0.0, 0.25))
    o, lse, rng = torch.ops.bertaccel.varlen_attention_packed_fwd(qkv, cu, 6, 0.0, 0.25)
    torch.library.opcheck(torch.ops.bertaccel.varlen_attention_packed_bwd.default,
                          (dout, qkv.detach(), o.detach(), lse.detach(), cu, 6, 0.0, 0.25, rng))
    with pytest.raises(ValueError, match=r"\[tokens, 3, heads, head_dim\]"):
        varlen_attention_packed(qkv[:, :2], cu, 6)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_seqused_reads_the_first_rows_of_each_slot_on_cpu(p):
    """With seqused the op reads a right-padded batch in place: its real rows' outputs and gradients are the
    float64 reference's per sequence (the dropout mask drawn by token row, as the kernels draw it), every other
    row of a slot is zero; opcheck with seqused; a negative seqused (the interface's mark of a mask that is not
    right-padded) is refused with the reason."""
    lengths, S = [5, 0, 8, 1], 8
    cu, used, real = _slots(lengths, S)
    T = cu[-1].item()
    q, k, v = (torch.randn(T, 2, 16, dtype=torch.float32, requires_grad=True) for _ in range(3))
    dout = torch.randn(T, 2, 16)
    torch.manual_seed(5)
    out, lse, rng = torch.ops.bertaccel.varlen_attention_fwd(q, k, v, cu, S, p, 0.25, used)
    ref = _reference(q, k, v, cu, 0.25, p, rng, seqused=used)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-4)
    assert not out[~real].any() and not lse[:, ~real].any()
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout.double())
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r.double(), atol=1e-5, rtol=1e-4)
        assert not g[~real].any()
    args = (q.detach(), k.detach(), v.detach(), cu, S, 0.0, 0.25, used)
    torch.library.opcheck(torch.ops.bertaccel.varlen_attention_fwd.default, args)
    o, lse, rng = torch.ops.bertaccel.varlen_attention_fwd(*args)
    torch.library.opcheck(torch.ops.bertaccel.varlen_attention_bwd.default,
                          (dout, *args[:3], o, lse, cu, S, 0.0, 0.25, rng, used))
    qkv = torch.stack(args[:3], 1)
    torch.library.opcheck(torch.ops.bertaccel.varlen_attention_packed_fwd.default, (qkv, cu, S, 0.0, 0.25, used))
    torch.testing.assert_close(varlen_attention_packed(qkv, cu, S, 0.0, 0.25, used), o)
    with pytest.raises(ValueError, match="not right-padded"):
        varlen_attention(*args[:3], cu, S, 0.0, 0.25, torch.tensor([5, -1, 8, 1], dtype=torch.int32))


def test_kernel_unavailable_says_why():
    q = torch.randn(4, 2, 32)
    assert attention.kernel_unavailable(q, q, q) == "not a CUDA tensor"


def test_bad_dropout_probability_is_refused():
    cu, T = _cu([3])
    q = torch.randn(T, 1, 16)
    with pytest.raises(ValueError, match="dropout probability"):
        varlen_attention(q, q, q, cu, 3, dropout_p=1.0)


# ------------------------------------------------------------------------------ CUDA
def _kernel_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from bertaccel.ops import build

    assert build.load_attention(), f"the attention kernels did not build: {build.attention_reason()}"


def _sdpa(q, k, v, cu, scale):
    """PyTorch's SDPA per sequence (its own dtype): the error bar."""
    out = torch.zeros_like(q)
    c = cu.tolist()
    for b in range(len(c) - 1):
        s, e = c[b], c[b + 1]
        if e > s:
            o = torch.nn.functional.scaled_dot_product_attention(*(t[s:e].transpose(0, 1)[None] for t in (q, k, v)),
                                                                scale=scale)
            out[s:e] = o[0].transpose(0, 1)
    return out


def _err(a, ref, real):
    return (a[:real].double() - ref[:real]).abs().max().item()


def _forward_kernel(name, monkeypatch):
    """`hopper`: the default kernels where the GPU is a Hopper (warpgroup MMAs); `wg1` / `wg2`: that
    forward with 64 / 128 queries per CTA; `n128`: with 128 keys per block (head dims 32, 64); `bulk`: the default forward, and the Hopper backward adding
    dQ to an fp32 buffer (its path past 2 key blocks) at every length; `mma`: the mma.sync forward and
    backward, the default elsewhere (BERTACCEL_ATTENTION_FWD / _BWD)."""
    if name != "mma" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warpgroup-MMA forward needs a Hopper GPU (sm_90)")
    if name == "bulk":
        monkeypatch.setenv("BERTACCEL_ATTENTION_BWD", name)
    elif name != "hopper":
        monkeypatch.setenv("BERTACCEL_ATTENTION_FWD", name)
    if name == "mma":  # the mma.sync backward too (the Hopper one takes head dims 32 and 64)
        monkeypatch.setenv("BERTACCEL_ATTENTION_BWD", "mma")


@pytest.mark.cuda
@pytest.mark.parametrize("fwd", ["hopper", "wg2", "n128", "bulk", "mma"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("lengths", [[77, 1, 0, 128, 33], [513, 64, 65, 3], [200, 129, 257]])
def test_forward_and_gradients_within_twice_sdpa_error(dtype, head_dim, lengths, fwd, monkeypatch):
    _kernel_or_skip()
    _forward_kernel(fwd, monkeypatch)
    from tests.ops.conftest import poison

    heads = 3
    cu, T = _cu(lengths, fillers=5)
    real = int(cu[-1])
    cu = cu.cuda()
    g = torch.Generator(device="cuda").manual_seed(head_dim + len(lengths))
    q, k, v, dout = (torch.randn(T, heads, head_dim, device="cuda", generator=g).to(dtype) for _ in range(4))
    scale = head_dim ** -0.5
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = _reference(*leaves, cu.cpu(), scale)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    sq = [t.clone().requires_grad_() for t in (q, k, v)]
    sdpa = _sdpa(*sq, cu, scale)
    sdpa_grads = torch.autograd.grad(sdpa, sq, dout)
    poison()
    ours_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ours = varlen_attention(*ours_in, cu, max(lengths), 0.0, scale)
    grads = torch.autograd.grad(ours, ours_in, dout)
    assert _err(ours, ref, real) <= 2 * _err(sdpa, ref, real) + 1e-3
    for name, a, b, r in zip("qkv", grads, sdpa_grads, ref_grads):
        assert _err(a, r, real) <= 2 * _err(b, r, real) + 1e-3, f"d{name}: {_err(a, r, real)} vs {_err(b, r, real)}"
        assert torch.isfinite(a).all() and not a[real:].any(), f"d{name} of the fillers"
    assert not ours[real:].any()


@pytest.mark.cuda
@pytest.mark.parametrize("fwd", ["hopper", "bulk", "mma"])
@pytest.mark.parametrize("packed", [False, True])
def test_many_fillers_are_zero_in_every_output(fwd, packed, monkeypatch):
    """More filler rows than the fillers' grid slice has warps (each warp zeroes rows in a strided loop; the
    packed call's gradient rows have a token stride of 3 x heads x d), on NaN-poisoned memory: the output,
    its lse-dependent gradients and every gradient are zero on the fillers, the real rows right."""
    _kernel_or_skip()
    _forward_kernel(fwd, monkeypatch)
    from tests.ops.conftest import poison

    heads, d, lengths = 12, 64, [100, 28, 61]
    cu, T = _cu(lengths, fillers=700)
    real = int(cu[-1])
    cu = cu.cuda()
    g = torch.Generator(device="cuda").manual_seed(7)
    qkv, dout = (torch.randn(T, n, heads, d, device="cuda", generator=g).to(torch.bfloat16) for n in (3, 1))
    dout = dout[:, 0]
    scale = d ** -0.5
    leaves = [t.double().requires_grad_() for t in qkv.unbind(1)]
    ref = _reference(*leaves, cu.cpu(), scale)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    sq = [t.clone().requires_grad_() for t in qkv.unbind(1)]
    sdpa = _sdpa(*sq, cu, scale)
    sdpa_grads = torch.autograd.grad(sdpa, sq, dout)
    poison()
    if packed:
        x = qkv.clone().requires_grad_()
        out = varlen_attention_packed(x, cu, max(lengths), 0.0, scale)
        grads = torch.autograd.grad(out, x, dout)[0].unbind(1)
    else:
        xs = [t.clone().requires_grad_() for t in qkv.unbind(1)]
        out = varlen_attention(*xs, cu, max(lengths), 0.0, scale)
        grads = torch.autograd.grad(out, xs, dout)
    assert torch.isfinite(out).all() and not out[real:].any(), "output of the fillers"
    assert _err(out, ref, real) <= 2 * _err(sdpa, ref, real) + 1e-3
    for name, a, b, r in zip("qkv", grads, sdpa_grads, ref_grads):
        assert torch.isfinite(a).all() and not a[real:].any(), f"d{name} of the fillers"
        assert _err(a, r, real) <= 2 * _err(b, r, real) + 1e-3, f"d{name}: {_err(a, r, real)} vs {_err(b, r, real)}"


@pytest.mark.cuda
@pytest.mark.parametrize("fwd", ["hopper", "wg2", "n128", "bulk", "mma"])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("S", [128, 200])  # 2 key blocks (the Hopper backward's clusters); 4, the last partial
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_seqused_slots_on_the_gpu(fwd, head_dim, S, p, monkeypatch):
    """A right-padded batch read in place (slots of S rows, seqused the lengths: empty, 1, partial blocks, full)
    on NaN-poisoned memory: without dropout the output and every gradient within twice SDPA's error of float64
    on the real rows; with dropout the reference's mask for the kernel's seed (drawn by token row); the slots'
    other rows zero in the output, lse and every gradient, the padding rows' inputs (random) unread."""
    _kernel_or_skip()
    _forward_kernel(fwd, monkeypatch)
    from tests.ops.conftest import poison

    lengths = [S, 0, 1, 65, S - 3, 64]
    cu, used, real = _slots(lengths, S)
    T, heads = int(cu[-1]), 3
    g = torch.Generator(device="cuda").manual_seed(head_dim + S)
    q, k, v, dout = (torch.randn(T, heads, head_dim, device="cuda", generator=g).bfloat16() for _ in range(4))
    scale = head_dim ** -0.5
    poison()
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(3)
    out, lse, rng = torch.ops.bertaccel.varlen_attention_fwd(*xs, cu.cuda(), S, p, scale, used.cuda())
    grads = torch.autograd.grad(out, xs, dout)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = _reference(*leaves, cu, scale, p, rng.cpu(), seqused=used)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    mask = real.cuda()
    assert not out[~mask].any() and not lse[:, ~mask].any(), "output / lse of the slots' padding rows"
    for name, a in zip("qkv", grads):
        assert torch.isfinite(a).all() and not a[~mask].any(), f"d{name} of the slots' padding rows"
    if p > 0:
        assert _err(out[mask], ref[real], int(real.sum())) < 0.05
        for name, a, r in zip("qkv", grads, ref_grads):
            assert _err(a[mask], r[real], int(real.sum())) < 0.05 * max(1.0, r.abs().max().item()), name
        return
    # SDPA on the same sequences, packed (its error is the bar)
    packed_cu, _ = _cu(lengths)
    sq = [t[mask].clone().requires_grad_() for t in (q, k, v)]
    sdpa = _sdpa(*sq, packed_cu.cuda(), scale)
    sdpa_grads = torch.autograd.grad(sdpa, sq, dout[mask])
    n = int(real.sum())
    assert _err(out[mask], ref[real], n) <= 2 * _err(sdpa, ref[real], n) + 1e-3
    for name, a, b, r in zip("qkv", grads, sdpa_grads, ref_grads):
        assert _err(a[mask], r[real], n) <= 2 * _err(b, r[real], n) + 1e-3, name


@pytest.mark.cuda
@pytest.mark.parametrize("fwd", ["hopper", "wg2", "n128", "bulk", "mma"])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("longest", [130, 128])  # 3 key blocks; 2 (the Hopper backward's cluster path)
def test_dropout_is_the_reference_mask_for_the_kernels_seed(head_dim, fwd, longest, monkeypatch):
    """The GPU's dropout equals the CPU reference's mask for the (seed, offset) the kernel reports:
    output and gradients, against float64 attention with that mask."""
    _kernel_or_skip()
    _forward_kernel(fwd, monkeypatch)
    lengths, heads, p = [longest, 17, 1, 64], 2, 0.2
    cu, T = _cu(lengths, fillers=3)
    real = int(cu[-1])
    q, k, v, dout = (torch.randn(T, heads, head_dim, device="cuda").bfloat16() for _ in range(4))
    scale = head_dim ** -0.5
    torch.manual_seed(7)
    out, lse, rng = torch.ops.bertaccel.varlen_attention_fwd(q, k, v, cu.cuda(), longest, p, scale)
    rng = rng.cpu()
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = _reference(*leaves, cu, scale, p, rng)
    plain = _reference(*leaves, cu, scale)
    assert _err(out, ref, real) < 0.05 < _err(out, plain, real)  # the mask matters, and it is this one
    grads = torch.ops.bertaccel.varlen_attention_bwd(dout, q, k, v, out, lse, cu.cuda(), longest, p, scale, rng.cuda())
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    for name, a, r in zip("qkv", grads, ref_grads):
        assert _err(a, r, real) < 0.05 * max(1.0, r.abs().max().item()), name
    torch.manual_seed(7)
    again = torch.ops.bertaccel.varlen_attention_fwd(q, k, v, cu.cuda(), longest, p, scale)
    assert torch.equal(out, again[0]) and torch.equal(rng, again[2].cpu())
    assert not torch.equal(out, torch.ops.bertaccel.varlen_attention_fwd(q, k, v, cu.cuda(), longest, p, scale)[0])


@pytest.mark.cuda
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_hopper_forward_equals_the_mma_forward(p, monkeypatch):
    """Both forwards draw the same dropout mask and round alike: outputs within a few bf16 ulps, lse
    within fp32 rounding, for the same (seed, offset)."""
    _kernel_or_skip()
    _forward_kernel("hopper", monkeypatch)
    lengths, heads, d = [300, 1, 64, 129, 0, 77], 3, 64
    cu, T = _cu(lengths, fillers=4)
    q, k, v = (torch.randn(T, heads, d, device="cuda").bfloat16() for _ in range(3))
    torch.manual_seed(3)
    out, lse, rng = torch.ops.bertaccel.varlen_attention_fwd(q, k, v, cu.cuda(), 300, p, d ** -0.5)
    monkeypatch.setenv("BERTACCEL_ATTENTION_FWD", "mma")
    torch.manual_seed(3)
    out2, lse2, rng2 = torch.ops.bertaccel.varlen_attention_fwd(q, k, v, cu.cuda(), 300, p, d ** -0.5)
    assert torch.equal(rng, rng2)
    torch.testing.assert_close(out.float(), out2.float(), atol=2e-2, rtol=2e-2)
    assert (lse - lse2).abs().max().item() <= 1e-4
    assert not out[int(cu[-1]):].any() and not lse[:, int(cu[-1]):].any()


@pytest.mark.cuda
def test_strided_views_of_one_qkv_output():
    """q, k, v as views of one [T, 3 * heads * d] projection output (token stride 3 * heads * d)."""
    _kernel_or_skip()
    lengths, heads, d = [50, 90], 4, 64
    cu, T = _cu(lengths)
    qkv = torch.randn(T, 3 * heads * d, device="cuda").bfloat16().requires_grad_()
    q, k, v = (t.view(T, heads, d) for t in qkv.split(heads * d, dim=1))
    assert attention.kernel_unavailable(q, k, v) is None and q.stride(0) == 3 * heads * d
    out = varlen_attention(q, k, v, cu.cuda(), 90)
    (grad,) = torch.autograd.grad(out.float().square().sum(), qkv)
    c = [t.contiguous().detach().requires_grad_() for t in (q, k, v)]
    out2 = varlen_attention(*c, cu.cuda(), 90)
    grads2 = torch.autograd.grad(out2.float().square().sum(), c)
    assert torch.equal(out, out2)
    assert torch.equal(grad, torch.cat([g.reshape(T, -1) for g in grads2], 1))


@pytest.mark.cuda
@pytest.mark.parametrize("fwd", ["hopper", "bulk", "mma"])
@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("lengths", [[50, 90], [300, 5, 0, 130, 64]])
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_packed_qkv_gradient_is_the_parts_gradients_written_in_place(fwd, head_dim, lengths, p, monkeypatch):
    """varlen_attention_packed on qkv [T, 3, heads, d]: the output of the separate op on the three parts,
    and its one [T, 3, heads, d] gradient theirs (dq, dk, dv written with token stride 3 x heads x d by
    every backward: the Hopper one direct from its clusters (<= 2 key blocks) or through the fp32 buffer,
    the mma.sync one); fillers zero."""
    _kernel_or_skip()
    _forward_kernel(fwd, monkeypatch)
    heads = 3
    cu, T = _cu(lengths, fillers=3)
    cu = cu.cuda()
    qkv = torch.randn(T, 3, heads, head_dim, device="cuda").bfloat16().requires_grad_()
    parts = [t.detach().clone().requires_grad_() for t in qkv.unbind(1)]
    dout = torch.randn(T, heads, head_dim, device="cuda").bfloat16()
    assert attention.kernel_unavailable(*qkv.unbind(1)) is None
    torch.cuda.manual_seed(7)
    out = varlen_attention_packed(qkv, cu, max(lengths), p)
    torch.cuda.manual_seed(7)  # the same dropout seed and offset
    out2 = varlen_attention(*parts, cu, max(lengths), p)
    assert torch.equal(out, out2)
    (grad,) = torch.autograd.grad(out, qkv, dout)
    grads2 = torch.autograd.grad(out2, parts, dout)
    assert grad.shape == qkv.shape and grad.is_contiguous()
    for i, name in enumerate("qkv"):
        # dk, dv: one CTA's sums, the same bits; dq: fp32 partial sums added in an order that may differ
        if name == "q":
            torch.testing.assert_close(grad[:, i], grads2[i], atol=2e-2, rtol=2e-2, msg=f"d{name}")
        else:
            assert torch.equal(grad[:, i], grads2[i]), f"d{name}"
        assert not grad[int(cu[-1]):, i].any(), f"d{name} of the fillers"


@pytest.mark.cuda
def test_cuda_graph_replays_draw_new_masks_and_match_eager():
    _kernel_or_skip()
    lengths, heads, d = [100, 28], 2, 32
    cu, T = _cu(lengths, fillers=4)
    cu = cu.cuda()
    q, k, v = (torch.randn(T, heads, d, device="cuda").bfloat16().requires_grad_() for _ in range(3))

    def step(p):
        out = varlen_attention(q, k, v, cu, 100, p)
        # detached: a live autograd graph from an eager call would tie q's AccumulateGrad node to the
        # default stream, which a capture cannot depend on
        return (out.detach(), *torch.autograd.grad(out.float().square().sum(), (q, k, v)))

    eager = step(0.0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(0.0), step(0.1)
    torch.cuda.current_stream().wait_stream(s)
    graph, graph_drop = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step(0.0)
    with torch.cuda.graph(graph_drop):
        static_drop = step(0.1)
    graph.replay()
    for a, b in zip(static, eager):
        assert torch.equal(a, b)
    graph_drop.replay()
    first = static_drop[0].clone()
    graph_drop.replay()
    assert not torch.equal(first, static_drop[0])  # each replay draws a new mask
    assert all(torch.isfinite(t).all() for t in static_drop)


@pytest.mark.cuda
@pytest.mark.parametrize("bwd", ["", "bulk"])
def test_backward_replays_with_new_inputs(bwd, monkeypatch):
    """The backward captured once and replayed on new inputs equals eager calls on them: the fp32 dQ
    buffer is cleared on every call (a stale sum would carry the first replay's dq along), packed
    sequences of 1 to 5 key blocks, an empty one; on a Hopper also with the buffer at every length."""
    _kernel_or_skip()
    if bwd and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warpgroup-MMA backward needs a Hopper GPU (sm_90)")
    monkeypatch.setenv("BERTACCEL_ATTENTION_BWD", bwd)
    lengths, heads, d = [300, 5, 0, 130, 64], 2, 64
    cu, T = _cu(lengths, fillers=3)
    cu = cu.cuda()
    q, k, v = (torch.randn(T, heads, d, device="cuda").bfloat16().requires_grad_() for _ in range(3))
    dout = torch.randn(T, heads, d, device="cuda").bfloat16()

    def step():
        return torch.autograd.grad(varlen_attention(q, k, v, cu, max(lengths)), (q, k, v), dout)

    graph, static = capture_graph(step)
    for _ in range(3):
        with torch.no_grad():
            for t in (q, k, v):
                t.copy_(torch.randn_like(t, dtype=torch.float32))
        graph.replay()
        eager = step()
        for name, a, b in zip("qkv", static, eager):
            # the same kernels; the fp32 sums' order differs between calls (one bf16 rounding step apart)
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2, msg=f"d{name}")
            assert not a[int(cu[-1]):].any(), f"d{name} of the fillers"


@pytest.mark.cuda
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_a_batch_of_fillers_only_gives_zeros_and_a_zero_state(p):
    """No sequence (cu_seqlens [0]) but filler rows: zero output and gradients, and the dropout state (seed,
    offset) zeros - no kernel block writes it then, so the host allocates it zeroed (elsewhere unfilled)."""
    _kernel_or_skip()
    cu = torch.zeros(1, dtype=torch.int32, device="cuda")
    q, k, v, dout = (torch.randn(5, 2, 64, device="cuda").bfloat16() for _ in range(4))
    out, lse, rng = torch.ops.bertaccel.varlen_attention_fwd(q, k, v, cu, 0, p, 0.125)
    assert not out.any() and not rng.any()
    grads = torch.ops.bertaccel.varlen_attention_bwd(dout, q, k, v, out, lse, cu, 0, p, 0.125, rng)
    assert not any(g.any() for g in grads)


@pytest.mark.cuda
def test_compile_fullgraph_and_opcheck_on_cuda():
    _kernel_or_skip()
    cu, T = _cu([40, 9], fillers=2)
    cu = cu.cuda()
    q, k, v = (torch.randn(T, 2, 64, device="cuda").bfloat16().requires_grad_() for _ in range(3))
    fn = torch.compile(lambda a, b, c: varlen_attention(a, b, c, cu, 40), fullgraph=True)
    out = fn(q, k, v)
    assert torch.equal(out, varlen_attention(q, k, v, cu, 40))
    torch.library.opcheck(torch.ops.bertaccel.varlen_attention_fwd.default, (q, k, v, cu, 40, 0.0, 0.125))
    qkv = torch.stack([q, k, v], 1).detach().requires_grad_()
    packed = torch.compile(lambda t: varlen_attention_packed(t, cu, 40), fullgraph=True)
    assert torch.equal(packed(qkv), varlen_attention(q, k, v, cu, 40))
    torch.library.opcheck(torch.ops.bertaccel.varlen_attention_packed_fwd.default, (qkv, cu, 40, 0.0, 0.125))
    o, lse, rng = torch.ops.bertaccel.varlen_attention_packed_fwd(qkv, cu, 40, 0.0, 0.125)
    torch.library.opcheck(torch.ops.bertaccel.varlen_attention_packed_bwd.default,
                          (torch.randn_like(o), qkv.detach(), o, lse, cu, 40, 0.0, 0.125, rng))


def test_attention_build_targets_sm90a_on_hopper_only(monkeypatch):
    """The attention extension is built for sm_90a (its wgmma kernels, with their define) on a Hopper,
    for the GPU's own arch elsewhere, and as TORCH_CUDA_ARCH_LIST says when it is set; every header
    its sources include is hashed into the build key."""
    import re

    from bertaccel.ops import build

    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert build._attention_arch() == "9.0a"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert build._attention_arch() == "8.0"
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert build._attention_arch() == "9.0"
    included = {name for src in build.attention_sources()
                for name in re.findall(r'#include "([^"]+)"', (build.CSRC / src).read_text())}
    assert included <= set(build.included_headers(build.attention_sources()))
    assert build.ATTENTION_SM90A_FLAGS == ["-DBERTACCEL_ATTENTION_SM90A"]
