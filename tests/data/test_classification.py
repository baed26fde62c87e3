"""TextClassificationDataModule: local formats, splits, padding, caching, and bad input."""

from __future__ import annotations

import csv
import gzip
from collections import Counter
from pathlib import Path

import pytest
import torch

from bertaccel.data import TextClassificationDataModule
from bertaccel.data.samplers import EpochSampler
from bertaccel.errors import DataError
from tests.conftest import sample_rows, write_jsonl


def dm(dataset, **kw) -> TextClassificationDataModule:
    kw.setdefault("tokenizer", "sample:sentiment")
    kw.setdefault("max_length", 48)
    kw.setdefault("batch_size", 8)
    return TextClassificationDataModule(dataset=str(dataset), **kw)


def write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=["text", "label"])
        w.writeheader()
        w.writerows(rows)


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "csv", "parquet"])
def test_local_formats_read_the_same_rows(tmp_path, fmt):
    train, test = sample_rows("train", 40), sample_rows("test", 12)
    d = tmp_path / fmt
    d.mkdir()
    for split, rows in (("train", train), ("test", test)):
        path = d / f"{split}.{fmt}"
        if fmt == "jsonl":
            write_jsonl(path, rows)
        elif fmt == "jsonl.gz":
            write_jsonl(path, rows, gz=True)
        elif fmt == "csv":
            write_csv(path, rows)
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(rows), path)
    m = dm(d, val_size=0.25)
    m.setup("fit")
    assert m.num_labels == 2
    assert len(m.datasets["train"]) + len(m.datasets["validation"]) == 40
    assert len(m.datasets["test"]) == 12
    assert m.text_of("test", 3) == test[3]["text"]


def test_validation_split_is_stratified_seeded_and_disjoint(tiny_data):
    a, b, c = dm(tiny_data, val_size=0.25, seed=1), dm(tiny_data, val_size=0.25, seed=1), dm(tiny_data, val_size=0.25, seed=2)
    for m in (a, b, c):
        m.setup("fit")
    val = a.datasets["validation"].indices
    train = a.datasets["train"].indices
    assert len(val) == 40 and len(train) == 120 and not set(val) & set(train)
    assert val == b.datasets["validation"].indices
    assert val != c.datasets["validation"].indices
    labels = a._load_raw()["train"].labels
    all_counts = Counter(labels)
    val_counts = Counter(labels[i] for i in val)
    for lab, n in all_counts.items():
        assert abs(val_counts[lab] - n * 0.25) <= 1


def test_an_existing_validation_file_is_used(tmp_path):
    d = tmp_path / "withval"
    write_jsonl(d / "train.jsonl", sample_rows("train", 30))
    write_jsonl(d / "validation.jsonl", sample_rows("train", 10, seed=5))
    write_jsonl(d / "test.jsonl", sample_rows("test", 10))
    m = dm(d)
    m.setup("fit")
    assert len(m.datasets["train"]) == 30 and len(m.datasets["validation"]) == 10


