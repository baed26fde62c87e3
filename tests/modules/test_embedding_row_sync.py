"""The word embeddings' gradient summed over the ranks by the rows the batch's ids touch (train_step.EmbeddingRowSync),
on 2 gloo processes: the same sums as the whole-table all-reduce, bit for bit, on every rank; whole-table where the
gradient has rows outside the ids (a tied output layer); a batch with more ids than built for is an error."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bertaccel.modules.train_step import EmbeddingRowSync, all_reduce_grads, embedding_row_sync_wanted, embedding_rows_pay

VOCAB, HIDDEN, MAX_IDS = 50, 6, 24


def _rank_grads(rank: int, n_ids: int, dense: bool, seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank `rank`'s batch ids (repeats included), its table gradient (zero outside the ids unless `dense`), and a
    second gradient that is not the table's."""
    g = torch.Generator().manual_seed(rank if seed is None else seed)
    ids = torch.randint(0, VOCAB // 2 + 10 * rank, (n_ids,), generator=g)  # overlapping, not equal, sets
    ids[3] = ids[0]  # a repeated id
    table = torch.zeros(VOCAB, HIDDEN)
    table.index_add_(0, ids, torch.randn(n_ids, HIDDEN, generator=g))
    if dense:
        table += torch.randn(VOCAB, HIDDEN, generator=g) * 1e-3
    return ids.view(2, -1), table, torch.randn(7, generator=g)


def _worker(rank: int, world: int, init: str, out: str, dense: bool) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    n_ids = MAX_IDS - 4 * rank  # ranks with different batch shapes
    ids, table, other = _rank_grads(rank, n_ids, dense)
    weight = torch.nn.Parameter(torch.zeros(VOCAB, HIDDEN))
    results = {}
    for name in ("rows", "whole"):
        weight.grad = table.clone()
        second = other.clone()
        if name == "rows":
            sync = EmbeddingRowSync(weight, MAX_IDS)
            for _ in range(2):  # the first call decides, the second runs as decided (on fresh copies)
                weight.grad, second = table.clone(), other.clone()
                sync.record(ids)
                sync([second, weight.grad])
            results["rows_only"] = sync.rows_only
        else:
            all_reduce_grads([second, weight.grad])
        results[name] = (weight.grad.clone(), second)
    too_many = EmbeddingRowSync(weight, 4)
    try:
        too_many.record(ids)
        results["too_many"] = None
    except RuntimeError as e:
        results["too_many"] = str(e)
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


def _accumulating_worker(rank: int, world: int, init: str, out: str) -> None:
    """Three updates of 3 micro-batches each, the last one cut short after 2 (an epoch's end): the table's gradient
    accumulates the micro-batches' rows, the sync at each update's end sums them as the whole all-reduce does."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    weight = torch.nn.Parameter(torch.zeros(VOCAB, HIDDEN))
    sync = EmbeddingRowSync(weight, MAX_IDS, micro_batches=3)
    results = []
    for update, micro in enumerate((3, 3, 2)):
        weight.grad = torch.zeros(VOCAB, HIDDEN)
        for k in range(micro):
            ids, table, _ = _rank_grads(rank, MAX_IDS - 4 * rank, False, seed=100 * rank + 10 * update + k)
            sync.record(ids)
            weight.grad += table
        whole = weight.grad.clone()
        all_reduce_grads([whole])
        sync([weight.grad])
        results.append((weight.grad.clone(), whole))
    torch.save({"results": results, "rows_only": sync.rows_only}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_under_accumulation_the_rows_of_every_micro_batch_are_summed(tmp_path):
    out = str(tmp_path / "acc")
    mp.start_processes(_accumulating_worker, args=(2, f"file://{tmp_path / 'pg'}", out), nprocs=2, start_method="spawn")
    for r in range(2):
        res = torch.load(f"{out}.{r}", weights_only=False)
        assert res["rows_only"] is True
        for rows, whole in res["results"]:
            torch.testing.assert_close(rows, whole, rtol=0, atol=0)


def _run(tmp_path, dense: bool) -> list[dict]:
    out = str(tmp_path / "out")
    mp.start_processes(_worker, args=(2, f"file://{tmp_path / 'pg'}", out, dense), nprocs=2, start_method="spawn")
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]


def test_rows_of_the_ids_sum_as_the_whole_table_all_reduce_on_every_rank(tmp_path):
    ranks = _run(tmp_path, dense=False)
    expected = sum(_rank_grads(r, MAX_IDS - 4 * r, False)[1] for r in range(2))
    for res in ranks:
        assert res["rows_only"] is True
        rows, second = res["rows"]
        whole, whole_second = res["whole"]
        torch.testing.assert_close(rows, whole, rtol=0, atol=0)  # 2 ranks: a + b either way
        torch.testing.assert_close(rows, expected, rtol=0, atol=0)
        torch.testing.assert_close(second, whole_second, rtol=0, atol=0)  # the other gradients all-reduced as before
        assert "more than the 4" in res["too_many"]
    torch.testing.assert_close(ranks[0]["rows"][0], ranks[1]["rows"][0], rtol=0, atol=0)


def test_the_rows_pay_while_the_ranks_gather_fewer_bytes_than_the_all_reduce_moves():
    assert embedding_rows_pay(2, 8192, 30522) and embedding_rows_pay(7, 8192, 30522)  # 57,344 < 61,044
    assert not embedding_rows_pay(8, 8192, 30522)  # 65,536 rows gathered a rank > 2 tables' worth
    assert embedding_rows_pay(2, 16384, 30522) and not embedding_rows_pay(4, 16384, 30522)  # 32 x 512 a rank


@pytest.mark.parametrize("value, mode", [(None, "1"), ("1", "1"), ("0", None), ("off", None), ("always", "always"),
                                         (" Always ", "always")])
def test_the_rows_sync_is_on_by_default_and_the_switch_turns_it_off_or_forces_it(monkeypatch, value, mode):
    if value is None:
        monkeypatch.delenv("BERTACCEL_EMBEDDING_ROW_SYNC", raising=False)
    else:
        monkeypatch.setenv("BERTACCEL_EMBEDDING_ROW_SYNC", value)
    assert embedding_row_sync_wanted() == mode


def test_an_unknown_rows_sync_setting_is_an_error_naming_the_values(monkeypatch):
    monkeypatch.setenv("BERTACCEL_EMBEDDING_ROW_SYNC", "2")
    with pytest.raises(ValueError, match=r"BERTACCEL_EMBEDDING_ROW_SYNC='2'.*expected 1 .*0 .*always"):
        embedding_row_sync_wanted()


def test_a_gradient_outside_the_ids_is_all_reduced_whole(tmp_path):
    ranks = _run(tmp_path, dense=True)
    for res in ranks:
        assert res["rows_only"] is False
        torch.testing.assert_close(res["rows"][0], res["whole"][0], rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_rows_sum_captures_into_a_cuda_graph(tmp_path):
    """One GPU, an NCCL group of one rank: the first sync (eager) decides, the second is captured - two all-gathers and
    the row updates - and each replay sums the table's rows of the ids in the static buffers as they are then (one rank:
    the sum is its own gradient, every row written back through the gathered copy)."""
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        weight = torch.nn.Parameter(torch.zeros(VOCAB, HIDDEN, device="cuda"))
        ids = torch.randint(0, VOCAB, (2, 10), device="cuda")
        weight.grad = torch.zeros(VOCAB, HIDDEN, device="cuda")
        other = torch.randn(5, device="cuda")
        sync = EmbeddingRowSync(weight, MAX_IDS)

        def fill(seed: int) -> torch.Tensor:
            g = torch.Generator(device="cuda").manual_seed(seed)
            ids.copy_(torch.randint(0, VOCAB, ids.shape, device="cuda", generator=g))
            weight.grad.zero_().index_add_(0, ids.view(-1), torch.randn(ids.numel(), HIDDEN, device="cuda", generator=g))
            return weight.grad.clone()

        def step() -> None:
            sync.record(ids)
            sync([other, weight.grad])

        fill(0)
        step()
        assert sync.rows_only is True
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # a warm-up on the capture's stream
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for seed in (1, 2):
            expected = fill(seed)
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(weight.grad, expected, rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_first_sync_inside_a_capture_keeps_the_whole_table_and_says_so(tmp_path, capsys):
    """One GPU, an NCCL group of one rank: where the first sync is itself captured (the check that the gradient has
    no rows outside the ids cannot read the device there), the table is all-reduced whole from then on, said once, and
    the replays sum it whole (one rank: the gradient itself)."""
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        weight = torch.nn.Parameter(torch.zeros(VOCAB, HIDDEN, device="cuda"))
        weight.grad = torch.randn(VOCAB, HIDDEN, device="cuda")
        other = torch.randn(5, device="cuda")
        ids = torch.randint(0, VOCAB, (2, 10), device="cuda")
        sync = EmbeddingRowSync(weight, MAX_IDS)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            all_reduce_grads([other, weight.grad])  # NCCL warmed for these sizes, without deciding anything
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            sync.record(ids)
            sync([other, weight.grad])
        assert sync.rows_only is False
        assert "first sync ran inside a CUDA-graph capture" in capsys.readouterr().out
        expected = torch.randn(VOCAB, HIDDEN, device="cuda")
        weight.grad.copy_(expected)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(weight.grad, expected, rtol=0, atol=0)
    finally:
        dist.destroy_process_group()
