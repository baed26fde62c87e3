#!/usr/bin/env bash
# On the GPU host: build the CUDA ops, run the `cuda` tests of src/bertaccel/ops, benchmark the ops.
# Logs and JSON go to $OUT (default ./bench_results). Usage: bash scripts/gpu_ops_check.sh
set -uo pipefail
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package (src layout) without installing it
OUT=${OUT:-bench_results}
mkdir -p "$OUT"
# Keep the compiled extension in the carried folder between GPU sessions (keyed by a source hash).
export BERTACCEL_CACHE=${BERTACCEL_CACHE:-$PWD/.carry/cache}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
start=$(date +%s)
python -c "from bertaccel.ops import build; assert build.load(verbose=True), build.unavailable_reason()" > "$OUT/build.log" 2>&1
echo "build rc=$? in $(( $(date +%s) - start ))s" | tee -a "$OUT/gpu.txt"
grep -E "registers|spill|bytes stack" "$OUT/build.log" | head -40
python -m pytest -m cuda tests/ops -q -p no:cacheprovider "$@" > "$OUT/cuda_tests.log" 2>&1
echo "cuda tests rc=$?" | tee -a "$OUT/gpu.txt"
grep -E "passed|failed|Error" "$OUT/cuda_tests.log" | tail -15
python -m benchmarks.bench_ops --out "$OUT/ops.json" > "$OUT/bench_ops.log" 2>&1
echo "bench rc=$?" | tee -a "$OUT/gpu.txt"
tail -62 "$OUT/bench_ops.log"
(cd "$BERTACCEL_CACHE" && tar czf "$OUT/ext_cache.tgz" extensions/*/BUILT extensions/*/*.so) 2>/dev/null
