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

One buffer per batch: a batch of several tensors (the packed classification batch has six) costs the
main process per tensor: a shared-memory file from the worker, unpickling it, a pinned copy, a
host-to-device copy, a `record_stream`. On the H100 host (cProfile of a graphed MiniLM fine-tune,
commit beaa183) fetching a batch took ~1.9 ms of the host's ~4.5 ms per step, the GPU's step being
4.5 ms: the host set the pace at times. `DeviceLoader` therefore collates every batch into one byte
buffer (`pack_batch`, in the worker) and hands out views of it again (`unpack_batch`: after the copy
to the GPU, or at once without one): one of each of those per batch.

Under DDP the classification loaders shard their own training order (`samplers.TrainShardSampler`); other
loaders Lightning rebuilds around a distributed sampler that wraps theirs. `progress` and `epoch_sampler` are
constructor arguments so a rebuilt loader keeps them. Every iterator sets the
epoch of the wrapped `EpochSampler` from the trainer's epoch (nothing else reaches it through the
wrapper), so each rank reads the same shard of the same order as in the uninterrupted run, and skips
the batches it already trained on.
"""

from __future__ import annotations

import math
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


BUFFER_KEY, LAYOUT_KEY = "_batch_buffer", "_batch_layout"
_ALIGN = 16  # bytes: every field starts at a multiple, so any dtype can view its bytes


class BatchLayout:
    """Where a packed batch's tensors lie in its buffer: (key, byte offset, shape, dtype) for each tensor, (key,
    None, None, None) for any other value, in the batch's key order. An object rather than a tuple so that the
    walks over every batch (the pin-memory thread's, Lightning's transfer and `apply_to_collection`) take it as one
    leaf instead of descending into its ~30 nested items (~50 us of the main process's time per walk, three walks
    a step, against a 2.6 ms graphed MiniLM step at max_length 256)."""

    __slots__ = ("fields",)

    def __init__(self, fields: tuple) -> None:
        self.fields = fields

    def __reduce__(self):  # pickled to the main process from the workers
        return BatchLayout, (self.fields,)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BatchLayout) and self.fields == other.fields

    def __repr__(self) -> str:
        return f"BatchLayout({self.fields!r})"


def is_packed(batch: Any) -> bool:
    """Whether `batch` is one `pack_batch` made (its tensors in one buffer)."""
    return isinstance(batch, dict) and BUFFER_KEY in batch


def pack_batch(batch: Any) -> Any:
    """A dict batch with its CPU tensors copied into one uint8 buffer (`BUFFER_KEY`) and their places
    (`LAYOUT_KEY`: a `BatchLayout`); anything else, or a dict with fewer than two tensors, as it is."""
    if not isinstance(batch, dict) or is_packed(batch):
        return batch
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and v.device.type == "cpu"
               and not v.requires_grad}
    if len(tensors) < 2:
        return batch
    layout, offset = [], 0
    for k, v in batch.items():
        if k not in tensors:
            layout.append((k, None, None, None))
            continue
        layout.append((k, offset, tuple(v.shape), v.dtype))
        offset += -(-v.numel() * v.element_size() // _ALIGN) * _ALIGN
    buffer = torch.empty(offset, dtype=torch.uint8)
    for k, at, _, dtype in layout:
        if at is not None:
            v = tensors[k]
            buffer[at : at + v.numel() * v.element_size()].view(dtype).copy_(v.reshape(-1))
    out = {k: v for k, v in batch.items() if k not in tensors}
    out[BUFFER_KEY], out[LAYOUT_KEY] = buffer, BatchLayout(tuple(layout))
    return out


def unpack_batch(batch: Any) -> Any:
    """The batch `pack_batch` packed, its tensors views of the buffer (wherever the buffer now is)."""
    if not is_packed(batch):
        return batch
    buffer = batch[BUFFER_KEY]
    out = {}
    for k, at, shape, dtype in batch[LAYOUT_KEY].fields:
        if at is None:
            out[k] = batch[k]
        else:
            out[k] = buffer[at : at + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
    return out


class OneBufferCollate:
    """A collate function whose dict batches come out packed into one buffer (`pack_batch`)."""

    def __init__(self, collate: Callable[[list], Any]) -> None:
        self.collate = collate

    def __call__(self, rows: list) -> Any:
        return pack_batch(self.collate(rows))


def prefetch_to_device(batches: Iterator[Any], device: torch.device) -> Iterator[Any]:
    """Yield `batches` moved to the CUDA `device`, each copied on a side stream one batch ahead."""
    stream = torch.cuda.Stream(device)

    def send(batch: Any) -> tuple[Any, torch.cuda.Event]:
        with torch.cuda.stream(stream):
            if is_packed(batch):  # one tensor: no walk over the batch
                moved = dict(batch)
                moved[BUFFER_KEY] = batch[BUFFER_KEY].to(device, non_blocking=True)
            else:
                moved = move_data_to_device(batch, device)  # non_blocking from pinned memory
        return moved, stream.record_event()

    def receive(moved: Any, copied: torch.cuda.Event) -> Any:
        here = torch.cuda.current_stream(device)
        here.wait_event(copied)
        if is_packed(moved):
            moved[BUFFER_KEY].record_stream(here)
        else:
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
    (see the module docstring). `device` None or not a GPU: a plain DataLoader. With `one_buffer`
    (default) and a `collate_fn`, each dict batch travels as one buffer (`pack_batch`) and comes out
    as the collate function made it."""

    def __init__(self, *args: Any, device: torch.device | str | None = None, one_buffer: bool = True,
                 **kwargs: Any) -> None:
        collate = kwargs.get("collate_fn")
        if one_buffer and collate is not None and not isinstance(collate, OneBufferCollate):
            kwargs["collate_fn"] = OneBufferCollate(collate)
        # The batches are pinned by PyTorch's pin-memory thread. Pinning them in the loop's own thread instead,
        # right before the copy (no second Python thread taking the interpreter's lock), measured slower: MiniLM
        # IMDB at 256, three interleaved rounds, 8,174-8,898 against 9,759-11,081 samples/s (H200, session 60).
        super().__init__(*args, **kwargs)
        # attributes of these names: Lightning rebuilds loaders from their attributes (the collate_fn it
        # finds is already wrapped, so a rebuilt loader does not wrap it again)
        self.device, self.one_buffer = device, one_buffer

    def host_batches(self) -> Iterator[Any]:
        return super().__iter__()

    def __iter__(self) -> Iterator[Any]:
        it = self.host_batches()
        device = torch.device(self.device) if self.device is not None else None
        if device is not None and device.type == "cuda":
            it = prefetch_to_device(it, device)
        return map(unpack_batch, it)


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
