"""Training samplers whose order depends only on (seed, epoch), so that a resumed run sees the
same batches as an uninterrupted one."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


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
