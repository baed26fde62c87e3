"""Batch collation with dynamic padding (to the longest row, optionally to a multiple of 8)."""

from __future__ import annotations

import torch


def pad_ids(rows: list[torch.Tensor], pad_id: int, multiple_of: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) input_ids and attention_mask, T = longest row rounded up to `multiple_of`."""
    longest = max(r.numel() for r in rows)
    if multiple_of:
        longest = -(-longest // multiple_of) * multiple_of
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : r.numel()] = r
        mask[i, : r.numel()] = 1
    return ids, mask


class ClassificationCollator:
    """Rows `{"input_ids", "label", "index"}` to a padded batch; a picklable class for workers."""

    def __init__(self, pad_id: int, pad_to_multiple_of: int | None = None) -> None:
        self.pad_id, self.pad_to_multiple_of = pad_id, pad_to_multiple_of

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        ids, mask = pad_ids([r["input_ids"] for r in rows], self.pad_id, self.pad_to_multiple_of)
        batch = {
            "input_ids": ids,
            "attention_mask": mask,
            "index": torch.tensor([r["index"] for r in rows], dtype=torch.long),
        }
        if rows[0].get("label") is not None:
            batch["labels"] = torch.tensor([r["label"] for r in rows], dtype=torch.long)
        return batch
