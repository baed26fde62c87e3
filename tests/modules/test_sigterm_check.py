"""The per-batch SIGTERM agreement under DDP read one batch late (modules/sigterm_check.py): a flag set
before batch i stops training at batch i + 1 on every rank, SIGTERMException as Lightning raises it, and
the replacement takes the fit loop's method only where Lightning has one and more than one rank runs."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException

from bertaccel.modules import sigterm_check


def _group(tmp_path, backend):
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)


@pytest.fixture
def one_process_group(tmp_path):
    _group(tmp_path, "gloo")
    yield
    dist.destroy_process_group()


def _trainer(device="cpu"):
    return types.SimpleNamespace(received_sigterm=False, world_size=2,
                                 strategy=types.SimpleNamespace(root_device=torch.device(device)))


def test_a_flag_set_before_a_batch_stops_the_batch_after(one_process_group):
    trainer = _trainer()
    check = sigterm_check.LaggedSigtermCheck(trainer)
    check()
    check()  # nothing received: no stop
    trainer.received_sigterm = True
    check()  # batch i broadcasts 1; it reads batch i - 1's 0
    with pytest.raises(SIGTERMException):
        check()  # batch i + 1 reads it


@pytest.mark.cuda
def test_the_flag_goes_through_pinned_memory_on_a_gpu(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _group(tmp_path, "nccl")  # as under DDP on GPUs
    try:
        _pinned_path()
    finally:
        dist.destroy_process_group()


def _pinned_path():
    trainer = _trainer("cuda")
    check = sigterm_check.LaggedSigtermCheck(trainer)
    check()
    host, event = check._pending
    assert host.is_pinned() and event is not None
    trainer.received_sigterm = True
    check()
    with pytest.raises(SIGTERMException):
        check()


class _Loop:
    def _broadcast_sigterm_tensor(self):
        raise AssertionError("Lightning's own check ran")


def test_install_replaces_the_loops_method_under_ddp_unless_turned_off(monkeypatch):
    loop = _Loop()
    trainer = _trainer()
    trainer.fit_loop = types.SimpleNamespace(epoch_loop=loop)
    trainer.world_size = 1
    assert not sigterm_check.install(trainer, force=True)
    trainer.world_size = 2
    monkeypatch.setenv("BERTACCEL_LAGGED_SIGTERM", "0")
    assert not sigterm_check.install(trainer)  # turned off: Lightning's own check stays
    assert "_broadcast_sigterm_tensor" not in loop.__dict__
    monkeypatch.delenv("BERTACCEL_LAGGED_SIGTERM")
    assert sigterm_check.install(trainer) and sigterm_check.install(trainer)  # the default; twice: still one replacement
    assert isinstance(loop._broadcast_sigterm_tensor, sigterm_check.LaggedSigtermCheck)
    trainer.fit_loop = types.SimpleNamespace(epoch_loop=object())  # a Lightning without the per-batch check
    assert not sigterm_check.install(trainer)


def test_lightning_still_has_the_per_batch_check():
    """The method this replaces: if Lightning renames it, install() silently does nothing - this says so."""
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    assert callable(getattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor", None))
