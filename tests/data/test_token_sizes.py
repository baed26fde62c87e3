"""Choosing the token counts packed static batches are padded to (`collate.choose_token_sizes`)."""

import itertools

import pytest
import torch

from bertaccel.data.collate import CAPTURE_COST_TOKENS, batch_token_counts, capture_cost_tokens, choose_token_sizes


def padding(counts: torch.Tensor, sizes: list[int]) -> int:
    sizes = torch.tensor(sorted(sizes))
    return int((sizes[torch.searchsorted(sizes, counts)] - counts).sum())


def test_batch_token_counts_sum_rows_capped_and_count_padding_rows():
    lengths = torch.tensor([5, 40, 7, 3, 9])
    # batches of 2 in the order 4, 1, 0, 3, 2: [9 + 32], [5 + 3], [7 + one padding row]
    assert batch_token_counts(lengths, torch.tensor([4, 1, 0, 3, 2]), 2, 32).tolist() == [41, 8, 8]
    assert batch_token_counts(lengths, torch.tensor([], dtype=torch.long), 2, 32).numel() == 0


@pytest.mark.parametrize("k", [1, 2, 3])
def test_chosen_sizes_pad_least_among_all_choices_of_the_candidates(k):
    """Brute force over every k multiples of 8 between the smallest and largest count: the dynamic
    programme's sizes pad no more than the best of them (candidates are every multiple here)."""
    g = torch.Generator().manual_seed(k)
    counts = torch.randint(40, 200, (60,), generator=g)
    sizes = choose_token_sizes(counts, k, multiple=8, candidates=1000)
    assert len(sizes) == k and sizes == sorted(sizes) and all(s % 8 == 0 for s in sizes)
    assert sizes[-1] >= int(counts.max()) and sizes[-1] - int(counts.max()) < 8
    top = -(-int(counts.max()) // 8) * 8
    grid = list(range(-(-int(counts.min()) // 8) * 8, top, 8))
    best = min(padding(counts, [*rest, top]) for rest in itertools.combinations(grid, k - 1))
    assert padding(counts, sizes) == best


def test_auto_trades_padding_against_captures():
    """'auto': many planned steps buy more sizes (less padding), few steps fewer; the choice minimises
    steps x mean padding + sizes x CAPTURE_COST_TOKENS over the sizes the programme offers."""
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(6000, 12000, (2000,), generator=g)
    few = choose_token_sizes(counts, "auto", steps=50)
    many = choose_token_sizes(counts, "auto", steps=100_000)
    assert len(few) < len(many) <= 16
    for steps, chosen in ((50, few), (100_000, many)):
        cost = steps * padding(counts, chosen) / counts.numel() + len(chosen) * CAPTURE_COST_TOKENS
        for k in range(1, 17):
            other = choose_token_sizes(counts, k)
            assert cost <= steps * padding(counts, other) / counts.numel() + k * CAPTURE_COST_TOKENS + 1e-6


def test_bad_bucket_counts_are_refused():
    with pytest.raises(ValueError, match="whole number >= 1 or 'auto'"):
        choose_token_sizes(torch.tensor([10, 20]), 0)
    assert choose_token_sizes(torch.tensor([], dtype=torch.long)) == []


def test_a_capture_is_worth_more_padding_tokens_for_a_narrower_model():
    """A capture's cost in padding tokens falls with hidden^2 (a padding token's GEMM work grows with it; the host's
    recording does not); BERT-base's is the default; a dearer capture never buys more sizes."""
    assert CAPTURE_COST_TOKENS == capture_cost_tokens(768)
    assert 240_000 < capture_cost_tokens(384) < 250_000 and 60_000 < capture_cost_tokens(768) < 62_000
    assert capture_cost_tokens(384) == pytest.approx(4 * capture_cost_tokens(768), rel=1e-4)
    g = torch.Generator().manual_seed(1)
    counts = torch.randint(6000, 12000, (600,), generator=g)
    by_width = [len(choose_token_sizes(counts, "auto", steps=200, capture_cost=capture_cost_tokens(h)))
                for h in (1024, 768, 384)]
    assert by_width == sorted(by_width, reverse=True) and by_width[0] > by_width[-1]
