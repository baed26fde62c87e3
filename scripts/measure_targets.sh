#!/usr/bin/env bash
# Every open issue's speed target measured in one device call (the targets name an H100; on another GPU the table
# shows the figures and counts nothing as met): the extensions built side by side, then, each within what is left of
# DEADLINE seconds (default 560, one call's 600 less a margin), the row ops against PyTorch and torch.compile (issue 9),
# our GEMM against cuBLAS at the 36 BERT cells (issue 10), attention fwd + bwd against SDPA's backends at the four
# target cells (issue 11) and the BERT-base 32x512 graphed train step beside HF SDPA (issue 10), then
# scripts/targets_table.py's table of the cells not at target and a count per issue.
#
#   source .carry/env.sh; OUT=$OUT/r BERTACCEL_COMMIT=<sha> bash scripts/measure_targets.sh
#   TARGET_STAGES="ops attention" ... bash scripts/measure_targets.sh     # a subset (builds only what it needs)
#
# Writes $OUT/{ops,gemm,attention,e2e}.json with their logs, build_*.log, targets.txt (every cell) and prints the
# unmet cells last.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export BERTACCEL_CACHE=${BERTACCEL_CACHE:-/tmp/bc}
OUT=${OUT:-bench_results/targets}
mkdir -p "$OUT"
T0=$(date +%s)
DEADLINE=${DEADLINE:-560}
STAGES=" ${TARGET_STAGES:-ops gemm attention e2e} "
has() { [[ $STAGES == *" $1 "* ]]; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
  echo "commit ${BERTACCEL_COMMIT:-unknown (give BERTACCEL_COMMIT)}"; } > "$OUT/environment.txt" 2>&1

# the extensions this run needs, each in its own process (a build is mostly nvcc on its own cores)
build() {  # name, python expression
  python -c "from bertaccel.ops import build; $2" > "$OUT/build_$1.log" 2>&1 &
  pids+=($!)
}
pids=()
build ops "assert build.load(verbose=True), build.unavailable_reason()"
{ has gemm || has e2e; } && build gemm "assert build.load_gemm(verbose=True), build.gemm_reason()"
{ has attention || has e2e; } && build attn "assert build.load_attention(verbose=True), build.attention_reason()"
failed=0
for p in "${pids[@]}"; do wait "$p" || failed=1; done
echo "built in $(( $(date +%s) - T0 ))s$([ $failed = 1 ] && echo ' - a build FAILED: see build_*.log')"

stage() {  # name, seconds at most (and within the deadline), command...
  local name=$1 lim=$2; shift 2
  local left=$(( DEADLINE - ($(date +%s) - T0) )); [ "$lim" -gt "$left" ] && lim=$left
  if [ "$lim" -lt 30 ]; then echo "$name skipped (${left}s left)"; return; fi
  timeout "$lim" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? (limit ${lim}s) at $(( $(date +%s) - T0 ))s"
}
has ops && stage ops 150 python -m benchmarks.bench_ops --ops layer_norm residual_layer_norm rms_norm softmax gelu \
  --out "$OUT/ops.json"
# The LayerNorm / embeddings backward at 384-1024 wide, each default against its alternative (all set on an H200 only;
# docs/row-ops.md): the register kernel on two blocks per SM at 24 elements a thread (from 7,168 rows at 384 wide - the
# embeddings' form from 12,288 - and 4,096 at 768; sessions 71-72) against one block (BERTACCEL_LN_BWD_TWO_BLOCKS_24=0);
# the shared-memory accumulators (1024 wide, the plain LayerNorm's below 8,192 rows only since session 72; at 768 until
# session 71) against them everywhere in that range (BERTACCEL_LN_BWD_SMEM_ACC=1); the column sums on 8 x 64 blocks
# (session 70) against 32 x 32 (BERTACCEL_COLSUM=wide) - which of each the H100 should take by default
has ops && stage ln_bwd 120 bash -c 'for round in 1 2; do for s in "" BERTACCEL_LN_BWD_TWO_BLOCKS_24=0 BERTACCEL_LN_BWD_SMEM_ACC=1 BERTACCEL_COLSUM=wide; do
  env $s python scripts/ln_bwd_sweep.py --ops layer_norm embeddings --widths 384 768 1024 --rows 2048 4096 8192 16384 32768; done; done'
has attention && stage attention 90 python -m benchmarks.bench_attention --no-variants \
  --cells 128x128x12x64:full 128x128x12x32:full 32x512x12x64:full 32x512x12x32:full --out "$OUT/attention.json"
has e2e && stage e2e 180 python -m benchmarks.e2e --models bert-base --shapes 32x512 --workloads train \
  --variants attn-fused-graphs attn-ffn-gemm-fused-graphs attn-fused-graphs-cls-only hf-sdpa-bf16 --rounds 2 --warmup 10 --steps 30 \
  --out "$OUT/e2e.json"
has gemm && stage gemm 200 python -m benchmarks.bench_gemm --no-epilogues --rounds 2 --out "$OUT/gemm.json"

[ -s "$OUT/ln_bwd.log" ] && python scripts/sweep_table.py "$OUT/ln_bwd.log" > "$OUT/ln_bwd_table.md" 2>&1 && tail -1 "$OUT/ln_bwd_table.md"
python scripts/targets_table.py "$OUT" > "$OUT/targets.txt" 2>&1
python scripts/targets_table.py "$OUT" --unmet
