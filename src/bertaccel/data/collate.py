"""Batch collation: dynamic padding (to the longest row, optionally to a multiple of 8), or static
shapes for CUDA graphs (lengths padded up to one of a few buckets, short batches padded with
masked rows to the full batch size); for the unpadded encoder, also where the real tokens are
(`packed_layout`), computed here on the CPU so that the step needs no host read."""

from __future__ import annotations

import bisect

import torch
import torch.nn.functional as F

from bertaccel.data.masking import IGNORE_INDEX  # also the label of a padding row


def bucket_lengths(max_length: int, buckets: int | list[int]) -> list[int]:
    """The padded lengths a batch may take: every multiple of `buckets` up to `max_length` (and
    `max_length` itself), or the given list (capped at `max_length`, which is always included)."""
    if isinstance(buckets, int):
        if buckets <= 0:
            raise ValueError(f"length_buckets must be a positive multiple or a list of lengths, got {buckets}.")
        out = list(range(buckets, max_length, buckets))
    else:
        if any(int(b) <= 0 for b in buckets):
            raise ValueError(f"length_buckets must hold positive lengths, got {list(buckets)}.")
        out = [int(b) for b in buckets if int(b) < max_length]
    return sorted(set(out)) + [max_length]


def pad_ids(
    rows: list[torch.Tensor],
    pad_id: int,
    multiple_of: int | None = None,
    buckets: list[int] | None = None,
    batch_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) input_ids and attention_mask.

    T is the longest row rounded up to `multiple_of`, or to the smallest of `buckets` that holds
    it. With `batch_size`, B is `batch_size` and the missing rows are padding rows: one [PAD]
    token that attends to itself (attention_mask 1 at position 0, so no softmax row is fully
    masked), to be ignored through their labels.
    """
    longest = max((r.numel() for r in rows), default=1)  # no rows: a batch of padding rows only
    if buckets:
        i = bisect.bisect_left(buckets, longest)
        if i == len(buckets):
            raise ValueError(f"a row of {longest} tokens is longer than the largest bucket {buckets[-1]}.")
        longest = buckets[i]
    elif multiple_of:
        longest = -(-longest // multiple_of) * multiple_of
    n = len(rows)
    if batch_size is not None and n > batch_size:
        raise ValueError(f"{n} rows do not fit a batch of {batch_size}.")
    b = batch_size if batch_size is not None else n
    ids = torch.full((b, longest), pad_id, dtype=torch.long)
    mask = torch.zeros((b, longest), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : r.numel()] = r
        mask[i, : r.numel()] = 1
    mask[n:, 0] = 1
    return ids, mask


def packed_layout(
    mask: torch.Tensor, token_quantum: int | None = None, token_sizes: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the real tokens of a right-padded [batch, seq] attention mask are, as the unpadded encoder
    (`bertaccel.modules.unpadded`) takes them: `packed_indices`, the flat positions (b * seq + s) of
    the real tokens sequence by sequence, and `cu_seqlens`, the int32 offsets of each sequence
    ([batch + 1], FlashAttention's varlen convention).

    The token count can be padded, with filler positions appended after the real tokens (the first
    padding positions of the batch, each once, so that packing and unpacking stay exact): to the
    smallest of `token_sizes` that holds it, else up to a multiple of `token_quantum`, else (sizes
    given, none large enough) to batch x seq. A CUDA graph then sees a few token counts instead of one
    per batch; the fillers run through the encoder as padding tokens and are never read back.
    """
    mask = mask.bool()
    seq = mask.shape[1]
    lengths = mask.sum(1)
    if bool((mask != (torch.arange(seq) < lengths[:, None])).any()):
        raise ValueError("the unpadded encoder needs right-padded batches (real tokens first in every row).")
    flat = mask.reshape(-1)
    indices = flat.nonzero().squeeze(1)
    tokens = indices.numel()
    budget = tokens
    if token_sizes:
        i = bisect.bisect_left(token_sizes, tokens)
        budget = token_sizes[i] if i < len(token_sizes) else flat.numel()
    elif token_quantum:
        budget = -(-max(tokens, 1) // token_quantum) * token_quantum
    budget = min(flat.numel(), budget)
    if budget > tokens:
        fill = (~flat).nonzero().squeeze(1)[: budget - tokens]
        indices = torch.cat([indices, fill])
    cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    return indices, cu_seqlens


# What one more CUDA-graph capture costs, in padding tokens computed (the trade `choose_token_sizes` makes when it
# picks how many token counts to capture). A capture records the step on the host: ~6.5 ms per encoder layer
# (MiniLM's 6 layers: 21-62 ms, mean ~39, on the H100 at beaa183 and the H200 at 8644dd7 / 14fa132; a deeper model's
# recording grows with its layers - BERT-base's is not measured). A padding token of a packed batch costs its share
# of the GEMMs, LayerNorms and GELU - not attention (it belongs to no sequence), not the optimizer: ~1.8e-13 s x
# layers x hidden^2 (32x512, lengths uniform in [0.2, 1] x 512, the padded graphed step's time minus the unpadded
# one's over the 6,554 padding tokens: MiniLM 0.156 us a token on the H200 - 4.147 / 4.124 vs 3.127 / 3.131 ms,
# 8351f97 -, 1.8e-13; BERT-base 1.37 us on the H100 - 24.65 vs 15.63-15.71 ms, 5ecbdb3 / 196f64f -, 1.9e-13). The
# layers cancel: a capture is worth ~3.6e10 / hidden^2 padding tokens - MiniLM (384) ~245k, BERT-base (768) ~61k,
# BERT-large (1024) ~34k. (Before, one 64k for every model, from MiniLM's mean cost per packed token rather than a
# padding token's: for MiniLM it bought a size more than pays - the staged IMDB rows, 195 steps at max_length 512: 3
# sizes where, by this estimate, 2 cost ~25 ms less.) Measured directly since (H200, da80fec, `benchmarks.e2e
# --token-budgets`: the same rows, the packed token count padded to several budgets): MiniLM 0.148 us a padding token
# at 32x256 (4,800 -> 8,192 tokens), 0.135 at 32x512 (9,600 -> 16,384) against this model's 0.159 - in steps, not
# evenly (the GEMMs' waves of tiles). In the fine-tune the choice's effect is inside the run-to-run spread (at 256: 1
# size 7,168 / 10,147 samples/s, 2 sizes 9,786 / 8,399 in two process orders).
CAPTURE_SECONDS_PER_LAYER = 6.5e-3
PADDING_TOKEN_SECONDS = 1.8e-13  # x layers x hidden^2


def capture_cost_tokens(hidden_size: int) -> int:
    """One CUDA-graph capture's cost in padding tokens of a packed batch, for an encoder of `hidden_size`."""
    return round(CAPTURE_SECONDS_PER_LAYER / (PADDING_TOKEN_SECONDS * hidden_size ** 2))


CAPTURE_COST_TOKENS = capture_cost_tokens(768)  # when the model is not known: BERT-base's


def batch_token_counts(lengths: torch.Tensor, order: torch.Tensor, batch_size: int, max_length: int) -> torch.Tensor:
    """The real-token count of each batch of `batch_size` rows taken in `order` (indices into `lengths`),
    as the packed collator counts it: every row's length capped at `max_length`; the padding rows that
    fill a short last batch up to `batch_size` count one token each."""
    order = torch.as_tensor(order, dtype=torch.long)
    if order.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    per_row = lengths.clamp(max=max_length).to(torch.long)[order]
    short = -order.numel() % batch_size
    per_row = torch.cat([per_row, torch.ones(short, dtype=torch.long)])
    return per_row.view(-1, batch_size).sum(1)


def _padding_by_sizes(counts: torch.Tensor, most: int, multiple: int, candidates: int) -> list[tuple[float, list[int]]]:
    """For k = 1..most: (mean padding per batch, the k sizes) of the best k token sizes for `counts`,
    each batch padded to the smallest size that holds it. Dynamic programming over candidate sizes: the
    counts' quantiles rounded up to `multiple` (the largest count among them)."""
    c = counts.to(torch.float64).sort().values
    n = c.numel()
    qs = torch.linspace(0, 1, candidates, dtype=torch.float64)
    cand = torch.unique(torch.ceil(torch.quantile(c, qs) / multiple) * multiple)
    m = cand.numel()
    prefix = torch.cat([torch.zeros(1, dtype=torch.float64), c.cumsum(0)])
    below = torch.searchsorted(c, cand, right=True)  # batches of at most each candidate size
    cnt, tot = below.to(torch.float64), prefix[below]
    # seg[i, j]: padding of the batches above candidate i and at most candidate j, padded to candidate j
    seg = (cnt[None, :] - cnt[:, None]) * cand[None, :] - (tot[None, :] - tot[:, None])
    seg = torch.where(torch.arange(m)[:, None] < torch.arange(m)[None, :], seg, torch.full_like(seg, float("inf")))
    best = cnt * cand - tot  # one size: the j-th candidate holds every batch up to it
    choice = [torch.full((m,), -1, dtype=torch.long)]
    out = [(float(best[-1]) / n, [int(cand[-1])])]
    for _ in range(2, most + 1):
        total = best[:, None] + seg  # the previous sizes end at candidate i, the new one is candidate j
        best, arg = total.min(0)
        choice.append(arg)
        sizes, j = [], m - 1
        for k in range(len(choice) - 1, -1, -1):
            sizes.append(int(cand[j]))
            j = int(choice[k][j])
            if j < 0:
                break
        out.append((float(best[-1]) / n, sorted(sizes)))
    return out


def choose_token_sizes(counts: torch.Tensor, buckets: int | str = "auto", steps: int | None = None,
                       multiple: int = 8, most: int = 16, candidates: int = 256,
                       capture_cost: int = CAPTURE_COST_TOKENS) -> list[int]:
    """The token counts a packed batch is padded to (`packed_layout`'s `token_sizes`), chosen from the
    real-token counts of the batches a loader will make (`batch_token_counts`): the sizes that minimise
    the padding when every batch is padded to the smallest size holding it. Each size that occurs costs one
    CUDA-graph capture, so `buckets` is how many: a number, or "auto": the number that minimises
    `steps` x padding per step + captures x `capture_cost` (`steps`: how many batches the run will take;
    default: as many as `counts`; `capture_cost`: `capture_cost_tokens(hidden size)`, BERT-base's by default). Sizes are multiples of `multiple`; the largest is the
    largest count (a batch above it is padded to batch x seq, one more capture)."""
    counts = torch.as_tensor(counts, dtype=torch.long)
    if counts.numel() == 0:
        return []
    if buckets != "auto" and not (isinstance(buckets, int) and buckets >= 1):
        raise ValueError(f"token buckets must be a whole number >= 1 or 'auto', got {buckets!r}.")
    options = _padding_by_sizes(counts, most if buckets == "auto" else buckets, multiple, candidates)
    if buckets != "auto":
        return options[-1][1]
    steps = counts.numel() if steps is None else steps
    return min(options, key=lambda o: steps * o[0] + len(o[1]) * capture_cost)[1]


class ClassificationCollator:
    """Rows `{"input_ids", "label", "index"}` to a padded batch; a picklable class for workers.

    Rows come longest first (a stable sort: our attention kernels start the longest sequences first); every batch
    carries each row's dataset `index`, `num_rows`, the number of real rows, and `num_tokens`, their real tokens
    (Python ints; packed: also `attention_pairs`, the sum of the squared lengths, padding rows' one token each
    included, as the varlen kernels run them). With `batch_size`
    (static shapes), padding rows are added up to it: their `labels` are -100 and their `index`
    is -1, so losses, metrics and prediction writers skip them. A filler row (`{"filler": True}`,
    what the datasets return for `EvalShardSampler`'s FILLER index) becomes such a padding row too.
    With `packed`, batches also carry `packed_indices` and `cu_seqlens` (`packed_layout`); with
    static shapes the token count is padded to the smallest of `token_sizes` that holds it (a list,
    e.g. from `choose_token_sizes`; batch x seq above the largest), or, given a number N, up to a
    multiple of batch x seq / N.
    """

    def __init__(
        self,
        pad_id: int,
        pad_to_multiple_of: int | None = None,
        buckets: list[int] | None = None,
        batch_size: int | None = None,
        packed: bool = False,
        token_sizes: int | list[int] = 16,
    ) -> None:
        self.pad_id, self.pad_to_multiple_of = pad_id, pad_to_multiple_of
        self.buckets, self.batch_size = buckets, batch_size
        self.packed = packed
        self.token_sizes = token_sizes if isinstance(token_sizes, int) else sorted(int(t) for t in token_sizes)

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor | int]:
        # fillers (an evaluation share under DDP padded to the other ranks' length) become padding rows
        size = self.batch_size if self.batch_size is not None else len(rows)
        labelled = any(r.get("label") is not None for r in rows)
        rows = [r for r in rows if not r.get("filler")]
        # the longest row first (stable): our attention kernels launch a batch's sequences in row order, so the
        # longest ones start first and the short ones fill in behind them (H200, lengths uniform in [0.2, 1] x 512:
        # attention forward + backward 5-7% faster, the MiniLM unpadded step 1.3%). Losses and metrics do not depend
        # on the order; predictions carry each row's `index`.
        rows.sort(key=lambda r: len(r["input_ids"]), reverse=True)
        ids, mask = pad_ids([r["input_ids"] for r in rows], self.pad_id, self.pad_to_multiple_of, self.buckets, size)
        n, b = len(rows), ids.shape[0]
        index = torch.full((b,), -1, dtype=torch.long)
        index[:n] = torch.tensor([r["index"] for r in rows], dtype=torch.long)
        # counted here on the host, so that the meters need no device work per step: the real tokens, and (packed)
        # the sum of the squared lengths, the varlen attention's query-key pairs
        lengths = [len(r["input_ids"]) for r in rows]  # (pad_ids refuses a row longer than the batch)
        batch = {"input_ids": ids, "attention_mask": mask, "index": index, "num_rows": n, "num_tokens": sum(lengths)}
        if self.packed:
            batch["attention_pairs"] = sum(k * k for k in lengths) + (b - n)  # padding rows: one token each
            quantum, sizes = None, None
            if self.batch_size is not None:  # static shapes: a few token counts
                if isinstance(self.token_sizes, int):
                    quantum = -(-ids.numel() // self.token_sizes)
                    quantum = -(-quantum // 8) * 8
                else:
                    sizes = self.token_sizes
            batch["packed_indices"], batch["cu_seqlens"] = packed_layout(mask, quantum, sizes)
        if labelled:
            labels = torch.full((b,), IGNORE_INDEX, dtype=torch.long)
            labels[:n] = torch.tensor([r["label"] for r in rows], dtype=torch.long)
            batch["labels"] = labels
        return batch
