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


def test_install_puts_on_sigterm_in_the_place_of_lightnings_notifier(monkeypatch):
    """The registered SIGTERM handler (Lightning's composition of its notifier and any earlier handler) gets
    the check's on_sigterm where the notifier was; on_sigterm records the signal and passes it on to the
    launched ranks once, with no collective and without setting received_sigterm (that waits for the
    ranks to agree)."""
    import signal

    from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose

    killed = []
    earlier = []
    connector = types.SimpleNamespace(received_sigterm=False)
    connector._sigterm_notifier_fn = lambda signum, frame: None
    trainer = _trainer()
    trainer.world_size = 2
    trainer.global_rank = 0
    trainer._signal_connector = connector
    trainer.strategy.launcher = types.SimpleNamespace(kill=killed.append)
    loop = _Loop()
    trainer.fit_loop = types.SimpleNamespace(epoch_loop=loop)
    before = signal.getsignal(signal.SIGTERM)
    composed = _HandlersCompose([connector._sigterm_notifier_fn, lambda signum, frame: earlier.append(signum)])
    signal.signal(signal.SIGTERM, composed)
    try:
        monkeypatch.delenv("BERTACCEL_LAGGED_SIGTERM", raising=False)
        assert sigterm_check.install(trainer) and sigterm_check.install(trainer)
        check = loop._broadcast_sigterm_tensor
        assert composed.signal_handlers[0] == check.on_sigterm and len(composed.signal_handlers) == 2
        composed(signal.SIGTERM, None)
        composed(signal.SIGTERM, None)
        assert check.signalled and killed == [signal.SIGTERM] and earlier == [signal.SIGTERM] * 2
        assert not connector.received_sigterm
    finally:
        signal.signal(signal.SIGTERM, before)


def test_install_says_once_when_the_handlers_notifier_stays(monkeypatch, caplog):
    """Where the registered SIGTERM handler holds no Lightning notifier (another handler set since), the per-batch
    check is still replaced and install says, once, why the notifier stays."""
    import logging
    import signal

    connector = types.SimpleNamespace(received_sigterm=False)
    connector._sigterm_notifier_fn = lambda signum, frame: None
    trainer = _trainer()
    trainer.world_size = 2
    trainer._signal_connector = connector
    loop = _Loop()
    trainer.fit_loop = types.SimpleNamespace(epoch_loop=loop)
    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # someone else's handler, not Lightning's composition
    try:
        monkeypatch.delenv("BERTACCEL_LAGGED_SIGTERM", raising=False)
        with caplog.at_level(logging.INFO, logger="bertaccel.modules.sigterm_check"):
            assert sigterm_check.install(trainer) and sigterm_check.install(trainer)
        assert isinstance(loop._broadcast_sigterm_tensor, sigterm_check.LaggedSigtermCheck)
        notes = [r.getMessage() for r in caplog.records if "notifier stays" in r.getMessage()]
        assert len(notes) == 1 and "not Lightning's composition" in notes[0]
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_signal_recorded_by_on_sigterm_stops_the_batch_after_next_and_sets_received_sigterm(one_process_group):
    trainer = _trainer()
    trainer._signal_connector = types.SimpleNamespace(received_sigterm=False)
    trainer.strategy.launcher = None
    check = sigterm_check.LaggedSigtermCheck(trainer)
    check()
    check.on_sigterm(15, None)
    check()  # batch i: the flag goes out
    assert not trainer._signal_connector.received_sigterm
    with pytest.raises(SIGTERMException):
        check()  # batch i + 1: agreed
    assert trainer._signal_connector.received_sigterm