@pytest.mark.parametrize("multiple", [None, 8])
def test_dynamic_padding(tiny_data, multiple):
    m = dm(tiny_data, pad_to_multiple_of=multiple, batch_size=16)
    m.setup("fit")
    batch = next(iter(m.val_dataloader()))
    lengths = batch["attention_mask"].sum(1)
    T = batch["input_ids"].shape[1]
    longest = int(lengths.max())
    assert T == (longest if multiple is None else -(-longest // 8) * 8)
    pad = m.tokenizer.pad_token_id
    assert bool((batch["input_ids"][batch["attention_mask"] == 0] == pad).all())
    # real rows are exactly the tokenized texts
    for row, idx, n in zip(batch["input_ids"], batch["index"], lengths):
        expect = m.tokenizer(m.text_of("validation", int(idx)), truncation=True, max_length=48)["input_ids"]
        assert row[:n].tolist() == expect


def test_truncation_to_max_length(tiny_data):
    m = dm(tiny_data, max_length=10, pad_to_multiple_of=None)
    m.setup("fit")
    batch = next(iter(m.train_dataloader()))
    assert batch["input_ids"].shape[1] <= 10


def test_tokenized_data_is_cached(tiny_data, monkeypatch):
    m = dm(tiny_data)
    m.setup("fit")
    first = m.datasets["train"][0]["input_ids"]

    def boom(*a, **k):
        raise AssertionError("tokenized again although the cache holds it")

    m2 = dm(tiny_data)
    monkeypatch.setattr(type(m2.tokenizer), "__call__", boom)
    m2.setup("fit")
    assert torch.equal(m2.datasets["train"][0]["input_ids"], first)


def test_cache_key_changes_with_max_length(tiny_data):
    a, b = dm(tiny_data, max_length=48), dm(tiny_data, max_length=12)
    a.setup("fit")
    b.setup("fit")
    assert int(b.datasets["train"].lengths().max()) <= 12 < int(a.datasets["train"].lengths().max())


def test_length_grouped_batches_have_less_padding(tmp_path):
    d = tmp_path / "lens"
    write_jsonl(d / "train.jsonl", sample_rows("train", 400))
    write_jsonl(d / "test.jsonl", sample_rows("test", 10))

    def padding(group: bool) -> float:
        m = dm(d, group_by_length=group, batch_size=16, pad_to_multiple_of=None)
        m.setup("fit")
        real = total = 0
        for b in m.train_dataloader():
            real += int(b["attention_mask"].sum())
            total += b["attention_mask"].numel()
        return 1 - real / total

    assert padding(True) < padding(False)


def test_sampler_order_depends_on_seed_and_epoch_only():
    lengths = torch.randint(1, 100, (100,))
    s = EpochSampler(100, seed=3, lengths=lengths, batch_size=8)
    s.set_epoch(0)
    e0 = list(s)
    s.set_epoch(1)
    e1 = list(s)
    s2 = EpochSampler(100, seed=3, lengths=lengths, batch_size=8)
    s2.set_epoch(1)
    assert sorted(e0) == list(range(100)) and e0 != e1 and list(s2) == e1


def test_sampler_deals_each_step_one_length_group_over_ranks():
    """Under DDP Lightning gives rank r every W-th index of the sampler's order (r, r + W, ...). With `ranks=W`
    each step's W batches are the W * batch_size rows of one length group (a global batch sorted by length),
    so the ranks' batches at a step have about the same length; grouped by batch_size alone a rank's batch
    mixes W batches of different lengths and is padded to the longest on every rank."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 512, (1000,), generator=g)
    B, W = 8, 2

    def steps(order: list[int]) -> list[list[list[int]]]:  # step -> rank -> the batch's rows
        shares = [order[r::W] for r in range(W)]
        return [[s[k * B:(k + 1) * B] for s in shares] for k in range(len(shares[0]) // B)]

    order = EpochSampler(1000, seed=3, lengths=lengths, batch_size=B, ranks=W).order(0)
    assert sorted(order) == list(range(1000))
    for k, batches in enumerate(steps(order)):
        rows = order[k * B * W:(k + 1) * B * W]  # the step's global batch
        assert sorted(i for b in batches for i in b) == sorted(rows)
        assert [int(lengths[i]) for i in rows] == sorted((int(lengths[i]) for i in rows), reverse=True)

    def longest_per_step(order: list[int]) -> float:
        return sum(max(int(lengths[b].max()) for b in batches) for batches in steps(order)) / len(steps(order))

    dealt_by_batch = EpochSampler(1000, seed=3, lengths=lengths, batch_size=B).order(0)
    assert longest_per_step(order) < 0.9 * longest_per_step(dealt_by_batch)
    # one rank: each batch the loader cuts is one length group (the short group, if any, comes last)
    for k in range(len(dealt_by_batch) // B):
        rows = [int(lengths[i]) for i in dealt_by_batch[k * B:(k + 1) * B]]
        assert rows == sorted(rows, reverse=True), k
    with pytest.raises(ValueError, match="ranks"):
        EpochSampler(10, seed=3, ranks=0)


def test_train_ranks_is_the_world_lightning_shards_training_over():
    from types import SimpleNamespace

    from bertaccel.data.samplers import train_ranks

    connector = SimpleNamespace(use_distributed_sampler=True)
    assert train_ranks(None) == 1
    assert train_ranks(SimpleNamespace(distributed_sampler_kwargs=None, _accelerator_connector=connector)) == 1
    ddp = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 4, "rank": 1}, _accelerator_connector=connector)
    assert train_ranks(ddp) == 4
    ddp._accelerator_connector = SimpleNamespace(use_distributed_sampler=False)  # the user's sampler, as it is
    assert train_ranks(ddp) == 1


def test_train_subset(tiny_data):
    m = dm(tiny_data, train_subset=50, test_subset=20)
    m.setup("fit")
    assert len(m.datasets["train"]) == 50 and len(m.datasets["test"]) == 20


def test_classes_file_sets_num_labels_and_names(tmp_path):
    d = tmp_path / "cls"
    write_jsonl(d / "train.jsonl", sample_rows("train", 20))
    write_jsonl(d / "test.jsonl", sample_rows("test", 8))
    (d / "classes.txt").write_text("neg\npos\nneutral\n")
    m = dm(d)
    assert m.num_labels == 3 and m.class_names == ["neg", "pos", "neutral"]


# ------------------------------------------------------------------------------------ bad input
def bad_dir(tmp_path, train_text: str) -> Path:
    d = tmp_path / "bad"
    d.mkdir(parents=True)
    (d / "train.jsonl").write_text(train_text)
    write_jsonl(d / "test.jsonl", sample_rows("test", 4))
    return d


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"text": "fine", "label": 0}\n{"text": "broken", "label": 1\n', r"train.jsonl:2: not valid JSON"),
        ('{"text": "fine", "label": 0}\n{"text": "  ", "label": 1}\n', r"train.jsonl:2: empty text"),
        ('{"text": "fine", "label": 0}\n{"txt": "x", "label": 1}\n', r"train.jsonl:2: no 'text' field"),
        ('{"text": "fine", "label": 0}\n{"text": "x", "label": "pos"}\n', r"train.jsonl:2: label 'pos' is not an integer"),
        ('{"text": "fine", "label": 0}\n{"text": "x"}\n', r"train.jsonl:2: no 'label' field"),
    ],
)
def test_malformed_rows_name_file_and_line(tmp_path, content, message):
    with pytest.raises(DataError, match=message):
        dm(bad_dir(tmp_path, content)).setup("fit")


def test_label_out_of_range_names_the_row(tmp_path):
    d = bad_dir(tmp_path, '{"text": "a", "label": 0}\n{"text": "b", "label": 1}\n{"text": "c", "label": 5}\n')
    with pytest.raises(DataError, match=r"train.jsonl:3: label 5 is outside 0..1"):
        dm(d, num_labels=2).setup("fit")
    with pytest.raises(DataError, match=r"label -1 is outside"):
        dm(bad_dir(tmp_path / "neg", '{"text": "a", "label": 0}\n{"text": "b", "label": -1}\n')).setup("fit")


def test_missing_and_empty_directories(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        dm(tmp_path / "missing").setup("fit")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="needs a train and a test file"):
        dm(tmp_path / "empty").setup("fit")
    (tmp_path / "empty" / "train.jsonl").write_text("")
    (tmp_path / "empty" / "test.jsonl").write_text("")
    with pytest.raises(DataError, match="has no rows"):
        dm(tmp_path / "empty").setup("fit")


def test_unknown_dataset_and_offline_hub(tmp_path):
    with pytest.raises(DataError, match="unknown dataset 'imbd'"):
        dm("imbd").setup("fit")
    with pytest.raises(DataError, match="point `data.dataset` at a local directory"):
        dm("imdb").setup("fit")  # HF_HUB_OFFLINE=1 in tests


def test_gz_jsonl_line_numbers(tmp_path):
    d = tmp_path / "gz"
    d.mkdir()
    with gzip.open(d / "train.jsonl.gz", "wt") as f:
        f.write('{"text": "a", "label": 0}\n\n{"text": "", "label": 1}\n')
    write_jsonl(d / "test.jsonl", sample_rows("test", 4))
    with pytest.raises(DataError, match=r"train.jsonl.gz:3: empty text"):
        dm(d).setup("fit")


@pytest.mark.parametrize("n,world", [(47, 2), (10, 3), (9, 3), (2, 4)])
def test_evaluation_shards_hold_every_row_once_and_equal_lengths(n, world):
    """Under DDP each rank evaluates its share of the fixed order; shorter shares end with fillers
    (not repeated rows, which DistributedSampler adds and the metrics would count twice)."""
    from torch.utils.data import DistributedSampler

    from bertaccel.data.samplers import FILLER, EvalShardSampler

    base = EpochSampler(n, seed=3, shuffle=True, fixed=True)
    shares = [list(EvalShardSampler(base, world, r)) for r in range(world)]
    assert isinstance(EvalShardSampler(base, world, 0), DistributedSampler)  # Lightning keeps it as it is
    assert len({len(s) for s in shares}) == 1 and len(shares[0]) == len(EvalShardSampler(base, world, 0))
    real = [i for s in shares for i in s if i != FILLER]
    assert sorted(real) == list(range(n))
    assert sum(s.count(FILLER) for s in shares) == len(shares[0]) * world - n


@pytest.mark.parametrize("static", [False, True])
def test_filler_rows_become_padding_rows(tiny_data, static):
    """A rank's last batch may hold fillers, or only fillers: they become padding rows (label -100,
    index -1), uncounted in `num_rows`; labels stay in the batch even when every row is a filler."""
    from bertaccel.data.samplers import FILLER

    dm = TextClassificationDataModule(dataset=str(tiny_data), tokenizer="sample:sentiment", max_length=32,
                                      batch_size=4, val_size=0.2, static_shapes=static)
    dm.setup("fit")
    ds = dm.datasets["validation"]
    collate = dm.collator(4)
    batch = collate([ds[0], ds[FILLER], ds[1]])
    assert batch["num_rows"] == 2 and batch["index"].tolist()[:2] == [ds[0]["index"], ds[1]["index"]]
    assert (batch["index"][2:] == -1).all() and (batch["labels"][2:] == -100).all()
    assert batch["input_ids"].shape[0] == (4 if static else 3)
    only = collate([ds[FILLER]])
    assert only["num_rows"] == 0 and (only["labels"] == -100).all() and (only["index"] == -1).all()
    assert only["attention_mask"][:, 0].all()  # a padding row attends to its first token: no empty softmax row


@pytest.mark.parametrize("value", [0, -3, 2.5, "many", [], [64, 0], True])
def test_token_buckets_must_be_auto_a_positive_whole_number_or_counts(tmp_path, value):
    from bertaccel.data import TextClassificationDataModule

    with pytest.raises(DataError, match="data.token_buckets must be 'auto', a whole number >= 1 or a list"):
        TextClassificationDataModule(dataset=str(tmp_path), token_buckets=value)


@pytest.mark.parametrize("buckets", ["auto", 2, [40, 90]])
def test_packed_static_batches_take_the_chosen_token_sizes(tiny_data, buckets):
    """With static shapes and the unpadded encoder, every training batch's token count is padded to one
    of the sizes chosen from the split's own batches (or given), and every batch fits one of them."""
    from bertaccel.data.collate import batch_token_counts

    dm = TextClassificationDataModule(dataset=str(tiny_data), tokenizer="sample:sentiment", max_length=32,
                                      batch_size=4, val_size=0.2, static_shapes=True, token_buckets=buckets)
    dm.setup("fit")
    dm.use_packed_layout()
    sampler = dm._sampler("train", 4, train=True)
    sizes = dm.token_sizes("train", 4, sampler)
    if isinstance(buckets, list):
        assert sizes == buckets
    else:
        counts = batch_token_counts(dm.datasets["train"].lengths(), torch.as_tensor(sampler.order(0)), 4, 32)
        assert sizes[-1] >= int(counts.max()) and all(s % 8 == 0 for s in sizes)
        if buckets == 2:
            assert len(sizes) == 2
    seen = set()
    for batch in dm.train_dataloader():
        n = batch["packed_indices"].numel()
        real = int(batch["attention_mask"].sum())
        assert n >= real and (n in sizes or n == batch["input_ids"].numel())
        seen.add(n)
    assert seen <= set(sizes) | {4 * 32}


def test_packed_batches_of_each_ddp_rank_take_the_chosen_token_sizes(tiny_data):
    """Under DDP (2 ranks, grouped by length, the unpadded layout) the token sizes are chosen from the batches each
    rank really gets (every second row of the order, `TrainShardSampler`), so every rank's batch fits one of them
    and none falls back to the full padded size (a shape of its own to capture)."""
    from types import SimpleNamespace

    from bertaccel.data.samplers import TrainShardSampler

    dm = TextClassificationDataModule(dataset=str(tiny_data), tokenizer="sample:sentiment", max_length=32,
                                      batch_size=4, val_size=0.2, static_shapes=True, token_buckets=3,
                                      group_by_length=True, num_workers=0)
    dm.setup("fit")
    dm.use_packed_layout()
    for rank in (0, 1):
        dm.trainer = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": rank}, global_rank=rank,
                                     _accelerator_connector=SimpleNamespace(use_distributed_sampler=True),
                                     max_epochs=1, strategy=SimpleNamespace(root_device=torch.device("cpu")))
        sampler = dm._sampler("train", 4, train=True)
        assert sampler.ranks == 2
        sizes = dm.token_sizes("train", 4, sampler)
        loader = dm._loader("train", 4, train=True, sampler=sampler)
        assert isinstance(loader.sampler, TrainShardSampler) and loader.sampler.rank == rank
        for batch in loader:
            assert batch["packed_indices"].numel() in sizes, (rank, int(batch["attention_mask"].sum()), sizes)


