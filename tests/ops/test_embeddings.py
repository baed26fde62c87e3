"""Tests of the fused embeddings (embeddings.py): CPU tests (opcheck, autograd formulas, fallback) run everywhere; `cuda` tests check
the kernels against float64 references on the GPU (see conftest.py)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.nn.functional as F

import bertaccel.ops.swap  # noqa: F401 - imports every op family
from tests.conftest import run_in_child
from tests.ops.conftest import DTYPES, check, cuda_test, leaves, poison, rand


def test_embedding_backward_matches_autograd_and_skips_the_padding_row():
    H, V = 24, 30
    ids = torch.randint(0, V, (4, 7))
    ids[0, :3] = 1  # padding id 1
    pos = torch.arange(7).expand(4, 7).contiguous()
    tt = torch.randint(0, 2, (4, 7))
    base = [rand(V, H), rand(7, H), rand(2, H), rand(H), rand(H)]
    a = [t.clone().requires_grad_(True) for t in base]
    r = [t.clone().requires_grad_(True) for t in base]
    y = torch.ops.bertaccel.embedding_layer_norm_fwd(ids, pos, tt, *a, 0.0, 1e-12, False, 1)[0]
    h = F.embedding(ids, r[0], padding_idx=1) + F.embedding(tt, r[2]) + F.embedding(pos, r[1])
    yr = F.layer_norm(h, (H,), r[3], r[4], 1e-12)
    torch.testing.assert_close(y, yr)
    dy = rand(4, 7, H)
    for g, gr in zip(torch.autograd.grad(y, a, dy), torch.autograd.grad(yr, r, dy)):
        torch.testing.assert_close(g, gr, rtol=1e-4, atol=1e-5)
    assert torch.all(torch.autograd.grad(torch.ops.bertaccel.embedding_layer_norm_fwd(
        ids, pos, tt, *a, 0.0, 1e-12, False, 1)[0], a[0], dy)[0][1] == 0)


@cuda_test
@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [128, 384, 768, 1000])
def test_embeddings(hidden, out_dtype):
    V, P, T, B, S = 1000, 512, 2, 8, 128
    g = torch.Generator(device="cuda").manual_seed(4)
    ids = torch.randint(0, V, (B, S), device="cuda", generator=g)
    ids[0, -5:] = 0  # padding ids: the padding row gets no gradient
    pos = torch.arange(S, device="cuda").expand(B, S).contiguous()
    tt = torch.randint(0, T, (B, S), device="cuda", generator=g)
    tables = [torch.randn(n, hidden, device="cuda") for n in (V, P, T)]
    w, b = torch.randn(hidden, device="cuda"), torch.randn(hidden, device="cuda")
    dy = torch.randn(B, S, hidden, device="cuda")

    def hf_like(word, position, token_type, w, b):
        word = word.clone()
        h = F.embedding(ids, word, padding_idx=0) + F.embedding(tt, token_type) + F.embedding(pos, position)
        return F.layer_norm(h, (hidden,), w, b, 1e-12)

    ref_in = leaves(*(t.double() for t in tables), w.double(), b.double())
    ref = hf_like(*ref_in)
    ref_g = torch.autograd.grad(ref, ref_in, dy.double())
    th_in = leaves(*(t.to(out_dtype) for t in (*tables, w, b)))  # PyTorch in the output dtype
    th = hf_like(*th_in)
    th_g = torch.autograd.grad(th, th_in, dy.to(out_dtype))
    poison()
    our_in = leaves(*tables, w, b)
    ours = torch.ops.bertaccel.embedding_layer_norm(ids, pos, tt, *our_in, 0.0, 1e-12, out_dtype == torch.bfloat16, 0)
    our_g = torch.autograd.grad(ours, our_in, dy.to(out_dtype))
    assert ours.dtype == out_dtype
    check(ours, th, ref, out_dtype, "y")
    for name, a, t, r in zip(("dword", "dposition", "dtoken_type", "dweight", "dbias"), our_g, th_g, ref_g):
        check(a, t, r, out_dtype, name)
    assert torch.all(our_g[0][0] == 0), "padding row got a gradient"


@cuda_test
def test_embeddings_dropout_is_consistent():
    V, H, B, S, p = 500, 768, 16, 128, 0.1
    ids = torch.randint(0, V, (B, S), device="cuda")
    pos = torch.arange(S, device="cuda").expand(B, S).contiguous()
    tt = torch.zeros_like(ids)
    tables = leaves(torch.randn(V, H, device="cuda"), torch.randn(S, H, device="cuda"), torch.randn(2, H, device="cuda"))
    w, b = leaves(torch.ones(H, device="cuda"), torch.zeros(H, device="cuda"))
    y = torch.ops.bertaccel.embedding_layer_norm(ids, pos, tt, *tables, w, b, p, 1e-12, True, -1)
    y0 = torch.ops.bertaccel.embedding_layer_norm(ids, pos, tt, *tables, w, b, 0.0, 1e-12, True, -1)
    dropped = y == 0
    assert abs(dropped.float().mean().item() - p) < 0.005
    torch.testing.assert_close(y[~dropped].float(), y0[~dropped].float() / (1 - p), atol=2e-2, rtol=1e-2)
    # d(ln bias) = sum of the gradient over kept elements / (1 - p): the backward used the same mask. Where the
    # undropped output is itself 0, y == 0 cannot tell kept from dropped: no gradient there.
    dy = torch.randn_like(y).masked_fill(y0 == 0, 0.0)
    db = torch.autograd.grad(y, b, dy)[0]
    expect = (dy.float() * (~dropped).float() / (1 - p)).sum((0, 1))
    torch.testing.assert_close(db, expect, atol=1e-1, rtol=1e-2)


def _tables_case(device, tokens_shape, H, V, P, T, dtype, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(0, V, tokens_shape, device=device, generator=g)
    ids.view(-1)[: ids.numel() // 4] = 3  # a long run of one word id: summed in registers first
    ids.view(-1)[-5:] = 0  # padding id 0
    pos = torch.randint(0, P, tokens_shape, device=device, generator=g)  # any positions, not only arange
    tt = torch.randint(0, T, tokens_shape, device=device, generator=g)
    tt.view(-1)[: ids.numel() // 2] = 1
    dz = torch.randn(*tokens_shape, H, device=device, generator=g).to(dtype)
    return dz, ids, pos, tt


@cuda_test
def test_an_unknown_scatter_order_is_refused_and_the_token_order_gives_the_same_gradients():
    """BERTACCEL_EMB_SCATTER (read once per process: child processes) takes `positions` (the default) or `tokens`
    (consecutive tokens a block, before session 78); both give the sums of the same rows."""
    code = ("import torch, bertaccel.ops.swap; from bertaccel.ops import build; assert build.load()\n"
            "from tests.ops.test_embeddings import _tables_case\n"
            "dz, ids, pos, tt = _tables_case('cuda', (32, 64), 768, 1000, 512, 3, torch.bfloat16)\n"
            "pos = torch.arange(64, device='cuda').expand(32, 64).contiguous()\n"
            "try:\n    g = torch.ops.bertaccel.embedding_tables_bwd(dz, ids, pos, tt, 1000, 512, 3, 0)\n"
            "    torch.save([t.cpu() for t in g], 'OUT')\n    print('ran')\n"
            "except RuntimeError as e:\n    print('refused:', e)\n")
    r = run_in_child(code, {"BERTACCEL_EMB_SCATTER": "rows"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "BERTACCEL_EMB_SCATTER=rows is not a scatter order" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    with tempfile.TemporaryDirectory() as d:
        grads = {}
        for order in ("tokens", "positions"):
            path = os.path.join(d, f"{order}.pt")
            r = run_in_child(code.replace("'OUT'", repr(path)), {"BERTACCEL_EMB_SCATTER": order})
            assert r.returncode == 0 and "ran" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
            grads[order] = torch.load(path)
    for a, b in zip(grads["tokens"], grads["positions"]):  # fp32 atomics in another order: the last bits may differ
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_embedding_tables_bwd_opcheck_cpu():
    dz, ids, pos, tt = _tables_case("cpu", (3, 11), 12, 20, 16, 3, torch.float32)
    torch.library.opcheck(torch.ops.bertaccel.embedding_tables_bwd.default, (dz, ids, pos, tt, 20, 16, 3, 0))


@cuda_test
@pytest.mark.parametrize("positions", ["random", "arange"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [((32, 256), 384), ((5, 77), 37), ((2, 513), 770), ((1, 1), 8), ((17, 33), 768),
                                   ((9, 40), 1024), ((300,), 384)], ids=str)
def test_embedding_tables_bwd_matches_the_sorted_backward(shape, dtype, positions):
    """The atomic scatter against nn.Embedding's backward from the same (rounded) dz in fp64; padding
    row zero; under deterministic algorithms it is PyTorch's sorted backward, bit for bit. Batches of 8 or more
    sequences are scattered a position of 16 sequences a block (17: a block of one sequence; 9: blocks of nine), fewer
    and flat ids by consecutive tokens; `arange` positions (a padded batch's) merge into one atomic a block."""
    tokens_shape, H = shape
    V, P, T = 1000, 512, 3
    dz, ids, pos, tt = _tables_case("cuda", tokens_shape, H, V, P, T, dtype)
    if positions == "arange":
        pos = torch.arange(tokens_shape[-1], device="cuda").expand(tokens_shape).contiguous()
    got = torch.ops.bertaccel.embedding_tables_bwd(dz, ids, pos, tt, V, P, T, 0)
    dz64 = dz.double().reshape(-1, H)
    want = [torch.ops.aten.embedding_dense_backward(dz64, i.reshape(-1), n, pad, False)
            for i, n, pad in ((ids, V, 0), (pos, P, -1), (tt, T, -1))]
    torch_fp32 = [torch.ops.aten.embedding_dense_backward(dz.float().reshape(-1, H), i.reshape(-1), n, pad, False)
                  for i, n, pad in ((ids, V, 0), (pos, P, -1), (tt, T, -1))]
    for name, a, r, t in zip(("word", "position", "token_type"), got, want, torch_fp32):
        assert a.dtype == torch.float32 and a.shape == r.shape, name
        err, ref_err = (a.double() - r).abs().max().item(), (t.double() - r).abs().max().item()
        assert err <= 2 * ref_err + 1e-6 * r.abs().max().item(), f"{name}: {err} vs PyTorch's {ref_err}"
    assert torch.all(got[0][0] == 0), "padding row got a gradient"
    torch.use_deterministic_algorithms(True)
    try:  # (PyTorch's own backward also takes another path in this mode: compare within it)
        det = torch.ops.bertaccel.embedding_tables_bwd(dz, ids, pos, tt, V, P, T, 0)
        sorted_ = [torch.ops.aten.embedding_dense_backward(dz.float().reshape(-1, H), i.reshape(-1), n, pad, False)
                   for i, n, pad in ((ids, V, 0), (pos, P, -1), (tt, T, -1))]
    finally:
        torch.use_deterministic_algorithms(False)
    for a, t in zip(det, sorted_):
        assert torch.equal(a, t)


def _check_position_offset(device):
    """transformers renamed the embeddings' position offset (`past_key_values_length` -> `cache_length`);
    the swapped module takes it under the installed version's name, by keyword, and shifts the
    positions as HF's own module does (CPU: the fallback runs the original; GPU: the kernel)."""
    import inspect

    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertEmbeddings

    from bertaccel.ops.embeddings import FusedBertEmbeddings

    cfg = BertConfig(vocab_size=50, hidden_size=32, max_position_embeddings=24, type_vocab_size=2, num_hidden_layers=1,
                     num_attention_heads=2, intermediate_size=64)
    original = BertEmbeddings(cfg).to(device).eval()
    swapped = FusedBertEmbeddings(original).eval()
    params = inspect.signature(BertEmbeddings.forward).parameters
    name = next(n for n in ("cache_length", "past_key_values_length") if n in params)
    ids = torch.randint(1, 50, (3, 9), device=device)
    with torch.no_grad():
        for offset in (0, 5):
            want = original(input_ids=ids, **{name: offset})
            got = swapped(input_ids=ids, **{name: offset})
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-5)
        shifted = original(input_ids=ids, **{name: 5})
    assert not torch.allclose(shifted, original(input_ids=ids)), "the offset changed nothing: the test tests nothing"


def test_swapped_embeddings_take_the_position_offset_of_this_transformers():
    _check_position_offset("cpu")


@cuda_test
def test_swapped_embeddings_kernel_takes_the_position_offset():
    _check_position_offset("cuda")
