#!/usr/bin/env bash
# Session 81's last change checked on a fresh H200 in one device call (~8 minutes):
#   BERTACCEL_COMMIT=<sha> bash docs/pending/measure.sh
# carrying .carry/env.sh and .carry/wheels. What it checks (landed on main in 988e457 from one sweep at 4096 wide, its
# cuda tests not yet run on a GPU): the plain LayerNorm and RMSNorm backward of bf16 rows wider than a warp on two
# blocks per SM from 8,192 rows (layer_norm_bwd.cuh bwd_two_blocks). 1. the cuda tests that run that path (LayerNorm /
# RMSNorm at 16384 x 4096 and 8192 wide); 2. the backward at other widths the rule covers (1536, 8192), the rule
# against one block (BERTACCEL_LN_BWD_TWO_BLOCKS=0), alternated, two rounds; 3. bench_ops beside torch.compile
# (RMSNorm 16384 x 4096 forward and backward: the cells behind compile in session 76); 4. BERTACCEL_LN_BWD_PREFETCH_PLAIN=1
# (built offline in session 81, off by default) against the default at BERT widths. Logs under $OUT, a table last.
source .carry/env.sh
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" BERTACCEL_CACHE=/tmp/bc BERTACCEL_COMMIT=${BERTACCEL_COMMIT:-unknown}
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee $OUT/gpu.txt
t0=$(date +%s)
python -c "from bertaccel.ops import build; assert build.load(verbose=True), build.unavailable_reason()" > $OUT/build.log 2>&1 \
  || { tail -30 $OUT/build.log; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
timeout 300 python -m pytest -m cuda -q -p no:cacheprovider tests/ops/test_ln_bwd_two_blocks_wide.py \
  tests/ops/test_ln_bwd_prefetch_plain.py tests/ops/test_column_sums.py tests/ops/test_rms_norm.py tests/ops/test_layer_norm.py \
  -k "4096 or 8192 or wide_rows or prefetching or default or by-width or shape-32x8 or refused" > $OUT/tests.log 2>&1
for r in 1 2; do for s in X=0 BERTACCEL_LN_BWD_TWO_BLOCKS=0; do
  env $s timeout 90 python scripts/ln_bwd_sweep.py --ops rms_norm layer_norm --widths 1536 4096 8192 --rows 8192 16384
done; done > $OUT/ln_bwd_sweep_wide.log 2>&1
# 4. BERTACCEL_LN_BWD_PREFETCH_PLAIN=1 (built in session 81, off): the plain LayerNorm / RMSNorm backward at BERT widths
# through the prefetching kernel with its next rows, against the default, alternated, two rounds
for r in 1 2; do for s in X=0 BERTACCEL_LN_BWD_PREFETCH_PLAIN=1; do
  env $s timeout 90 python scripts/ln_bwd_sweep.py --ops layer_norm rms_norm --widths 384 768 1024 --rows 2048 16384
done; done > $OUT/ln_bwd_sweep_prefetch_plain.log 2>&1
timeout 120 python -m benchmarks.bench_ops --ops rms_norm --out $OUT/bench_ops.json > $OUT/bench_ops.log 2>&1
echo "== tests"; grep -E "^FAILED|passed|failed" $OUT/tests.log | tail -6
echo "== backward, rows wider than a warp (default = two blocks from 8,192 rows; TWO_BLOCKS=0 = one)"
python scripts/sweep_table.py $OUT/ln_bwd_sweep_wide.log
echo "== backward at BERT widths (default / BERTACCEL_LN_BWD_PREFETCH_PLAIN=1)"
python scripts/sweep_table.py $OUT/ln_bwd_sweep_prefetch_plain.log
echo "== bench_ops (4096 wide)"; grep -E "4096" $OUT/bench_ops.log | cut -c1-120
