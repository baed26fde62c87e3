"""The fine-tune headline: the plain PyTorch loop a user would write against `bertaccel fit`, in one
run on one GPU, on the same data, model and recipe.

    python -m benchmarks.finetune --data .carry/imdb --model .carry/minilm --out ft.json

Variants:
  plain           HF BertForSequenceClassification, SDPA, bf16 autocast, fused AdamW, linear
                  schedule with 6% warm-up, padded to max_length, DataLoader; the loop the team
                  measured as the reference.
  plain-compile   the same with `model.compile(mode="reduce-overhead")` (compile time included; the graphs compiled
                  and seconds spent compiling inside the timed steps are reported beside the rate).
  cli-bf16        `bertaccel fit -c configs/imdb_minilm.yaml` (bf16-mixed, SDPA).
  cli-fused       + configs/presets/fused.yaml (kernel swap).
  cli-graphs      + configs/presets/graphs.yaml (whole-step CUDA graphs).
  cli-fused-graphs  both presets.
  cli-compile-graphs  graphs + configs/presets/compile.yaml (inductor kernels inside the step graph).
  cli-fused-compile-graphs  all three.
  cli-unpadded    + configs/presets/unpadded.yaml (encoder on real tokens only; eager steps).
  cli-fused-unpadded  + fused.yaml and unpadded.yaml.
  cli-fused-unpadded-graphs  + graphs.yaml, fused.yaml and unpadded.yaml (packed static batches).
  A ":wN" suffix (cli-graphs:w0) runs a CLI variant with N DataLoader workers (default --workers); ":bN"
  (cli-graphs:b256) pads to length buckets every N tokens (one bucket when N = max_length); ":tN" pads
  packed (unpadded) batches' token counts to N sizes chosen from the batches (`data.token_buckets`;
  default "auto"); ":cast"
  turns `model.bf16_weight_copies` off (autocast casts each fp32 weight in every graphed step);
  ":attn" runs `model.attn_implementation: bertaccel` (our attention kernel on the padded batches);
  ":flash" / ":sdpa" run unpadded attention on PyTorch's FlashAttention varlen / re-padded SDPA instead
  of our kernel (BERTACCEL_VARLEN_ATTENTION); ":nofreeze" leaves the garbage collector unfrozen
  (BERTACCEL_GC_FREEZE=0; see BertModule._freeze_heap); ":pN" redraws the progress bar N times a second
  (the CLI's default 4; Lightning's 100, which the runs before session 45 used); ":nopin" turns
  `data.pin_memory` off (no pin-memory thread taking the interpreter's lock beside the loop); ":gilN" sets the
  interpreter's thread switch interval to N us (Python's default 5,000: a thread wanting the lock may wait that
  long while another runs Python).

Train samples/s excludes the first `--skip` steps in every variant (the CLI's throughput meter
does the same with its warm-up steps; graph captures of lengths first seen later stay in the
measured time). Test accuracy is on the whole test file; the CLI holds out `--val-size` train rows
for validation, the plain loop trains on the same remaining rows.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
CLI_PRESETS = {
    "cli-bf16": [],
    "cli-fused": ["configs/presets/fused.yaml"],
    "cli-graphs": ["configs/presets/graphs.yaml"],
    "cli-fused-graphs": ["configs/presets/graphs.yaml", "configs/presets/fused.yaml"],
    "cli-compile-graphs": ["configs/presets/graphs.yaml", "configs/presets/compile.yaml"],
    "cli-fused-compile-graphs": ["configs/presets/graphs.yaml", "configs/presets/fused.yaml", "configs/presets/compile.yaml"],
    "cli-unpadded": ["configs/presets/unpadded.yaml"],
    "cli-fused-unpadded": ["configs/presets/fused.yaml", "configs/presets/unpadded.yaml"],
    "cli-fused-unpadded-graphs": ["configs/presets/graphs.yaml", "configs/presets/fused.yaml", "configs/presets/unpadded.yaml"],
    "cli-recommended": ["configs/presets/recommended.yaml"],
    "cli-recommended-unpadded": ["configs/presets/recommended.yaml", "configs/presets/unpadded.yaml"],
}


def read_rows(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def find(data: Path, split: str) -> Path:
    for name in (f"{split}.jsonl.gz", f"{split}.jsonl"):
        if (data / name).is_file():
            return data / name
    raise SystemExit(f"finetune: no {split}.jsonl(.gz) in {data}")


def compile_stats() -> tuple[int, float]:
    """(graphs torch.compile has compiled in this process, seconds spent compiling frames) so far, from dynamo's own
    counters: read at both ends of the timed steps, the difference is the compile work inside them."""
    from torch._dynamo.utils import compile_times, counters

    names, secs = compile_times(repr="csv", aggregate=True)
    total = sum(float(t) for n, t in zip(names, secs) if n == "_compile.compile_inner")
    return int(counters["stats"]["unique_graphs"]), total


def plain_loop(args, compiled: bool) -> dict:
    """The plain fine-tuning loop, written the way a user would."""
    from transformers import AutoTokenizer, BertForSequenceClassification, get_linear_schedule_with_warmup

    torch.manual_seed(args.seed)
    dev = torch.device("cuda")
    train = read_rows(find(args.data, "train"))
    test = read_rows(find(args.data, "test"))
    # the CLI holds `val_size` rows out of train; use the same number of training rows
    g = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(train), generator=g).tolist()
    train = [train[i] for i in order[: len(train) - args.val_size]]
    tok = AutoTokenizer.from_pretrained(args.model)

    def encode(rows):
        enc = tok([r["text"] for r in rows], padding="max_length", truncation=True, max_length=args.max_length,
                  return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"], torch.tensor([r["label"] for r in rows])

    tr, te = encode(train), encode(test)
    model = BertForSequenceClassification.from_pretrained(args.model, dtype=torch.float32, num_labels=2,
                                                          attn_implementation="sdpa").to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, fused=True)
    steps = math.ceil(len(train) / args.batch_size)
    sched = get_linear_schedule_with_warmup(opt, int(0.06 * steps), steps)
    if compiled:
        model.compile(mode="reduce-overhead")
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*tr), batch_size=args.batch_size, shuffle=True,
                                         generator=torch.Generator().manual_seed(args.seed), pin_memory=True)
    t_start = time.perf_counter()
    t0, n = None, 0
    for i, (ids, mask, y) in enumerate(loader):
        if i == args.skip:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            compiled_at_t0 = compile_stats() if compiled else None
        ids, mask, y = ids.to(dev, non_blocking=True), mask.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=ids, attention_mask=mask).logits
        loss = torch.nn.functional.cross_entropy(logits.float(), y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if i >= args.skip:
            n += ids.shape[0]
    torch.cuda.synchronize()
    t_end = time.perf_counter()
    # the compile work inside the timed steps (a batch of a new shape, a guard that failed): part of the rate
    compiled_in_timed = None if not compiled or compiled_at_t0 is None else \
        [b - a for a, b in zip(compiled_at_t0, compile_stats())]
    model.eval()
    # test samples/s from batch `eval_skip` on, as the CLI runs' meter counts them (their first batches hold the
    # compile, or the graph capture)
    correct, t1, n_test = 0, None, 0
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        for k, s in enumerate(range(0, te[0].shape[0], args.eval_batch_size)):
            if k == args.eval_skip:
                torch.cuda.synchronize()
                t1 = time.perf_counter()
            ids, mask, y = (t[s : s + args.eval_batch_size].to(dev, non_blocking=True) for t in te)
            correct += (model(input_ids=ids, attention_mask=mask).logits.argmax(-1) == y).sum()
            if k >= args.eval_skip:
                n_test += ids.shape[0]
    correct = int(correct)
    t2 = time.perf_counter()
    out = {
        "train_samples_per_s": n / (t_end - t0),
        "train_wall_s": t_end - t_start,
        "test_samples_per_s": n_test / (t2 - t1) if t1 is not None else None,
        "test_acc": correct / te[0].shape[0],
    }
    if compiled_in_timed is not None:
        out["train_graphs_compiled_in_timed_steps"] = compiled_in_timed[0]
        out["train_compile_s_in_timed_steps"] = compiled_in_timed[1]
    return out


def cli_run(args, name: str, presets: list[str], workers: int, extra: list[str] = (), env: dict | None = None) -> dict:
    run_name = f"bench_{name.replace(':', '_')}"
    cmd = [sys.executable, "-m", "bertaccel", "fit", "-c", "configs/imdb_minilm.yaml"]
    interval = (env or {}).get("BERTACCEL_BENCH_SWITCH_INTERVAL_US")
    if interval:  # ":gilN": the CLI with the interpreter's thread switch interval set first
        cmd[1:3] = ["-c", "import runpy, sys; sys.setswitchinterval(float(sys.argv.pop(1)) * 1e-6); "
                    "runpy.run_module('bertaccel', run_name='__main__', alter_sys=True)", interval]
    for p in presets:
        cmd += ["-c", p]
    cmd += ["--data.init_args.dataset", str(args.data), "--model.init_args.pretrained", str(args.model),
            "--data.init_args.tokenizer", str(args.model), "--data.init_args.val_size", str(args.val_size),
            "--data.init_args.max_length", str(args.max_length), "--data.init_args.batch_size", str(args.batch_size),
            "--data.init_args.num_workers", str(workers), "--model.init_args.lr", str(args.lr),
            "--throughput.enabled", "true", "--throughput.warmup_steps", str(args.skip),
            "--throughput.eval_warmup_steps", str(args.eval_skip),
            "--trainer.logger.init_args.name", run_name,
            "--trainer.logger.init_args.save_dir", str(args.runs), "--seed_everything", str(args.seed), *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, **(env or {})})
    wall = time.perf_counter() - t0
    log = proc.stdout + proc.stderr
    (args.runs / f"{run_name}.log").parent.mkdir(parents=True, exist_ok=True)
    (args.runs / f"{run_name}.log").write_text(log)
    if proc.returncode != 0:
        return {"error": f"rc={proc.returncode}: {log.strip().splitlines()[-1][:300] if log.strip() else ''}"}
    versions = sorted((args.runs / run_name).glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    stats = {}
    for v in versions:
        f = v / "benchmark_stats.json"
        if f.is_file():
            stats.update(json.loads(f.read_text()))
    acc = re.findall(r"test/acc\s*[│|]\s*([0-9.]+)", log)
    out = {
        "train_samples_per_s": stats.get("train", {}).get("samples_per_s"),
        "test_samples_per_s": stats.get("test", {}).get("samples_per_s"),
        "train_step_ms_p50": stats.get("train", {}).get("step_ms_p50"),
        "train_step_ms_mean": stats.get("train", {}).get("step_ms_mean"),
        "train_data_wait_ms_mean": stats.get("train", {}).get("data_wait_ms_mean"),
        "train_slowest_steps_ms": stats.get("train", {}).get("slowest_steps_ms"),
        "train_slowest_steps_at": stats.get("train", {}).get("slowest_steps_at"),
        "train_slowest_steps_gc_ms": stats.get("train", {}).get("slowest_steps_gc_ms"),
        "train_host_gc_ms_total": stats.get("train", {}).get("host_gc_ms_total"),
        "peak_memory_gb": stats.get("train", {}).get("peak_memory_gb"),
        "train_gpu_step_fraction": stats.get("train", {}).get("gpu_step_fraction"),
        "train_graph_captures": stats.get("train", {}).get("graph_captures"),
        "train_graph_capture_parts_s": stats.get("train", {}).get("graph_capture_parts_s"),
        "test_acc": float(acc[-1]) if acc else None,
        "process_wall_s": wall,
        "graph_lines": [line.strip()[:200] for line in log.splitlines() if "cuda_graphs" in line or "CUDA graphs" in line][:4],
    }
    return out


def run_variant(args, v: str) -> dict:
    """One run of variant `v` (see the module docstring): its numbers, or {"error": ...}."""
    if v in ("plain", "plain-compile"):
        return plain_loop(args, compiled=v == "plain-compile")
    else:  # "cli-graphs:w0": with 0 DataLoader workers; ":b256": one length bucket of 256
        base_name, *options = v.split(":")
        workers, extra, env = args.workers, [], {}
        for o in options:
            if o[:1] == "w" and o[1:].isdigit():
                workers = int(o[1:])
            elif o[:1] == "b" and o[1:].isdigit():
                extra += ["--data.init_args.length_buckets", o[1:]]
            elif o[:1] == "t" and o[1:].isdigit():
                extra += ["--data.init_args.token_buckets", o[1:]]
            elif o == "cast":
                extra += ["--model.init_args.bf16_weight_copies", "false"]
            elif o == "attn":
                extra += ["--model.init_args.attn_implementation", "bertaccel"]
            elif o == "cls":  # the last layer at the [CLS] position only (bertaccel.modules.last_layer; the config's default)
                extra += ["--model.init_args.last_layer_cls_only", "true"]
            elif o == "full":  # the last layer at every position (the option off)
                extra += ["--model.init_args.last_layer_cls_only", "false"]
            elif o in ("flash", "sdpa"):
                env["BERTACCEL_VARLEN_ATTENTION"] = o
            elif o == "nofreeze":
                env["BERTACCEL_GC_FREEZE"] = "0"
            elif o[:1] == "p" and o[1:].isdigit():  # progress bar redraws per second (0: none; CLI default 4)
                extra += ["--progress_bar.refresh_rate", o[1:]]
            elif o == "nopin":  # batches from pageable memory: no pin-memory thread beside the loop's
                extra += ["--data.init_args.pin_memory", "false"]
            elif o[:3] == "gil" and o[3:].isdigit():  # the interpreter's thread switch interval, in us (default 5,000)
                env["BERTACCEL_BENCH_SWITCH_INTERVAL_US"] = o[3:]
            else:
                raise SystemExit(f"variant {v!r}: unknown option {o!r} (wN: N DataLoader workers, bN: buckets "
                                 "every N tokens, tN: N token sizes (unpadded), cast: no bf16 weight copies, attn: our attention on padded batches, cls / full: the last layer at [CLS] only / at every position, flash / sdpa: unpadded attention "
                                 "by PyTorch's kernels, nofreeze: BERTACCEL_GC_FREEZE=0, pN: progress bar redrawn N times a second, "
                                 "nopin: no pinned memory, gilN: thread switch interval N us)")
        return cli_run(args, v, CLI_PRESETS[base_name], workers, extra, env)


ROUND_KEYS = ("train_samples_per_s", "test_samples_per_s", "train_step_ms_p50", "train_data_wait_ms_mean",
              "train_gpu_step_fraction", "test_acc")


def summarize_rounds(runs: list[dict]) -> dict:
    """A variant's result over its rounds: the round with the median train samples/s (the lower middle one of an
    even count), every round's main numbers under "rounds" when there was more than one."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[-1]
    ranked = sorted(ok, key=lambda r: r.get("train_samples_per_s") or 0.0)
    out = dict(ranked[(len(ranked) - 1) // 2])
    if len(runs) > 1:
        out["rounds"] = [{k: r.get(k) for k in ROUND_KEYS} if "error" not in r else {"error": r["error"]} for r in runs]
    return out


def round_lines(results: dict, variants: list[str]) -> list[str]:
    """The spread: every round's train samples/s in the order the rounds ran and, with a plain loop among the
    variants, each round's ratio against the plain loop of the same round (the table's ratio is of median rounds,
    which may come from different rounds)."""
    lines = ["train samples/s by round (the table shows the median round)"]
    per = {v: [r.get("train_samples_per_s") for r in results[v].get("rounds", [])] for v in variants}
    for v in variants:
        lines.append(f"{v:<18} " + "  ".join(f"{x:,.0f}" if x else "failed" for x in per[v]))
    plain = per.get("plain")
    if plain:
        lines += ["", "x plain by round (against the same round's plain loop)"]
        for v in variants:
            if v != "plain":
                lines.append(f"{v:<18} " + "  ".join(f"{x / b:.2f}" if x and b else "-" for x, b in zip(per[v], plain)))
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--variants", nargs="+", default=["plain", "plain-compile", *CLI_PRESETS])
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--eval-batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--val-size", type=int, default=500)
    ap.add_argument("--skip", type=int, default=10, help="steps excluded from train samples/s")
    ap.add_argument("--eval-skip", type=int, default=2, help="test batches excluded from test samples/s, in every "
                    "variant (until session 80 the plain loops counted every test batch and the CLI runs left out "
                    "--skip of them)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--runs", type=Path, default=Path("runs"))
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every variant this many times, interleaved (a fresh process each); a variant's numbers are "
                         "its median round's by train samples/s, every round's kept in the JSON (\"rounds\")")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    args.data, args.model, args.runs = args.data.resolve(), args.model.resolve(), args.runs.resolve()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()}}
    rounds: dict[str, list[dict]] = {v: [] for v in args.variants}
    for r in range(args.rounds):
        # every round runs each variant once (a fresh process), the order reversed every other round so that a drift
        # of the machine over the run does not favour the variants that come first
        for v in args.variants if r % 2 == 0 else reversed(args.variants):
            t0 = time.perf_counter()
            rounds[v].append(run_variant(args, v))
            print(f"{v} (round {r + 1}): {rounds[v][-1]} ({time.perf_counter() - t0:.0f} s)", flush=True)
            for name, runs in rounds.items():
                if runs:
                    results[name] = summarize_rounds(runs)
            if args.out:
                args.out.write_text(json.dumps(results, indent=1))
    base = results.get("plain", {}).get("train_samples_per_s")
    compiled = results.get("plain-compile", {}).get("train_samples_per_s")  # the steadier yardstick (README)
    print(f"\n{results['device']}, IMDB rows from {args.data.name}, max_length {args.max_length}, batch {args.batch_size}")
    # step p50 / slowest: the CLI meter's median and slowest measured step (a graph capture of a token or length
    # bucket first seen inside the measured window shows there, and in samples/s, but not in the median)
    print(f"{'run':<18} {'train samples/s':>16} {'x plain':>8} {'x compiled':>11} {'test samples/s':>15} {'test acc':>9} "
          f"{'step p50 ms':>12} {'slowest ms':>11}")
    for v in args.variants:
        r = results[v]
        if "error" in r:
            print(f"{v:<18} failed: {r['error']}")
            continue
        tr = r.get("train_samples_per_s")
        ratio = f"{tr / base:.2f}" if tr and base else "-"
        ratio_c = f"{tr / compiled:.2f}" if tr and compiled else "-"
        te, acc = r.get("test_samples_per_s"), r.get("test_acc")
        p50, slowest = r.get("train_step_ms_p50"), (r.get("train_slowest_steps_ms") or [None])[0]
        # a stage with fewer steps than the meter's warm-up measures nothing: '-', not 0
        print(f"{v:<18} {tr or 0:>16,.0f} {ratio:>8} {ratio_c:>11} {f'{te:,.0f}' if te else '-':>15} {acc * 100 if acc else 0:>8.2f}% "
              f"{f'{p50:.2f}' if p50 else '-':>12} {f'{slowest:.1f}' if slowest else '-':>11}")
    if args.rounds > 1:
        print("\n" + "\n".join(round_lines(results, args.variants)))
    if args.out:
        picture = plot(results, args.variants, args.out.with_suffix(".png"))
        if picture:
            print(f"picture: {picture}")


def plot(results: dict, variants: list[str], path: Path) -> Path | None:
    """Train and test samples/s per variant as bars, with the ratio to the plain loop (PNG)."""
    from benchmarks.plots import pyplot

    plt = pyplot()
    if plt is None:
        return None
    rows = [(v, results[v]) for v in variants if "error" not in results.get(v, {"error": 1})]
    if not rows:
        return None
    base = results.get("plain", {}).get("train_samples_per_s")
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.45 * len(rows) + 1.8))
    for ax, key, title in ((axes[0], "train_samples_per_s", "train samples/s"), (axes[1], "test_samples_per_s", "test samples/s")):
        names = [v for v, _ in rows]
        values = [r.get(key) or 0 for _, r in rows]
        bars = ax.barh(names, values, color="#4c72b0")
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10)
        if key == "train_samples_per_s" and base:
            for bar, value in zip(bars, values):
                ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {value / base:.2f}x", va="center", fontsize=8)
    fig.suptitle(f"{results.get('device', '')}: fine-tune, x = ratio to the plain loop", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
