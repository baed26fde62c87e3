"""The preset comparison of the bert4torch experiments, in one run: BERT-base masked-LM pretraining
from scratch on local text, one `bertaccel fit` per preset, the same data, seed and steps.

    python -m benchmarks.presets --train-files ../shared/data/imdb/unsup.jsonl.gz \
        --val-files ../shared/data/wikitext-2/wiki.valid.raw.gz \
        --tokenizer ../shared/data/bert-base-uncased/vocab.txt --steps 1000 --out presets.json
    python -m benchmarks.presets --smoke --out /tmp/presets.json     # CPU, tiny model, a few steps
    python -m benchmarks.presets --report a.json b.json --out all.json   # merge runs split over calls

The JSON is rewritten after each preset, so a run cut short keeps the presets it finished; `--report`
merges such files (the same arguments, presets split over several calls) into one table and picture.

Per preset: tokens/s and step time (the throughput meter, warm-up excluded), peak memory, the
validation loss and perplexity at each validation (equal steps), and at the shortest run's training
time (equal wall time: the loss of the last validation each run reached within that time, with time
= steps x the median step time). A PNG of validation loss against training time next to the JSON.
"""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# name -> (-c preset files, extra options)
PRESETS: dict[str, tuple[list[str], list[str]]] = {
    "baseline": (["configs/presets/baseline.yaml"], []),  # fp32, eager attention
    "bf16": (["configs/presets/bf16.yaml"], []),
    "fused": (["configs/presets/bf16.yaml", "configs/presets/fused.yaml"], []),
    "recommended": (["configs/presets/recommended.yaml"], []),
    "recommended-muon": (["configs/presets/recommended.yaml"], ["--model.init_args.optimizer", "muon"]),
    "recommended-normuon": (["configs/presets/recommended.yaml"], ["--model.init_args.optimizer", "normuon"]),
    "full": (["configs/presets/full.yaml"], ["--model.init_args.lm_head_fp8", "true"]),
    # full with SDPA instead of our attention (session 44 measured the two as full-bertaccel / full-sdpa before
    # full.yaml named ours: 33.3 vs 34.0 ms per 64x128 step, presets_full_attn_b86fdab.json)
    "full-sdpa": (["configs/presets/full.yaml"], ["--model.init_args.lm_head_fp8", "true",
                                                   "--model.init_args.attn_implementation", "sdpa"]),
    # one change at a time against recommended: the FP8 LM head alone; NorMuon at a quarter of the Muon lr
    "recommended-fp8-head": (["configs/presets/recommended.yaml"], ["--model.init_args.lm_head_fp8", "true"]),
    # the last layer at every position (mlm_local.yaml computes it at the masked positions only since session 55;
    # "recommended" before that commit is this one: bertaccel.modules.last_layer)
    "recommended-whole-last": (["configs/presets/recommended.yaml"], ["--model.init_args.last_layer_masked_only", "false"]),
    "recommended-normuon-lr0.005": (["configs/presets/recommended.yaml"],
                                    ["--model.init_args.optimizer", "normuon", "--model.init_args.muon_lr", "0.005"]),
}
TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}


