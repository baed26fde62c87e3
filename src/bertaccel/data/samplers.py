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
    ) -> None:
        self.n, self.seed, self.shuffle, self.fixed = n, seed, shuffle, fixed
        self.lengths, self.batch_size, self.mega_batches = lengths, batch_size, mega_batches
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
        mega = self.batch_size * self.mega_batches
        batches = []
        for start in range(0, self.n, mega):
            chunk = perm[start : start + mega]
            chunk = chunk[torch.argsort(self.lengths[chunk], descending=True, stable=True)]
            batches += list(chunk.split(self.batch_size))
        # The longest batch first: an out-of-memory shows at step 0, not hours in.
        longest = max(range(len(batches)), key=lambda i: int(self.lengths[batches[i]].max()))
        rest = [b for i, b in enumerate(batches) if i != longest]
        rest = [rest[i] for i in torch.randperm(len(rest), generator=g).tolist()]
        return torch.cat([batches[longest], *rest]).tolist() if batches else []

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


class EvalShardSampler(DistributedSampler):
    """One rank's share of an evaluation order (`base`: a fixed EpochSampler), every row on exactly one
    rank: rank r takes rows r, r + W, r + 2W, ... of the order, and the shorter shares end with
    `FILLER` indices so that every rank runs the same number of batches (collectives stay matched).

    PyTorch's DistributedSampler instead repeats the first rows to even the shares out, so a split of n
    rows on W ranks is evaluated with up to W - 1 rows twice: the epoch's accuracy, F1 and loss count
    them. Fillers become padding rows (label -100, index -1; `ClassificationCollator`, the masked-LM's
    collate) that metrics, losses, prediction writers and the throughput meter skip. Lightning keeps a
    loader's sampler when it is a DistributedSampler, so this one is used as it is.
    """

    def __init__(self, base: Sampler, num_replicas: int, rank: int) -> None:
        super().__init__(base, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)  # type: ignore[arg-type]
        self.base = base
        self.num_samples = -(-len(base) // num_replicas)  # type: ignore[arg-type]
        self.total_size = self.num_samples * num_replicas

    def __iter__(self) -> Iterator:
        share = list(self.base)[self.rank :: self.num_replicas]
        # the masked-LM's epoch-tagged sampler yields (epoch, index) pairs
        filler = (self.base.epoch, FILLER) if getattr(self.base, "yields_epoch", False) else FILLER
        return iter(share + [filler] * (self.num_samples - len(share)))

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:  # evaluation orders are fixed
        self.epoch = epoch


def shard_for_ranks(sampler: Sampler, trainer) -> Sampler:
    """An evaluation sampler as is on one process, or this rank's `EvalShardSampler` under DDP/FSDP."""
    world = getattr(trainer, "world_size", 1) if trainer is not None else 1
    if world <= 1:
        return sampler
    return EvalShardSampler(sampler, num_replicas=world, rank=trainer.global_rank)
