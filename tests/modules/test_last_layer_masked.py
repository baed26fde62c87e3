"""The masked-LM's last layer at the masked positions only (bertaccel.modules.last_layer, `BertMLM(last_layer_masked_only
=True)`): the same loss and gradients as the whole layer (dynamic and static selections, padding, a row with nothing
masked, an empty row), the static per-sequence rows and what they leave out, the FLOP count, a fit on CPU, and a bf16
CUDA graph on the GPU."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch

from bertaccel.modules import BertMLM
from bertaccel.modules.last_layer import last_layer_at_rows, masked_rows
from tests.ops.conftest import assert_within_twice, replayed_output_and_grads

CONFIG = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=64)


def _batch(B: int = 4, S: int = 24, vocab: int = 100, p: float = 0.3, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    for b, n in enumerate([S, 17, 9, 0][:B]):  # right padding, down to an empty row
        mask[b, n:] = 0
    labels = torch.where((torch.rand(B, S, generator=g) < p) & mask.bool(), ids, torch.full_like(ids, -100))
    labels[2] = -100  # a row with nothing masked
    return ids, mask, labels


def _pair(attn: str = "sdpa", **kwargs):
    torch.manual_seed(0)
    whole = BertMLM(config=CONFIG, vocab_size=100, attn_implementation=attn, **kwargs).double()
    masked = BertMLM(config=CONFIG, vocab_size=100, attn_implementation=attn, last_layer_masked_only=True, **kwargs).double()
    masked.load_state_dict(whole.state_dict())
    return whole, masked


def _outputs_and_grads(model, ids, mask, labels):
    model.zero_grad(set_to_none=True)
    out = model.step_outputs(ids, mask, labels)
    out["loss"].backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    return {k: v.detach() for k, v in out.items()}, grads


def test_masked_rows_in_order_with_a_static_bound():
    selected = torch.tensor([[0, 1, 0, 1, 1], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    rows, used = masked_rows(selected)
    assert rows.shape == (3, 5) and used.sum().item() == 8
    assert rows[0, :3].tolist() == [1, 3, 4] and used[0].tolist() == [True, True, True, False, False]
    assert not used[1].any() and rows[2].tolist() == [0, 1, 2, 3, 4]
    rows, used = masked_rows(selected, per_row=2)  # the static bound: the first two of each row
    assert rows.tolist()[0] == [1, 3] and rows.tolist()[2] == [0, 1] and used.sum().item() == 4
    rows, used = masked_rows(selected[1:2])  # nothing selected: one unused row
    assert rows.shape == (1, 1) and not used.any()


@pytest.mark.parametrize("attn", ["sdpa", "eager", "bertaccel"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_same_loss_and_gradients_as_the_whole_layer(attn, static):
    if attn == "bertaccel":
        from bertaccel.modules.hf_attention import register

        register()
    whole, masked = _pair(attn, cuda_graphs=static)  # cuda_graphs: the static selection (CPU runs it eagerly)
    batch = _batch()
    out, grads = _outputs_and_grads(whole, *batch)
    out_m, grads_m = _outputs_and_grads(masked, *batch)
    for k in ("loss", "count", "correct"):
        torch.testing.assert_close(out_m[k], out[k], rtol=1e-10, atol=1e-12)
    if static:
        assert float(out_m["dropped_masked"]) == 0
    for name, g in grads.items():
        torch.testing.assert_close(grads_m[name], g, rtol=1e-9, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
    assert grads_m["model.bert.encoder.layer.1.attention.self.query.weight"].abs().sum() > 0


def test_outside_the_rows_context_the_whole_layer_runs_and_revert_restores():
    whole, masked = _pair()
    ids, mask, _ = _batch()
    full = whole.model.bert(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(masked.model.bert(input_ids=ids, attention_mask=mask).last_hidden_state, full)
    rows = torch.tensor([[3, 0], [5, 1], [0, 2], [1, 7]])
    with masked._last_layer.at(rows):
        at_rows = masked.model.bert(input_ids=ids, attention_mask=mask).last_hidden_state
    assert at_rows.shape == (4, 2, 32)
    torch.testing.assert_close(at_rows[:3], full[:3].gather(1, rows[:3, :, None].expand(-1, -1, 32)), rtol=1e-10, atol=1e-12)
    assert torch.isfinite(at_rows).all()  # the empty row attends to position 0, not to nothing
    with pytest.raises(ValueError, match="already computed at some rows only"):
        last_layer_at_rows(masked.model)
    masked._last_layer.revert()
    assert "forward" not in masked.model.bert.encoder.__dict__
    with pytest.raises(ValueError, match="int64"):
        with last_layer_at_rows(masked.model).at(rows.int()):
            pass


def test_static_rows_leave_out_what_exceeds_them_and_count_it(monkeypatch):
    whole, masked = _pair(cuda_graphs=True)
    ids, mask, labels = _batch(p=0.6)
    per_row = (labels != -100).sum(1)
    monkeypatch.setattr(BertMLM, "row_mask_budget", lambda self, seq: 3)
    out = masked.step_outputs(ids, mask, labels)
    assert float(out["dropped_masked"]) == float((per_row - per_row.clamp(max=3)).sum()) > 0
    kept = labels.clone()  # the whole model on the first three masked positions of each row: the same loss
    for b in range(labels.shape[0]):
        kept[b, torch.nonzero(labels[b] != -100).flatten()[3:]] = -100
    torch.testing.assert_close(out["loss"], whole.step_outputs(ids, mask, kept)["loss"], rtol=1e-10, atol=1e-12)


def test_under_torch_compile():
    """The rows reach the compiled encoder through the handle: new rows each batch, the same loss as the whole layer."""
    whole, masked = _pair(cuda_graphs=True)
    whole.float(), masked.float()
    masked.model.compile(backend="aot_eager")
    for seed in (1, 2):
        batch = _batch(seed=seed)
        torch.testing.assert_close(masked.step_outputs(*batch)["loss"], whole.step_outputs(*batch)["loss"],
                                   rtol=1e-5, atol=1e-6)


def test_row_budget_and_flop_count():
    """The last layer's GEMMs on the flat rows the head takes (the static budget under graphs, the count otherwise),
    its attention on B x Q queries (the static queries per sequence, or the largest count)."""
    whole, masked = _pair(cuda_graphs=True)
    assert masked.row_mask_budget(128) % 8 == 0 and 19 < masked.row_mask_budget(128) < 64
    assert masked.row_mask_budget(512) < 160 and masked.row_mask_budget(4) == 4
    ids, mask, labels = _batch()
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    cfg = whole.model.config
    H, F, S, B = cfg.hidden_size, cfg.intermediate_size, ids.shape[1], ids.shape[0]
    per_row = 2 * (2 * H * H + 2 * H * F)  # Q, output and feed-forward matmuls of one row
    per_query = 4 * S * H  # attention of one query
    M, Q = masked.mask_budget(B * S), masked.row_mask_budget(S)
    assert whole.flops_per_batch(batch, True) - masked.flops_per_batch(batch, True) == 3 * (
        (B * S - M) * per_row + (B * S - B * Q) * per_query)
    masked.cuda_graphs = False  # eager: the count and the largest count per sequence
    n, q = int((labels != -100).sum()), int((labels != -100).sum(1).max())
    assert whole.flops_per_batch(batch, False) - masked.flops_per_batch(batch, False) == (
        (B * S - n) * per_row + (B * S - B * q) * per_query)


def test_kept_rows_layouts():
    """masked_kept_rows: the flat rows in the head's order (row-major), each query's flat row, each flat row's query;
    rows past a sequence's queries or past the budget not real."""
    from bertaccel.modules.last_layer import masked_kept_rows

    selected = torch.tensor([[0, 1, 0, 1, 1], [0, 0, 0, 0, 0], [1, 1, 0, 0, 1]], dtype=torch.bool)
    kept, real = masked_kept_rows(selected)
    assert kept.flat.tolist() == [1, 3, 4, 10, 11, 14] and real.all()
    assert kept.rows.tolist()[0] == [1, 3, 4] and kept.to_rows.tolist() == [[0, 1, 2], [6, 6, 6], [3, 4, 5]]
    assert kept.to_flat.tolist() == [0, 1, 2, 6, 7, 8]  # (b * Q + q), Q = 3
    kept, real = masked_kept_rows(selected, per_row=2, budget=8)
    assert kept.flat.tolist()[:6] == [1, 3, 4, 10, 11, 14]
    assert real.tolist() == [True, True, False, True, True, False, False, False]  # third of a row; unfilled slots
    assert kept.to_rows.tolist() == [[0, 1], [8, 8], [3, 4]]