def run_preset(args, name: str) -> dict:
    files, extra = PRESETS[name]
    run_name = f"presets_{name}"
    cmd = [sys.executable, "-m", "bertaccel", "fit", "-c", "configs/mlm_local.yaml"]
    for f in files:
        cmd += ["-c", f]
    cmd += [*extra, "--data.init_args.train_files", json.dumps([str(p) for p in args.train_files]),
            "--data.init_args.val_files", json.dumps([str(p) for p in args.val_files]) if args.val_files else "null",
            "--data.init_args.exclude_files", "null", "--data.init_args.tokenizer", str(args.tokenizer),
            "--data.init_args.block_size", str(args.block_size), "--data.init_args.batch_size", str(args.batch_size),
            "--trainer.max_steps", str(args.steps), "--trainer.max_epochs", "-1",
            "--trainer.val_check_interval", str(args.val_every), "--trainer.limit_val_batches", str(args.val_batches),
            "--trainer.check_val_every_n_epoch", "null", "--trainer.log_every_n_steps", str(max(1, args.val_every // 4)),
            "--throughput.enabled", "true", "--throughput.warmup_steps", str(args.warmup),
            "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.init_args.save_dir", str(args.runs),
            "--trainer.logger.init_args.name", run_name, "--seed_everything", str(args.seed),
            "--progress_bar.refresh_rate", "0", "--test_after_fit", "false",
            # no checkpoints: a BERT-base one with its optimizer state is ~1.3 GB, written at every validation
            "--checkpoint.save_top_k", "0", "--checkpoint.save_last", "false"]
    cmd += shlex.split(args.fit_args)
    if args.smoke:
        cmd += ["--trainer.accelerator", "cpu", "--model.init_args.config", json.dumps(TINY)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    args.runs.mkdir(parents=True, exist_ok=True)
    (args.runs / f"{run_name}.log").write_text(log)
    if proc.returncode != 0:
        return {"error": f"rc={proc.returncode}: {log.strip().splitlines()[-1][:300] if log.strip() else ''}"}
    version = max((args.runs / run_name).glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    stats = json.loads((version / "benchmark_stats.json").read_text()).get("train", {})
    val = [(int(r["step"]), float(r["val/loss"])) for r in csv.DictReader(open(version / "metrics.csv"))
           if r.get("val/loss")]
    step_s = (stats.get("step_ms_p50") or 0) / 1e3
    return {
        "tokens_per_s": stats.get("real_tokens_per_s"),
        "step_ms_p50": stats.get("step_ms_p50"),
        "peak_memory_gb": stats.get("peak_memory_gb"),
        "mfu": stats.get("mfu"),
        "data_wait_ms_mean": stats.get("data_wait_ms_mean"),
        "gpu_step_fraction": stats.get("gpu_step_fraction"),
        "val_loss_by_step": val,
        "val_loss_by_time_s": [(step * step_s, loss) for step, loss in val],
        "process_wall_s": time.perf_counter() - t0,
    }


def at_time(points: list[tuple[float, float]], t: float) -> float | None:
    """The loss of the last validation reached within training time t."""
    within = [loss for when, loss in points if when <= t + 1e-9]
    return within[-1] if within else None


def plot(results: dict, path: Path) -> Path | None:
    from benchmarks.plots import pyplot

    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results["presets"].items():
        if "error" in r or not r["val_loss_by_step"]:
            continue
        axes[0].plot(*zip(*r["val_loss_by_step"]), marker="o", ms=3, label=name)
        axes[1].plot(*zip(*r["val_loss_by_time_s"]), marker="o", ms=3, label=name)
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("training time (s)")
    for ax in axes:
        ax.set_ylabel("validation loss")
        ax.legend(fontsize=7)
    fig.suptitle(f"{results.get('device', '')}: BERT masked-LM from scratch, presets", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    ap.add_argument("--train-files", nargs="+", type=Path)
    ap.add_argument("--val-files", nargs="*", type=Path, default=[])
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--val-every", type=int, default=100)
    ap.add_argument("--val-batches", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=20, help="steps the throughput meter leaves out")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--runs", type=Path, default=Path("runs"))
    ap.add_argument("--fit-args", default="", help="more `bertaccel fit` options for every preset, e.g. "
                    "'--data.init_args.num_workers 0' (one change measured across the presets)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, the shipped sample text: the harness only")
    ap.add_argument("--out", type=Path, default=Path("bench_results/presets.json"))
    ap.add_argument("--report", nargs="+", type=Path, metavar="JSON",
                    help="merge saved results (presets split over calls) into --out: table and picture, nothing run")
    args = ap.parse_args(argv)
    if args.report:
        report(merge(args.report), args.out)
        return
    if args.smoke:
        sample = REPO / "src" / "bertaccel" / "data" / "samples" / "sentiment"
        args.train_files = args.train_files or [sample / "train.jsonl"]
        args.tokenizer = args.tokenizer or "sample:sentiment"
        args.block_size, args.batch_size = 32, 8
    if not args.train_files or not args.tokenizer:
        ap.error("--train-files and --tokenizer are needed (or --smoke)")
    args.runs = args.runs.resolve()
    args.train_files = [p.resolve() for p in args.train_files]
    args.val_files = [p.resolve() for p in args.val_files]
    import torch

    from benchmarks.common import environment

    results = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu",
               "environment": environment(), "args": {k: str(v) for k, v in vars(args).items()}, "presets": {}}
    for name in args.presets:
        results["presets"][name] = run_preset(args, name)
        print(f"{name}: {results['presets'][name]}", flush=True)
        save(results, args.out)  # a run cut short keeps what it finished
    report(results, args.out)


def save(results: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(out)


def merge(paths: list[Path]) -> dict:
    """Several saved runs (presets split over calls, same arguments) as one; later files win."""
    runs = [json.loads(p.read_text()) for p in paths]
    merged = dict(runs[0], presets={})
    for run, path in zip(runs, paths):
        if run.get("device") != merged.get("device"):
            raise SystemExit(f"{path}: measured on {run.get('device')}, the others on {merged.get('device')}")
        merged["presets"].update(run["presets"])
    merged["merged_from"] = [str(p) for p in paths]
    return merged


def report(results: dict, out: Path) -> None:
    """Equal-time losses over the finished presets, the JSON, the table and the picture."""
    done = {n: r for n, r in results["presets"].items() if "error" not in r and r["val_loss_by_time_s"]}
    if done:
        t = min(r["val_loss_by_time_s"][-1][0] for r in done.values())
        results["equal_time_s"] = t
        for r in done.values():
            r["val_loss_at_equal_time"] = at_time(r["val_loss_by_time_s"], t)
    save(results, out)
    a = results["args"]
    print(f"\n{results['device']}: masked-LM, {a.get('steps')} steps, batch {a.get('batch_size')} x {a.get('block_size')}")
    print(f"{'preset':<22} {'tokens/s':>10} {'step ms':>8} {'wait ms':>8} {'mem GB':>7} {'val loss (last)':>16} "
          f"{'at equal time':>14}")
    for name, r in results["presets"].items():
        if "error" in r:
            print(f"{name:<22} failed: {r['error']}")
            continue
        last = r["val_loss_by_step"][-1][1] if r["val_loss_by_step"] else float("nan")
        eq = r.get("val_loss_at_equal_time")
        print(f"{name:<22} {r['tokens_per_s'] or 0:>10,.0f} {r['step_ms_p50'] or 0:>8.1f} "
              f"{r.get('data_wait_ms_mean') or float('nan'):>8.2f} {r['peak_memory_gb'] or 0:>7.2f} "
              f"{last:>16.3f} {eq if eq is not None else float('nan'):>14.3f}")
    picture = plot(results, out.with_suffix(".png"))
    if picture:
        print(f"picture: {picture}")


if __name__ == "__main__":
    main()
