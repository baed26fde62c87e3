"""What the gradient all-reduce of a graphed DDP step costs (`bertaccel.modules.train_step.all_reduce_grads`).

One process per GPU (NCCL). The gradients are those of a graphed bf16-mixed step: the Linear weights'
gradients in bf16 (their bf16 copies'), every other parameter's in fp32. Timed with CUDA events
(median), each row in the same run:

- `all_reduce_grads` eager, and captured in a CUDA graph and replayed (what the graphed step runs);
- NCCL alone: one all-reduce per dtype of preallocated flat buffers (the floor for this volume);
- every gradient in fp32 (the volume Lightning's DDP all-reduces for the same model).

    python -m benchmarks.bench_grad_sync [--models minilm base] [--out grad_sync.json]
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


def gradient_shapes(name: str) -> list[tuple[tuple[int, ...], torch.dtype]]:
    from transformers import BertConfig, BertForSequenceClassification

    with torch.device("meta"):
        model = BertForSequenceClassification(BertConfig(vocab_size=30522, num_labels=2, **MODELS[name]))
    linear = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    return [(tuple(p.shape), torch.bfloat16 if id(p) in linear else torch.float32) for p in model.parameters()]


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


def worker(rank: int, world: int, models: list[str], out: str | None) -> None:
    from bertaccel.modules.train_step import all_reduce_grads

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    rows = []
    for name in models:
        shapes = gradient_shapes(name)
        grads = [torch.randn(s, device="cuda").to(d) for s, d in shapes]
        nbytes = sum(g.numel() * g.element_size() for g in grads)
        fp32 = [g.float() for g in grads]
        flats = [torch.empty(sum(g.numel() for g in grads if g.dtype == d), dtype=d, device="cuda")
                 for d in (torch.bfloat16, torch.float32)]

        def nccl_only():
            for f in flats:
                dist.all_reduce(f)

        row = {"model": name, "world": world, "tensors": len(grads), "mbytes": nbytes / 1e6,
               "mbytes_all_fp32": sum(g.numel() * 4 for g in grads) / 1e6,
               "all_reduce_grads_ms": timed(lambda: all_reduce_grads(grads)),
               "nccl_flat_ms": timed(nccl_only),
               "all_fp32_ms": timed(lambda: all_reduce_grads(fp32))}
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            all_reduce_grads(grads)  # warm: NCCL connections for these sizes exist before the capture
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            all_reduce_grads(grads)
        row["graphed_ms"] = timed(graph.replay)
        row["graphed_gbs"] = nbytes / row["graphed_ms"] / 1e6
        rows.append(row)
        del graph
    if rank == 0:
        from benchmarks.common import environment

        print(f"{'model':8} {'MB':>7} {'eager ms':>9} {'graphed ms':>10} {'GB/s':>6} {'NCCL flat':>9} {'all fp32 ms':>11}")
        for r in rows:
            print(f"{r['model']:8} {r['mbytes']:7.1f} {r['all_reduce_grads_ms']:9.3f} {r['graphed_ms']:10.3f} "
                  f"{r['graphed_gbs']:6.0f} {r['nccl_flat_ms']:9.3f} {r['all_fp32_ms']:11.3f}")
        if out:
            with open(out, "w") as f:
                json.dump({"environment": environment() | {"gpus": world}, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--out")
    args = parser.parse_args()
    world = torch.cuda.device_count()
    if world < 2:
        raise SystemExit("bench_grad_sync needs at least 2 GPUs (one process per GPU)")
    torch.multiprocessing.spawn(worker, args=(world, args.models, args.out), nprocs=world)


if __name__ == "__main__":
    main()
