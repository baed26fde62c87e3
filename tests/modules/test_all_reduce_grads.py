"""`train_step.all_reduce_grads` on two gloo processes: every gradient summed over the ranks, in place (the same
tensors), through the flat buffer per dtype, coalesced in place for the dtypes in `in_place`, or both mixed."""

from __future__ import annotations

import torch


def _worker(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from bertaccel.modules.train_step import all_reduce_grads

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    results = {}
    for key, in_place in (("flat", ()), ("bf16", (torch.bfloat16,)), ("all", (torch.bfloat16, torch.float32))):
        grads = [torch.full((5, 3), rank + 1.0).bfloat16(), torch.arange(7.0) * (rank + 1),
                 torch.full((4,), 10.0 ** rank).bfloat16()]
        ptrs = [g.data_ptr() for g in grads]
        all_reduce_grads(grads, in_place=in_place)
        assert [g.data_ptr() for g in grads] == ptrs
        results[key] = grads
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


def test_all_reduce_grads_sums_every_gradient_flat_coalesced_or_mixed_on_two_gloo_processes(tmp_path):
    world = 2
    torch.multiprocessing.spawn(_worker, args=(world, f"file://{tmp_path / 'store'}", str(tmp_path / "grads")),
                                nprocs=world)
    expected = [torch.full((5, 3), 3.0).bfloat16(), torch.arange(7.0) * 3, torch.full((4,), 11.0).bfloat16()]
    for rank in range(world):
        got = torch.load(f"{tmp_path / 'grads'}.{rank}")
        assert set(got) == {"flat", "bf16", "all"}
        for grads in got.values():
            for x, y in zip(grads, expected):
                assert x.dtype == y.dtype
                torch.testing.assert_close(x, y, rtol=0, atol=0)
