"""The GEMM baselines our own tensor-core GEMM must meet: cuBLAS through PyTorch at BERT's shapes.

    python -m benchmarks.bench_gemm --out bench_results/gemm.json
    python -m benchmarks.bench_gemm --device cpu --shapes 64x48x32     # the harness only

For each M x N x K (M = tokens, N = output features, K = input features; nn.Linear's y = x W^T with
W stored [N, K]) and bf16 operands with fp32 accumulation, the three GEMMs of a linear layer:
forward y = x W^T, dgrad dx = dy W, wgrad dW = dy^T x, each 2*M*N*K FLOPs, timed from CUDA-graph
replays (kernels only). Also the epilogue baselines the fused GEMMs must beat: linear + bias + GELU
as PyTorch runs it (cuBLAS with bias, then GELU) and with bertaccel's bias_gelu kernel after a
bias-free cuBLAS GEMM, against our GEMM with bias + GELU in its epilogue. Our GEMM (bertaccel.ops.gemm,
Hopper) runs beside cuBLAS in the same process on the same tensors; `--sweep` also times every tile
width and K split (the data behind the tile heuristic in csrc/gemm.cu).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from benchmarks.common import environment, graph_time_ms, kernel_env, print_table, write_json

# the grid: M x N x K in {2048, 16384} x {768, 2304, 3072} x {768, 3072}
SHAPES = [(m, n, k) for m in (2048, 16384) for n in (768, 2304, 3072) for k in (768, 3072)]


def parse_shape(text: str) -> tuple[int, int, int]:
    m, n, k = (int(v) for v in text.lower().split("x"))
    return m, n, k


def time_ms(fn, args, device: str) -> float:
    if device == "cuda":
        return graph_time_ms(fn, [args], calls=10, replays=10)
    import time

    fn(*args)
    t0 = time.perf_counter()
    for _ in range(3):
        fn(*args)
    return (time.perf_counter() - t0) / 3 * 1e3


def _ours_available(device: str, epilogues: bool = True) -> bool:
    """Our GEMM's extension loaded (and, for the epilogue baselines, the main one with bias_gelu)."""
    if device != "cuda":
        return False
    from bertaccel.ops import build

    return build.load_gemm() and (not epilogues or build.load())


def _env_call(var: str, value: str, fn, *args):
    """fn(*args) with the environment variable `var` set to `value` for this call only: the GEMM op reads
    BERTACCEL_GEMM_STORE (staged: the threads store the outputs instead of TMA) and BERTACCEL_GEMM_SPLIT
    (kernel: K splits summed inside the kernel; workspace: by a second pass) at each call, so a graph
    captured inside this call keeps that choice."""
    with kernel_env({var: value}):
        return fn(*args)


def config_label(cfg) -> str:
    """gemm_config's [tile rows, width, splits, schedule, in-kernel sum, tuned, blocks per cluster] as the
    sweep labels it ("c2": clusters of two blocks)."""
    rows, width, splits, schedule, kernel_sum, _ = cfg[:6]
    cluster = cfg[6] if len(cfg) > 6 else 1
    kind = {1: "", 2: "pp ", 3: "sk ", 4: "r192 "}[schedule]
    return (f"{kind}n{width} s{splits}" + (" kernel-sum" if kernel_sum and splits > 1 else "")
            + (" c2" if cluster == 2 and schedule != 3 else ""))


class ColdL2:
    """Calls with their operands out of L2, as a training step's weights are: each call follows a read of 256 MB
    (5x the H100's L2); `flush_ms` (the read alone, timed the same way) is what to subtract."""

    def __init__(self, device: str, rounds: int) -> None:
        self.buf = torch.empty(64 * 1024 * 1024, device=device)
        self.flush_ms = interleaved_ms([lambda *a: self.buf.sum()], (), device, rounds)[0]

    def __call__(self, fn):
        return lambda *a: (self.buf.sum(), fn(*a))[1]


