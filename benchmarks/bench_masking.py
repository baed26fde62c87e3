"""Host cost of masked-LM masking per batch, one CPU thread (one DataLoader worker): the earlier
implementation (a torch.Generator and ~15 small ops per block, kept here as `generator_mask_tokens`),
the hash masking called block by block, and the hash masking of the whole batch in one call (what
`MaskedBlocks.__getitems__` does).

    python -m benchmarks.bench_masking [--vocab ../shared/data/bert-base-uncased/vocab.txt] [--out masking.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bertaccel.data.masking import block_keys, continuation_table, mask_blocks, mask_tokens, special_table
from bertaccel.pretrained import load_tokenizer


def generator_mask_tokens(ids, generator, *, mask_id, special, continuation=None, probability=0.15,
                          mask_fraction=0.8, random_fraction=0.1):
    """The masking bertaccel used before the hash (per block, from a seeded torch.Generator)."""
    ids = ids.long()
    candidate = ~special[ids]
    if continuation is not None:
        starts = (~continuation[ids]) | special[ids]
        word = starts.long().cumsum(0) - 1
        selected = (torch.rand(int(word[-1]) + 1, generator=generator) < probability)[word] & candidate
    else:
        selected = (torch.rand(ids.shape, generator=generator) < probability) & candidate
    labels = torch.where(selected, ids, torch.full_like(ids, -100))
    action = torch.rand(ids.shape, generator=generator)
    to_mask = selected & (action < mask_fraction)
    to_random = selected & (action >= mask_fraction) & (action < mask_fraction + random_fraction)
    out = ids.clone()
    out[to_mask] = mask_id
    if to_random.any():
        pool = torch.nonzero(~special, as_tuple=True)[0]
        out[to_random] = pool[torch.randint(len(pool), (int(to_random.sum()),), generator=generator)]
    return out, labels


def _generator_batch(ids, masking):
    return [generator_mask_tokens(ids[i], torch.Generator().manual_seed(i), **masking) for i in range(len(ids))]


def _time(fn, repeats: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t) / repeats * 1e3


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", default="../shared/data/bert-base-uncased/vocab.txt")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # one DataLoader worker
    tok = load_tokenizer(args.vocab)
    special, cont = special_table(tok), continuation_table(tok)
    pool = torch.nonzero(~special, as_tuple=True)[0]
    rows = []
    for batch, seq in ((64, 128), (16, 512), (256, 128)):
        ids = pool[torch.randint(len(pool), (batch, seq), generator=torch.Generator().manual_seed(0))]
        keys = block_keys(42, 0, torch.arange(batch))
        for wwm in (False, True):
            masking = dict(mask_id=tok.mask_token_id, special=special, continuation=cont if wwm else None)
            generator = _time(lambda: _generator_batch(ids, masking), args.repeats)
            per_block = _time(lambda: [mask_tokens(ids[i], keys[i], **masking) for i in range(batch)], args.repeats)
            batched = _time(lambda: mask_blocks(ids, keys, **masking), args.repeats)
            rows.append({"batch": batch, "seq": seq, "whole_word": wwm, "generator_per_block_ms": generator,
                         "per_block_ms": per_block,
                         "batched_ms": batched, "speedup_over_generator": generator / batched})
    print(f"{'batch x seq':>12} {'wwm':>5} {'generator ms':>13} {'hash/block ms':>14} {'batched ms':>11} {'speedup':>8}")
    for r in rows:
        print(f"{r['batch']:>5} x {r['seq']:<5} {str(r['whole_word']):>5} {r['generator_per_block_ms']:13.2f} "
              f"{r['per_block_ms']:14.2f} "
              f"{r['batched_ms']:11.2f} {r['speedup_over_generator']:7.1f}x")
    result = {"threads": 1, "torch": torch.__version__, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
