"""Muon / NorMuon / AdamW in one optimizer: the orthogonalisations, the update rules against
float64 references written from the papers' definitions, and the model option end to end."""

from __future__ import annotations

import math

import pytest
import torch

from bertaccel.optim import MuonWithAdamW, orthogonalize


@pytest.mark.parametrize("shape", [(48, 24), (24, 72), (64, 64)])
def test_orthogonalizers(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    exact = orthogonalize(g, method="svd")
    u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
    torch.testing.assert_close(exact.double(), u @ vh)
    pe = torch.linalg.svdvals(orthogonalize(g, steps=8, method="polar-express"))
    # converges to the polar factor for singular values inside its design interval [1e-3, 1] (relative)
    sv = torch.linalg.svdvals(g)
    inside = sv / sv.max() > 2e-3
    assert (pe[inside] - 1).abs().max() < 1e-2
    ns = torch.linalg.svdvals(orthogonalize(g, steps=5, method="newton-schulz"))
    assert ns[inside].min() > 0.1 and ns.max() < 1.3  # Muon's quintic: near, not at, 1
    # same singular vectors as the exact factor: the iteration is an odd polynomial of g
    cos = torch.nn.functional.cosine_similarity(orthogonalize(g, 8, "polar-express").flatten(), exact.flatten(), dim=0)
    assert cos > 0.99
    with pytest.raises(ValueError, match="takes a matrix or a stack"):
        orthogonalize(torch.randn(2, 3, 4, 5))


def test_stacked_orthogonalization_equals_one_matrix_at_a_time():
    gen = torch.Generator().manual_seed(3)
    for shape in [(4, 12, 20), (3, 20, 12)]:
        g = torch.randn(shape, generator=gen) * torch.tensor([0.1, 1.0, 30.0, 2.0])[: shape[0], None, None]
        for method in ("newton-schulz", "polar-express"):
            stacked = orthogonalize(g, 5, method)
            one_by_one = torch.stack([orthogonalize(m, 5, method) for m in g])
            torch.testing.assert_close(stacked, one_by_one, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lr_on_device", [False, True], ids=["lr-float", "lr-tensor"])
def test_adamw_groups_match_torch_adamw(lr_on_device):
    torch.manual_seed(0)
    shapes = [(6, 4), (4,), (6, 4), (3, 5, 2)]
    a = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    b = [torch.nn.Parameter(t.detach().clone()) for t in a]
    lr = torch.tensor(3e-3) if lr_on_device else 3e-3
    mine = MuonWithAdamW(a, lr=lr, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)
    ref = torch.optim.AdamW(b, lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)
    for step in range(6):
        for i, (x, y) in enumerate(zip(a, b)):
            if step == 2 and i == 1:  # a parameter without a gradient this step is left alone
                x.grad = y.grad = None
                continue
            g = torch.randn(x.shape)
            x.grad, y.grad = g.clone(), g.clone()
        mine.step()
        ref.step()
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def reference_steps(w, grads, lr, wd, beta, normuon, beta2=0.95):
    """Muon (Nesterov momentum, exact polar factor, sqrt(max(1, rows/cols)) scale, decoupled decay)
    and NorMuon (row-wise second moment of the orthogonalised update, Frobenius norm kept), float64."""
    w = w.double().clone()
    m = torch.zeros_like(w)
    v = torch.zeros(w.shape[0], 1, dtype=torch.float64)
    for g in grads:
        g = g.double()
        m = beta * m + (1 - beta) * g
        nesterov = (1 - beta) * g + beta * m
        u, _, vh = torch.linalg.svd(nesterov, full_matrices=False)
        o = u @ vh
        if normuon:
            norm = o.norm()
            v = beta2 * v + (1 - beta2) * (o * o).mean(dim=1, keepdim=True)
            o = o / v.sqrt()
            o = o * norm / o.norm()
        o = o * math.sqrt(max(1.0, w.shape[0] / w.shape[1]))
        w = w * (1 - lr * wd) - lr * o
    return w


@pytest.mark.parametrize("normuon", [False, True], ids=["muon", "normuon"])
@pytest.mark.parametrize("shape", [(16, 8), (8, 20)])
def test_muon_and_normuon_match_the_reference(normuon, shape):
    gen = torch.Generator().manual_seed(1)
    w0 = torch.randn(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen) for _ in range(5)]
    p = torch.nn.Parameter(w0.clone())
    opt = MuonWithAdamW([{"params": [p], "muon": True}], lr=0.02, weight_decay=0.1, orthogonalizer="svd",
                        normuon=normuon)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    torch.testing.assert_close(p.detach().double(), reference_steps(w0, grads, 0.02, 0.1, 0.95, normuon),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("normuon", [False, True], ids=["muon", "normuon"])
def test_a_group_of_several_shapes_steps_each_matrix_as_alone(normuon):
    """The optimizer stacks the matrices of each shape; each must still follow its own reference."""
    gen = torch.Generator().manual_seed(2)
    shapes = [(16, 8), (8, 20), (16, 8), (20, 8), (16, 8)]
    w0 = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(4)]
    ps = [torch.nn.Parameter(w.clone()) for w in w0]
    opt = MuonWithAdamW([{"params": ps, "muon": True}], lr=0.02, weight_decay=0.1, orthogonalizer="svd",
                        normuon=normuon)
    for step in grads:
        for p, g in zip(ps, step):
            p.grad = g.clone()
        opt.step()
    for i, p in enumerate(ps):
        ref = reference_steps(w0[i], [step[i] for step in grads], 0.02, 0.1, 0.95, normuon)
        torch.testing.assert_close(p.detach().double(), ref, rtol=1e-5, atol=1e-6)


def test_muon_groups_refuse_vectors():
    with pytest.raises(ValueError, match="2-D weight matrices only"):
        MuonWithAdamW([{"params": [torch.nn.Parameter(torch.randn(4))], "muon": True}])


@pytest.mark.parametrize("name", ["muon", "normuon"])
def test_model_option_puts_encoder_matrices_on_muon_and_trains(name, tiny_data, tmp_path):
    import lightning.pytorch as pl

    from bertaccel.data import TextClassificationDataModule
    from bertaccel.modules import BertClassifier
    from tests.conftest import TINY_BERT

    pl.seed_everything(0)
    model = BertClassifier(config=TINY_BERT, vocab_size=256, num_labels=2, lr=1e-3, optimizer=name,
                           muon_orthogonalizer="polar-express")
    dm = TextClassificationDataModule(dataset=str(tiny_data), tokenizer="sample:sentiment", max_length=32,
                                      batch_size=16, val_size=0.2)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model, datamodule=dm)
    opt = trainer.optimizers[0]
    assert isinstance(opt, MuonWithAdamW) and opt.defaults["normuon"] == (name == "normuon")
    muon = {id(p) for g in opt.param_groups if g["muon"] for p in g["params"]}
    for pname, p in model.model.named_parameters():
        expected = p.ndim == 2 and ".encoder." in f".{pname}"
        assert (id(p) in muon) == expected, pname
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert float(trainer.callback_metrics["train/loss_epoch"]) < 0.75