@pytest.mark.parametrize("packed", [False, True])
def test_rows_come_longest_first_with_their_labels_and_indices(packed):
    """The collator orders a batch's rows longest first (stable for equal lengths; fillers stay padding rows at the
    end): labels and dataset indices follow their rows, and the packed layout is that of the sorted rows."""
    from bertaccel.data.collate import ClassificationCollator

    lengths = [3, 7, 5, 7, 1]
    rows = [{"input_ids": torch.arange(1, n + 1), "label": i % 2, "index": 10 + i} for i, n in enumerate(lengths)]
    batch = ClassificationCollator(0, batch_size=8, buckets=[8], packed=packed)(rows + [{"filler": True}])
    assert batch["index"].tolist() == [11, 13, 12, 10, 14, -1, -1, -1]
    assert batch["labels"].tolist() == [1, 1, 0, 0, 0, -100, -100, -100]
    assert batch["attention_mask"][:5].sum(1).tolist() == [7, 7, 5, 3, 1] and batch["num_rows"] == 5
    for r, i in zip(batch["input_ids"][:5], batch["index"][:5]):
        n = lengths[int(i) - 10]
        assert r[:n].tolist() == list(range(1, n + 1))
    if packed:
        assert batch["cu_seqlens"][:6].tolist() == [0, 7, 14, 19, 22, 23]


def test_packed_layout_values_a_capture_from_the_models_hidden_size(tiny_data, monkeypatch):
    """`use_packed_layout(hidden_size)` hands "auto" token buckets the model's capture cost (BERT-base's when not
    given), and the sizes are chosen again for another cost."""
    from bertaccel.data import classification
    from bertaccel.data.collate import CAPTURE_COST_TOKENS, capture_cost_tokens

    seen = []
    choose = classification.choose_token_sizes
    monkeypatch.setattr(classification, "choose_token_sizes",
                        lambda *a, **k: seen.append(k["capture_cost"]) or choose(*a, **k))
    dm = TextClassificationDataModule(dataset=str(tiny_data), tokenizer="sample:sentiment", max_length=32,
                                      batch_size=4, val_size=0.2, static_shapes=True)
    dm.setup("fit")
    dm.use_packed_layout()
    dm.token_sizes("test", 4)
    dm.use_packed_layout(hidden_size=384)
    dm.token_sizes("test", 4)
    assert seen == [CAPTURE_COST_TOKENS, capture_cost_tokens(384)]
