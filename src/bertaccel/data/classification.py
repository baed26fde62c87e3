"""`TextClassificationDataModule`: IMDB, AG News, any Hub dataset with a text and a label column,
or a local directory of train/test(/validation) files."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, Dataset

from bertaccel.data.collate import (
    CAPTURE_COST_TOKENS,
    ClassificationCollator,
    batch_token_counts,
    bucket_lengths,
    capture_cost_tokens,
    choose_token_sizes,
)
from bertaccel.data.masking import IGNORE_INDEX
from bertaccel.data.loader import (DeviceLoader, ResumableDataLoader, check_worker_sharing, fit_progress,
                                   loader_device, set_worker_sharing)
from bertaccel.data.samplers import FILLER, EpochSampler, shard_for_ranks, shard_training, train_ranks
from bertaccel.data.sources import RawSplit, find_split_file, load_hub_dataset, looks_like_path, read_table
from bertaccel.data.tokenized import TokenizedTexts, tokenize_texts
from bertaccel.errors import DataError, check_batch_sizes
from bertaccel.pretrained import load_tokenizer

log = logging.getLogger(__name__)

# Short names for the datasets this project is built around: (Hub name, Hub config, class names).
KNOWN_DATASETS = {
    "imdb": ("stanfordnlp/imdb", None, ["neg", "pos"]),
    "ag_news": ("fancyzhx/ag_news", None, ["World", "Sports", "Business", "Sci/Tech"]),
}
SAMPLE_DIR = Path(__file__).parent / "samples"


class ClassificationDataset(Dataset):
    def __init__(self, tokens: TokenizedTexts, labels: list[int] | None, indices: list[int]) -> None:
        self.tokens, self.labels, self.indices = tokens, labels, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict:
        if i == FILLER:  # evaluation under DDP: a rank's share padded to the others' length
            return {"filler": True, "label": None if self.labels is None else IGNORE_INDEX}
        j = self.indices[i]
        return {
            "input_ids": self.tokens[j].long(),
            "label": None if self.labels is None else self.labels[j],
            "index": j,
        }

    def lengths(self) -> torch.Tensor:
        return self.tokens.lengths()[torch.tensor(self.indices, dtype=torch.long)]


class TextClassificationDataModule(pl.LightningDataModule):
    """Text classification data: tokenized once (cached), dynamically padded batches.

    Args:
        dataset: "imdb", "ag_news", a Hub dataset name ("owner/name"), "sample:sentiment" (the small
            corpus shipped with the project), or a local directory with `train` and `test` files
            (and optionally `validation`) as .jsonl, .jsonl.gz, .csv or .parquet.
        tokenizer: Hub name or directory of a model's tokenizer, or a WordPiece vocab.txt.
        hub_config: Configuration name of the Hub dataset, if it has several.
        text_column: Column holding the text.
        label_column: Column holding the integer label (0..num_labels-1).
        num_labels: Number of classes; inferred (classes.txt, Hub features, or the largest label + 1)
            when not set.
        max_length: Longest tokenized input; longer texts are truncated.
        batch_size: Training batch size.
        eval_batch_size: Batch size for validation/test/predict (default: batch_size).
        val_size: Validation split carved from train (stratified, seeded) when the data has none: a
            fraction in (0, 1) or a number of rows.
        pad_to_multiple_of: Pad each batch's length up to a multiple of this (8 suits tensor cores);
            None pads to the longest row. Not used with `static_shapes`.
        static_shapes: Give every batch one of a few shapes, as CUDA graphs need: the length is
            padded up to the next of `length_buckets`, and a short last batch is filled up with
            padding rows (label -100, index -1; never counted by losses, metrics or predictions).
            Turned on by the model when it runs CUDA graphs (`model.cuda_graphs`).
        length_buckets: With `static_shapes`: the lengths a batch may be padded to, as a multiple
            (64: 64, 128, ... up to `max_length`) or a list; `max_length` is always one of them.
        token_buckets: With `static_shapes` and the unpadded encoder (`model.unpadded`): batches are
            padded to `max_length` (the encoder skips padding, so the padded length costs nothing) and
            their real-token count is padded to one of a few token counts, each of which costs one CUDA
            graph capture (~40 ms for MiniLM). The counts are chosen from the split's own batches (their
            real-token counts, from the sampler's order; `collate.choose_token_sizes`) to minimise the
            padding: "auto" (default) also picks how many, trading the padding of the run's planned
            steps against the captures (a capture valued in padding tokens from the model's hidden size,
            `collate.capture_cost_tokens`: MiniLM ~245k, BERT-base ~61k); a number fixes how many; a list
            gives the token counts. A batch above the largest count is padded to batch x `max_length`.
            IMDB at 512 (24,000 training rows, one epoch, batch 32): "auto" picks 3 sizes for MiniLM
            (padding 8.6% of the real tokens) and 5 for BERT-base (4.5%); at 256, 2 and 3.
        group_by_length: Batch training texts of similar length together (less padding).
        train_subset: Use only this many training rows (seeded random subset), e.g. for quick runs.
        test_subset: Use only this many test rows (seeded random subset).
        predict_split: Which split `predict` runs on: "test", "validation" or "train".
        num_workers: DataLoader worker processes.
        pin_memory: Pin host memory for faster copies to the GPU (only used when a GPU is present).
        prefetch_to_device: On a GPU, copy each batch to it one batch ahead on a side CUDA stream
            (bertaccel.data.loader.DeviceLoader); false: Lightning copies it before the step.
        worker_sharing: How workers hand batches over (`file_system`: by shared-memory file name, the
            default; `file_descriptor`: PyTorch's Linux default, a socket per tensor; null: leave
            PyTorch's setting). Process-wide; see bertaccel.data.loader.set_worker_sharing.
        seed: Seed for the validation split, subsets and the shuffling order.
        cache_dir: Where tokenized data is cached (default: $BERTACCEL_CACHE or ~/.cache/bertaccel).
    """

    def __init__(
        self,
        dataset: str = "imdb",
        tokenizer: str = "bert-base-uncased",
        hub_config: str | None = None,
        text_column: str = "text",
        label_column: str = "label",
        num_labels: int | None = None,
        max_length: int = 512,
        batch_size: int = 16,
        eval_batch_size: int | None = None,
        val_size: float = 0.1,
        pad_to_multiple_of: int | None = 8,
        static_shapes: bool = False,
        length_buckets: int | list[int] = 64,
        token_buckets: int | list[int] | str = "auto",
        group_by_length: bool = False,
        train_subset: int | None = None,
        test_subset: int | None = None,
        predict_split: str = "test",
        num_workers: int = 0,
        pin_memory: bool = True,
        prefetch_to_device: bool = True,
        worker_sharing: str | None = "file_system",
        seed: int = 42,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if predict_split not in ("train", "validation", "test"):
            raise DataError(f"predict_split must be train, validation or test, got '{predict_split}'.")
        check_batch_sizes(batch_size, eval_batch_size)
        if max_length < 8:
            raise DataError(f"max_length {max_length} is too small; use at least 8 tokens.")
        self.dataset = dataset
        self.tokenizer_name = tokenizer
        self.text_column, self.label_column = text_column, label_column
        self.max_length = max_length
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        if not (0 < val_size < 1 or (val_size >= 1 and float(val_size).is_integer())):
            raise DataError(f"val_size {val_size} is neither a fraction in (0, 1) nor a whole number of rows.")
        self.val_size = val_size
        self.pad_to_multiple_of = pad_to_multiple_of
        self.static_shapes = static_shapes
        self.packed = False  # set by model.unpadded (use_packed_layout)
        self._capture_cost = CAPTURE_COST_TOKENS  # (use_packed_layout: from the model's hidden size)
        self.length_buckets = length_buckets
        try:
            bucket_lengths(max_length, length_buckets)
        except ValueError as e:
            raise DataError(f"{e} Set `data.length_buckets` to e.g. 64 or [128, 256, 512].") from None
        if not (token_buckets == "auto" or (isinstance(token_buckets, int) and not isinstance(token_buckets, bool)
                                            and token_buckets >= 1)
                or (isinstance(token_buckets, list) and token_buckets
                    and all(isinstance(t, int) and t >= 1 for t in token_buckets))):
            raise DataError(f"data.token_buckets must be 'auto', a whole number >= 1 or a list of token counts, "
                            f"got {token_buckets!r}.")
        self.token_buckets = token_buckets
        self._chosen_token_sizes: dict[tuple, list[int]] = {}  # token_sizes, per split / batch size / plan
        self.group_by_length = group_by_length
        self.train_subset, self.test_subset = train_subset, test_subset
        self.predict_split = predict_split
        self.num_workers, self.pin_memory, self.seed = num_workers, pin_memory, seed
        self.worker_sharing = check_worker_sharing(worker_sharing)
        self.prefetch_to_device = prefetch_to_device
        self.cache_dir = cache_dir
        self.hub_config = hub_config
        self._num_labels = num_labels
        self._raw: dict[str, RawSplit] | None = None
        self.class_names: list[str] | None = None
        self.datasets: dict[str, ClassificationDataset] = {}

    # --------------------------------------------------------------------- what the model needs
    @property
    def tokenizer(self):
        return load_tokenizer(self.tokenizer_name)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def num_labels(self) -> int:
        if self._num_labels is None:
            self._load_raw()
        return self._num_labels

    # ------------------------------------------------------------------------------ raw data
    def _load_raw(self) -> dict[str, RawSplit]:
        if self._raw is not None:
            return self._raw
        name = self.dataset
        if name.startswith("sample:"):
            directory = SAMPLE_DIR / name.split(":", 1)[1]
            if not directory.is_dir():
                raise DataError(f"no sample '{name}'; shipped samples: {[f'sample:{p.name}' for p in SAMPLE_DIR.iterdir() if p.is_dir()]}.")
            raw = self._load_local(directory)
        elif os.path.isdir(os.path.expanduser(name)):
            raw = self._load_local(Path(name).expanduser())
        elif name in KNOWN_DATASETS or (name.count("/") == 1 and not looks_like_path(name)):
            raw = self._load_hub(name)
        elif looks_like_path(name) or os.path.exists(name):
            raise DataError(f"local dataset directory {name} does not exist (or is not a directory); "
                            f"from here ({os.getcwd()}) it resolves to {os.path.abspath(os.path.expanduser(name))}.")
        else:
            raise DataError(
                f"unknown dataset '{name}': not a local directory, not one of {sorted(KNOWN_DATASETS)}, "
                "and not a Hub name of the form owner/name."
            )
        self._check_labels(raw)
        self._raw = raw
        return raw

    def _load_local(self, directory: Path) -> dict[str, RawSplit]:
        files = {s: find_split_file(directory, s) for s in ("train", "validation", "test")}
        if files["train"] is None or files["test"] is None:
            present = sorted(p.name for p in directory.iterdir()) if directory.exists() else []
            raise DataError(
                f"{directory} needs a train and a test file (.jsonl, .jsonl.gz, .csv or .parquet); "
                f"found {present or 'nothing'}."
            )
        raw = {s: read_table(f, self.text_column, self.label_column) for s, f in files.items() if f is not None}
        classes = directory / "classes.txt"
        if classes.is_file():
            self.class_names = [c.strip() for c in classes.read_text(encoding="utf-8").splitlines() if c.strip()]
            if self._num_labels is None:
                self._num_labels = len(self.class_names)
        return raw

    def _load_hub(self, name: str) -> dict[str, RawSplit]:
        hub_name, hub_config, names = KNOWN_DATASETS.get(name, (name, self.hub_config, None))
        ds = load_hub_dataset(hub_name, self.hub_config or hub_config)
        if "train" not in ds or "test" not in ds:
            raise DataError(f"Hub dataset '{hub_name}' has splits {list(ds)}; bertaccel needs 'train' and 'test'.")
        raw = {}
        for split, hub_split in (("train", "train"), ("validation", "validation"), ("test", "test")):
            if hub_split not in ds:
                continue
            cols = ds[hub_split].column_names
            for col in (self.text_column, self.label_column):
                if col not in cols:
                    raise DataError(
                        f"Hub dataset '{hub_name}' split '{hub_split}' has no column '{col}' (columns: {cols}); "
                        "set `data.text_column` / `data.label_column`."
                    )
            texts = ds[hub_split][self.text_column]
            labels = [int(x) for x in ds[hub_split][self.label_column]]
            for i, t in enumerate(texts):
                if not isinstance(t, str) or not t.strip():
                    raise DataError(f"Hub dataset '{hub_name}' split '{hub_split}' row {i}: empty text.")
            raw[split] = RawSplit(texts, labels, f"{hub_name}:{hub_split}")
        feature = ds["train"].features.get(self.label_column)
        self.class_names = getattr(feature, "names", None) or names
        if self._num_labels is None and self.class_names:
            self._num_labels = len(self.class_names)
        return raw

    def _check_labels(self, raw: dict[str, RawSplit]) -> None:
        if self._num_labels is None:
            seen = sorted({label for r in raw.values() for label in r.labels})
            self._num_labels = seen[-1] + 1
            missing = sorted(set(range(self._num_labels)) - set(seen))
            if seen[0] < 0:
                pass  # reported below, with the row
            elif missing and len(missing) <= 10:
                rank_zero_warn(
                    f"bertaccel: {self._num_labels} classes inferred from the largest label ({seen[-1]}), but classes "
                    f"{missing} never occur: is a label wrong? Set `data.num_labels` or list the class names in "
                    "classes.txt next to the data to make the classes explicit."
                )
            elif missing:
                rank_zero_warn(
                    f"bertaccel: {self._num_labels} classes inferred from the largest label ({seen[-1]}), but only "
                    f"{len(seen)} occur: is a label wrong? Set `data.num_labels` or write classes.txt."
                )
            else:
                rank_zero_info(f"bertaccel: {self._num_labels} classes (0..{seen[-1]}) inferred from the labels.")
        if self._num_labels < 2:
            raise DataError(f"num_labels is {self._num_labels}; classification needs at least 2 classes.")
        n = self._num_labels
        for split, r in raw.items():
            for i, label in enumerate(r.labels):
                if not 0 <= label < n:
                    where = f"{r.locations[i][0]}:{r.locations[i][1]}" if r.locations else f"{r.origin} row {i}"
                    raise DataError(
                        f"{where}: label {label} is outside 0..{n - 1} (num_labels={n}). "
                        "Fix the row, or set `data.num_labels` if there are more classes."
                    )

    # ---------------------------------------------------------------------------- splitting
    def _split_validation(self, labels: list[int]) -> tuple[list[int], list[int]]:
        """Stratified, seeded (train, validation) index lists."""
        n = len(labels)
        n_val = int(round(self.val_size * n)) if self.val_size < 1 else int(self.val_size)
        if not 0 < n_val < n:
            raise DataError(f"val_size {self.val_size} leaves no training or no validation rows of {n}.")
        g = torch.Generator().manual_seed(self.seed)
        by_label: dict[int, list[int]] = {}
        for i in torch.randperm(n, generator=g).tolist():
            by_label.setdefault(labels[i], []).append(i)
        val: list[int] = []
        for lab in sorted(by_label):
            idx = by_label[lab]
            val += idx[: int(round(n_val * len(idx) / n))]
        val_set = set(val)
        return [i for i in range(n) if i not in val_set], sorted(val)

    def _subset(self, indices: list[int], size: int | None, salt: int) -> list[int]:
        if size is None or size >= len(indices):
            return indices
        g = torch.Generator().manual_seed(self.seed + salt)
        return sorted(indices[i] for i in torch.randperm(len(indices), generator=g)[:size].tolist())

    # ------------------------------------------------------------------------------- Lightning
    def prepare_data(self) -> None:
        # Runs on one process per node: download (Hub) and tokenize into the cache once.
        for split in self._load_raw().values():
            tokenize_texts(split.texts, self.tokenizer, self.max_length, cache_dir=self.cache_dir)

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        raw = self._load_raw()
        tokens = {s: tokenize_texts(r.texts, self.tokenizer, self.max_length, cache_dir=self.cache_dir) for s, r in raw.items()}
        if "validation" in raw:
            train_idx, val_idx = list(range(len(raw["train"].texts))), list(range(len(raw["validation"].texts)))
            val_split = "validation"
        else:
            train_idx, val_idx = self._split_validation(raw["train"].labels)
            val_split = "train"  # the validation rows are rows of the train file
        train_idx = self._subset(train_idx, self.train_subset, 1)
        test_idx = self._subset(list(range(len(raw["test"].texts))), self.test_subset, 2)
        self._chosen_token_sizes.clear()  # chosen from the datasets made here
        self.datasets = {
            "train": ClassificationDataset(tokens["train"], raw["train"].labels, train_idx),
            "validation": ClassificationDataset(tokens[val_split], raw[val_split].labels, val_idx),
            "test": ClassificationDataset(tokens["test"], raw["test"].labels, test_idx),
        }
        self._texts = {"train": raw["train"].texts, "validation": raw[val_split].texts, "test": raw["test"].texts}
        sizes = {k: len(v) for k, v in self.datasets.items()}
        log.info("data %s: %s rows, %d labels", self.dataset, sizes, self.num_labels)

    def text_of(self, split: str, index: int) -> str:
        """The raw text of row `index` (as in a batch's `index`) of `split`."""
        return self._texts[split][index]

    def use_static_shapes(self) -> None:
        """Pad batches to bucketed lengths and full batch size from now on (see `static_shapes`)."""
        self.static_shapes = True

    def use_packed_layout(self, hidden_size: int | None = None) -> None:
        """Give every batch `packed_indices` and `cu_seqlens` for the unpadded encoder (`model.unpadded`);
        `hidden_size`: the encoder's, which sets what a graph capture costs against padding tokens when "auto"
        `token_buckets` are chosen (`collate.capture_cost_tokens`; unknown: BERT-base's)."""
        self.packed = True
        self._capture_cost = capture_cost_tokens(hidden_size) if hidden_size else CAPTURE_COST_TOKENS

    def collator(self, batch_size: int, split: str | None = None, sampler: EpochSampler | None = None) -> ClassificationCollator:
        pad_id = self.tokenizer.pad_token_id
        if self.static_shapes and self.packed:  # one length; the shapes vary with the real-token count only
            sizes = self.token_sizes(split, batch_size, sampler) if split is not None else 16
            return ClassificationCollator(pad_id, buckets=[self.max_length], batch_size=batch_size, packed=True,
                                          token_sizes=sizes)
        if self.static_shapes:
            return ClassificationCollator(pad_id, buckets=bucket_lengths(self.max_length, self.length_buckets),
                                          batch_size=batch_size)
        return ClassificationCollator(pad_id, self.pad_to_multiple_of, packed=self.packed)

    def token_sizes(self, split: str, batch_size: int, sampler: EpochSampler | None = None) -> list[int]:
        """The token counts packed batches of `split` are padded to (`token_buckets`): given, or chosen
        from the real-token counts of the batches the split's sampler makes (training: its first epochs,
        at least 2,048 batches when the split is smaller; evaluation: its one fixed order). Every rank of
        a DDP run computes the same sizes (from every rank's share of the whole order)."""
        if isinstance(self.token_buckets, list):
            return sorted(self.token_buckets)
        ds = self.datasets[split]
        train = split == "train" and sampler is not None and not sampler.fixed
        per_epoch = -(-len(ds) // batch_size)
        steps = per_epoch * (self._planned_epochs() if split in ("train", "validation") else 1)
        # the loaders are built more than once per run (Lightning, the epoch-length check): choose once
        capture_cost = self._capture_cost
        key = (split, batch_size, train, self.group_by_length, steps, capture_cost)
        if key in self._chosen_token_sizes:
            return self._chosen_token_sizes[key]
        sampler = sampler or self._sampler(split, batch_size, train=False)
        epochs = min(16, -(-2048 // max(per_epoch, 1))) if train else 1
        lengths = ds.lengths()
        # each rank's batches: every `ranks`-th row of the order (`TrainShardSampler`)
        ranks = getattr(sampler, "ranks", 1)
        orders = [torch.as_tensor(sampler.order(e), dtype=torch.long) for e in range(epochs)]
        counts = torch.cat([batch_token_counts(lengths, order[r::ranks], batch_size, self.max_length)
                            for order in orders for r in range(ranks)])
        sizes = self._chosen_token_sizes[key] = choose_token_sizes(counts, self.token_buckets, steps=steps,
                                                                   capture_cost=capture_cost)
        rank_zero_info(f"bertaccel: packed {split} batches padded to {len(sizes)} token counts {sizes} (data.token_buckets)")
        return sizes

    def _planned_epochs(self) -> int:
        """The epochs the trainer will run (1 when unknown or bounded by steps only)."""
        epochs = getattr(self.trainer, "max_epochs", None) if self.trainer is not None else None
        return epochs if isinstance(epochs, int) and epochs > 0 else 1

    def _sampler(self, split: str, batch_size: int, train: bool) -> EpochSampler:
        ds = self.datasets[split]
        return EpochSampler(
            len(ds),
            self.seed,
            shuffle=True,  # evaluation too, in one fixed order: files sorted by label stay representative
            lengths=ds.lengths() if train and self.group_by_length else None,
            batch_size=batch_size,
            fixed=not train,
            ranks=train_ranks(self.trainer) if train else 1,  # one length group per step across DDP ranks
        )

    def _loader(self, split: str, batch_size: int, train: bool, loader_class: type[DeviceLoader] = DeviceLoader,
                sampler: EpochSampler | None = None, **loader_kwargs) -> DataLoader:
        ds = self.datasets[split]
        sampler = base = sampler or self._sampler(split, batch_size, train)
        if not train:  # under DDP: every row on exactly one rank (no repeated rows in the metrics)
            sampler = shard_for_ranks(sampler, self.trainer)
        else:  # under DDP: each rank its share of the one order, length groups kept (Lightning would reshuffle it)
            sampler = shard_training(sampler, self.trainer)
        workers = self._workers()
        set_worker_sharing(self.worker_sharing, workers)
        return loader_class(
            ds,
            batch_size=batch_size,
            sampler=sampler,
            collate_fn=self.collator(batch_size, split, base),
            num_workers=workers,
            pin_memory=self.pin_memory and torch.cuda.is_available(),
            device=loader_device(self.trainer, self.prefetch_to_device),
            persistent_workers=workers > 0,
            # worker seeds from the loader's own generator: making an iterator does not draw from the
            # global RNG, whose state checkpoints carry (exact resume with dropout)
            generator=torch.Generator().manual_seed(self.seed),
            **loader_kwargs,
        )

    def _workers(self) -> int:
        """`num_workers`, at most the CPU cores this process may use minus one (for the main process)."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        workers = min(self.num_workers, max(cores - 1, 0))
        if workers < self.num_workers and not getattr(self, "_told_workers", False):
            self._told_workers = True
            rank_zero_info(f"bertaccel: data.num_workers {self.num_workers} on {cores} CPU cores: using {workers}.")
        return workers

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer  # None outside a Trainer
        if trainer is None:
            return self._loader("train", self.batch_size, train=True)
        sampler = self._sampler("train", self.batch_size, train=True)
        return self._loader("train", self.batch_size, train=True, loader_class=ResumableDataLoader, sampler=sampler,
                            progress=fit_progress(trainer), epoch_sampler=sampler)

    def val_dataloader(self) -> DataLoader:
        return self._loader("validation", self.eval_batch_size, train=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", self.eval_batch_size, train=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.predict_split, self.eval_batch_size, train=False)
