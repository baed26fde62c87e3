"""Training samplers whose order depends only on (seed, epoch), so that a resumed run sees the
same batches as an uninterrupted one; the evaluation sampler that shares a split over DDP ranks with
every row on exactly one rank."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DistributedSampler, Sampler

FILLER = -1  # an index that names no row: the evaluation datasets return a filler for it


class EpochSampler(Sampler[int]):
    """Indices 0..n-1, shuffled anew each epoch from (seed, epoch), optionally grouped by length.

    With `lengths` and `batch_size`, indices are cut into mega-batches of `mega_batches` x
    `batch_size`, each sorted by length, and the resulting batches shuffled: batches hold texts of
    similar length, so dynamic padding wastes little, and the order stays random (as in HF's
    `LengthGroupedSampler`). Lightning calls `set_epoch`; if nothing does (a wrapping sampler under
    DDP), the epoch advances by itself after each full pass.

    `ranks`: the number of DDP ranks the order is dealt to. `TrainShardSampler` gives rank r the indices
    r, r + W, r + 2W, ... of this order, so a rank's batch of `batch_size` is every W-th row of W * `batch_size`
    consecutive rows. Grouped by length, those W * `batch_size` rows are one group of similar lengths (a global
    batch): every rank's batch at a step then has about the same length. Grouped by `batch_size` alone, a
    rank's batch would mix rows of W differently long groups and be padded to the longest of them, on every
    rank, while the step waits for its slowest rank (`scripts/padding_per_step.py`: IMDB at 512 tokens, batch
    16, 2 ranks: 367 padded tokens a row per step against 288).
    """

    def __init__(
        self,
        n: int,
        seed: int,
        shuffle: bool = True,
        lengths: torch.Tensor | None = None,
        batch_size: int | None = None,
        mega_batches: int = 50,
        fixed: bool = False,
        ranks: int = 1,
    ) -> None:
        if ranks < 1:
            raise ValueError(f"ranks must be at least 1, got {ranks}.")
        self.n, self.seed, self.shuffle, self.fixed = n, seed, shuffle, fixed
        self.lengths, self.batch_size, self.mega_batches, self.ranks = lengths, batch_size, mega_batches, ranks
        self.epoch = 0
        self._epoch_set = False

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self._epoch_set = True

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        perm = torch.randperm(self.n, generator=g)
        if self.lengths is None or self.batch_size is None:
            return perm.tolist()
        size = self.batch_size * self.ranks  # one step's rows over all ranks
        mega = size * self.mega_batches
        batches = []
        for start in range(0, self.n, mega):
            chunk = perm[start : start + mega]
            chunk = chunk[torch.argsort(self.lengths[chunk], descending=True, stable=True)]
            batches += list(chunk.split(size))
        if not batches:
            return []
        # The one short group (the end of the last mega-batch) goes last: anywhere else it would shift every
        # later step's batch off its length group. The longest full group first: an out-of-memory shows at
        # step 0, not hours in.
        short = [b for b in batches if len(b) < size]
        full = [b for b in batches if len(b) == size]
        if not full:
            return torch.cat(short).tolist()
        longest = max(range(len(full)), key=lambda i: int(self.lengths[full[i]].max()))
        rest = [b for i, b in enumerate(full) if i != longest]
        rest = [rest[i] for i in torch.randperm(len(rest), generator=g).tolist()]
        return torch.cat([full[longest], *rest, *short]).tolist()

    def __iter__(self) -> Iterator[int]:
        if self.fixed:  # the same shuffled order every time (evaluation)
            return iter(self.order(0))
        epoch = self.epoch
        if not self._epoch_set:
            self.epoch += 1
        self._epoch_set = False
        return iter(self.order(epoch))

    def __len__(self) -> int:
        return self.n


class _RankShare(DistributedSampler):
    """One rank's share of the order of `base`, ceil(len(base) / num_replicas) indices on every rank. A
    DistributedSampler, so Lightning keeps it as it is (it wraps any other sampler in its own, which reshuffles a
    training order). The subclasses say which indices and how the epoch is followed."""

    def __init__(self, base: Sampler, num_replicas: int, rank: int) -> None:
        super().__init__(base, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)  # type: ignore[arg-type]
        self.base = base
        self.num_samples = -(-len(base) // num_replicas)  # type: ignore[arg-type]
        self.total_size = self.num_samples * num_replicas

    def __len__(self) -> int:
        return self.num_samples


class EvalShardSampler(_RankShare):
    """One rank's share of an evaluation order (`base`: a fixed EpochSampler), every row on exactly one
    rank: rank r takes rows r, r + W, r + 2W, ... of the order, and the shorter shares end with
    `FILLER` indices so that every rank runs the same number of batches (collectives stay matched).

    PyTorch's DistributedSampler instead repeats the first rows to even the shares out, so a split of n
    rows on W ranks is evaluated with up to W - 1 rows twice: the epoch's accuracy, F1 and loss count
    them. Fillers become padding rows (label -100, index -1; `ClassificationCollator`, the masked-LM's
    collate) that metrics, losses, prediction writers and the throughput meter skip. Lightning keeps a
    loader's sampler when it is a DistributedSampler, so this one is used as it is.
    """

    def __iter__(self) -> Iterator:
        share = list(self.base)[self.rank :: self.num_replicas]
        # the masked-LM's epoch-tagged sampler yields (epoch, index) pairs
        filler = (self.base.epoch, FILLER) if getattr(self.base, "yields_epoch", False) else FILLER
        return iter(share + [filler] * (self.num_samples - len(share)))

    def set_epoch(self, epoch: int) -> None:  # evaluation orders are fixed
        self.epoch = epoch


class TrainShardSampler(_RankShare):
    """One rank's share of a training order (`base`: an `EpochSampler` made with `ranks=num_replicas`):
    rows r, r + W, r + 2W, ... of the epoch's order, the order first filled up with its own first rows to a
    multiple of W (as PyTorch's DistributedSampler does), so every rank runs the same number of batches.

    Lightning wraps a training sampler that is not a DistributedSampler in its `DistributedSamplerWrapper`
    with shuffling always on: it reshuffles the order with its own seed, and the length groups are gone
    (measured on CPU, 2 ranks: a step's two batches were any two random batches). Being a DistributedSampler,
    this one is kept as it is: the ranks deal the order that one process would run, group by group, and
    `set_epoch` (which Lightning calls on it) reaches `base`."""

    def __iter__(self) -> Iterator:
        order = list(self.base)
        order += order[: self.total_size - len(order)]
        return iter(order[self.rank :: self.num_replicas])

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.base, "set_epoch"):
            self.base.set_epoch(epoch)


def train_ranks(trainer) -> int:
    """How many ranks Lightning deals a training sampler's order to (its distributed sampler wrapper under
    DDP and FSDP): the world size, or 1 on one process, outside a Trainer, or with `use_distributed_sampler`
    off (the user's sampler shards, or does not)."""
    if trainer is None:
        return 1
    kwargs = getattr(trainer, "distributed_sampler_kwargs", None)
    connector = getattr(trainer, "_accelerator_connector", None)
    if not kwargs or not getattr(connector, "use_distributed_sampler", True):
        return 1
    return int(kwargs.get("num_replicas", 1))


def shard_training(sampler: Sampler, trainer) -> Sampler:
    """A training sampler as is on one process, or this rank's `TrainShardSampler` when Lightning would
    deal it to several ranks (DDP, FSDP; `train_ranks`)."""
    ranks = train_ranks(trainer)
    if ranks <= 1:
        return sampler
    return TrainShardSampler(sampler, num_replicas=ranks, rank=trainer.global_rank)


def shard_for_ranks(sampler: Sampler, trainer) -> Sampler:
    """An evaluation sampler as is on one process, or this rank's `EvalShardSampler` under DDP/FSDP."""
    world = getattr(trainer, "world_size", 1) if trainer is not None else 1
    if world <= 1:
        return sampler
    return EvalShardSampler(sampler, num_replicas=world, rank=trainer.global_rank)
