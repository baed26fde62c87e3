"""Padded tokens per row and step of a length-grouped training order, offline (no GPU, no model): how
`data.group_by_length` pads on one process and on W DDP ranks, against the orders it replaced.

    python scripts/padding_per_step.py --data .carry/imdb --tokenizer .carry/minilm --max-length 512 --batch-size 16

Rows are tokenized as the data module does (truncated at max_length) and each step's batch is padded to the next
multiple of `--multiple` (the static-shape length buckets), the step costing its longest batch over the ranks. Orders:
- current, 1 process and W ranks (`EpochSampler(ranks=W)` dealt by `TrainShardSampler`: rank r every W-th row);
- groups of one rank's batch (`ranks=1`) dealt to W ranks in turn: a rank's batch mixes W groups;
- "short group anywhere": the order before 48ca7da, whose one short group could sit mid-epoch and shift every later batch;
- "reshuffled under DDP": what Lightning's DistributedSamplerWrapper (shuffle on) did to it before 48ca7da.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
from pathlib import Path

import torch

from bertaccel.data.samplers import EpochSampler


def order_before_48ca7da(n: int, seed: int, lengths: torch.Tensor, batch_size: int, epoch: int = 0) -> list[int]:
    """EpochSampler.order as it was: the short group shuffled in with the rest."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    perm = torch.randperm(n, generator=g)
    mega = batch_size * 50
    batches = []
    for start in range(0, n, mega):
        chunk = perm[start : start + mega]
        chunk = chunk[torch.argsort(lengths[chunk], descending=True, stable=True)]
        batches += list(chunk.split(batch_size))
    longest = max(range(len(batches)), key=lambda i: int(lengths[batches[i]].max()))
    rest = [b for i, b in enumerate(batches) if i != longest]
    rest = [rest[i] for i in torch.randperm(len(rest), generator=g).tolist()]
    return torch.cat([batches[longest], *rest]).tolist()


def padded_per_step(order: list[int], lengths: torch.Tensor, batch_size: int, ranks: int, multiple: int, max_length: int) -> float:
    shares = [order[r::ranks] for r in range(ranks)]
    steps = len(shares[0]) // batch_size
    pad = lambda n: min(max_length, math.ceil(n / multiple) * multiple)  # noqa: E731
    return sum(max(pad(int(lengths[s[k * batch_size:(k + 1) * batch_size]].max())) for s in shares) for k in range(steps)) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True, help="a folder with train.jsonl(.gz)")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--multiple", type=int, default=16)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    path = next(p for p in (args.data / "train.jsonl.gz", args.data / "train.jsonl") if p.exists())
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    lengths = torch.tensor([len(ids) for ids in tok(texts, truncation=True, max_length=args.max_length)["input_ids"]])
    n, B, W = len(lengths), args.batch_size, args.ranks
    generator = torch.Generator().manual_seed(args.seed)
    old = order_before_48ca7da(n, args.seed, lengths, B)
    rows = {
        "1 process, current": padded_per_step(EpochSampler(n, args.seed, lengths=lengths, batch_size=B).order(0), lengths, B, 1, args.multiple, args.max_length),
        "1 process, short group anywhere (before 48ca7da)": padded_per_step(old, lengths, B, 1, args.multiple, args.max_length),
        f"{W} ranks, current": padded_per_step(EpochSampler(n, args.seed, lengths=lengths, batch_size=B, ranks=W).order(0), lengths, B, W, args.multiple, args.max_length),
        f"{W} ranks, groups of one rank's batch dealt in turn": padded_per_step(EpochSampler(n, args.seed, lengths=lengths, batch_size=B).order(0), lengths, B, W, args.multiple, args.max_length),
        f"{W} ranks, reshuffled under DDP (before 48ca7da)": padded_per_step([old[i] for i in torch.randperm(n, generator=generator).tolist()], lengths, B, W, args.multiple, args.max_length),
        f"{W} ranks, ungrouped (random order)": padded_per_step(torch.randperm(n, generator=generator).tolist(), lengths, B, W, args.multiple, args.max_length),
    }
    print(f"{n} rows of {path}, max_length {args.max_length}, batch {B} a rank, padded to multiples of {args.multiple}; "
          f"mean real length {lengths.float().mean():.1f}")
    for name, value in rows.items():
        print(f"  {name:55s} {value:7.1f} padded tokens a row per step")


if __name__ == "__main__":
    main()