def interleaved_ms(fns, args, device: str, rounds: int) -> list[float]:
    """Median time of each of fns, timed in turn `rounds` times."""
    times = [[] for _ in fns]
    for _ in range(rounds):
        for t, fn in zip(times, fns):
            t.append(time_ms(fn, args, device))
    return [statistics.median(t) for t in times]


def run(shapes, device: str, dtype: torch.dtype, sweep: bool = False, schedules=(1, 2, 3),
        compare_stores: bool = False, rounds: int = 3, gelu_only: bool = False,
        fp32_tiles=(1, 2), gemms=("fwd", "dgrad", "wgrad"), epilogues: bool = True,
        split_sums=("default",), tune: bool = False, clusters=(1,), cold_l2: bool = False) -> list[dict]:
    rows = []
    cold = ColdL2(device, rounds) if cold_l2 else None  # the standard cells with operands from DRAM

    def add(row: dict) -> None:  # printed as it is measured, so a run cut short keeps what it timed
        rows.append(row)
        print(json.dumps(row), flush=True)

    ours = _ours_available(device, epilogues or gelu_only) and dtype in (torch.bfloat16, torch.float32)  # fp32: the SIMT kernel
    fp32 = dtype == torch.float32
    if device == "cuda" and fp32:
        torch.backends.cuda.matmul.allow_tf32 = False  # cuBLAS's true fp32 GEMM (PyTorch's default too)
    if ours:
        from bertaccel.ops import gemm

        GEMM = torch.ops.bertaccel.gemm.default
    for m, n, k in shapes:
        x = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(n, k, device=device, dtype=dtype) * k**-0.5
        dy = torch.randn(m, n, device=device, dtype=dtype)
        bias = torch.randn(n, device=device, dtype=dtype)
        flops = 2 * m * n * k
        cases = {
            "fwd x W^T": (lambda x, w: F.linear(x, w), (x, w), (False, False)),
            "dgrad dy W": (lambda dy, w: dy @ w, (dy, w), (False, True)),
            "wgrad dy^T x": (lambda dy, x: dy.t() @ x, (dy, x), (True, True)),
            # an fp32 weight's gradient where the model runs on its fp32 weights (no bf16 copies): cuBLAS's bf16 product cast to fp32 (autocast, then
            # autograd's accumulation into the fp32 .grad), ours written in fp32 by the kernel (GemmLinear)
            "wgrad-f32 dy^T x (fp32 out)": (lambda dy, x: (dy.t() @ x).float(), (dy, x), (True, True)),
        }
        for name, (fn, args, (ta, tb)) in ({} if gelu_only else cases).items():
            if name.split()[0] not in gemms:
                continue
            # cuBLAS and ours (and ours with staged stores) timed in turn, `rounds` times, medians: the
            # H100's clocks drift under sustained tensor-core load, so one pass ran them at different clocks
            fns = [fn] + ([gemm.gemm_case(name)] if ours else [])
            labels = ["bertaccel"]
            if ours and compare_stores:
                fns.append(lambda a, b, f=gemm.gemm_case(name): _env_call("BERTACCEL_GEMM_STORE", "staged", f, a, b))
                labels.append("bertaccel staged-store")
            for mode in split_sums if ours else ():
                if mode != "default":
                    fns.append(lambda a, b, f=gemm.gemm_case(name), mode=mode: _env_call("BERTACCEL_GEMM_SPLIT", mode, f, a, b))
                    labels.append(f"bertaccel {mode}-split")
            if ours and 2 in clusters:  # the model's pick (tile, splits, schedule) in clusters of two blocks
                fns.append(lambda a, b, f=gemm.gemm_case(name): _env_call("BERTACCEL_GEMM_CLUSTER", "2", f, a, b))
                labels.append("bertaccel cluster-2")
            if ours and tune:  # BERTACCEL_GEMM_TUNE=1: the first (eager, warm-up) call times the model's closest picks
                fns.append(lambda a, b, f=gemm.gemm_case(name): _env_call("BERTACCEL_GEMM_TUNE", "1", f, a, b))
                labels.append("bertaccel tuned")
            if cold:
                fns = [cold(f) for f in fns]
            ms, *ms_ours = (t - (cold.flush_ms if cold else 0.0) for t in interleaved_ms(fns, args, device, rounds))
            row = {"shape": f"{m}x{n}x{k}", "gemm": name, "impl": "cublas", "ms": round(ms, 4),
                   "TFLOP/s": round(flops / ms / 1e9, 1), **({"l2": "cold"} if cold_l2 else {})}
            add(row)
            if not ours:
                continue
            for impl, t in zip(labels, ms_ours):
                env = ({"BERTACCEL_GEMM_TUNE": "1"} if impl == "bertaccel tuned"
                       else {"BERTACCEL_GEMM_CLUSTER": "2"} if impl == "bertaccel cluster-2" else {})
                with kernel_env(env):  # [tile rows, width, splits, schedule, in-kernel sum, tuned]
                    cfg = torch.ops.bertaccel.gemm_config(args[0], args[1], 0, ta, tb, name.startswith("wgrad-f32"), False)
                add({"shape": row["shape"], "gemm": name, "impl": impl, "ms": round(t, 4),
                     "TFLOP/s": round(flops / t / 1e9, 1), "of_cublas": round(ms / t, 3),
                     "config": config_label(cfg), **({"l2": "cold"} if cold_l2 else {})})
            if sweep and fp32:  # the SIMT kernel's block tiles (1: 128x128, 2: 128x64) and K splits
                for tile in fp32_tiles:
                    for splits in range(1, 9) if name.startswith("wgrad") or m <= 4096 else (1,):
                        def f(a, b, tile=tile, splits=splits, ta=ta, tb=tb):
                            return GEMM(a, b, None, None, 0, ta, tb, True, False, tile, splits)[0]
                        t = time_ms(f, args, device)
                        add({"shape": row["shape"], "gemm": name, "impl": f"bertaccel t{tile} s{splits}",
                             "ms": round(t, 4), "TFLOP/s": round(flops / t / 1e9, 1), "of_cublas": round(ms / t, 3)})
            elif sweep:  # every schedule, tile width and K split, for the tile heuristic
                # 96-wide tiles: cooperative, with a K-major B (the forward's layout) only
                configs = [(schedule, tile) for schedule, tiles in ((1, (64, 96, 128, 192, 256)), (2, (64, 128)),
                                                                    (3, (128, 192, 256)), (4, (64, 128, 192)))
                           if schedule in schedules for tile in tiles if tile != 96 or not tb]
                # split_sums: "kernel" / "workspace" time each split configuration with its K splits summed
                # that way (BERTACCEL_GEMM_SPLIT), labelled "... s2 kernel-sum"; "default" unlabelled
                # K splits: weight gradients at many tokens up to 8 (the model's range), the others up to 4
                split_range = (1, 2, 3, 4, 6, 8) if name.startswith("wgrad") and m > 4096 else (1, 2, 3, 4)
                for schedule, tile in configs:
                    for splits in split_range if (name.startswith("wgrad") or m <= 4096) and schedule != 3 else (1,):
                        for mode in split_sums if splits > 1 and schedule in (1, 4) else ("default",):
                            for cluster in clusters if schedule != 3 else (1,):
                                def f(a, b, tile=tile, splits=splits, ta=ta, tb=tb, schedule=schedule,
                                      f32=name.startswith("wgrad-f32")):
                                    return GEMM(a, b, None, None, 0, ta, tb, f32, False, tile, splits, schedule)[0]
                                if mode != "default":
                                    f = (lambda a, b, f=f, mode=mode: _env_call("BERTACCEL_GEMM_SPLIT", mode, f, a, b))
                                # clusters of two ("c2"), or single blocks, each forced (the model picks otherwise)
                                f = (lambda a, b, f=f, c=cluster: _env_call("BERTACCEL_GEMM_CLUSTER", str(c), f, a, b))
                                t = time_ms(f, args, device)
                                kind = {1: "", 2: "pp ", 3: "sk ", 4: "r192 "}[schedule]
                                label = (f"bertaccel {kind}n{tile} s{splits}" + ("" if mode == "default" else f" {mode}-sum")
                                         + (" c2" if cluster == 2 else ""))
                                add({"shape": row["shape"], "gemm": name, "impl": label,
                                     "ms": round(t, 4), "TFLOP/s": round(flops / t / 1e9, 1), "of_cublas": round(ms / t, 3)})
        if not epilogues:
            continue
        # the epilogue baselines: linear + bias + GELU
        gelu_cases = {"F.linear(bias) + gelu": lambda x, w, b: F.gelu(F.linear(x, w, b))}
        if device == "cuda":
            from bertaccel.ops.gelu import bias_gelu

            gelu_cases["F.linear + bertaccel bias_gelu"] = lambda x, w, b: bias_gelu(F.linear(x, w), b)
        if ours:
            # one GEMM with bias + GELU in the epilogue; training also writes the pre-activation
            gelu_cases["bertaccel gemm+bias+gelu"] = lambda x, w, b: GEMM(x, w, b, None, 2, False, False, False, False)[0]
            gelu_cases["bertaccel gemm+bias+gelu (saves pre)"] = lambda x, w, b: GEMM(x, w, b, None, 2, False, False, False, True)
            for label, sched in () if fp32 else (("cooperative", 1), ("ping-pong", 2)):  # each schedule, saving pre
                gelu_cases[f"bertaccel {label} gemm+bias+gelu (saves pre)"] = (
                    lambda x, w, b, sched=sched: GEMM(x, w, b, None, 2, False, False, False, True, 0, 1, sched))
            if not fp32:
                gelu_cases["bertaccel ping-pong gemm+bias+gelu"] = lambda x, w, b: GEMM(x, w, b, None, 2, False, False, False,
                                                                                          False, 128, 1, 2)[0]
        if ours and compare_stores:
            for name in [n for n in gelu_cases if n.startswith("bertaccel")]:
                gelu_cases[name + " [staged stores]"] = (
                    lambda x, w, b, fn=gelu_cases[name]: _env_call("BERTACCEL_GEMM_STORE", "staged", fn, x, w, b))
        times = interleaved_ms(list(gelu_cases.values()), (x, w, bias), device, rounds)
        for name, ms in zip(gelu_cases, times):
            add({"shape": f"{m}x{n}x{k}", "gemm": name, "impl": "epilogue", "ms": round(ms, 4),
                 "TFLOP/s": round(flops / ms / 1e9, 1), "of_cublas": round(times[0] / ms, 3)})
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per shape and GEMM: cuBLAS, ours (the heuristic's pick) and the best swept configuration."""
    out = []
    keys = sorted({(r["shape"], r["gemm"]) for r in rows if r["impl"] == "cublas"}, key=lambda k: (k[0], k[1]))
    for shape, g in keys:
        sel = [r for r in rows if r["shape"] == shape and r["gemm"] == g]
        cub = next(r for r in sel if r["impl"] == "cublas")
        ours = next((r for r in sel if r["impl"] == "bertaccel"), None)
        staged = next((r for r in sel if r["impl"] == "bertaccel staged-store"), None)
        picks = {r["impl"].split()[1]: r["of_cublas"] for r in sel if r["impl"].endswith("-split") or r["impl"] == "bertaccel tuned"}
        best = max((r for r in sel if r["impl"].startswith("bertaccel ") and r is not staged
                    and not r["impl"].endswith("-split") and r["impl"] != "bertaccel tuned"), key=lambda r: r["TFLOP/s"],
                   default=None)
        out.append({"shape": shape, "gemm": g, "cublas TFLOP/s": cub["TFLOP/s"],
                    "ours TFLOP/s": ours["TFLOP/s"] if ours else None, "of_cublas": ours["of_cublas"] if ours else None,
                    "pick": ours.get("config") if ours else None,
                    "staged-store of_cublas": staged["of_cublas"] if staged else None,
                    **{f"{mode} of_cublas": v for mode, v in picks.items()},
                    "best swept": best["impl"].split(" ", 1)[1] if best else None,
                    "best of_cublas": best["of_cublas"] if best else None})
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", type=parse_shape, default=SHAPES, help="M x N x K, e.g. 16384x3072x768")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--fp32", action="store_true", help="fp32 operands instead of bf16 (ours: the SIMT kernel; cuBLAS without TF32)")
    ap.add_argument("--sweep", action="store_true", help="also time every tile width and K split of ours")
    ap.add_argument("--schedules", nargs="+", type=int, default=[1, 2, 3, 4], choices=[1, 2, 3, 4],
                    help="the schedules --sweep times: 1 cooperative, 2 ping-pong, 3 stream-K, 4 cooperative "
                         "with 192-row tiles (three consumer warpgroups)")
    ap.add_argument("--fp32-tiles", nargs="+", type=int, default=[1, 2],
                    help="the SIMT block tiles --fp32 --sweep times (1: 128x128, 2: 128x64)")
    ap.add_argument("--compare-stores", action="store_true",
                    help="also time ours with the threads' staged stores instead of TMA stores (BERTACCEL_GEMM_STORE=staged)")
    ap.add_argument("--gelu-only", action="store_true", help="only the linear + bias + GELU cases")
    ap.add_argument("--gemms", nargs="+", default=["fwd", "dgrad", "wgrad"], choices=["fwd", "dgrad", "wgrad", "wgrad-f32"],
                    help="which of each shape's three GEMMs to time")
    ap.add_argument("--no-epilogues", action="store_true", help="skip the linear + bias + GELU cases")
    ap.add_argument("--split-sums", nargs="+", default=["default"], choices=["default", "workspace", "kernel"],
                    help="how K splits are summed (BERTACCEL_GEMM_SPLIT) in the times of ours: each mode named is "
                         "timed beside the others, for the model's pick and, with --sweep, every split configuration")
    ap.add_argument("--tune", action="store_true",
                    help="also time ours with BERTACCEL_GEMM_TUNE=1 (the first call times the cost model's closest picks)")
    ap.add_argument("--clusters", nargs="+", type=int, default=[1], choices=[1, 2],
                    help="2: also time the model's pick in clusters of two blocks (BERTACCEL_GEMM_CLUSTER=2) and, with "
                         "--sweep, every configuration both ways (labels ending in c2)")
    ap.add_argument("--rounds", type=int, default=3, help="times each implementation is timed, in turn (median)")
    ap.add_argument("--cold-l2", action="store_true",
                    help="time the standard cells with L2 flushed before each call (a 256 MB read, its time subtracted)")
    ap.add_argument("--out", default="bench_results/gemm.json")
    args = ap.parse_args(argv)
    if args.cold_l2 and args.device != "cuda":
        ap.error("--cold-l2 flushes a GPU's L2; it needs --device cuda")
    dtype = torch.float32 if args.fp32 or args.device == "cpu" else torch.bfloat16
    rows = run(args.shapes, args.device, dtype, args.sweep, tuple(args.schedules), args.compare_stores,
               args.rounds, args.gelu_only, tuple(args.fp32_tiles), tuple(args.gemms), not args.no_epilogues,
               tuple(args.split_sums), args.tune, tuple(args.clusters), args.cold_l2)
    table = summary(rows)
    write_json(args.out, {"environment": environment(), "dtype": str(dtype), "rows": rows, "summary": table})
    print_table([r for r in rows if not r["impl"].startswith("bertaccel ") or r["impl"] == "bertaccel staged-store"
                 or r["impl"].endswith("-split") or r["impl"] in ("bertaccel tuned", "bertaccel cluster-2")],
                ["shape", "gemm", "impl", "ms", "TFLOP/s", "of_cublas", "config"])
    if any(r["ours TFLOP/s"] for r in table):
        print()
        print_table(table, list(dict.fromkeys(c for r in table for c in r)))


if __name__ == "__main__":
    main()
