#!/usr/bin/env bash
# Measures docs/pending/ln-fwd-ring-fast-residual.patch on a fresh H200 in one device call (~6 minutes):
#   BERTACCEL_COMMIT=<sha> bash docs/pending/measure.sh
# carrying .carry/env.sh and .carry/wheels. One tree (this checkout with the patch applied): the patch keeps the general
# residual kernels - PTX identical to main's - behind BERTACCEL_LN_RING_FAST=plain, so one build compares both.
# Logs under $OUT, a short table last.
source .carry/env.sh
export BERTACCEL_CACHE=/tmp/bc BERTACCEL_COMMIT=${BERTACCEL_COMMIT:-unknown}
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee $OUT/gpu.txt
rm -rf /tmp/b && mkdir -p /tmp/b && tar --exclude=./.carry --exclude=./.venv -cf - . | tar -xf - -C /tmp/b
(cd /tmp/b && patch -p1 < docs/pending/ln-fwd-ring-fast-residual.patch) > $OUT/build.log 2>&1 || { cat $OUT/build.log; exit 1; }
cd /tmp/b && export PYTHONPATH="/tmp/b/src:/tmp/b:$PYTHONPATH"
t0=$(date +%s)
python -c "from bertaccel.ops import build; assert build.load(verbose=True), build.unavailable_reason()" >> $OUT/build.log 2>&1 \
  || { tail -30 $OUT/build.log; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
grep -E "ln_fwd_ring_kernel<.*, true, (16|32), true, [0-3]>" $OUT/build.log | head -30 > $OUT/registers_fast_residual.txt
# tests: the FAST kernels (every setting in a child), LayerNorm (the residual forms, their dropout masks), half warps, grid
timeout 240 python -m pytest -m cuda -q -p no:cacheprovider tests/ops/test_ln_fwd_fast.py tests/ops/test_layer_norm.py \
  tests/ops/test_ln_fwd_half_warp.py tests/ops/test_ring_grid.py > $OUT/tests.log 2>&1
timeout 120 compute-sanitizer --tool memcheck python scripts/memcheck_row_ops.py > $OUT/memcheck.log 2>&1
# the forward sweep, FAST residual on (default) and off (plain), alternated, two rounds; float32 one round
for r in 1 2; do for s in X=0 BERTACCEL_LN_RING_FAST=plain; do env $s timeout 60 python scripts/ln_fwd_sweep.py; done; done \
  > $OUT/ln_fwd_residual_sweep.log 2>&1
for s in X=0 BERTACCEL_LN_RING_FAST=plain; do env $s timeout 60 python scripts/ln_fwd_sweep.py --dtype float32; done \
  >> $OUT/ln_fwd_residual_sweep.log 2>&1
echo "== tests"; grep -E "^FAILED|passed|failed" $OUT/tests.log | tail -6; echo "== memcheck"; tail -2 $OUT/memcheck.log
echo "== sweep (16384 rows)"; grep SWEEP $OUT/ln_fwd_residual_sweep.log | grep "16384x" | sed 's/clone.*| resLN /resLN /'
