"""Workers hand batches over by shared-memory file name (data.worker_sharing), process-wide, only when
a loader has workers; a bad value is refused with the choices."""

from __future__ import annotations

import sys

import pytest
import torch

from bertaccel.data.loader import set_worker_sharing
from bertaccel.data.classification import TextClassificationDataModule
from bertaccel.errors import DataError


@pytest.fixture
def restore_strategy():
    before = torch.multiprocessing.get_sharing_strategy()
    yield
    torch.multiprocessing.set_sharing_strategy(before)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux sharing strategies")
def test_set_worker_sharing_only_with_workers(restore_strategy):
    torch.multiprocessing.set_sharing_strategy("file_descriptor")
    set_worker_sharing("file_system", workers=0)
    assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor"
    set_worker_sharing(None, workers=2)
    assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor"
    set_worker_sharing("file_system", workers=2)
    assert torch.multiprocessing.get_sharing_strategy() == "file_system"


def test_bad_worker_sharing_is_refused():
    with pytest.raises(DataError, match="worker_sharing must be one of"):
        TextClassificationDataModule(dataset="x", worker_sharing="sockets")
