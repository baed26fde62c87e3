"""`train_step.all_reduce_grads` on two gloo processes (and, captured in a CUDA graph, on two GPUs): every gradient summed over the ranks, in place (the same
tensors), through the flat buffer per dtype, coalesced in place for the dtypes in `in_place` (and the gradients of
at least `in_place_numel` elements: the fp32 one of 7 in place, the one of 3 through the flat buffer), or mixed."""

from __future__ import annotations

import pytest
import torch


def _worker(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from bertaccel.modules.train_step import all_reduce_grads

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    reduced = []  # the tensors NCCL / gloo was handed, by address: which gradients went in place
    all_reduce = dist.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):
        reduced.append(tensor.data_ptr())
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = recording_all_reduce
    results, in_place_at = {}, {}
    for key, in_place, numel in (("flat", (), None), ("bf16", (torch.bfloat16,), None),
                                 ("all", (torch.bfloat16, torch.float32), None),
                                 ("bf16+large", (torch.bfloat16,), 7), ("large", (), 7)):
        grads = [torch.full((5, 3), rank + 1.0).bfloat16(), torch.arange(7.0) * (rank + 1),
                 torch.full((4,), 10.0 ** rank).bfloat16(), torch.full((3,), -2.0 * (rank + 1))]
        ptrs = [g.data_ptr() for g in grads]
        reduced.clear()
        all_reduce_grads(grads, in_place=in_place, in_place_numel=numel)
        assert [g.data_ptr() for g in grads] == ptrs
        results[key] = grads
        in_place_at[key] = [i for i, p in enumerate(ptrs) if p in reduced]
    dist.all_reduce = all_reduce
    results["in place"] = in_place_at
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


def test_all_reduce_grads_sums_every_gradient_flat_coalesced_by_dtype_or_size_or_mixed_on_two_gloo_processes(tmp_path):
    world = 2
    torch.multiprocessing.spawn(_worker, args=(world, f"file://{tmp_path / 'store'}", str(tmp_path / "grads")),
                                nprocs=world)
    expected = [torch.full((5, 3), 3.0).bfloat16(), torch.arange(7.0) * 3, torch.full((4,), 11.0).bfloat16(),
                torch.full((3,), -6.0)]
    for rank in range(world):
        got = torch.load(f"{tmp_path / 'grads'}.{rank}")
        assert got.pop("in place") == {"flat": [], "bf16": [0, 2], "all": [0, 1, 2, 3], "bf16+large": [0, 1, 2],
                                       "large": [0, 1]}  # bf16 5x3 has 15 elements, >= 7
        assert set(got) == {"flat", "bf16", "all", "bf16+large", "large"}
        for grads in got.values():
            for x, y in zip(grads, expected):
                assert x.dtype == y.dtype
                torch.testing.assert_close(x, y, rtol=0, atol=0)


def _nccl_graph_worker(rank: int, world: int, port: int, out: str) -> None:
    """Captures `all_reduce_grads` in a CUDA graph on each rank (flat, the default, and everything of 7+ elements in
    place), then replays it on new values twice: what a graphed DDP step does."""
    import os

    import torch.distributed as dist

    from benchmarks.bench_grad_sync import graph_of
    from bertaccel.modules.train_step import all_reduce_grads

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    results = {}
    for key, numel in (("flat", None), ("default", "default"), ("large", 7)):
        grads = [torch.zeros(5, 3, dtype=torch.bfloat16, device="cuda"), torch.zeros(7, device="cuda"),
                 torch.zeros(4, dtype=torch.bfloat16, device="cuda"), torch.zeros(3, device="cuda")]
        kwargs = {} if numel == "default" else {"in_place_numel": numel}
        if key == "flat":
            kwargs["in_place"] = ()
        graph = graph_of(lambda: all_reduce_grads(grads, **kwargs))  # run once on the capture stream, then captured
        sums = []
        for round_ in range(2):
            for i, g in enumerate(grads):
                g.copy_(torch.arange(g.numel(), device="cuda").view_as(g) * (rank + 1) + 10 * round_ + i)
            graph.replay()
            torch.cuda.synchronize()
            sums.append([g.float().cpu() for g in grads])
        results[key] = sums
        del graph
    torch.save(results, f"{out}.{rank}")
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_all_reduce_grads_captured_in_a_cuda_graph_sums_new_values_at_each_replay_on_two_gpus(tmp_path):
    import random

    world = 2
    torch.multiprocessing.spawn(_nccl_graph_worker, args=(world, random.randint(20000, 40000), str(tmp_path / "g")),
                                nprocs=world)
    shapes = [(5, 3), (7,), (4,), (3,)]
    for rank in range(world):
        got = torch.load(f"{tmp_path / 'g'}.{rank}")
        assert set(got) == {"flat", "default", "large"}
        for key, rounds in got.items():
            for round_, grads in enumerate(rounds):
                for i, (g, shape) in enumerate(zip(grads, shapes)):
                    n = torch.tensor(shape).prod().item()
                    # rank 0 holds a * 1 + c, rank 1 a * 2 + c: the sum a * 3 + 2c (small integers: exact in bf16)
                    want = (torch.arange(n).view(shape) * 3 + 2 * (10 * round_ + i)).float()
                    torch.testing.assert_close(g, want, rtol=0, atol=0, msg=f"{key} round {round_} gradient {i}")
