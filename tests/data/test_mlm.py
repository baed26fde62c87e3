"""Masked-LM data: packing, masking statistics (15%, 80/10/10, whole words), determinism."""

from __future__ import annotations

import math

import pytest
import torch

from bertaccel.data import MLMDataModule
from bertaccel.data.masking import (IGNORE_INDEX, block_keys, continuation_table, hash_bits, hash_uniform,
                                    mask_blocks, mask_tokens, replacement_pool, special_table)
from bertaccel.data.mlm import pack_blocks
from bertaccel.data.tokenized import TokenizedTexts
from bertaccel.errors import DataError
from bertaccel.pretrained import load_tokenizer
from tests.conftest import SAMPLE


@pytest.fixture
def tok():
    return load_tokenizer("sample:sentiment")


def test_packing_wraps_blocks_in_cls_sep_and_keeps_the_stream():
    stream = torch.arange(10, 10 + 23, dtype=torch.int32)
    docs = TokenizedTexts(stream, torch.tensor([0, 10, 23]))
    blocks = pack_blocks(docs, block_size=8, cls_id=2, sep_id=3)
    assert blocks.shape == (3, 8)  # 23 tokens // 6 per block, tail of 5 dropped
    assert (blocks[:, 0] == 2).all() and (blocks[:, -1] == 3).all()
    assert blocks[:, 1:-1].reshape(-1).tolist() == stream[:18].tolist()


