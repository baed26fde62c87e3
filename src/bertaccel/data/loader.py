"""`DeviceLoader`: a DataLoader that copies batches to the GPU one batch ahead on a side stream;
`ResumableDataLoader`: one whose place in the epoch also goes into checkpoints.

Copying ahead: Lightning copies each batch to the GPU on the compute stream right before its step
(non_blocking from pinned memory, so the host does not wait, but on the GPU the copy queues behind
the previous step and the step behind the copy). `DeviceLoader` issues the copy of batch N+1 on a
side stream when batch N is handed out, so the copy engine runs it while step N computes; the step
of batch N+1 waits for its copy with an event, and the batch's memory is marked as used by the
compute stream (`record_stream`) so the allocator does not hand it out early. Lightning's own
transfer then finds the tensors on the device and does nothing.

Lightning saves `state_dict()` of a training loader that has one and hands it back through
`load_state_dict()` on `fit --ckpt_path ...`. The state is (epoch, batches already trained on in
it), read from the trainer's own progress (not from the iterator, which Lightning's fetcher keeps one
batch ahead). On resume, every iterator made for the checkpoint's epoch skips those batches (Lightning
may make one before using it), so the run continues with the batch after the checkpoint instead of
restarting the epoch; with the random states the
checkpoint also carries, a resumed run ends with the weights of an uninterrupted one.

Under DDP Lightning rebuilds the loader around a distributed sampler that wraps ours; `progress` and
`epoch_sampler` are constructor arguments so the rebuilt loader keeps them. Every iterator sets the
epoch of the wrapped `EpochSampler` from the trainer's epoch (nothing else reaches it through the
wrapper), so each rank reads the same shard of the same order as in the uninterrupted run, and skips
the batches it already trained on.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection, move_data_to_device
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader

from bertaccel.errors import DataError

SHARING_STRATEGIES = ("file_system", "file_descriptor")


def check_worker_sharing(strategy: str | None) -> str | None:
    """`data.worker_sharing` as given, or a DataError naming the choices."""
    if strategy is not None and strategy not in SHARING_STRATEGIES:
        raise DataError(f"worker_sharing must be one of {SHARING_STRATEGIES} or null, got '{strategy}'.")
    return strategy


def set_worker_sharing(strategy: str | None, workers: int) -> None:
    """How DataLoader workers hand batches to the main process (process-wide; None: PyTorch's own).

    Workers put each batch's tensors in shared memory. PyTorch's Linux default, "file_descriptor",
    sends each tensor's descriptor over a new Unix socket with an authentication handshake: with
    four tensors per batch that was ~4 connections per training step, ~2.5 ms of the main process's
    (GIL-holding) time per step under cProfile on the H100 host (scripts/host_steps.py), against a
    4.7 ms graphed MiniLM step: the GPU waited for the host. "file_system" passes a shared-memory file
    name instead (no socket); PyTorch's shm manager removes the files.
    """
    check_worker_sharing(strategy)
    if strategy is None or workers == 0 or not sys.platform.startswith("linux"):
        return
    if torch.multiprocessing.get_sharing_strategy() != strategy:
        torch.multiprocessing.set_sharing_strategy(strategy)
        rank_zero_info(f"bertaccel: DataLoader workers share batches by '{strategy}' (data.worker_sharing).")


def prefetch_to_device(batches: Iterator[Any], device: torch.device) -> Iterator[Any]:
    """Yield `batches` moved to the CUDA `device`, each copied on a side stream one batch ahead."""
    stream = torch.cuda.Stream(device)

    def send(batch: Any) -> tuple[Any, torch.cuda.Event]:
        with torch.cuda.stream(stream):
            moved = move_data_to_device(batch, device)  # non_blocking from pinned memory
        return moved, stream.record_event()

    def receive(moved: Any, copied: torch.cuda.Event) -> Any:
        here = torch.cuda.current_stream(device)
        here.wait_event(copied)
        apply_to_collection(moved, torch.Tensor, lambda t: t.record_stream(here) if t.is_cuda else None)
        return moved

    ahead = None
    for batch in batches:
        sent = send(batch)
        if ahead is not None:
            yield receive(*ahead)
        ahead = sent
    if ahead is not None:
        yield receive(*ahead)


class DeviceLoader(DataLoader):
    """A DataLoader whose batches arrive on `device`, copied one batch ahead on a side CUDA stream
    (see the module docstring). `device` None or not a GPU: a plain DataLoader."""

    def __init__(self, *args: Any, device: torch.device | str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.device = device  # an attribute of this name: Lightning rebuilds loaders from their attributes

    def host_batches(self) -> Iterator[Any]:
        return super().__iter__()

    def __iter__(self) -> Iterator[Any]:
        it = self.host_batches()
        device = torch.device(self.device) if self.device is not None else None
        if device is None or device.type != "cuda":
            return it
        return prefetch_to_device(it, device)


def loader_device(trainer, enabled: bool) -> torch.device | None:
    """The device a data module's loaders copy ahead to: the trainer's GPU, when `enabled`."""
    if not enabled or trainer is None:
        return None
    device = trainer.strategy.root_device
    return device if device.type == "cuda" else None


class ResumableDataLoader(DeviceLoader):
    """A DataLoader with `state_dict` / `load_state_dict` for mid-epoch resume.

    `progress` (from the data module) returns (epoch, batches trained on in it) for the running fit;
    `epoch_sampler` is the sampler whose epoch follows the trainer's; `device` as in `DeviceLoader`.
    """

    _resume: tuple[int, int] | None = None

    def __init__(self, *args: Any, progress: Callable[[], tuple[int, int]] | None = None,
                 epoch_sampler: Any = None, device: torch.device | str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, device=device, **kwargs)
        self.progress = progress
        self.epoch_sampler = epoch_sampler  # the EpochSampler, possibly wrapped by Lightning under DDP

    def state_dict(self) -> dict[str, Any]:
        if self.progress is None:
            return {}
        epoch, done = self.progress()
        return {"epoch": int(epoch), "batches_done": int(done)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self._resume = (int(state["epoch"]), int(state["batches_done"]))

    def host_batches(self) -> Iterator[Any]:
        if self.progress is not None and self.epoch_sampler is not None:
            self.epoch_sampler.set_epoch(self.progress()[0])
        it = super().host_batches()
        if self._resume is not None and self.progress is not None:
            epoch, done = self._resume
            if epoch != self.progress()[0]:
                self._resume = None  # a later epoch: start at its beginning
            elif 0 < done < len(self):
                # Lightning may make the iterator of the resumed epoch more than once before using it:
                # every one of them skips the batches the checkpointed run already trained on
                for _ in range(done):
                    next(it)
        return it


def fit_progress(trainer) -> Callable[[], tuple[int, int]]:
    """`progress` for a training loader of `trainer`'s fit: (epoch, batches trained on in it)."""
    loop = trainer.fit_loop.epoch_loop
    return lambda: (trainer.current_epoch, loop.batch_progress.current.processed)
