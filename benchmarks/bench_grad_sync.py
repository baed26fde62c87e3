"""What the gradient all-reduce of a graphed DDP step costs (`bertaccel.modules.train_step.all_reduce_grads`).

One process per GPU (NCCL). The gradients are those of a graphed bf16-mixed step: the Linear weights'
gradients in bf16 (their bf16 copies'), every other parameter's in fp32. Timed with CUDA events
(median), each row in the same run:

- `all_reduce_grads` with every gradient through the flat buffers (`in_place=()`, the graphed step's sum before
  session 66), eager, and captured in a CUDA graph and replayed;
- NCCL alone: one all-reduce per dtype of preallocated flat buffers (the floor for this volume);
- every gradient in fp32 (the volume Lightning's DDP all-reduces for the same model);
- the parts `all_reduce_grads` adds to NCCL's own time, alone: the cat into the flat buffers (`cat_ms`) and the copy
  back (`copy_back_ms`), and what gradients kept in the flat buffers would cost instead (`flat_views_ms`: zero the
  buffers, then add each new gradient into its view, as autograd's in-place accumulation would, since it could no
  longer hand its fresh tensor over), each timed eager (host launches included) and captured in a CUDA graph and replayed
  (`*_graphed_ms`: the GPU's own time, what a graphed step pays);
- NCCL coalesced (`coalesced_ms`, `coalesced_graphed_ms`; `all_reduce_grads(in_place=(bf16, fp32))`): every gradient
  all-reduced in place, the calls of a dtype coalesced into one NCCL group (`dist._coalescing_manager`, as FSDP2
  does): no flat buffer, no cat, no copy back; and the mixed form (`bf16_in_place_*`; `all_reduce_grads`' default since
  session 66): the bf16 Linear weights' gradients in place, the fp32 ones (word table, norms, biases) through the flat
  buffer; and that plus every gradient of at least 2^20 elements in place whatever its dtype (`large_in_place_*`:
  `in_place_numel`; in BERT only the fp32 word table).

`--without-word-embeddings` leaves the word embeddings' table out of the all-reduce, as a graphed step does where it
sums that gradient by the batch's rows (`EmbeddingRowSync`, the default since session 65; its gather is timed in
`bench_ddp_step`).

    python -m benchmarks.bench_grad_sync [--models minilm base] [--without-word-embeddings] [--out grad_sync.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist

MODELS = {
    "minilm": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
}


def gradient_shapes(name: str, word_embeddings: bool = True) -> list[tuple[tuple[int, ...], torch.dtype]]:
    from transformers import BertConfig, BertForSequenceClassification

    with torch.device("meta"):
        model = BertForSequenceClassification(BertConfig(vocab_size=30522, num_labels=2, **MODELS[name]))
    linear = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    table = model.get_input_embeddings().weight
    return [(tuple(p.shape), torch.bfloat16 if id(p) in linear else torch.float32) for p in model.parameters()
            if word_embeddings or p is not table]


def sync_parts(grads: list[torch.Tensor]) -> dict:
    """`all_reduce_grads`'s steps around NCCL, each a function: `cat` (the gradients into one flat buffer per dtype),
    `copy_back` (the flat buffers' values back into the gradients) and `flat_views` (the alternative: gradients as
    views of preallocated flat buffers - zero them, then add a fresh gradient into each view)."""
    from bertaccel.modules.train_step import grads_by_dtype

    groups = grads_by_dtype(grads)
    flats = [torch.cat([g.reshape(-1) for g in same]) for same in groups]
    views = [list(f.split([g.numel() for g in same])) for f, same in zip(flats, groups)]
    fresh = [[g.reshape(-1).clone() for g in same] for same in groups]

    def cat():
        for same in groups:
            torch.cat([g.reshape(-1) for g in same])

    def copy_back():
        for same, v in zip(groups, views):
            torch._foreach_copy_(same, [x.view_as(g) for x, g in zip(v, same)])

    def flat_views():
        for f, v, new in zip(flats, views, fresh):
            f.zero_()
            torch._foreach_add_(v, new)

    flat_views.views = views  # type: ignore[attr-defined]  (for the tests)
    return {"cat": cat, "copy_back": copy_back, "flat_views": flat_views}


def graph_of(fn) -> torch.cuda.CUDAGraph:
    """`fn` captured into a CUDA graph (run once on the capture stream first: NCCL's connections and the caching
    allocator's blocks exist before the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    torch.cuda.synchronize()
    return graph


def timed(fn, repeats: int = 30, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def worker(rank: int, world: int, models: list[str], out: str | None, word_embeddings: bool = True) -> None:
    from bertaccel.modules.train_step import IN_PLACE_NUMEL, all_reduce_grads

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    rows = []
    for name in models:
        shapes = gradient_shapes(name, word_embeddings)
        grads = [torch.randn(s, device="cuda").to(d) for s, d in shapes]
        nbytes = sum(g.numel() * g.element_size() for g in grads)
        fp32 = [g.float() for g in grads]
        flats = [torch.empty(sum(g.numel() for g in grads if g.dtype == d), dtype=d, device="cuda")
                 for d in (torch.bfloat16, torch.float32)]

        def nccl_only():
            for f in flats:
                dist.all_reduce(f)

        row = {"model": name, "world": world, "word_embeddings": word_embeddings, "tensors": len(grads), "mbytes": nbytes / 1e6,
               "mbytes_all_fp32": sum(g.numel() * 4 for g in grads) / 1e6,
               "all_reduce_grads_ms": timed(lambda: all_reduce_grads(grads, in_place=())),
               "nccl_flat_ms": timed(nccl_only),
               "all_fp32_ms": timed(lambda: all_reduce_grads(fp32, in_place=()))}
        graphs = [graph_of(lambda: all_reduce_grads(grads, in_place=()))]  # all freed before the process group
        row["graphed_ms"] = timed(graphs[-1].replay)
        row["graphed_gbs"] = nbytes / row["graphed_ms"] / 1e6
        for part, fn in sync_parts(grads).items():  # eager (as all_reduce_grads above), then graphed (its GPU time)
            row[f"{part}_ms"] = timed(fn)
            graphs.append(graph_of(fn))
            row[f"{part}_graphed_ms"] = timed(graphs[-1].replay)
        for key, in_place, numel in (("coalesced", (torch.bfloat16, torch.float32), None),
                                     ("bf16_in_place", (torch.bfloat16,), None),
                                     ("large_in_place", (torch.bfloat16,), IN_PLACE_NUMEL)):
            row[f"{key}_ms"] = timed(lambda: all_reduce_grads(grads, in_place=in_place, in_place_numel=numel))
            graphs.append(graph_of(lambda: all_reduce_grads(grads, in_place=in_place, in_place_numel=numel)))
            row[f"{key}_graphed_ms"] = timed(graphs[-1].replay)
        rows.append(row)
        del graphs
    if rank == 0:
        from benchmarks.common import environment

        print(f"{'model':8} {'MB':>7} {'eager ms':>9} {'graphed ms':>10} {'GB/s':>6} {'NCCL flat':>9} {'coalesced':>9} "
              f"{'graphed':>7} {'bf16 in place':>13} {'graphed':>7} {'+ large':>7} {'graphed':>7} {'all fp32 ms':>11}  (word embeddings {'in' if word_embeddings else 'out'})")
        for r in rows:
            print(f"{r['model']:8} {r['mbytes']:7.1f} {r['all_reduce_grads_ms']:9.3f} {r['graphed_ms']:10.3f} "
                  f"{r['graphed_gbs']:6.0f} {r['nccl_flat_ms']:9.3f} {r['coalesced_ms']:9.3f} {r['coalesced_graphed_ms']:7.3f} "
                  f"{r['bf16_in_place_ms']:13.3f} {r['bf16_in_place_graphed_ms']:7.3f} {r['large_in_place_ms']:7.3f} "
                  f"{r['large_in_place_graphed_ms']:7.3f} {r['all_fp32_ms']:11.3f}")
        print(f"{'parts, ms':8} {'cat':>7} {'graphed':>7} {'copy back':>9} {'graphed':>7} {'flat views':>10} {'graphed':>7}")
        for r in rows:
            print(f"{r['model']:8} {r['cat_ms']:7.3f} {r['cat_graphed_ms']:7.3f} {r['copy_back_ms']:9.3f} "
                  f"{r['copy_back_graphed_ms']:7.3f} {r['flat_views_ms']:10.3f} {r['flat_views_graphed_ms']:7.3f}")
        if out:
            with open(out, "w") as f:
                json.dump({"environment": environment() | {"gpus": world}, "rows": rows}, f, indent=1)
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--without-word-embeddings", action="store_true",
                        help="leave the word embeddings' table out (summed by its rows in a graphed step, the default)")
    parser.add_argument("--out")
    args = parser.parse_args()
    world = torch.cuda.device_count()
    if world < 2:
        raise SystemExit("bench_grad_sync needs at least 2 GPUs (one process per GPU)")
    torch.multiprocessing.spawn(worker, args=(world, args.models, args.out, not args.without_word_embeddings), nprocs=world)


if __name__ == "__main__":
    main()
