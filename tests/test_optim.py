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


# ----------------------------------------------------------------------------- the learning-rate schedule
def _schedule(groups=2, warmup=3, total=10, lr=1e-3):
    from bertaccel.optim import LinearWarmupDecay

    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(groups)]
    opt = torch.optim.SGD([{"params": [p]} for p in params], lr=lr)
    return opt, LinearWarmupDecay(opt, warmup, total)


def test_schedule_matches_transformers_linear_warmup():
    from transformers import get_linear_schedule_with_warmup

    opt, ours = _schedule()
    ref_opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(2)], lr=1e-3)
    ref = get_linear_schedule_with_warmup(ref_opt, 3, 10)
    for _ in range(14):  # through the warm-up, the decay and past its end
        assert ours.get_last_lr() == pytest.approx(ref.get_last_lr(), abs=0)
        opt.step(), ref_opt.step()
        ours.step(), ref.step()


def test_schedule_takes_a_group_added_mid_run():
    """Lightning's BaseFinetuning adds a group when it unfreezes a backbone: transformers' LambdaLR raised at
    its next step (one lambda per group, zipped strictly). The group keeps the rate it was added with, then
    follows the schedule's shape."""
    opt, sched = _schedule(warmup=2, total=10)
    for _ in range(5):
        opt.step()
        sched.step()
    factor_now = sched.factor(5)  # the others' factor at step 5
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 2e-5})
    opt.step()
    sched.step()
    assert len(sched.get_last_lr()) == 3
    assert sched.get_last_lr()[2] == pytest.approx(2e-5 * sched.factor(6) / factor_now)
    assert sched.get_last_lr()[0] == pytest.approx(1e-3 * sched.factor(6))
    for _ in range(10):
        opt.step()
        sched.step()
    assert sched.get_last_lr() == [0.0, 0.0, 0.0]


def test_schedule_state_is_the_step_not_the_configuration():
    """A resumed run follows its own schedule (other max_epochs / data) from the checkpoint's step; a checkpoint
    written with transformers' LambdaLR loads."""
    from transformers import get_linear_schedule_with_warmup

    opt, sched = _schedule(warmup=2, total=10)
    for _ in range(4):
        opt.step()
        sched.step()
    state = sched.state_dict()
    assert state["last_epoch"] == 4 and "total_steps" not in state and "warmup_steps" not in state
    opt2, resumed = _schedule(warmup=2, total=20)
    resumed.load_state_dict(state)
    assert resumed.total_steps == 20 and resumed.last_epoch == 4
    old_opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(2)], lr=1e-3)
    old = get_linear_schedule_with_warmup(old_opt, 2, 10)
    for _ in range(3):
        old_opt.step()
        old.step()
    opt3, from_old = _schedule(warmup=2, total=10)
    from_old.load_state_dict(old.state_dict())
    assert from_old.last_epoch == 3
    opt3.step()
    from_old.step()
    assert from_old.get_last_lr() == pytest.approx([1e-3 * from_old.factor(4)] * 2)
