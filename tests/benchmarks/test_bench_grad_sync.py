"""benchmarks/bench_grad_sync.py's parts of the gradient sum, on CPU: the cat and copy-back it times are a round trip
of the gradients' values, the flat-view alternative leaves each view holding its fresh gradient, and leaving the word
embeddings out drops exactly the table (what a graphed step sums by its rows)."""

from __future__ import annotations

import torch

from benchmarks.bench_grad_sync import gradient_shapes, sync_parts


def test_leaving_the_word_embeddings_out_drops_the_table_alone():
    whole, without = gradient_shapes("minilm"), gradient_shapes("minilm", word_embeddings=False)
    assert len(whole) == len(without) + 1
    assert [s for s in whole if s not in without] == [((30522, 384), torch.float32)]


def test_the_timed_parts_round_trip_the_gradients_and_the_views_hold_the_fresh_gradients():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=g).to(d) for s, d in [((5, 3), torch.bfloat16), ((7,), torch.float32),
                                                            ((2, 4), torch.bfloat16), ((3,), torch.float32)]]
    before = [x.clone() for x in grads]
    parts = sync_parts(grads)
    assert set(parts) == {"cat", "copy_back", "flat_views"}
    for x in grads:
        x.mul_(3)  # the copy back must put the flat buffers' values (the originals) back
    parts["cat"]()
    parts["copy_back"]()
    for x, y in zip(grads, before):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    parts["flat_views"]()
    parts["flat_views"]()  # twice: zeroed first, so each view holds one fresh gradient, not two
    views = [v for group in parts["flat_views"].views for v in group]
    by_dtype = [x for d in (torch.bfloat16, torch.float32) for x in before if x.dtype == d]
    assert len(views) == len(by_dtype)
    for v, x in zip(views, by_dtype):
        torch.testing.assert_close(v, x.reshape(-1), rtol=0, atol=0)
