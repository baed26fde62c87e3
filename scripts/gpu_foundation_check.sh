#!/usr/bin/env bash
# On the GPU host (after `source .carry/env.sh`, with ../shared/gpu/stage.sh --imdb 12500 --minilm):
# 1. all-MiniLM-L6-v2 fine-tuned on the staged IMDB subset through the CLI, bf16-mixed, the plain
#    loop's recipe (max_length 256, batch 32, 1 epoch, lr 5e-5), with the throughput meter; then the
#    same with the `fused` preset (kernel swap);
# 2. a short BERT-base masked-LM fit from scratch on local text (loss going down, tokens/s).
set -uo pipefail
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package (src layout) without installing it
OUT=${OUT:-bench_results}
mkdir -p "$OUT"
export BERTACCEL_CACHE=${BERTACCEL_CACHE:-$PWD/.carry/cache}
LOCAL=(--data.init_args.dataset .carry/imdb --model.init_args.pretrained .carry/minilm
       --data.init_args.tokenizer .carry/minilm --data.init_args.val_size 500 --throughput.enabled true
       --progress_bar.refresh_rate 200)
for preset in plain fused; do
  extra=(); [ "$preset" = fused ] && extra=(-c configs/presets/fused.yaml)
  python -m bertaccel fit -c configs/imdb_minilm.yaml "${extra[@]}" "${LOCAL[@]}" \
    --trainer.logger.init_args.name "imdb_minilm_$preset" > "$OUT/imdb_minilm_$preset.log" 2>&1
  echo "imdb minilm $preset rc=$?"
  cp runs/imdb_minilm_$preset/version_0/benchmark_stats.json "$OUT/imdb_minilm_${preset}_stats.json" 2>/dev/null
  grep -E "test/acc|test/f1|throughput \(|kernel swap:|Error" "$OUT/imdb_minilm_$preset.log" | grep -v "stays\|restored\|->" | cut -c1-400
done
python -m bertaccel fit -c configs/mlm_local.yaml --data.init_args.train_files '[.carry/imdb/train.jsonl.gz]' \
  --data.init_args.val_files null --data.init_args.exclude_files null --data.init_args.tokenizer .carry/minilm \
  --trainer.max_steps 400 --trainer.val_check_interval 100 --trainer.limit_val_batches 20 --throughput.enabled true \
  --trainer.log_every_n_steps 25 --progress_bar.refresh_rate 200 \
  --trainer.logger lightning.pytorch.loggers.CSVLogger --trainer.logger.init_args.save_dir runs \
  --trainer.logger.init_args.name mlm_gpu > "$OUT/mlm.log" 2>&1
echo "mlm rc=$?"
cp runs/mlm_gpu/version_0/metrics.csv "$OUT/mlm_metrics.csv" 2>/dev/null
grep -E "throughput \(train|Error" "$OUT/mlm.log" | cut -c1-400
python - <<'PY'
import csv
rows = list(csv.DictReader(open("runs/mlm_gpu/version_0/metrics.csv")))
train = [(int(r["step"]), float(r["train/loss_step"])) for r in rows if r.get("train/loss_step")]
val = [(int(r["step"]), float(r["val/loss"]), float(r["val/ppl"])) for r in rows if r.get("val/loss")]
print("mlm train loss by step:", [(s, round(l, 3)) for s, l in train[::2]])
print("mlm val loss/ppl by step:", [(s, round(l, 3), round(p, 1)) for s, l, p in val])
PY
