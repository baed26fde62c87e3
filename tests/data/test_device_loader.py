"""DeviceLoader: batches copied to the GPU one batch ahead on a side stream; Lightning rebuilds it
(DDP's distributed sampler, predict's index sampler) with its device."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import DistributedSampler

from bertaccel.data.loader import DeviceLoader, ResumableDataLoader, loader_device


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 37

    def __getitem__(self, i):
        return {"x": torch.full((5,), float(i)), "index": torch.tensor(i), "tag": "row"}


def test_without_a_gpu_device_it_is_a_plain_dataloader():
    plain = list(torch.utils.data.DataLoader(Rows(), batch_size=8))
    for device in (None, "cpu"):
        got = list(DeviceLoader(Rows(), batch_size=8, device=device))
        assert len(got) == len(plain)
        assert all(torch.equal(a["x"], b["x"]) and a["tag"] == b["tag"] for a, b in zip(got, plain))
    assert loader_device(None, True) is None


def test_lightning_rebuilds_keep_the_device():
    loader = DeviceLoader(Rows(), batch_size=8, device="cuda:1")
    sampler = DistributedSampler(Rows(), num_replicas=2, rank=0, shuffle=False)
    rebuilt = _update_dataloader(loader, sampler, mode=RunningStage.PREDICTING)
    assert type(rebuilt) is DeviceLoader and rebuilt.device == "cuda:1"
    resumable = ResumableDataLoader(Rows(), batch_size=8, device="cuda:0", progress=lambda: (0, 0))
    rebuilt = _update_dataloader(resumable, sampler)
    assert type(rebuilt) is ResumableDataLoader and rebuilt.device == "cuda:0" and rebuilt.progress is not None


@pytest.mark.cuda
def test_batches_arrive_on_the_gpu_in_order_and_intact():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    loader = DeviceLoader(Rows(), batch_size=8, pin_memory=True, num_workers=2, device=device)
    expected = list(torch.utils.data.DataLoader(Rows(), batch_size=8))
    for _ in range(2):  # two epochs, workers reused
        got = []
        for batch in loader:
            assert batch["x"].is_cuda and batch["index"].is_cuda and batch["tag"] == ["row"] * len(batch["x"])
            # keep the compute stream busy so a copy that did not wait for its event would be caught
            # reading stale memory: overwrite the batch after a long kernel, then compare a copy
            big = torch.randn(2048, 2048, device=device)
            for _ in range(5):
                big = big @ big / 2048**0.5
            got.append({k: v.clone() for k, v in batch.items() if torch.is_tensor(v)})
            batch["x"].fill_(-1.0)
        torch.cuda.synchronize()
        assert len(got) == len(expected)
        for a, b in zip(got, expected):
            assert torch.equal(a["x"].cpu(), b["x"]) and torch.equal(a["index"].cpu(), b["index"])


class Mixed(torch.utils.data.Dataset):
    """Rows with tensors of several dtypes and shapes, an empty one, and non-tensor values."""

    def __len__(self):
        return 21

    def __getitem__(self, i):
        return {"ids": torch.arange(i, i + 3), "mask": torch.tensor([i % 2 == 0, True, False]),
                "cu": torch.tensor([0, i], dtype=torch.int32), "x": torch.full((2, 5), i / 3, dtype=torch.bfloat16),
                "empty": torch.zeros(0), "tag": f"row{i}", "n": i}


def test_one_buffer_batches_come_out_as_collated(tmp_path):
    """Batches packed into one buffer in the workers come out equal to the plain collate's, every dtype
    and shape, key order and non-tensor values included; the packed form holds one tensor."""
    from torch.utils.data import default_collate

    from bertaccel.data.loader import BUFFER_KEY, pack_batch, unpack_batch

    expected = list(torch.utils.data.DataLoader(Mixed(), batch_size=4, collate_fn=default_collate))
    packed = pack_batch(expected[0])
    assert [k for k, v in packed.items() if torch.is_tensor(v)] == [BUFFER_KEY]
    for workers in (0, 2):
        got = list(DeviceLoader(Mixed(), batch_size=4, collate_fn=default_collate, num_workers=workers))
        assert len(got) == len(expected)
        for a, b in zip(got, expected):
            assert list(a) == list(b)
            for k in b:
                if torch.is_tensor(b[k]):
                    assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
                else:
                    assert a[k] == b[k], k
    assert unpack_batch({"x": 1}) == {"x": 1} and pack_batch([torch.ones(2)])[0].tolist() == [1.0, 1.0]


def test_the_packed_layout_is_one_leaf_for_the_walks_over_a_batch():
    """The layout travels as one object (pickled from the workers unchanged): the pin-memory thread's walk and
    Lightning's `apply_to_collection` see it as a leaf, not ~30 nested items."""
    import pickle

    from lightning.fabric.utilities.apply_func import apply_to_collection
    from torch.utils.data import default_collate

    from bertaccel.data.loader import LAYOUT_KEY, BatchLayout, pack_batch, unpack_batch

    packed = pack_batch(default_collate([Mixed()[i] for i in range(4)]))
    layout = packed[LAYOUT_KEY]
    assert isinstance(layout, BatchLayout) and pickle.loads(pickle.dumps(layout)) == layout
    # strings: the "tag" column's four; a walk descending into the layout would also meet its keys ("ids", ...)
    seen = []
    apply_to_collection(packed, str, lambda v: seen.append(v) or v)
    assert seen == [f"row{i}" for i in range(4)], seen
    unpacked = unpack_batch(pickle.loads(pickle.dumps(packed)))
    assert torch.equal(unpacked["ids"], default_collate([Mixed()[i] for i in range(4)])["ids"])


def test_lightning_rebuilds_do_not_wrap_the_collate_twice():
    from torch.utils.data import default_collate

    from bertaccel.data.loader import OneBufferCollate

    loader = DeviceLoader(Mixed(), batch_size=4, collate_fn=default_collate)
    rebuilt = _update_dataloader(loader, DistributedSampler(Mixed(), num_replicas=2, rank=1, shuffle=False))
    assert isinstance(rebuilt.collate_fn, OneBufferCollate) and rebuilt.collate_fn.collate is default_collate
    assert torch.equal(next(iter(rebuilt))["ids"], default_collate([Mixed()[i] for i in (1, 3, 5, 7)])["ids"])
    plain = DeviceLoader(Mixed(), batch_size=4, collate_fn=default_collate, one_buffer=False)
    assert plain.collate_fn is default_collate
