"""What the gradient all-reduce adds to a graphed DDP training step, and how much of it the overlapped sync
(`BERTACCEL_GRAD_SYNC_OVERLAP`, `train_step.OverlappedGradSync`) hides behind the backward.

One process per GPU (NCCL). Each rank runs the graphed step body `bertaccel fit` runs
(`train_step.build_train_step`: bf16 weight copies, our AdamW, captured by `StepGraphs` and replayed) of an HF
BERT classifier (random init, SDPA, the same seeded batch on every rank, full length), in five variants timed
in the same run, each step with CUDA events after a barrier (median over `--steps`):

- `no-sync`: the step without any all-reduce (what one GPU runs);
- `sync-after`: `all_reduce_grads` after the backward, the word table whole (`BERTACCEL_EMBEDDING_ROW_SYNC=0`): the
  bf16 gradients and the table in place, coalesced, the small fp32 ones through one flat buffer;
- `sync-overlapped`: bucket by bucket from the backward's gradient hooks, on a side stream;
- `sync-embedding-rows`: after the backward, the word embeddings' gradient summed by the rows the batch's ids touch
  (`train_step.EmbeddingRowSync`; the default since session 65), the rest in one all-reduce per dtype;
- `sync-overlapped-embedding-rows`: both (the table's bucket, ready last, summed by its rows);
- `sync-embedding-rows-flat`: as `sync-embedding-rows` with every other gradient through a flat buffer per dtype
  (`all_reduce_grads(in_place=())`, the form before session 66; not in the default `--variants`); the default
  all-reduces the bf16 Linear weights' gradients in place, coalesced;
- `sync-after-table-flat`: as `sync-after` with the whole fp32 word table through the flat buffer
  (`all_reduce_grads(in_place_numel=None)`, the form of session 66; not in the default `--variants`); the default
  all-reduces every gradient of 2^20 elements or more in place, the table included.

    python -m benchmarks.bench_ddp_step [--models minilm base] [--shapes 32x256 16x512] [--out ddp_step.json]

`--device cpu` runs it with gloo on CPU processes (the reference ops): a smoke test of the script, not a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist

MODELS = {
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=256),
    "minilm": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536, vocab_size=30522),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, vocab_size=30522),
}
VARIANTS = ("no-sync", "sync-after", "sync-overlapped", "sync-embedding-rows", "sync-overlapped-embedding-rows")
EXTRA_VARIANTS = ("sync-embedding-rows-flat", "sync-after-table-flat")


def time_step(one_step, device: torch.device, steps: int, warmup: int) -> list[float]:
    from benchmarks.common import step_times_ms

    for _ in range(warmup):
        one_step()
    cuda = device.type == "cuda"

    def line_up() -> None:  # every rank starts the timed step together, its GPU idle
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()

    return step_times_ms(one_step, steps, cuda, before=line_up)


def run_variant(model_name: str, batch: int, seq: int, variant: str, device: torch.device, world: int, steps: int,
                warmup: int, bucket_mb: float = 25.0) -> dict:
    from transformers import BertConfig, BertForSequenceClassification

    from bertaccel.modules.graphs import StepGraphs
    from bertaccel.modules.train_step import EmbeddingRowSync, all_reduce_grads, build_train_step, make_static_grads
    from bertaccel.modules.weight_copies import Bf16WeightCopies

    torch.manual_seed(0)
    config = BertConfig(num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **MODELS[model_name])
    config._attn_implementation = "sdpa"
    model = BertForSequenceClassification(config).to(device)
    cuda = device.type == "cuda"
    lr = torch.tensor(1e-5, device=device) if cuda else 1e-5
    opt = torch.optim.AdamW(model.parameters(), lr=lr, **({"fused": True, "capturable": True} if cuda else {}))
    make_static_grads(model.parameters())
    copies = Bf16WeightCopies(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g).to(device)
    mask = torch.ones(batch, seq, dtype=torch.long, device=device)
    labels = torch.randint(0, 2, (batch,), generator=g).to(device)

    def forward(ids, mask, labels):
        return {"loss": torch.nn.functional.cross_entropy(model(input_ids=ids, attention_mask=mask).logits, labels)}

    synced = variant != "no-sync"
    grad_sync = all_reduce_grads if synced else None
    if variant == "sync-after-table-flat":
        grad_sync = lambda grads: all_reduce_grads(grads, in_place_numel=None)  # noqa: E731
    if "embedding-rows" in variant:
        reduce = (lambda grads: all_reduce_grads(grads, in_place=())) if variant.endswith("-flat") else None
        grad_sync = EmbeddingRowSync(model.get_input_embeddings().weight, batch * seq, reduce=reduce)
    step = build_train_step(forward, opt, copies=copies,
                            autocast=lambda: torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False),
                            grad_sync=grad_sync, world_size=world if synced else 1, row_ids_input="ids",
                            overlap_order=list(model.parameters()) if variant.startswith("sync-overlapped") else None,
                            bucket_bytes=int(bucket_mb * 2**20))
    runner = StepGraphs(variant, capture=cuda)
    times = time_step(lambda: runner.run("step", step, {"ids": ids, "mask": mask, "labels": labels}), device, steps, warmup)
    overlap = getattr(step, "overlap", None)
    row = {"model": model_name, "shape": f"{batch}x{seq}", "variant": variant, "world": world,
           "step_ms_p50": statistics.median(times), "step_ms_min": min(times), "replays": runner.stats.replays,
           "bucket_mb": bucket_mb if overlap else None, "buckets": len(overlap.buckets) if overlap else None,
           "buckets_sent_in_backward": overlap.launched_in_backward if overlap else None,
           "embedding_rows_only": grad_sync.rows_only if isinstance(grad_sync, EmbeddingRowSync) else None}
    step.close()
    return row


def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        options = None
        if args.nccl_high_priority:  # the process group's NCCL stream at high priority (its kernels' blocks go first)
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = True
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device, pg_options=options)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    for model_name in args.models:
        for shape in args.shapes:
            batch, seq = (int(x) for x in shape.split("x"))
            for _ in range(args.rounds):
                for variant in args.variants:
                    for bucket_mb in (args.bucket_mb if variant.startswith("sync-overlapped") else [args.bucket_mb[0]]):
                        rows.append(run_variant(model_name, batch, seq, variant, device, world, args.steps, args.warmup,
                                                bucket_mb))
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
    if rank == 0:
        print(f"{'model':7} {'shape':7} {'variant':30} {'step ms p50':>11} {'min':>7} {'bucket MiB':>10} {'buckets':>7} "
              f"{'in backward':>11}  (NCCL_MAX_NCHANNELS={os.environ.get('NCCL_MAX_NCHANNELS', 'unset')}, "
              f"high-priority stream: {args.nccl_high_priority})")
        for r in rows:
            print(f"{r['model']:7} {r['shape']:7} {r['variant']:30} {r['step_ms_p50']:11.3f} {r['step_ms_min']:7.3f} "
                  f"{r['bucket_mb'] if r['bucket_mb'] is not None else '-':>10} "
                  f"{r['buckets'] if r['buckets'] is not None else '-':>7} "
                  f"{r['buckets_sent_in_backward'] if r['buckets_sent_in_backward'] is not None else '-':>11}")
        if args.out:
            from benchmarks.common import environment

            with open(args.out, "w") as f:
                json.dump({"environment": environment() | {"gpus": world}, "args": vars(args), "rows": rows}, f, indent=1)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["minilm", "base"], choices=list(MODELS))
    parser.add_argument("--shapes", nargs="+", default=["32x256", "16x512"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS + EXTRA_VARIANTS))
    parser.add_argument("--rounds", type=int, default=2, help="the variants this many times, interleaved")
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[25.0],
                        help="the overlapped sync's bucket size(s) in MiB, each timed (default 25, DDP's)")
    parser.add_argument("--nccl-high-priority", action="store_true",
                        help="NCCL's stream at high priority (ProcessGroupNCCL.Options.is_high_priority_stream)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--world", type=int, default=None, help="processes (default: every GPU; 2 on CPU)")
    parser.add_argument("--out")
    args = parser.parse_args()
    world = args.world or (torch.cuda.device_count() if args.device == "cuda" else 2)
    if args.device == "cuda" and world < 2:
        raise SystemExit("bench_ddp_step needs at least 2 GPUs (one process per GPU); --device cpu for a smoke test")
    torch.multiprocessing.spawn(worker, args=(world, args), nprocs=world)


if __name__ == "__main__":
    main()
