"""BERT's masked-LM corruption, drawn from a generator seeded per (seed, epoch, block).

Not `transformers.DataCollatorForLanguageModeling`: that collator draws from the worker's global
RNG, so the masks of a resumed run differ from an uninterrupted one's, and the masks of a block
depend on which worker and batch it landed in. Here they depend only on (seed, epoch, block index):
new masks every epoch, identical across resumes, worker counts and DDP layouts.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def continuation_table(tokenizer) -> torch.Tensor:
    """(V,) bool: True for WordPiece continuation tokens ("##ing"), which belong to the word before."""
    vocab = tokenizer.get_vocab()
    table = torch.zeros(max(vocab.values()) + 1, dtype=torch.bool)
    for tok, i in vocab.items():
        if tok.startswith("##"):
            table[i] = True
    return table


def special_table(tokenizer) -> torch.Tensor:
    """(V,) bool: True for special tokens ([CLS], [SEP], [PAD], ...), never masked or drawn."""
    vocab_size = max(tokenizer.get_vocab().values()) + 1
    table = torch.zeros(vocab_size, dtype=torch.bool)
    table[torch.tensor(tokenizer.all_special_ids, dtype=torch.long)] = True
    return table


def mask_tokens(
    ids: torch.Tensor,
    generator: torch.Generator,
    *,
    mask_id: int,
    special: torch.Tensor,
    continuation: torch.Tensor | None = None,
    probability: float = 0.15,
    mask_fraction: float = 0.8,
    random_fraction: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Corrupt one block of token ids. Returns (input_ids, labels), labels -100 where not selected.

    Each non-special token is selected with `probability` (with `continuation`, whole words are
    selected together: a word's tokens share one draw). Selected tokens become [MASK] with
    `mask_fraction`, a random non-special token with `random_fraction`, and stay as they are otherwise.
    """
    ids = ids.long()
    candidate = ~special[ids]
    if continuation is not None:
        # word id of each token: a new word starts at every non-continuation token
        starts = (~continuation[ids]) | special[ids]
        word = starts.long().cumsum(0) - 1
        word_draw = torch.rand(int(word[-1]) + 1, generator=generator) < probability
        selected = word_draw[word] & candidate
    else:
        selected = (torch.rand(ids.shape, generator=generator) < probability) & candidate
    labels = torch.where(selected, ids, torch.full_like(ids, IGNORE_INDEX))
    action = torch.rand(ids.shape, generator=generator)
    to_mask = selected & (action < mask_fraction)
    to_random = selected & (action >= mask_fraction) & (action < mask_fraction + random_fraction)
    out = ids.clone()
    out[to_mask] = mask_id
    if to_random.any():
        pool = torch.nonzero(~special, as_tuple=True)[0]
        draws = pool[torch.randint(len(pool), (int(to_random.sum()),), generator=generator)]
        out[to_random] = draws
    return out, labels