@pytest.fixture
def sample_mlm(tmp_path):
    """An MLMDataModule on 300 lines of the shipped sample text, blocks of 32, set up for fit."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(line for line in (SAMPLE / "train.jsonl").read_text().splitlines()[:300]))
    m = MLMDataModule(train_files=[str(corpus)], tokenizer="sample:sentiment", block_size=32, batch_size=4)
    m.setup("fit")
    return m


def random_blocks(tok, n=400, T=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    special = special_table(tok)
    pool = torch.nonzero(~special, as_tuple=True)[0]
    ids = pool[torch.randint(len(pool), (n, T), generator=g)]
    ids[:, 0], ids[:, -1] = tok.cls_token_id, tok.sep_token_id
    return ids


def test_masking_rate_and_80_10_10(tok):
    special = special_table(tok)
    blocks = random_blocks(tok)
    out, lab = mask_blocks(blocks, block_keys(1, 0, torch.arange(len(blocks))), mask_id=tok.mask_token_id,
                           special=special)
    ids = blocks
    selected = lab != IGNORE_INDEX
    n_candidates = (~special[ids]).sum()
    rate = selected.sum() / n_candidates
    n = int(selected.sum())
    # binomial tolerance: 5 standard deviations
    assert abs(rate - 0.15) < 5 * math.sqrt(0.15 * 0.85 / int(n_candidates))
    assert (lab[selected] == ids[selected]).all()  # labels are the original tokens
    assert not selected[:, 0].any() and not selected[:, -1].any()  # specials never selected
    masked = (out == tok.mask_token_id) & selected
    kept = (out == ids) & selected
    replaced = selected & ~masked & ~kept
    for share, want in ((masked.sum() / n, 0.8), (replaced.sum() / n, 0.1)):
        assert abs(share - want) < 5 * math.sqrt(want * (1 - want) / n)
    # random replacements are never special tokens; unselected tokens are untouched
    assert not special[out[replaced]].any()
    assert (out[~selected] == ids[~selected]).all()
    # kept share ~10% too (minus the random draws that hit the same token by chance)
    assert abs(kept.sum() / n - 0.1) < 0.03


def test_whole_word_masking_masks_words_together(tok):
    special, cont = special_table(tok), continuation_table(tok)
    text = " ".join(["unbelievably overwhelmingly xylophonic zigzagging"] * 12)
    ids = torch.tensor(tok(text, max_length=400, truncation=True)["input_ids"])
    assert cont[ids].any(), "the text must contain multi-piece words"
    saw_multi = False
    for key in range(50):
        _, lab = mask_tokens(ids, key, mask_id=tok.mask_token_id, special=special, continuation=cont)
        sel = lab != IGNORE_INDEX
        starts = (~cont[ids]) | special[ids]
        word = starts.long().cumsum(0)
        for w in word[sel].unique():
            members = (word == w) & ~special[ids]
            assert sel[members].all(), "a word was masked only in part"
            saw_multi |= int(members.sum()) > 1
    assert saw_multi


def test_hash_draws_are_uniform_and_independent():
    """The counter-based draws behind the masks: uniform over buckets, uncorrelated between neighbouring
    blocks, positions and streams, and the integer arithmetic is exact (Python ints agree)."""
    keys = block_keys(7, 3, torch.arange(2000))
    assert keys.unique().numel() == 2000 and int(keys.min()) >= 0 and int(keys.max()) < 2**32
    u = hash_uniform(keys, 1, torch.arange(256))
    assert float(u.min()) >= 0 and float(u.max()) < 1
    counts = torch.histc(u, bins=64, min=0, max=1)
    expected = u.numel() / 64
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 63 + 5 * (2 * 63) ** 0.5  # chi-square, 63 degrees of freedom, 5 sigma
    n = u.numel()
    for a, b in ((u[1:], u[:-1]), (u[:, 1:], u[:, :-1]), (u, hash_uniform(keys, 2, torch.arange(256)))):
        c = torch.corrcoef(torch.stack([a.reshape(-1), b.reshape(-1)]))[0, 1]
        assert abs(float(c)) < 5 / n**0.5
    # bit-exact against arbitrary-precision Python integers
    from bertaccel.data.masking import _mix32

    def py_mix(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) % 2**32
        x ^= x >> 15
        x = (x * 0x846CA68B) % 2**32
        return x ^ (x >> 16)

    xs = torch.randint(0, 2**32, (1000,), generator=torch.Generator().manual_seed(0), dtype=torch.long)
    assert _mix32(xs).tolist() == [py_mix(x) for x in xs.tolist()]
    assert hash_bits(keys[:3], 5, torch.arange(4)).shape == (3, 4)


def test_batched_masks_equal_block_by_block_masks(tok):
    """A block's masks depend on (seed, epoch, block) only: the same in any batch, in any order."""
    special, cont = special_table(tok), continuation_table(tok)
    blocks = random_blocks(tok, n=12, T=40)
    for continuation in (None, cont):
        masking = dict(mask_id=tok.mask_token_id, special=special, continuation=continuation)
        keys = block_keys(3, 1, torch.arange(12))
        out, lab = mask_blocks(blocks, keys, **masking)
        perm = torch.randperm(12, generator=torch.Generator().manual_seed(0))
        out_p, lab_p = mask_blocks(blocks[perm], keys[perm], **masking)
        assert torch.equal(out_p, out[perm]) and torch.equal(lab_p, lab[perm])
        for i in (0, 5, 11):
            one_out, one_lab = mask_tokens(blocks[i], keys[i], **masking)
            assert torch.equal(one_out, out[i]) and torch.equal(one_lab, lab[i])
        # the replacement pool passed in (as MaskedBlocks does, once) gives the same masks
        pooled = mask_blocks(blocks, keys, **masking, pool=replacement_pool(special))
        assert torch.equal(pooled[0], out) and torch.equal(pooled[1], lab)


@pytest.mark.cuda
def test_masks_on_the_gpu_equal_the_cpu_masks(tok):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    special, cont = special_table(tok), continuation_table(tok)
    blocks = random_blocks(tok, n=64, T=128)
    keys = block_keys(42, 2, torch.arange(64))
    for continuation in (None, cont):
        masking = dict(mask_id=tok.mask_token_id, special=special, continuation=continuation)
        cpu = mask_blocks(blocks, keys, **masking)
        gpu = mask_blocks(blocks.cuda(), keys.cuda(), **masking)
        assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu, gpu))


