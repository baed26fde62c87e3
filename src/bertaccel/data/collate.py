"""Batch collation: dynamic padding (to the longest row, optionally to a multiple of 8), or static
shapes for CUDA graphs (lengths padded up to one of a few buckets, short batches padded with
masked rows to the full batch size); for the unpadded encoder, also where the real tokens are
(`packed_layout`), computed here on the CPU so that the step needs no host read."""

from __future__ import annotations

import bisect

import torch
import torch.nn.functional as F

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
    longest = max((r.numel() for r in rows), default=1)  # no rows: a batch of padding rows only
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


def packed_layout(mask: torch.Tensor, token_quantum: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the real tokens of a right-padded [batch, seq] attention mask are, as the unpadded encoder
    (`bertaccel.modules.unpadded`) takes them: `packed_indices`, the flat positions (b * seq + s) of
    the real tokens sequence by sequence, and `cu_seqlens`, the int32 offsets of each sequence
    ([batch + 1], FlashAttention's varlen convention).

    With `token_quantum`, the token count is rounded up to a multiple of it (at most batch x seq) with
    filler positions appended after the real tokens: the first padding positions of the batch, each
    once, so that packing and unpacking stay exact. A CUDA graph then sees a few token counts instead
    of one per batch; the fillers run through the encoder as padding tokens and are never read back.
    """
    mask = mask.bool()
    seq = mask.shape[1]
    lengths = mask.sum(1)
    if bool((mask != (torch.arange(seq) < lengths[:, None])).any()):
        raise ValueError("the unpadded encoder needs right-padded batches (real tokens first in every row).")
    flat = mask.reshape(-1)
    indices = flat.nonzero().squeeze(1)
    if token_quantum:
        tokens = indices.numel()
        budget = min(flat.numel(), -(-max(tokens, 1) // token_quantum) * token_quantum)
        fill = (~flat).nonzero().squeeze(1)[: budget - tokens]
        indices = torch.cat([indices, fill])
    cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    return indices, cu_seqlens


class ClassificationCollator:
    """Rows `{"input_ids", "label", "index"}` to a padded batch; a picklable class for workers.

    Every batch carries `num_rows`, the number of real rows (a Python int). With `batch_size`
    (static shapes), padding rows are added up to it: their `labels` are -100 and their `index`
    is -1, so losses, metrics and prediction writers skip them. A filler row (`{"filler": True}`,
    what the datasets return for `EvalShardSampler`'s FILLER index) becomes such a padding row too.
    With `packed`, batches also carry `packed_indices` and `cu_seqlens` (`packed_layout`); with
    static shapes the token count is rounded up to one of `token_buckets` steps of batch x seq.
    """

    def __init__(
        self,
        pad_id: int,
        pad_to_multiple_of: int | None = None,
        buckets: list[int] | None = None,
        batch_size: int | None = None,
        packed: bool = False,
        token_buckets: int = 16,
    ) -> None:
        self.pad_id, self.pad_to_multiple_of = pad_id, pad_to_multiple_of
        self.buckets, self.batch_size = buckets, batch_size
        self.packed, self.token_buckets = packed, token_buckets

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor | int]:
        # fillers (an evaluation share under DDP padded to the other ranks' length) become padding rows
        size = self.batch_size if self.batch_size is not None else len(rows)
        labelled = any(r.get("label") is not None for r in rows)
        rows = [r for r in rows if not r.get("filler")]
        ids, mask = pad_ids([r["input_ids"] for r in rows], self.pad_id, self.pad_to_multiple_of, self.buckets, size)
        n, b = len(rows), ids.shape[0]
        index = torch.full((b,), -1, dtype=torch.long)
        index[:n] = torch.tensor([r["index"] for r in rows], dtype=torch.long)
        batch = {"input_ids": ids, "attention_mask": mask, "index": index, "num_rows": n}
        if self.packed:
            quantum = None
            if self.batch_size is not None:  # static shapes: a few token counts per length bucket
                quantum = -(-ids.numel() // self.token_buckets)
                quantum = -(-quantum // 8) * 8
            batch["packed_indices"], batch["cu_seqlens"] = packed_layout(mask, quantum)
        if labelled:
            labels = torch.full((b,), IGNORE_INDEX, dtype=torch.long)
            labels[:n] = torch.tensor([r["label"] for r in rows], dtype=torch.long)
            batch["labels"] = labels
        return batch
