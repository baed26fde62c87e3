#!/usr/bin/env bash
# On the GPU host: op benchmarks; a short BERT-base MLM fit; profiles (configs/profile.yaml) of the
# MiniLM IMDB fine-tune with and without the kernel swap, and of BERT-base at batch 16 x seq 128
# (train and test). Statistics are copied to $OUT.
set -uo pipefail
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package (src layout) without installing it
OUT=${OUT:-bench_results}
mkdir -p "$OUT"
export BERTACCEL_CACHE=${BERTACCEL_CACHE:-$PWD/.carry/cache}
python -m benchmarks.bench_ops --out "$OUT/ops.json" > "$OUT/bench_ops.log" 2>&1; echo "bench rc=$?"
DATA=(--data.init_args.dataset .carry/imdb --data.init_args.tokenizer .carry/minilm --data.init_args.val_size 500
      --progress_bar.refresh_rate 200)
COMMON=("${DATA[@]}" --test_after_fit false)
profile() {  # name, extra args...
  local name=$1; shift
  python -m bertaccel fit -c configs/imdb_minilm.yaml -c configs/profile.yaml "${COMMON[@]}" "$@" \
    --trainer.logger.init_args.name "prof_$name" > "$OUT/prof_$name.log" 2>&1
  echo "profile $name rc=$?"
  local d=runs/prof_$name/version_0
  for f in profile_summary kernel_statistics; do cp "$d/profiler/$f.json" "$OUT/prof_${name}_$f.json" 2>/dev/null; done
  cp "$d/benchmark_stats.json" "$OUT/prof_${name}_throughput.json" 2>/dev/null
}
profile minilm_plain --model.init_args.pretrained .carry/minilm
profile minilm_fused --model.init_args.pretrained .carry/minilm -c configs/presets/fused.yaml
BASE=(--model.init_args.pretrained null --model.init_args.config '{}' --data.init_args.max_length 128
      --data.init_args.batch_size 16 --data.init_args.eval_batch_size 16 --data.init_args.pad_to_multiple_of 128)
profile bert_base_plain "${BASE[@]}"
profile bert_base_fused "${BASE[@]}" -c configs/presets/fused.yaml
for name in bert_base_plain bert_base_fused; do
  python -m bertaccel test -c configs/imdb_minilm.yaml -c configs/profile.yaml "${DATA[@]}" "${BASE[@]}" \
    $( [ $name = bert_base_fused ] && echo "-c configs/presets/fused.yaml" ) \
    --trainer.logger.init_args.name "prof_${name}_test" > "$OUT/prof_${name}_test.log" 2>&1
  echo "profile ${name}_test rc=$?"
  cp runs/prof_${name}_test/version_0/profiler/test_profile_summary.json "$OUT/prof_${name}_test_summary.json" 2>/dev/null
done
python -m bertaccel fit -c configs/mlm_local.yaml --data.init_args.train_files '[.carry/imdb/train.jsonl.gz]' \
  --data.init_args.val_files null --data.init_args.exclude_files null --data.init_args.tokenizer .carry/minilm \
  --trainer.max_steps 400 --trainer.val_check_interval 100 --trainer.limit_val_batches 20 --throughput.enabled true \
  --trainer.log_every_n_steps 25 --progress_bar.refresh_rate 200 \
  --trainer.logger lightning.pytorch.loggers.CSVLogger --trainer.logger.init_args.save_dir runs \
  --trainer.logger.init_args.name mlm_gpu > "$OUT/mlm.log" 2>&1
echo "mlm rc=$?"
cp runs/mlm_gpu/version_0/metrics.csv "$OUT/mlm_metrics.csv" 2>/dev/null
grep -E "throughput \(train" "$OUT/mlm.log" | cut -c1-400
tail -58 "$OUT/bench_ops.log"
