"""Batch-size sweep: step latency and throughput against batch size, one line per variant.

    python -m benchmarks.sweep --models bert-base --seq-lens 128 --variants hf-sdpa-bf16 hf-compile fused
    python -m benchmarks.sweep --device cpu --models tiny --variants hf-eager-fp32 --steps 3   # smoke run

Each point is `benchmarks.e2e.step_times` (same models, inputs, warm-up and CUDA-event timing as the
end-to-end table). Writes `<out>/sweep.csv`, `<out>/sweep.json` and `<out>/sweep.png`: for every
(model, sequence length, workload) a panel of samples/s and a panel of step latency against batch size.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
from pathlib import Path

from transformers import BertConfig

from benchmarks.common import environment, print_table, write_json
from benchmarks.e2e import MODELS, VARIANTS, step_times
from bertaccel.modules.flops import bert_step_flops

COLUMNS = ["model", "seq", "workload", "variant", "batch", "ms", "p90_ms", "samples_per_s", "tokens_per_s", "TFLOP/s"]


def sweep(models, seq_lens, batch_sizes, workloads, variants, warmup, steps, device) -> list[dict]:
    rows = []
    for model in models:
        cfg = BertConfig(num_labels=2, **MODELS[model])
        for seq in seq_lens:
            for workload in workloads:
                for variant in variants:
                    for batch in batch_sizes:
                        try:
                            t = sorted(step_times(variant, model, batch, seq, workload, warmup, steps, device))
                            ms, p90 = statistics.median(t), t[min(len(t) - 1, int(0.9 * len(t)))]
                        except Exception as e:  # noqa: BLE001 - a failed point is reported and left blank
                            print(f"{model} seq {seq} {workload} {variant} batch {batch}: FAILED {type(e).__name__}: {e}")
                            ms = p90 = math.nan
                        flops = bert_step_flops(cfg, batch, seq, training=workload == "train")
                        ok = not math.isnan(ms)
                        rows.append({
                            "model": model, "seq": seq, "workload": workload, "variant": variant, "batch": batch,
                            "ms": round(ms, 3) if ok else "", "p90_ms": round(p90, 3) if ok else "",
                            "samples_per_s": round(batch / ms * 1e3, 1) if ok else "",
                            "tokens_per_s": round(batch * seq / ms * 1e3) if ok else "",
                            "TFLOP/s": round(flops / ms / 1e9, 2) if ok else "",
                        })
                        print_table(rows[-1:], COLUMNS)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["model"], r["seq"], r["workload"]) for r in rows})
    fig, axes = plt.subplots(len(groups), 2, figsize=(11, 3.6 * len(groups)), squeeze=False)
    for (model, seq, workload), (ax_tp, ax_lat) in zip(groups, axes):
        for variant in dict.fromkeys(r["variant"] for r in rows):
            pts = [r for r in rows if (r["model"], r["seq"], r["workload"], r["variant"]) == (model, seq, workload, variant)
                   and r["ms"] != ""]
            if not pts:
                continue
            bs = [r["batch"] for r in pts]
            ax_tp.plot(bs, [r["samples_per_s"] for r in pts], marker="o", label=variant)
            ax_lat.plot(bs, [r["ms"] for r in pts], marker="o", label=variant)
        for ax, ylabel in ((ax_tp, "samples/s"), (ax_lat, "step latency (ms, median)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch size")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{model}, seq {seq}, {workload}")
            ax.grid(True, alpha=0.3)
        ax_tp.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["bert-base"], choices=list(MODELS))
    ap.add_argument("--seq-lens", nargs="+", type=int, default=[128])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4, 8, 16, 32])
    ap.add_argument("--workloads", nargs="+", default=["infer", "train"], choices=["train", "infer"])
    ap.add_argument("--variants", nargs="+", default=["hf-eager-bf16", "hf-sdpa-bf16", "fused"], choices=list(VARIANTS))
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: smoke runs of the harness only")
    ap.add_argument("--out", default="bench_results/sweep")
    args = ap.parse_args()

    rows = sweep(args.models, args.seq_lens, args.batch_sizes, args.workloads, args.variants, args.warmup, args.steps,
                 args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "sweep.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    write_json(out / "sweep.json", {"environment": environment(), "device": args.device, "rows": rows})
    plot(rows, out / "sweep.png")
    print()
    print_table(rows, COLUMNS)
    print(f"\nwrote {out / 'sweep.csv'}, {out / 'sweep.json'}, {out / 'sweep.png'}")


if __name__ == "__main__":
    main()
