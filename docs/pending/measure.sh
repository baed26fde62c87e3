#!/usr/bin/env bash
# Measures what docs/pending holds (see its README): one GPU call, ~6-7 minutes on a fresh H200.
#   BERTACCEL_COMMIT=$(git rev-parse --short HEAD) bash docs/pending/measure.sh   (run by the device tool, .carry staged)
# Tree A: this checkout; tree B: a copy with both patches applied (each has its switch back to the general kernel). Logs under $OUT, a short table last.
source .carry/env.sh
export PYTHONPATH="$PWD/src:$PWD"; export BERTACCEL_CACHE=/tmp/bc; export BERTACCEL_COMMIT=${BERTACCEL_COMMIT:-unknown}
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee $OUT/gpu.txt
mkdir -p /tmp/b && tar --exclude=./.carry --exclude=./.venv -cf - . | tar -xf - -C /tmp/b
(cd /tmp/b && patch -p1 < docs/pending/ln-fwd-ring-fast-rows-whole-stores.patch && patch -p1 < docs/pending/embeddings-fwd-warp-rows.patch) > $OUT/build.log 2>&1 || { echo patch failed; cat $OUT/build.log; exit 1; }
t0=$(date +%s)
AB_LOG_DIR=/tmp/builds bash scripts/ab_runs.sh --build ops /tmp/b/src 0 -- true >> $OUT/build.log 2>&1 || { tail -50 /tmp/builds/*.log; exit 1; }
echo "build $(( $(date +%s) - t0 )) s" | tee -a $OUT/build.log
# 1. tests of the patched tree (FAST ring, LN/RMS, ring grid, embeddings)
(cd /tmp/b && PYTHONPATH="/tmp/b/src:/tmp/b" timeout 400 python -m pytest -m cuda -q -p no:cacheprovider tests/ops/test_ln_fwd_fast.py \
  tests/ops/test_layer_norm.py tests/ops/test_rms_norm.py tests/ops/test_ring_grid.py tests/ops/test_embeddings.py tests/ops/test_emb_fwd_warp_rows.py 2>&1 | tail -15) > $OUT/tests_b.log
tail -3 $OUT/tests_b.log
# 2. LN forward FAST on/off in tree B, alternated, two rounds
for r in 1 2; do for s in "" "BERTACCEL_LN_RING_FAST=0"; do
  env $s PYTHONPATH="/tmp/b/src:$PWD" python /tmp/b/scripts/ln_fwd_sweep.py; done; done > $OUT/ln_fwd_fast_sweep.log 2>&1
for s in "" "BERTACCEL_LN_RING_FAST=0"; do env $s PYTHONPATH="/tmp/b/src:$PWD" python /tmp/b/scripts/ln_fwd_sweep.py --dtype float32; done >> $OUT/ln_fwd_fast_sweep.log 2>&1
env PYTHONPATH="/tmp/b/src:$PWD" python /tmp/b/scripts/ln_fwd_sweep.py --weights input --compile >> $OUT/ln_fwd_fast_sweep.log 2>&1
env BERTACCEL_LN_RING_FAST=0 PYTHONPATH="/tmp/b/src:$PWD" python /tmp/b/scripts/ln_fwd_sweep.py --weights input >> $OUT/ln_fwd_fast_sweep.log 2>&1
# 3. embeddings: A (this checkout), B (warp rows + gamma/beta early), B with BERTACCEL_EMB_WARP_ROWS=0 (gamma/beta early
# alone), alternated, two rounds, then compile once
for r in 1 2; do
  BERTACCEL_AB=A$r python scripts/emb_fwd_sweep.py
  BERTACCEL_AB=B$r PYTHONPATH="/tmp/b/src:$PWD" python scripts/emb_fwd_sweep.py
  BERTACCEL_AB=B$r BERTACCEL_EMB_WARP_ROWS=0 PYTHONPATH="/tmp/b/src:$PWD" python scripts/emb_fwd_sweep.py
done > $OUT/emb_fwd_sweep.log 2>&1
BERTACCEL_AB=B PYTHONPATH="/tmp/b/src:$PWD" python scripts/emb_fwd_sweep.py --compile >> $OUT/emb_fwd_sweep.log 2>&1
# 4. memcheck of the patched kernels
cat > /tmp/mc.py <<'PY'
import torch
from bertaccel.ops.layer_norm import layer_norm
from bertaccel.ops.rms_norm import rms_norm
import bertaccel.ops.embeddings  # noqa
for dt in (torch.bfloat16, torch.float32):
    for n, h in ((1, 768), (37, 384), (130, 768), (301, 1024), (4099, 768)):
        x = torch.randn(n, h, device="cuda", dtype=dt); w = torch.randn(h, device="cuda"); b = torch.randn(h, device="cuda")
        with torch.no_grad():
            layer_norm(x, w, b, 1e-12); rms_norm(x, w, 1e-6)
for bsz, seq, h in ((3, 37, 768), (2, 5, 384), (4, 129, 1024), (7, 129, 512), (3, 41, 1000)):
    ids = torch.randint(1, 30522, (bsz, seq), device="cuda"); pos = torch.arange(seq, device="cuda").expand(bsz, seq).contiguous()
    a = (ids, pos, torch.randint(0, 2, (bsz, seq), device="cuda"), torch.randn(30522, h, device="cuda"), torch.randn(512, h, device="cuda"),
         torch.randn(2, h, device="cuda"), torch.randn(h, device="cuda"), torch.randn(h, device="cuda"))
    with torch.no_grad():
        torch.ops.bertaccel.embedding_layer_norm(*a, 0.0, 1e-12, True, 0); torch.ops.bertaccel.embedding_layer_norm_fwd(*a, 0.1, 1e-12, True, 0)
        torch.ops.bertaccel.embedding_layer_norm_fwd(*a, 0.1, 1e-12, False, 0)
torch.cuda.synchronize(); print("memcheck script ok")
PY
PYTHONPATH="/tmp/b/src:$PWD" timeout 200 compute-sanitizer --tool memcheck python /tmp/mc.py > $OUT/memcheck.log 2>&1
tail -2 $OUT/memcheck.log
echo "== LN"; grep SWEEP $OUT/ln_fwd_fast_sweep.log | grep -E "16384x(768|1024)|16384x384"
echo "== EMB"; grep EMB $OUT/emb_fwd_sweep.log
