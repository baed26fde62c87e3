"""`train_step.all_reduce_grads` on two gloo processes: every gradient summed over the ranks, in place (the same
tensors), through the flat buffer per dtype, coalesced in place for the dtypes in `in_place` (and the gradients of
at least `in_place_numel` elements: the fp32 one of 7 in place, the one of 3 through the flat buffer), or mixed."""

from __future__ import annotations

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
