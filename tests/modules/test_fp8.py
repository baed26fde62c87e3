"""The FP8 linear layer of the masked-LM head, on PyTorch's CPU `_scaled_mm`: values and every
gradient against float64, odd row and vocabulary counts, the amax history, and a masked-LM that
trains with it like without."""

from __future__ import annotations

import pytest
import torch

from bertaccel.modules.fp8 import E4M3, E5M2, AmaxHistory, fp8_linear

pytestmark = pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="no float8 types in this torch")


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.detach().double() - ref.detach()).norm() / ref.detach().norm())


def quantized(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the layer's first call makes of `t` (scaled by its own amax), back in float64."""
    fp8_max = torch.finfo(dtype).max
    scale = fp8_max / t.detach().abs().amax().double()
    return (t.detach().double() * scale).clamp(-fp8_max, fp8_max).to(dtype).double() / scale


@pytest.mark.parametrize(("m", "v"), [(64, 128), (37, 100), (5, 30)], ids=["aligned", "odd-rows-and-vocab", "few-rows"])
def test_fp8_linear_values_and_gradients_against_float64(m, v):
    """Exact on the quantized operands (the matmuls add only fp32 rounding), and within e4m3 / e5m2
    quantization error of the unquantized float64 product (3 and 2 mantissa bits: a few percent)."""
    torch.manual_seed(0)
    h = 64
    x = torch.randn(m, h, requires_grad=True)
    w = (torch.randn(v, h) * 0.05).requires_grad_(True)
    b = torch.randn(v, requires_grad=True)
    dy = torch.randn(m, v)
    y = fp8_linear(x, w, b, AmaxHistory())
    gx, gw, gb = torch.autograd.grad(y, (x, w, b), dy)
    v16 = v - v % 16
    xq, wq = quantized(x, E4M3), torch.cat([quantized(w[:v16], E4M3), w[v16:].detach().double()])
    gq = torch.cat([quantized(dy[:, :v16], E5M2), dy[:, v16:].double()], dim=1)
    # the last v % 16 vocabulary rows run unquantized: their products use x as it is
    y_q = torch.cat([xq @ wq[:v16].t(), x.detach().double() @ wq[v16:].t()], dim=1) + b.detach().double()
    assert rel(y, y_q) < 1e-5
    dx_q = gq[:, :v16] @ wq[:v16] + gq[:, v16:] @ wq[v16:]
    dw_q = torch.cat([gq[:, :v16].t() @ xq, gq[:, v16:].t() @ x.detach().double()])
    assert rel(gx, dx_q) < 1e-5 and rel(gw, dw_q) < 1e-5
    xd, wd, bd = (t.detach().double().requires_grad_(True) for t in (x, w, b))
    yd = xd @ wd.t() + bd
    rx, rw, rb = torch.autograd.grad(yd, (xd, wd, bd), dy.double())
    assert rel(y, yd) < 0.08 and rel(gx, rx) < 0.12 and rel(gw, rw) < 0.12
    torch.testing.assert_close(gb.double(), rb, rtol=1e-5, atol=1e-5)  # the bias gradient is not quantized (fp32 sum)
    assert y.shape == (m, v) and gw.shape == w.shape


def test_amax_history_scales_by_the_past_and_rolls():
    hist = AmaxHistory(length=4)
    first = hist.scale(0, torch.tensor([2.0, -4.0]), 448.0)
    assert float(first) == pytest.approx(448.0 / 4.0)  # empty history: the tensor's own amax
    second = hist.scale(0, torch.tensor([100.0]), 448.0)
    assert float(second) == pytest.approx(448.0 / 4.0)  # the history's max, not the new outlier
    third = hist.scale(0, torch.tensor([1.0]), 448.0)
    assert float(third) == pytest.approx(448.0 / 100.0)
    assert hist.amax[0].tolist() == [1.0, 100.0, 4.0, 0.0]


def test_hidden_size_not_a_multiple_of_16_runs_unscaled():
    x, w, b = torch.randn(8, 20), torch.randn(40, 20), torch.randn(40)
    torch.testing.assert_close(fp8_linear(x, w, b, AmaxHistory()), torch.nn.functional.linear(x, w, b))


def test_mlm_with_the_fp8_head_trains_like_the_plain_head():
    """Same data, seed and steps: the FP8-head model's loss goes down with the plain one's."""
    from bertaccel.modules import BertMLM

    cfg = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 120, (8, 24), generator=g)
    labels = torch.where(torch.rand(8, 24, generator=g) < 0.3, ids, torch.full_like(ids, -100))
    losses = {}
    for fp8 in (False, True):
        torch.manual_seed(0)
        model = BertMLM(config=cfg, vocab_size=120, lm_head_fp8=fp8)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        run = []
        for _ in range(30):
            out = model.step_outputs(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)
            opt.zero_grad()
            out["loss"].backward()
            opt.step()
            run.append(float(out["loss"]))
        losses[fp8] = run
    assert losses[True][-1] < 0.6 * losses[True][0]  # it learns
    assert abs(losses[True][-1] - losses[False][-1]) < 0.15 * losses[False][-1]
