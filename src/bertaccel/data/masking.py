"""BERT's masked-LM corruption, drawn from a counter-based hash of (seed, epoch, block, position).

Not `transformers.DataCollatorForLanguageModeling`: that collator draws from the worker's global
RNG, so the masks of a resumed run differ from an uninterrupted one's, and the masks of a block
depend on which worker and batch it landed in. Here every random number is a hash of (seed, epoch,
block index, position): new masks every epoch, identical across resumes, worker counts, batch
compositions and DDP layouts.

The hash makes the masking of a whole batch a few vectorized integer ops (`mask_blocks`, called once
per batch by `MaskedBlocks.__getitems__`) instead of a generator and ~15 small tensor ops per block:
a 64 x 128 batch took 14-20 ms block by block and 1.2-1.6 ms batched on one CPU core
(`python -m benchmarks.bench_masking`), where a graphed BERT-base step on an H100 takes ~17 ms.
The hash is Chris Wellons' "lowbias32" (multiply-xorshift rounds) on 32-bit words, computed in int64
without overflow, so CPU and GPU give the same bits.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100

_M32 = 0xFFFFFFFF
# one independent stream of draws per decision
_SELECT, _ACTION, _TOKEN = 0x243F6A88, 0x85A308D3, 0x13198A2E  # digits of pi


def _mul32(x, c: int):
    """(x * c) mod 2**32 for 0 <= x < 2**32 (int or int64 tensor), with no intermediate above 2**49."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x):
    """lowbias32: a bijection of 32-bit words with good avalanche (int or int64 tensor)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def block_keys(seed: int, epoch: int, index: torch.Tensor) -> torch.Tensor:
    """(N,) int64 32-bit keys of blocks `index` in `epoch` of a run seeded `seed`."""
    base = _mix32((_mix32(seed & _M32) + (epoch & _M32)) & _M32)
    return _mix32((index.long() + base) & _M32)


def hash_bits(keys: torch.Tensor, stream: int, counters: torch.Tensor) -> torch.Tensor:
    """32 random bits per (key, counter): keys (B,), counters (B, S) or (S,) -> (B, S) int64."""
    base = _mix32(keys.long() ^ stream)[:, None]
    return _mix32(_mix32((base + counters) & _M32) ^ base)


def hash_uniform(keys: torch.Tensor, stream: int, counters: torch.Tensor) -> torch.Tensor:
    """Uniform floats in [0, 1) on a 2**-24 grid, one per (key, counter)."""
    return (hash_bits(keys, stream, counters) >> 8).float() * 2.0**-24


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


def replacement_pool(special: torch.Tensor) -> torch.Tensor:
    """The ids of the non-special tokens, in order: what a random replacement is drawn from."""
    return torch.nonzero(~special, as_tuple=True)[0]


def mask_blocks(
    ids: torch.Tensor,
    keys: torch.Tensor,
    *,
    mask_id: int,
    special: torch.Tensor,
    continuation: torch.Tensor | None = None,
    probability: float = 0.15,
    mask_fraction: float = 0.8,
    random_fraction: float = 0.1,
    pool: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Corrupt a batch of blocks. ids (B, S), keys (B,) from `block_keys`. Returns (input_ids,
    labels), labels -100 where not selected.

    Each non-special token is selected with `probability` (with `continuation`, whole words are
    selected together: a word's tokens share one draw). Selected tokens become [MASK] with
    `mask_fraction`, a random non-special token with `random_fraction`, and stay as they are otherwise.
    A block's result depends on its key alone, not on the other blocks of the batch.
    pool: the token ids random replacements are drawn from, `replacement_pool(special)` (computed here
    when not given; callers that mask many batches pass it once).
    """
    ids = ids.long()
    special = special.to(ids.device)
    positions = torch.arange(ids.shape[1], device=ids.device)
    candidate = ~special[ids]
    if continuation is not None:
        # word number of each token: a new word starts at every non-continuation token
        starts = (~continuation.to(ids.device)[ids]) | special[ids]
        selected = hash_uniform(keys, _SELECT, starts.long().cumsum(1)) < probability
    else:
        selected = hash_uniform(keys, _SELECT, positions) < probability
    selected &= candidate
    labels = torch.where(selected, ids, IGNORE_INDEX)
    action = hash_uniform(keys, _ACTION, positions)
    to_mask = selected & (action < mask_fraction)
    to_random = selected & (action >= mask_fraction) & (action < mask_fraction + random_fraction)
    pool = replacement_pool(special) if pool is None else pool.to(ids.device)
    drawn = pool[(hash_bits(keys, _TOKEN, positions) * len(pool)) >> 32]  # < 2**32 * len(pool): no overflow
    out = torch.where(to_mask, mask_id, torch.where(to_random, drawn, ids))
    return out, labels


def mask_tokens(ids: torch.Tensor, key: int | torch.Tensor, **masking) -> tuple[torch.Tensor, torch.Tensor]:
    """`mask_blocks` for one block: ids (S,), one key."""
    keys = torch.as_tensor([int(key)], dtype=torch.long, device=ids.device)
    out, labels = mask_blocks(ids[None], keys, **masking)
    return out[0], labels[0]
