"""Does the per-batch SIGTERM agreement under DDP stall the host? (GPU host; one process, NCCL.)

    python -m benchmarks.bench_sigterm_check [--busy-ms 50] [--rounds 5] [--out sigterm_check.json]

Queues a GPU kernel that runs about `--busy-ms` (torch.cuda._sleep, standing in for the training steps the
host has launched ahead), then times on the host one call of Lightning's check
(`_TrainingEpochLoop._broadcast_sigterm_tensor`: a tensor made with torch.tensor(..., device=...), a
broadcast, `.item()`) and one of `LaggedSigtermCheck` (bertaccel.modules.sigterm_check). A check that
synchronises takes about the busy time; one that does not, microseconds. Medians over `--rounds`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import types

import torch
import torch.distributed as dist

from benchmarks.common import environment, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--busy-ms", type=float, default=50.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_sigterm_check needs a CUDA GPU (NCCL)")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{tmp}/store", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        try:
            _measure(args)
        finally:
            dist.destroy_process_group()


def _measure(args) -> None:
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    from bertaccel.modules.sigterm_check import LaggedSigtermCheck

    trainer = types.SimpleNamespace(received_sigterm=False, world_size=1,
                                    strategy=types.SimpleNamespace(root_device=torch.device("cuda", 0)))
    loop = types.SimpleNamespace(trainer=trainer)
    lightning = lambda: _TrainingEpochLoop._broadcast_sigterm_tensor(loop)  # noqa: E731
    checks = {"lightning": lightning, "lagged": LaggedSigtermCheck(trainer)}
    # cycles for the busy kernel: calibrated on this GPU
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(10_000_000)
    torch.cuda.synchronize()
    cycles = int(10_000_000 * args.busy_ms / (1e3 * (time.perf_counter() - t0)))
    host_ms: dict[str, list[float]] = {name: [] for name in checks}
    for _ in range(args.rounds + 1):  # the first round warms NCCL and the allocators up
        for name, check in checks.items():
            torch.cuda.synchronize()
            torch.cuda._sleep(cycles)
            t = time.perf_counter()
            check()
            host_ms[name].append(1e3 * (time.perf_counter() - t))
            torch.cuda.synchronize()
    result = {name: round(statistics.median(v[1:]), 3) for name, v in host_ms.items()}
    print(f"host ms per check with {args.busy_ms:.0f} ms of GPU work queued (median of {args.rounds}): {result}")
    if args.out:
        write_json(args.out, {"environment": environment(), "busy_ms": args.busy_ms, "host_ms": result})


if __name__ == "__main__":
    main()