def test_dataset_batches_equal_single_items(sample_mlm):
    ds = sample_mlm.datasets["train"]
    keys = [(1, 7), (1, 2), (2, 7), (1, 9)]
    for key, row in zip(keys, ds.__getitems__(keys)):
        single = ds[key]
        assert torch.equal(row["input_ids"], single["input_ids"]) and torch.equal(row["labels"], single["labels"])
    assert not torch.equal(ds[(1, 7)]["labels"], ds[(2, 7)]["labels"])


def test_masks_are_new_each_epoch_and_reproducible(sample_mlm):
    m = sample_mlm
    ds = m.datasets["train"]
    assert torch.equal(ds[(0, 5)]["labels"], ds[(0, 5)]["labels"])
    assert not torch.equal(ds[(0, 5)]["labels"], ds[(1, 5)]["labels"])
    val = m.datasets["validation"]
    assert torch.equal(val[(0, 1)]["labels"], val[(3, 1)]["labels"])  # validation masks are fixed
    batch = next(iter(m.train_dataloader()))
    assert batch["input_ids"].shape == (4, 32) and batch["labels"].shape == (4, 32)
    assert (batch["input_ids"][:, 0] == m.tokenizer.cls_token_id).all()


def test_local_directory_and_errors(tmp_path):
    d = tmp_path / "wiki"
    d.mkdir()
    text = (SAMPLE / "train.jsonl").read_text()
    (d / "wiki.train.raw").write_text(text)
    (d / "wiki.valid.raw").write_text(text[:5000])
    m = MLMDataModule(dataset=str(d), tokenizer="sample:sentiment", block_size=32)
    m.setup("fit")
    assert len(m.datasets["validation"]) > 0 and len(m.datasets["train"]) > len(m.datasets["validation"])
    with pytest.raises(DataError, match="does not exist"):
        MLMDataModule(dataset=str(tmp_path / "nope"), tokenizer="sample:sentiment").setup("fit")
    with pytest.raises(DataError, match="unknown dataset"):
        MLMDataModule(dataset="wikitxt", tokenizer="sample:sentiment").setup("fit")
    short = tmp_path / "short.txt"
    short.write_text("too short\n")
    with pytest.raises(DataError, match="shorter than one block"):
        MLMDataModule(train_files=[str(short)], tokenizer="sample:sentiment", block_size=64).setup("fit")


def test_exclude_files_drops_documents(tmp_path):
    a = tmp_path / "a.txt"
    a.write_text("\n".join(f"document number {i} is about the movie" for i in range(200)))
    b = tmp_path / "b.txt"
    b.write_text("\n".join(f"document number {i} is about the movie" for i in range(100)))
    m = MLMDataModule(train_files=[str(a)], exclude_files=[str(b)], tokenizer="sample:sentiment", block_size=16, val_size=0.1)
    full = MLMDataModule(train_files=[str(a)], tokenizer="sample:sentiment", block_size=16, val_size=0.1)
    m.setup("fit")
    full.setup("fit")
    total = lambda x: len(x.datasets["train"]) + len(x.datasets["validation"])  # noqa: E731
    assert total(m) < 0.6 * total(full)


def test_mlm_filler_rows_add_nothing(tmp_path):
    """Under DDP a rank's validation share may end with a filler block: no masked labels, attends to
    its first token only, not counted in `num_rows`."""
    from bertaccel.data.mlm import MaskedBlocks, _collate
    from bertaccel.data.samplers import FILLER

    blocks = torch.arange(40, dtype=torch.int32).view(4, 10) + 5
    ds = MaskedBlocks(blocks, dict(mask_id=1, special=torch.zeros(100, dtype=torch.bool), continuation=None,
                                   probability=0.5, mask_fraction=0.8, random_fraction=0.1), seed=0,
                      fixed_epoch=0)
    batch = _collate([ds[(0, 2)], ds[(0, FILLER)]])
    assert batch["num_rows"] == 1
    assert (batch["labels"][1] == -100).all() and batch["attention_mask"][1].tolist() == [1] + [0] * 9
    assert batch["attention_mask"][0].all()
