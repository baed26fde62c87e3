"""Lightning's per-batch SIGTERM agreement under DDP, without a host-device synchronisation per step.

Lightning (2.5+, `_TrainingEpochLoop._broadcast_sigterm_tensor`) makes the ranks agree at the start of
every training batch whether rank 0 has received SIGTERM: it makes a one-element tensor on the device,
broadcasts it from rank 0 and reads it back with `.item()`. The read waits for everything queued on the
GPU - the steps the host had launched ahead - so each step's host work (the loop, the hooks, the next
launch) then runs while the GPU is idle. Measured on 2 H100s, MiniLM IMDB max_length 256 with
`recommended.yaml` (one epoch, session 45, `scripts/host_steps.py`): 2.6 ms of every step's host time inside
it (8.9 ms per step under cProfile), the GPU busy 69% of each step (87% on one GPU), 4.1 ms per step counted as
waiting for the batch.

`LaggedSigtermCheck` makes the same agreement one batch later: at batch i it enqueues the collective over
the flag (an all_reduce max since 331f418, below), a non-blocking copy of the result into pinned host memory and
an event; at batch i + 1 it waits for
that event only - for the GPU work queued before batch i's step, which the host is at most one step
ahead of - and acts on the value. Every rank reads the same result at the same batch, so all ranks stop
at the same batch as before, one batch later. On a CPU device (gloo) the copy is synchronous and the
logic the same. `install` puts it in place of the loop's method when Lightning has one (else nothing
changes: Lightning without the per-batch check, or a later version that changed it).

On by default; BERTACCEL_LAGGED_SIGTERM=0 puts Lightning's own check back. Its first version made the flag with
torch.tensor(..., device=...) - a copy from pageable memory, which waits for the stream - and measured no gain
on 2 H200s (10,406 against 11,281 train samples/s). The flag is now made by a fill kernel, and on 2 H200s
(session 46, commit 604f561, same fit, two rounds alternating, `STAGES=sigterm scripts/gpu_check.sh`):
15,881 / 15,324 train samples/s against 10,408 / 10,484 with Lightning's check (1.49x), the GPU busy 93% / 91%
of each step against 72% / 77%, the same validation accuracy; `benchmarks/bench_sigterm_check.py` with 50 ms of
GPU work queued: 0.56 ms of host time per check against Lightning's 49.9 ms (it waits for the queue).

The signal itself (session 46). Lightning's SIGTERM handler, besides setting `trainer.received_sigterm` and
passing the signal on to the ranks its launcher started, broadcasts a flag from inside the signal handler - a
collective at whatever point the handler interrupts, out of step with the other ranks' collectives - and the
training loop then raises on that rank alone at the end of its batch. A SIGTERM that reaches rank 0 alone (as
where rank 0 launched no other rank) hung a 2-process gloo fit with Lightning's check and with this one alike.
`install` therefore also puts `LaggedSigtermCheck.on_sigterm` in the place of Lightning's notifier in the
registered handler: it records the signal and passes it on as Lightning does, without a collective and without
setting `received_sigterm`; the per-batch agreement is a max over every rank's flag (all_reduce) rather than
rank 0's broadcast, so a SIGTERM reaching any one rank stops all of them after the same batch, and
`received_sigterm` is set on every rank when they agree, just before SIGTERMException. Measured in this form on 2
H200s (331f418, `graphs.yaml`, one epoch each): 8,325 train samples/s against 6,188 with Lightning's check.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException

log = logging.getLogger(__name__)

_METHOD = "_broadcast_sigterm_tensor"


class LaggedSigtermCheck:
    """Callable replacing `trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor`, and (`on_sigterm`) the
    SIGTERM handler's notifier (see the module)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.signalled = False  # this process got SIGTERM (on_sigterm)
        self._pending: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
        self.notifier_note_given = False  # install's message when the handler's notifier could not be replaced

    def on_sigterm(self, signum: int, _frame: Any) -> None:
        """In the place of Lightning's `_sigterm_notifier_fn`: record the signal and pass it on to the ranks
        this process launched (as Lightning does), with no collective and no `received_sigterm` yet."""
        # on Lightning's logger, which prints at INFO, as its own notifier's message
        logging.getLogger("lightning.pytorch").info(f"[rank: {getattr(self.trainer, 'global_rank', '?')}] Received SIGTERM: {signum}")
        if not self.signalled:
            launcher = getattr(self.trainer.strategy, "launcher", None)
            if launcher is not None:
                launcher.kill(signum)
        self.signalled = True

    def __call__(self) -> None:
        previous, self._pending = self._pending, None
        device = self.trainer.strategy.root_device
        # made on the device by a fill kernel: torch.tensor([...], device=...) copies from pageable host memory,
        # which waits for the stream - the very synchronisation this class exists to avoid (its first version
        # did that and measured no gain)
        flag = torch.zeros(1, dtype=torch.int64, device=device)
        if self.signalled or getattr(self.trainer, "received_sigterm", False):
            flag.fill_(1)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # any rank's SIGTERM stops every rank
        except Exception:  # noqa: BLE001 - as Lightning's own check: a failed collective does not stop training
            flag = None
        if flag is not None:
            if device.type == "cuda":
                host = torch.empty(1, dtype=flag.dtype, pin_memory=True)
                host.copy_(flag, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self._pending = (host, event)
            else:
                self._pending = (flag, None)
        if previous is not None:
            host, event = previous
            if event is not None:
                event.synchronize()
            if int(host[0]) == 1:
                connector = getattr(self.trainer, "_signal_connector", None)
                if connector is not None:
                    connector.received_sigterm = True  # every rank, at the same batch
                with contextlib.suppress(Exception):
                    dist.barrier()  # as Lightning: every rank here before any exits
                raise SIGTERMException()


def enabled() -> bool:
    """On unless BERTACCEL_LAGGED_SIGTERM=0 (measured on 2 H200s: see the module)."""
    return os.environ.get("BERTACCEL_LAGGED_SIGTERM", "1") != "0"


def install(trainer: Any, force: bool = False) -> bool:
    """Replace the fit loop's per-batch SIGTERM broadcast with `LaggedSigtermCheck` (DDP only: the loop
    calls it when torch.distributed is initialised with more than one rank), where `enabled()` or `force`,
    and Lightning's SIGTERM notifier in the registered handler with its `on_sigterm`. True if replaced."""
    if not (force or enabled()):
        return False
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    if loop is None or trainer.world_size <= 1 or not callable(getattr(type(loop), _METHOD, None)):
        return False
    check = loop.__dict__.get(_METHOD)
    if not isinstance(check, LaggedSigtermCheck):
        check = LaggedSigtermCheck(trainer)
        setattr(loop, _METHOD, check)
        log.debug("bertaccel: the per-batch SIGTERM agreement reads its result one batch late (no sync per step)")
    if not _replace_notifier(trainer, check) and not check.notifier_note_given:
        check.notifier_note_given = True  # once per check (install runs at every fit start)
        log.info("bertaccel: Lightning's SIGTERM notifier stays in the signal handler (%s): a SIGTERM reaching one rank "
                 "alone runs its broadcast inside the handler, as without bertaccel; the per-batch agreement is still "
                 "read one batch late", _why_notifier_stays(trainer))
    return True


def _why_notifier_stays(trainer: Any) -> str:
    """Why `_replace_notifier` found nothing to replace, for install's message."""
    if getattr(getattr(trainer, "_signal_connector", None), "_sigterm_notifier_fn", None) is None:
        return "this Lightning's signal connector has no SIGTERM notifier"
    if threading.current_thread() is not threading.main_thread():
        return "not on the main thread, where signal handlers are set"
    return "the registered SIGTERM handler is not Lightning's composition holding its notifier"


def _replace_notifier(trainer: Any, check: LaggedSigtermCheck) -> bool:
    """In the SIGTERM handler Lightning registered (a `_HandlersCompose` of its connector's notifier and any
    handler there before), put `check.on_sigterm` where the notifier is. Lightning's connector restores the
    handlers it found at the end of the run. False where there is nothing to replace (not the main thread,
    another handler registered since, a Lightning without the notifier)."""
    connector = getattr(trainer, "_signal_connector", None)
    notifier = getattr(connector, "_sigterm_notifier_fn", None)
    if notifier is None or threading.current_thread() is not threading.main_thread():
        return False
    handlers = getattr(signal.getsignal(signal.SIGTERM), "signal_handlers", None)
    if not isinstance(handlers, list):
        return False
    for i, h in enumerate(handlers):
        if h == notifier or h == check.on_sigterm:
            handlers[i] = check.on_sigterm
            return True
    return False
