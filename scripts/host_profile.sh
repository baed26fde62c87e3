#!/usr/bin/env bash
# On the GPU host: where the host's time goes in a graphed fine-tune step (cProfile of `bertaccel fit`).
#   bash scripts/host_profile.sh [extra CLI args]   -> $OUT/host_profile.txt
set -uo pipefail
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package (src layout) without installing it
OUT=${OUT:-bench_results}; mkdir -p "$OUT"
python -m cProfile -o "$OUT/fit.prof" -m bertaccel fit -c configs/imdb_minilm.yaml -c configs/presets/graphs.yaml \
  --data.init_args.dataset .carry/imdb --model.init_args.pretrained .carry/minilm --data.init_args.tokenizer .carry/minilm \
  --data.init_args.val_size 500 --trainer.limit_train_batches 300 --trainer.limit_val_batches 0 --test_after_fit false \
  --trainer.logger.init_args.name host_profile "$@" > "$OUT/host_profile.log" 2>&1
echo "profile rc=$?"
python - "$OUT/fit.prof" > "$OUT/host_profile.txt" <<'PY'
import pstats, sys
s = pstats.Stats(sys.argv[1]); s.sort_stats("tottime").print_stats(35); s.sort_stats("cumulative").print_stats(60)
PY
head -80 "$OUT/host_profile.txt" | tail -50
