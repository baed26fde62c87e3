"""`MLMDataModule`: text packed into fixed-length blocks with [CLS]/[SEP], masked anew every epoch."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from bertaccel.data.masking import (IGNORE_INDEX, block_keys, continuation_table, mask_blocks, replacement_pool,
                                    special_table)
from bertaccel.data.loader import (DeviceLoader, ResumableDataLoader, check_worker_sharing, fit_progress,
                                   loader_device, set_worker_sharing)
from bertaccel.data.samplers import FILLER, EpochSampler, shard_for_ranks
from bertaccel.data.sources import (TEXT_SUFFIXES, TABLE_SUFFIXES, find_split_file, load_hub_dataset, looks_like_path,
                                     read_text_documents)
from bertaccel.data.tokenized import tokenize_texts
from bertaccel.errors import DataError, check_batch_sizes
from bertaccel.pretrained import load_tokenizer

log = logging.getLogger(__name__)

KNOWN_CORPORA = {
    "wikitext-2": ("Salesforce/wikitext", "wikitext-2-raw-v1"),
    "wikitext-103": ("Salesforce/wikitext", "wikitext-103-raw-v1"),
}


def pack_blocks(docs_ids, block_size: int, cls_id: int, sep_id: int) -> torch.Tensor:
    """Concatenate documents' token ids and cut them into (N, block_size) blocks [CLS] ... [SEP].
    The tail shorter than a block is dropped."""
    body = block_size - 2
    stream = docs_ids.ids.long()
    n = stream.numel() // body
    if n == 0:
        return torch.empty(0, block_size, dtype=torch.int32)
    blocks = torch.empty(n, block_size, dtype=torch.int32)
    blocks[:, 0] = cls_id
    blocks[:, 1:-1] = stream[: n * body].view(n, body)
    blocks[:, -1] = sep_id
    return blocks


class MaskedBlocks(Dataset):
    """Blocks of token ids; item `(epoch, i)` is block i with the masks of that epoch.

    The DataLoader fetches a batch through `__getitems__`: one vectorized masking of all its blocks
    (see bertaccel.data.masking), the same masks block by block as `__getitem__` gives.
    """

    def __init__(self, blocks: torch.Tensor, masking: dict, seed: int, fixed_epoch: int | None = None) -> None:
        self.blocks, self.seed, self.fixed_epoch = blocks, seed, fixed_epoch
        # the replacement pool once, not per batch (the same ids: mask_blocks would compute it from `special`)
        self.masking = masking if "pool" in masking else {**masking, "pool": replacement_pool(masking["special"])}

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, key) -> dict:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list) -> list[dict]:
        pairs = [key if isinstance(key, tuple) else (0, key) for key in keys]
        rows: list[dict | None] = [None] * len(pairs)
        by_epoch: dict[int, list[tuple[int, int]]] = {}  # epoch -> [(position in batch, block)]
        for pos, (epoch, i) in enumerate(pairs):
            if i == FILLER:  # evaluation under DDP: a rank's share padded to the others' length
                ids = self.blocks[0].long()
                rows[pos] = {"input_ids": ids, "labels": torch.full_like(ids, IGNORE_INDEX), "filler": True}
            else:
                epoch = self.fixed_epoch if self.fixed_epoch is not None else epoch
                by_epoch.setdefault(epoch, []).append((pos, i))
        for epoch, members in by_epoch.items():
            index = torch.tensor([i for _, i in members], dtype=torch.long)
            ids, labels = mask_blocks(self.blocks[index], block_keys(self.seed, epoch, index), **self.masking)
            for (pos, _), row_ids, row_labels in zip(members, ids, labels):
                rows[pos] = {"input_ids": row_ids, "labels": row_labels}
        return rows


class _EpochTagged(EpochSampler):
    """Yields (epoch, index) so the dataset can draw the masks of that epoch in any worker."""

    yields_epoch = True

    def __iter__(self):
        epoch = self.epoch
        for i in super().__iter__():
            yield (epoch, i)


def _collate(rows: list[dict]) -> dict[str, torch.Tensor | int]:
    """Blocks to a batch. A filler row (an evaluation share under DDP padded to the other ranks'
    length) has no masked labels and attends to its first token only: it adds nothing to the loss
    and is not counted as a sample or as real tokens."""
    ids = torch.stack([r["input_ids"] for r in rows])
    mask = torch.ones_like(ids)
    fillers = [i for i, r in enumerate(rows) if r.get("filler")]
    mask[fillers, 1:] = 0
    return {"input_ids": ids, "labels": torch.stack([r["labels"] for r in rows]), "attention_mask": mask,
            "num_rows": len(rows) - len(fillers)}


class MLMDataModule(pl.LightningDataModule):
    """Masked-LM pretraining data.

    Args:
        dataset: "wikitext-2" or "wikitext-103" (raw, from the Hub), another Hub dataset with a text
            column, or a local directory with train/validation(/test) text files (.txt, .raw, .tokens,
            .jsonl, their .gz; e.g. wiki.train.raw). Ignored when `train_files` is set.
        train_files: Local files to train on (text: one document per line; jsonl: `text_column`).
        val_files: Local files to validate on; when absent, `val_size` of the training blocks.
        exclude_files: Documents that also occur in these files are dropped from training (e.g. keep
            IMDB test reviews out of pretraining when IMDB test accuracy is reported later).
        tokenizer: Hub name or directory of a BERT tokenizer, or a WordPiece vocab.txt.
        hub_config: Configuration of the Hub dataset (for "wikitext-2" it is chosen for you).
        text_column: Text column of table files and Hub datasets.
        block_size: Tokens per block, [CLS] and [SEP] included (128 or 512 in BERT's recipe).
        batch_size: Training batch size (blocks).
        eval_batch_size: Validation batch size (default: batch_size).
        mlm_probability: Share of tokens selected for prediction.
        mask_fraction: Of the selected tokens, the share replaced by [MASK].
        random_fraction: Of the selected tokens, the share replaced by a random token (the rest stay).
        whole_word_mask: Select whole words: all WordPiece pieces of a word together.
        val_size: Fraction of the training blocks held out when there is no validation split.
        max_train_documents: Use only the first N training documents (quick runs).
        num_workers: DataLoader worker processes.
        prefetch_to_device: On a GPU, copy each batch to it one batch ahead on a side CUDA stream
            (bertaccel.data.loader.DeviceLoader); false: Lightning copies it before the step.
        worker_sharing: How workers hand batches over: `file_system` (default), `file_descriptor`
            (PyTorch's Linux default) or null; see bertaccel.data.loader.set_worker_sharing.
        seed: Seed for masks, shuffling and the validation split.
        cache_dir: Where tokenized data is cached.
    """

    def __init__(
        self,
        dataset: str = "wikitext-2",
        train_files: list[str] | None = None,
        val_files: list[str] | None = None,
        exclude_files: list[str] | None = None,
        tokenizer: str = "bert-base-uncased",
        hub_config: str | None = None,
        text_column: str = "text",
        block_size: int = 128,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        mlm_probability: float = 0.15,
        mask_fraction: float = 0.8,
        random_fraction: float = 0.1,
        whole_word_mask: bool = False,
        val_size: float = 0.05,
        max_train_documents: int | None = None,
        num_workers: int = 0,
        prefetch_to_device: bool = True,
        worker_sharing: str | None = "file_system",
        seed: int = 42,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        check_batch_sizes(batch_size, eval_batch_size)
        if not 0 < mlm_probability < 1:
            raise DataError(f"mlm_probability must be in (0, 1), got {mlm_probability}.")
        if mask_fraction + random_fraction > 1:
            raise DataError("mask_fraction + random_fraction must be at most 1.")
        if block_size < 8:
            raise DataError(f"block_size {block_size} is too small; use at least 8.")
        self.dataset, self.train_files, self.val_files = dataset, train_files, val_files
        self.exclude_files = exclude_files or []
        self.tokenizer_name, self.hub_config, self.text_column = tokenizer, hub_config, text_column
        self.block_size, self.batch_size = block_size, batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.mlm_probability, self.mask_fraction, self.random_fraction = mlm_probability, mask_fraction, random_fraction
        self.whole_word_mask, self.val_size = whole_word_mask, val_size
        self.max_train_documents = max_train_documents
        self.num_workers, self.seed, self.cache_dir = num_workers, seed, cache_dir
        self.worker_sharing = check_worker_sharing(worker_sharing)
        self.prefetch_to_device = prefetch_to_device
        self.datasets: dict[str, MaskedBlocks] = {}

    @property
    def tokenizer(self):
        return load_tokenizer(self.tokenizer_name)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    # ------------------------------------------------------------------------------ documents
    def _documents(self) -> dict[str, list[str]]:
        if self.train_files:
            docs = {"train": [d for f in self.train_files for d in read_text_documents(f, self.text_column)]}
            if self.val_files:
                docs["validation"] = [d for f in self.val_files for d in read_text_documents(f, self.text_column)]
            return docs
        name = os.path.expanduser(self.dataset)
        if os.path.isdir(name):
            suffixes = TEXT_SUFFIXES + TABLE_SUFFIXES
            hint = "Keep one per split, or name the files with `data.train_files` / `data.val_files`."
            files = {s: find_split_file(Path(name), s, suffixes, hint) for s in ("train", "validation")}
            if files["train"] is None:
                raise DataError(
                    f"{name} has no train file (train.txt, wiki.train.raw, train.jsonl.gz, ...). "
                    "Name the files with `data.train_files` instead."
                )
            return {s: read_text_documents(f, self.text_column) for s, f in files.items() if f is not None}
        if looks_like_path(name) or os.path.exists(name):
            raise DataError(f"local corpus {name} does not exist or is not a directory; for files use `data.train_files`.")
        if name not in KNOWN_CORPORA and name.count("/") != 1:
            raise DataError(
                f"unknown dataset '{name}': not a local directory, not one of {sorted(KNOWN_CORPORA)}, "
                "and not a Hub name of the form owner/name. Local files go in `data.train_files`."
            )
        hub_name, config = KNOWN_CORPORA.get(name, (name, None))
        ds = load_hub_dataset(hub_name, self.hub_config or config)
        docs = {}
        for split in ("train", "validation"):
            if split in ds:
                docs[split] = [t.strip() for t in ds[split][self.text_column] if t and t.strip()]
        if "train" not in docs:
            raise DataError(f"Hub dataset '{hub_name}' has no train split (splits: {list(ds)}).")
        return docs

    # ------------------------------------------------------------------------------- Lightning
    def _blocks(self, docs: list[str]) -> torch.Tensor:
        tok = self.tokenizer
        ids = tokenize_texts(docs, tok, max_length=None, add_special_tokens=False, cache_dir=self.cache_dir)
        return pack_blocks(ids, self.block_size, tok.cls_token_id, tok.sep_token_id)

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        docs = self._documents()
        train_docs = docs["train"]
        if self.exclude_files:
            excluded = {d for f in self.exclude_files for d in read_text_documents(f, self.text_column)}
            before = len(train_docs)
            train_docs = [d for d in train_docs if d not in excluded]
            log.info("dropped %d training documents that occur in %s", before - len(train_docs), self.exclude_files)
        if self.max_train_documents is not None:
            train_docs = train_docs[: self.max_train_documents]
        train = self._blocks(train_docs)
        if "validation" in docs:
            val = self._blocks(docs["validation"])
        else:
            g = torch.Generator().manual_seed(self.seed)
            perm = torch.randperm(train.shape[0], generator=g)
            n_val = max(1, int(round(self.val_size * train.shape[0])))
            val, train = train[perm[:n_val].sort().values], train[perm[n_val:].sort().values]
        for split, blocks in (("train", train), ("validation", val)):
            if blocks.shape[0] == 0:
                raise DataError(f"the {split} text is shorter than one block of {self.block_size} tokens.")
        tok = self.tokenizer
        masking = {
            "mask_id": tok.mask_token_id,
            "special": special_table(tok),
            "continuation": continuation_table(tok) if self.whole_word_mask else None,
            "probability": self.mlm_probability,
            "mask_fraction": self.mask_fraction,
            "random_fraction": self.random_fraction,
        }
        # Validation masks are fixed (epoch 0) so that the validation loss is comparable across epochs.
        self.datasets = {
            "train": MaskedBlocks(train, masking, self.seed),
            "validation": MaskedBlocks(val, masking, self.seed, fixed_epoch=0),
        }
        log.info("MLM data: %d train / %d validation blocks of %d tokens", train.shape[0], val.shape[0], self.block_size)

    def _loader(self, split: str, batch_size: int, train: bool, loader_class: type[DeviceLoader] = DeviceLoader,
                sampler: EpochSampler | None = None, **loader_kwargs) -> DataLoader:
        ds = self.datasets[split]
        set_worker_sharing(self.worker_sharing, self.num_workers)
        if sampler is None:
            sampler = _EpochTagged(len(ds), self.seed, shuffle=train)
            if not train:  # under DDP: every block on exactly one rank (no repeated blocks in the metrics)
                sampler = shard_for_ranks(sampler, self.trainer)
        return loader_class(
            ds,
            batch_size=batch_size,
            sampler=sampler,
            collate_fn=_collate,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            device=loader_device(self.trainer, self.prefetch_to_device),
            persistent_workers=self.num_workers > 0,
            # worker seeds from the loader's own generator: making an iterator does not draw from the
            # global RNG, whose state checkpoints carry (exact resume with dropout)
            generator=torch.Generator().manual_seed(self.seed),
            drop_last=train,
            **loader_kwargs,
        )

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer  # None outside a Trainer
        if trainer is None:
            return self._loader("train", self.batch_size, train=True)
        # resumable in the middle of an epoch, one process or DDP (see ResumableDataLoader)
        sampler = _EpochTagged(len(self.datasets["train"]), self.seed, shuffle=True)
        return self._loader("train", self.batch_size, train=True, loader_class=ResumableDataLoader, sampler=sampler,
                            progress=fit_progress(trainer), epoch_sampler=sampler)

    def val_dataloader(self) -> DataLoader:
        return self._loader("validation", self.eval_batch_size, train=False)
