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
