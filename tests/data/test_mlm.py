"""Masked-LM data: packing, masking statistics (15%, 80/10/10, whole words), determinism."""

from __future__ import annotations

import math

import pytest
import torch

from bertaccel.data import MLMDataModule
from bertaccel.data.masking import IGNORE_INDEX, continuation_table, mask_tokens, special_table
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
    g = torch.Generator().manual_seed(1)
    outs, labels = zip(*(mask_tokens(b, g, mask_id=tok.mask_token_id, special=special) for b in blocks))
    out, lab, ids = torch.stack(outs), torch.stack(labels), blocks
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
    g = torch.Generator().manual_seed(0)
    saw_multi = False
    for _ in range(50):
        _, lab = mask_tokens(ids, g, mask_id=tok.mask_token_id, special=special, continuation=cont)
        sel = lab != IGNORE_INDEX
        starts = (~cont[ids]) | special[ids]
        word = starts.long().cumsum(0)
        for w in word[sel].unique():
            members = (word == w) & ~special[ids]
            assert sel[members].all(), "a word was masked only in part"
            saw_multi |= int(members.sum()) > 1
    assert saw_multi


def test_masks_are_new_each_epoch_and_reproducible(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(line for line in (SAMPLE / "train.jsonl").read_text().splitlines()[:300]))
    m = MLMDataModule(train_files=[str(corpus)], tokenizer="sample:sentiment", block_size=32, batch_size=4)
    m.setup("fit")
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