def test_fit_on_cpu_trains_like_the_whole_layer(tmp_path):
    """Graph-mode loop (run eagerly on CPU, static rows) with and without the option: the same parameters after a
    few steps and the same validation loss."""
    from bertaccel.data import MLMDataModule

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"the film number {i} was {'good' if i % 2 else 'bad'} and long" for i in range(300)))

    def train(option: bool):
        pl.seed_everything(4)
        model = BertMLM(config=dict(CONFIG, num_hidden_layers=2), vocab_size=None, lr=3e-3, cuda_graphs=True,
                        last_layer_masked_only=option)
        model._capture_without_gpu = True
        dm = MLMDataModule(train_files=[str(corpus)], tokenizer="sample:sentiment", block_size=32, batch_size=8)
        trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                             limit_train_batches=5, limit_val_batches=2)
        trainer.fit(model, datamodule=dm)
        return model, trainer

    whole, tw = train(False)
    masked, tm = train(True)
    for (name, a), b in zip(whole.named_parameters(), masked.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    torch.testing.assert_close(tm.callback_metrics["val/loss"], tw.callback_metrics["val/loss"], rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
def test_bf16_swapped_graph_on_gpu_within_twice_the_whole_layers_error():
    """bf16 autocast, the kernel swap and our attention (a Hopper GPU; SDPA elsewhere), the step's static selection
    captured in a CUDA graph with forward + backward and replayed: loss and gradients against the fp64 whole model,
    within 2x the error of the bf16 whole model's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from bertaccel.modules.hf_attention import register
    from bertaccel.ops.swap import DEFAULT, swap

    register()
    config = dict(CONFIG, hidden_size=384, num_attention_heads=12, intermediate_size=1536, max_position_embeddings=256)
    torch.manual_seed(0)
    ref = BertMLM(config=config, vocab_size=1000, attn_implementation="bertaccel", cuda_graphs=True).double().cuda()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, 1000, (4, 128), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 100:] = 0
    labels = torch.where((torch.rand(ids.shape, generator=g) < 0.15) & mask.bool(), ids, torch.full_like(ids, -100))
    ids, mask, labels = ids.cuda(), mask.cuda(), labels.cuda()
    ref_out, ref_grads = _outputs_and_grads(ref, ids, mask, labels)
    results = {}
    for name in ("whole", "masked"):
        model = copy.deepcopy(ref).float()
        swap(model.model, DEFAULT)
        if name == "masked":
            model._last_layer = last_layer_at_rows(model.model)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model.step_outputs(ids, mask, labels)
            out["loss"].backward()
            return out["loss"]

        results[name] = replayed_output_and_grads(step, model)

    assert_within_twice(results["masked"], results["whole"], ref_out["loss"], ref_grads)


def test_a_deep_copy_runs_its_own_encoder():
    """copy.deepcopy (EMA / SWA copies, tests) keeps the option, bound to the copy's encoder and handle."""
    whole, masked = _pair()
    twin = copy.deepcopy(masked)
    encoder = twin.model.bert.encoder
    assert encoder.forward.__self__ is encoder and twin._last_layer.encoder is encoder
    batch = _batch()
    torch.testing.assert_close(twin.step_outputs(*batch)["loss"], whole.step_outputs(*batch)["loss"], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("qk_norm", ["layernorm", "rmsnorm"])
def test_with_qk_norm(qk_norm):
    """QK-norm wraps the key projection (K and V then run as two projections, not one GEMM): the same loss and
    gradients, for the masked-LM and for the classifier at [CLS]."""
    from bertaccel.modules.classifier import BertClassifier

    whole, masked = _pair(qk_norm=qk_norm)
    batch = _batch()
    out, grads = _outputs_and_grads(whole, *batch)
    out_m, grads_m = _outputs_and_grads(masked, *batch)
    torch.testing.assert_close(out_m["loss"], out["loss"], rtol=1e-10, atol=1e-12)
    for name, g in grads.items():
        torch.testing.assert_close(grads_m[name], g, rtol=1e-9, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
    torch.manual_seed(0)
    whole_c = BertClassifier(config=CONFIG, num_labels=3, vocab_size=100, qk_norm=qk_norm).double()
    cls = BertClassifier(config=CONFIG, num_labels=3, vocab_size=100, qk_norm=qk_norm, last_layer_cls_only=True).double()
    cls.load_state_dict(whole_c.state_dict())
    ids, mask, _ = batch
    mask = mask.clone()
    mask[3, 0] = 1  # (the classifier's rows keep their [CLS])
    torch.testing.assert_close(cls(ids, mask), whole_c(ids, mask), rtol=1e-10, atol=1e-12)
