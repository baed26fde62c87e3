"""Batch collation: dynamic padding (to the longest row, optionally to a multiple of 8), or static
shapes for CUDA graphs (lengths padded up to one of a few buckets, short batches padded with
masked rows to the full batch size)."""

from __future__ import annotations

import bisect

import torch

from bertaccel.data.masking import IGNORE_INDEX  # also the label of a padding row


def bucket_lengths(max_length: int, buckets: int | list[int]) -> list[int]:
    """The padded lengths a batch may take: every multiple of `buckets` up to `max_length` (and
    `max_length` itself), or the given list (capped at `max_length`, which is always included)."""
    if isinstance(buckets, int):
        if buckets <= 0:
            raise ValueError(f"length_buckets must be a positive multiple or a list of lengths, got {buckets}.")
        out = list(range(buckets, max_length, buckets))
    else:
        if any(int(b) <= 0 for b in buckets):
            raise ValueError(f"length_buckets must hold positive lengths, got {list(buckets)}.")
        out = [int(b) for b in buckets if int(b) < max_length]
    return sorted(set(out)) + [max_length]


def pad_ids(
    rows: list[torch.Tensor],
    pad_id: int,
    multiple_of: int | None = None,
    buckets: list[int] | None = None,
    batch_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) input_ids and attention_mask.

    T is the longest row rounded up to `multiple_of`, or to the smallest of `buckets` that holds
    it. With `batch_size`, B is `batch_size` and the missing rows are padding rows: one [PAD]
    token that attends to itself (attention_mask 1 at position 0, so no softmax row is fully
    masked), to be ignored through their labels.
    """
    longest = max(r.numel() for r in rows)
    if buckets:
        i = bisect.bisect_left(buckets, longest)
        if i == len(buckets):
            raise ValueError(f"a row of {longest} tokens is longer than the largest bucket {buckets[-1]}.")
        longest = buckets[i]
    elif multiple_of:
        longest = -(-longest // multiple_of) * multiple_of
    n = len(rows)
    if batch_size is not None and n > batch_size:
        raise ValueError(f"{n} rows do not fit a batch of {batch_size}.")
    b = batch_size if batch_size is not None else n
    ids = torch.full((b, longest), pad_id, dtype=torch.long)
    mask = torch.zeros((b, longest), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : r.numel()] = r
        mask[i, : r.numel()] = 1
    mask[n:, 0] = 1
    return ids, mask


class ClassificationCollator:
    """Rows `{"input_ids", "label", "index"}` to a padded batch; a picklable class for workers.

    Every batch carries `num_rows`, the number of real rows (a Python int). With `batch_size`
    (static shapes), padding rows are added up to it: their `labels` are -100 and their `index`
    is -1, so losses, metrics and prediction writers skip them.
    """

    def __init__(
        self,
        pad_id: int,
        pad_to_multiple_of: int | None = None,
        buckets: list[int] | None = None,
        batch_size: int | None = None,
    ) -> None:
        self.pad_id, self.pad_to_multiple_of = pad_id, pad_to_multiple_of
        self.buckets, self.batch_size = buckets, batch_size

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor | int]:
        ids, mask = pad_ids([r["input_ids"] for r in rows], self.pad_id, self.pad_to_multiple_of, self.buckets, self.batch_size)
        n, b = len(rows), ids.shape[0]
        index = torch.full((b,), -1, dtype=torch.long)
        index[:n] = torch.tensor([r["index"] for r in rows], dtype=torch.long)
        batch = {"input_ids": ids, "attention_mask": mask, "index": index, "num_rows": n}
        if rows[0].get("label") is not None:
            labels = torch.full((b,), IGNORE_INDEX, dtype=torch.long)
            labels[:n] = torch.tensor([r["label"] for r in rows], dtype=torch.long)
            batch["labels"] = labels
        return batch
