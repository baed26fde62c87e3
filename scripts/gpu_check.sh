#!/usr/bin/env bash
# Everything this project measures or tests on a GPU, in stages, so that one device call holds the
# build, the GPU tests and the benchmarks of one change (run after `source .carry/env.sh`):
#   STAGES="build tests graph_tests ops"                bash scripts/gpu_check.sh   (ops library)
#   STAGES="build headline e2e_graphs"                  bash scripts/gpu_check.sh   (graphed steps)
#   STAGES="build e2e e2e_compile profile sweep mlm"    bash scripts/gpu_check.sh
# Stages: build, tests (cuda tests of the ops), graph_tests (cuda tests of the modules), ops
# (benchmarks/bench_ops.py; OPS= picks families, OPS_RING_OFF=1 runs them again with the rows rings off, OPS_PDL_OFF=1 without programmatic dependent launch), ln_sweep (scripts/ln_fwd_sweep.py; LN_SWEEP_SETTINGS=, LN_SWEEP_ROUNDS=), softmax_sweep (scripts/softmax_fwd_sweep.py, bf16 and float32), e2e, e2e_eager_base, e2e_compile,
# ln_bwd_sweep (scripts/ln_bwd_sweep.py; LN_BWD_SETTINGS= (space-separated settings, each one or more A=1,B=0), LN_BWD_ROUNDS=, LN_BWD_ARGS=), colsum_shapes (the partial-row sums under each BERTACCEL_COLSUM shape: column_sum and the LayerNorm-family backward; COLSUM_SHAPES=, COLSUM_ROUNDS=), eager_overhead (scripts/eager_overhead.py: host us per eager call; EAGER_ARGS=), norm_forms (scripts/norm_forms.py: saving vs output-only LayerNorm/RMSNorm forward), e2e_graphs, e2e_gemm, gemm_build, gemm_tests (GEMM_TEST_K= a pytest -k expression; TESTS_K= for tests),
# ffn_tests, ffn (benchmarks/bench_ffn.py: the feed-forward block; FFN_ARGS=), gemm_variants (#if variants of the GEMM built side by side, timed in turn: GEMM_VARIANTS=), gemm_epilogue_sweep (each epilogue on every schedule / tile width), step_gemms (one BERT step's GEMM calls timed alone - warm, cold, rewarmed, alternating - and in the step's order), gemm (our GEMM vs cuBLAS; GEMM_ARGS="--sweep --schedules 2"), gemm_kernels (scripts/gemm_kernels.py; GEMM_KERNELS_ARGS=), headline (benchmarks/finetune.py; FT_VARIANTS=), finetune (MiniLM IMDB through the CLI),
# profile, sweep, mlm (short BERT-base masked-LM fit), nan_debug, host_profile, host_steps, startup,
# multi_gpu (DDP 1 vs 2 GPUs and FSDP BERT-base; needs nvidia-h200-x2; MULTI_RUNS=, MULTI_ARGS=, MULTI_FSDP=0),
# grad_sync (2+ GPUs: the graphed DDP step's gradient all-reduce and its parts, benchmarks/bench_grad_sync.py; GRAD_SYNC_ARGS="--without-word-embeddings"), ddp_tests (2 GPUs: the NCCL
# cuda tests of tests/test_ddp.py), ddp_step (2 GPUs: benchmarks/bench_ddp_step.py; DDP_STEP_ARGS=), ddp_scaling (2 GPUs:
# recommended.yaml on 1 and 2 GPUs, MiniLM and BERT-base; SCALING_RUNS=, SCALING_ENV=), anatomy (where a graphed step's
# GPU time goes), attention (benchmarks/bench_attention.py), attn_tests (build + cuda tests of the fused
# attention and the unpadded model), hf_attention (cuda tests of attn_implementation bertaccel and graphed steps through it vs SDPA
# and the unpadded encoder: HF_ATTN_CELLS="model:shape:lengths ..."), recommended (the MiniLM IMDB fine-tune as users compose
# the presets, max_length 512 and 256: recommended, recommended + unpadded, graphs + fused with SDPA, plain), ddp_rows (2 GPUs: DDP fit, test, predict rows),
# sigterm (2 GPUs: the per-batch SIGTERM check's host cost, benchmarks/bench_sigterm_check.py, then one-epoch DDP fits of recommended.yaml
# with BERTACCEL_LAGGED_SIGTERM=0 and 1, alternating, SIGTERM_ROUNDS=2), residual_dgrad (benchmarks/bench_residual_dgrad.py),
# dropout (the dropouts' exact-mask cuda tests, attention kernel sums with p = 0.1, scripts/ln_fwd_sweep.py), step_switches
# (the cuda tests of BERTACCEL_ADAMW_ALL and BERTACCEL_RESIDUAL_FANOUT, then BERT-base 32x512 graphed steps with each switched), gelu_sweep (bias+GELU forward
# vectors per thread), op_kernels (per-kernel time of the norm / GELU ops, scripts/op_kernels.py),
# ncu_attn (Nsight Compute on the attention forward or, NCU_ATTN_KERNEL=attn_bwd_kernel, backward: NCU_ATTN_CELL, NCU_ATTN_FWD), ncu_gemm (our GEMM and cuBLAS, scripts/gemm_calls.py: NCU_GEMM_SHAPES, NCU_GEMM_GEMMS), ncu_gemm_stalls (warp-stall samples per SASS instruction of the same calls, scripts/ncu_stalls.py; NCU_TOP, NCU_GEMM_EPILOGUE=none|bias|gelu|gelu-pre), ncu_gemm_states (stall reasons per GEMM kernel, caches flushed and not; scripts/ncu_stall_reasons.py), ncu_rows (Nsight Compute counters of the LayerNorm-family kernels, scripts/row_op_calls.py). OPS_SETTINGS="A=1 B=2": the ops stage again under each switch.
# Logs and JSON go to $OUT; the compiled extension is cached in $BERTACCEL_CACHE (default /tmp/bc,
# kept while the machine stays warm). The environment (GPU, driver, versions, commit) goes first.
# The device tool returns at most 8 files from $OUT (no more than two folders down): with many stages, read
# results.tgz (every JSON and log of the call) or delete what is not needed at the end of the command.
set -uo pipefail
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package (src layout) without installing it
OUT=${OUT:-bench_results}
mkdir -p "$OUT"
export BERTACCEL_CACHE=${BERTACCEL_CACHE:-/tmp/bc}
STAGES=${STAGES:-build tests ops e2e}
has() { [[ " $STAGES " == *" $1 "* ]]; }
# The staged MiniLM IMDB fine-tune (.carry/imdb, .carry/minilm) with the throughput meter: the multi-GPU stages' runs
MINILM_IMDB=(--data.init_args.dataset .carry/imdb --model.init_args.pretrained .carry/minilm --data.init_args.tokenizer .carry/minilm
             --data.init_args.val_size 500 --throughput.enabled true)
# train_stats STATS_JSON KEY...: those keys of a run's benchmark_stats.json train section, on one line
train_stats() {
  python -c "import json,sys; t=json.load(open(sys.argv[1]))['train']; print('  train', {k: t.get(k) for k in sys.argv[2:]})" "$@" 2>/dev/null
}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  # Give BERTACCEL_COMMIT (the sha, from the machine that sent the tree): the GPU host's copy may carry
  # a stale .git (session 15: rev-parse there named the first call's commit in every later call).
  echo "commit ${BERTACCEL_COMMIT:-unknown (BERTACCEL_COMMIT not given; git there says $(git rev-parse --short HEAD 2>/dev/null || echo nothing))}"; } > "$OUT/environment.txt" 2>&1
[ -n "${BERTACCEL_COMMIT:-}" ] || echo "warning: BERTACCEL_COMMIT not given; results will not name their commit reliably"
if has build; then
  s=$(date +%s)
  python -c "from bertaccel.ops import build; assert build.load(verbose=True), build.unavailable_reason()" > "$OUT/build.log" 2>&1
  echo "build rc=$? in $(( $(date +%s) - s ))s"
  grep -E "registers|spill|bytes stack" "$OUT/build.log" > "$OUT/registers.txt"
fi
if has tests; then
  ignore=(); has gemm_tests && ignore=(--ignore=tests/ops/test_gemm.py)  # run there, on its own clock
  BERTACCEL_FAILURE_LOG="$OUT/cuda_test_failures.log" timeout ${TESTS_TIMEOUT:-400} python -u -m pytest -m cuda tests/ops -q -p no:cacheprovider "${ignore[@]}" ${TESTS_K:+-k "$TESTS_K"} > "$OUT/cuda_tests.log" 2>&1
  echo "cuda tests rc=$?"; grep -E "^FAILED|passed|failed" "$OUT/cuda_tests.log" | tail -12
fi
if has attn_tests; then  # the fused varlen attention: build, its cuda tests and the unpadded model's
  s=$(date +%s)
  python -c "from bertaccel.ops import build; assert build.load_attention(verbose=True), build.attention_reason()" > "$OUT/attn_build.log" 2>&1
  echo "attention build rc=$? in $(( $(date +%s) - s ))s"
  grep -E "bytes spill stores" "$OUT/attn_build.log" | grep -v " 0 bytes spill stores" | head -3  # spills, if any
  grep -c "C7514" "$OUT/attn_build.log" | sed 's/^/wgmma-serialized kernels (ptxas C7514, want 0): /'
  timeout ${ATTN_TESTS_TIMEOUT:-400} python -u -m pytest -m cuda tests/ops/test_attention.py tests/modules/test_unpadded.py -q -p no:cacheprovider ${ATTN_TESTS_K:+-k "$ATTN_TESTS_K"} > "$OUT/attn_tests.log" 2>&1
  echo "attention tests rc=$?"; grep -E "^FAILED|^E  |passed|failed" "$OUT/attn_tests.log" | head -40
fi
if has hf_attention; then  # attn_implementation bertaccel: its cuda tests, then graphed train steps vs SDPA and the unpadded encoder
  python -c "from bertaccel.ops import build; assert build.load_attention(), build.attention_reason()" > "$OUT/hf_attn_build.log" 2>&1
  echo "attention build rc=$?"
  timeout 200 python -u -m pytest -m cuda tests/modules/test_hf_attention.py -q -p no:cacheprovider > "$OUT/hf_attn_tests.log" 2>&1
  echo "hf attention tests rc=$?"; grep -E "^FAILED|^E  |passed|failed" "$OUT/hf_attn_tests.log" | head -10
  for cell in ${HF_ATTN_CELLS:-bert-base:16x128:uniform minilm:32x256:uniform bert-base:32x512:full}; do
    IFS=: read -r model shape lengths <<< "$cell"
    timeout 200 python -m benchmarks.e2e --models "$model" --shapes "$shape" --lengths "$lengths" --workloads train --rounds 2 \
      --variants fused-graphs attn-fused-graphs fused-unpadded-graphs --warmup 10 --steps 30 \
      --out "$OUT/e2e_hf_attn_${model}_${shape}_${lengths}.json" > "$OUT/e2e_hf_attn_${model}_${shape}_${lengths}.log" 2>&1
    echo "e2e $cell rc=$?"; grep -hE "^(bert|minilm)" "$OUT/e2e_hf_attn_${model}_${shape}_${lengths}.log" | sort -u
  done
fi
if has recommended; then  # the presets as users compose them (needs .carry/imdb and .carry/minilm)
  for len in 512 256; do
    timeout 300 python -m benchmarks.finetune --data .carry/imdb --model .carry/minilm --runs /tmp/ft_runs_$len --max-length $len \
      --out "$OUT/finetune_recommended_$len.json" --variants cli-recommended cli-fused-graphs cli-recommended-unpadded plain \
      > "$OUT/finetune_recommended_$len.log" 2>&1
    echo "finetune $len rc=$?"; tail -6 "$OUT/finetune_recommended_$len.log"
  done
fi
if has data_tests; then  # cuda tests of the data pipeline (prefetch to the GPU, masks on the GPU) + host masking cost
  python -u -m pytest -m cuda tests/data tests/callbacks -q -p no:cacheprovider > "$OUT/data_tests.log" 2>&1
  echo "data tests rc=$?"; grep -E "^FAILED|^E  |passed|failed" "$OUT/data_tests.log" | head -20
  python -m benchmarks.bench_masking --vocab .carry/minilm/vocab.txt --out "$OUT/masking.json" 2>&1 | tail -8
fi
if has graph_tests; then  # whole-step CUDA graphs: equality with eager, dropout, captures, memory, resume, syncs
  BERTACCEL_FAILURE_LOG="$OUT/graph_test_failures.log" python -u -m pytest -m cuda tests/modules -q -p no:cacheprovider > "$OUT/graph_tests.log" 2>&1
  echo "graph tests rc=$?"; grep -E "^FAILED|^E  |passed|failed" "$OUT/graph_tests.log" | head -30
fi
if has nan_debug; then  # which part of the graphed step gives the intermittent NaN (scripts/debug_graph_nan.py)
  for v in ${NAN_VARIANTS:-eager graphs nopin mainwarm evaleager poolper}; do
    python scripts/debug_graph_nan.py ${NAN_TRIALS:-3} $v > "$OUT/nan_$v.log" 2>&1
    grep SUMMARY "$OUT/nan_$v.log" || tail -3 "$OUT/nan_$v.log"
  done
fi
if has host_profile; then
  bash scripts/host_profile.sh > /dev/null 2>&1; echo "host profile done"
fi
# FT_ARGS: more benchmarks/finetune.py arguments (e.g. "--max-length 512")
if has headline; then  # the README's fine-tune table: plain loop, compile, and the CLI variants in one run
  python -m benchmarks.finetune --data .carry/imdb --model .carry/minilm --runs /tmp/ft_runs --out "$OUT/finetune.json" \
    --variants ${FT_VARIANTS:-plain cli-graphs cli-fused-graphs cli-bf16 cli-fused plain-compile} ${FT_ARGS:-} > "$OUT/finetune.log" 2>&1
  echo "finetune rc=$?"; tail -9 "$OUT/finetune.log"
  grep -h "CUDA graphs\|cuda_graphs\|captured\|Error\|error" /tmp/ft_runs/*.log | sort | uniq -c | head -20
fi
if has e2e_graphs; then
  timeout ${E2E_TIMEOUT:-300} python -m benchmarks.e2e --models ${E2E_MODELS:-bert-base} --shapes ${E2E_SHAPES:-16x128 32x512} --variants ${E2E_VARIANTS:-hf-sdpa-bf16 hf-compile graphs fused-graphs fused-graphs-cast} \
    --warmup 10 --steps 30 ${E2E_ARGS:-} --out "$OUT/e2e_graphs.json" > "$OUT/e2e_graphs.log" 2>&1
  echo "e2e graphs rc=$?"; grep -E "^(bert|minilm)" "$OUT/e2e_graphs.log"; grep -A24 "GPU ms per step by kernel" "$OUT/e2e_graphs.log"
fi
if has e2e_gemm; then  # BERT-base steps with every nn.Linear on our GEMM, beside the default swap and HF SDPA
  timeout ${E2E_TIMEOUT:-300} python -m benchmarks.e2e --models bert-base --shapes ${E2E_SHAPES:-16x128 32x512} \
    --variants ${E2E_GEMM_VARIANTS:-hf-sdpa-bf16 fused-graphs gemm-fused-graphs ffn-gemm-fused-graphs} --warmup 10 --steps 30 --out "$OUT/e2e_gemm.json" > "$OUT/e2e_gemm.log" 2>&1
  echo "e2e gemm rc=$?"; grep -E "^bert" "$OUT/e2e_gemm.log"; grep -iE "error|warn.*gemm" "$OUT/e2e_gemm.log" | sort | uniq -c | head -5
fi
if has ops; then
  python -m benchmarks.bench_ops --ops ${OPS:-layer_norm residual_layer_norm rms_norm} --out "$OUT/ops.json" > "$OUT/bench_ops.log" 2>&1
  echo "bench rc=$?"; grep -E "^(layer_norm|residual|rms_norm|softmax|embeddings|embedding_scatter|bias_gelu) " "$OUT/bench_ops.log" | cut -c1-120
  if [ -n "${OPS_RING_OFF:-}" ]; then  # the same ops with the LayerNorm family's row rings off, same call
    BERTACCEL_LN_RING=0 python -m benchmarks.bench_ops --ops ${OPS:-layer_norm residual_layer_norm rms_norm} --out "$OUT/ops_ring_off.json" > "$OUT/bench_ops_ring_off.log" 2>&1
    echo "bench (rings off) rc=$?"; grep -E "^(layer_norm|residual|rms_norm|embeddings) .*bertaccel" "$OUT/bench_ops_ring_off.log" | cut -c1-120
  fi
  for setting in ${OPS_SETTINGS:-}; do  # the same ops again under each kernel switch (README "Kernel switches"), same call
    env $setting python -m benchmarks.bench_ops --ops ${OPS:-layer_norm residual_layer_norm rms_norm} --out "$OUT/ops_${setting//[^A-Za-z0-9]/_}.json" > "$OUT/bench_ops_${setting//[^A-Za-z0-9]/_}.log" 2>&1
    echo "bench ($setting) rc=$?"; grep -E "^[a-z_]+ .*bertaccel" "$OUT/bench_ops_${setting//[^A-Za-z0-9]/_}.log" | cut -c1-120
  done
  if [ -n "${OPS_PDL_OFF:-}" ]; then  # the same ops with the column sums launched plainly (no programmatic dependent launch)
    BERTACCEL_PDL=0 python -m benchmarks.bench_ops --ops ${OPS:-layer_norm residual_layer_norm rms_norm} --out "$OUT/ops_pdl_off.json" > "$OUT/bench_ops_pdl_off.log" 2>&1
    echo "bench (PDL off) rc=$?"; grep -E "^[a-z_]+ .*bertaccel" "$OUT/bench_ops_pdl_off.log" | cut -c1-120
  fi
fi
if has e2e; then
  python -m benchmarks.e2e --variants hf-eager-fp32 hf-eager-bf16 hf-sdpa-bf16 fused fused-eager --warmup 10 --steps 30 \
    --out "$OUT/e2e_eager.json" > "$OUT/e2e_eager.log" 2>&1
  echo "e2e rc=$?"
fi
if has e2e_compile; then
  python -m benchmarks.e2e --variants hf-sdpa-bf16 hf-compile fused fused-compile --warmup 15 --steps 30 \
    --out "$OUT/e2e_compile.json" > "$OUT/e2e_compile.log" 2>&1
  echo "e2e compile rc=$?"
fi
if has finetune; then  # MiniLM on the staged IMDB subset through the CLI, plain and fused (issue 2's recipe)
  for preset in plain fused; do
    extra=(); [ "$preset" = fused ] && extra=(-c configs/presets/fused.yaml)
    python -m bertaccel fit -c configs/imdb_minilm.yaml "${extra[@]}" --data.init_args.dataset .carry/imdb \
      --model.init_args.pretrained .carry/minilm --data.init_args.tokenizer .carry/minilm --data.init_args.val_size 500 \
      --throughput.enabled true --trainer.logger.init_args.name "ft_$preset" \
      > "$OUT/ft_$preset.log" 2>&1
    echo "finetune $preset rc=$?"
    cp runs/ft_$preset/version_0/benchmark_stats.json "$OUT/ft_${preset}_stats.json" 2>/dev/null
    grep -E "test/acc|throughput \(|kernel swap: replaced" "$OUT/ft_$preset.log" | cut -c1-300
  done
fi
if has profile; then  # BERT-base, batch 16 x seq 128, train and test, plain and fused
  BASE=(--data.init_args.dataset .carry/imdb --data.init_args.tokenizer .carry/minilm --data.init_args.val_size 500
        --model.init_args.pretrained null --model.init_args.config '{}' --data.init_args.max_length 128 --data.init_args.pad_to_multiple_of 128 --data.init_args.batch_size 16
        --data.init_args.eval_batch_size 16 --test_after_fit false)
  for preset in plain fused; do
    extra=(); [ "$preset" = fused ] && extra=(-c configs/presets/fused.yaml)
    for stage in fit test; do
      name=prof_bert_${preset}_$stage
      python -m bertaccel $stage -c configs/imdb_minilm.yaml -c configs/profile.yaml "${extra[@]}" "${BASE[@]}" \
        --trainer.logger.init_args.name $name > "$OUT/$name.log" 2>&1
      echo "profile $name rc=$?"
      prefix=$([ $stage = fit ] && echo "" || echo "test_")
      cp runs/$name/version_0/profiler/${prefix}profile_summary.json "$OUT/${name}_summary.json" 2>/dev/null
      cp runs/$name/version_0/profiler/${prefix}kernel_statistics.json "$OUT/${name}_kernels.json" 2>/dev/null
    done
  done
fi
if has sweep; then
  python -m benchmarks.sweep --models bert-base --seq-lens 128 --variants hf-eager-bf16 hf-sdpa-bf16 fused \
    --workloads infer train --out "$OUT/sweep" > "$OUT/sweep.log" 2>&1
  echo "sweep rc=$?"
fi
for f in e2e_eager e2e_compile; do [ -f "$f.log" ] && grep -A80 "^$" "$f.log" | grep -E "^(model|bert|minilm)" | tail -41; done
if has attention; then  # SDPA backends (padded, masked) vs FlashAttention varlen on the packed tokens
  # ATTN_CELLS="32x512x12x64:full ...": only those cells (a quicker call while iterating on one)
  timeout ${ATTN_TIMEOUT:-200} python -m benchmarks.bench_attention ${ATTN_CELLS:+--cells $ATTN_CELLS} --out "$OUT/attention.json" > "$OUT/attention.log" 2>&1
  echo "attention rc=$?"; tail -25 "$OUT/attention.log"
fi
if has anatomy; then  # GPU time of one graphed step by part and by kernel category (scripts/step_anatomy.py)
  timeout ${ANATOMY_TIMEOUT:-300} python scripts/step_anatomy.py ${ANATOMY_ARGS:-} --out "$OUT/step_anatomy.json" > "$OUT/step_anatomy.log" 2>&1
  echo "anatomy rc=$?"; cat "$OUT/step_anatomy.log" | grep -v Warning | head -${ANATOMY_TAIL:-80}
fi
if has host_steps; then  # host time per steady-state graphed step, cProfile of the main thread (HOST_STEPS_ARGS: more CLI args)
  python scripts/host_steps.py fit -c configs/imdb_minilm.yaml -c configs/presets/graphs.yaml \
    --data.init_args.dataset .carry/imdb --model.init_args.pretrained .carry/minilm --data.init_args.tokenizer .carry/minilm \
    --data.init_args.val_size 500 --trainer.limit_train_batches 300 --trainer.limit_val_batches 0 --test_after_fit false \
    --trainer.logger.init_args.name host_steps ${HOST_STEPS_ARGS:-} > "$OUT/host_steps.log" 2>&1
  echo "host steps rc=$?"; head -1 "$OUT/host_steps.txt"
  python -X importtime -c "import bertaccel.ops.swap" 2> "$OUT/importtime.txt"; sort -t'|' -k2 -n "$OUT/importtime.txt" | tail -4
fi
if has startup; then  # who registers custom ops at startup, and what it costs
  python - > "$OUT/startup.txt" 2>&1 <<'PY'
import cProfile, pstats, time
t = time.time()
cProfile.run("import bertaccel.cli; from bertaccel.modules import BertClassifier; m = BertClassifier(config={'hidden_size': 64, 'num_hidden_layers': 1, 'num_attention_heads': 2, 'intermediate_size': 64}, vocab_size=128).cuda()", "/tmp/start.prof")
print(f"startup {time.time() - t:.1f}s")
s = pstats.Stats("/tmp/start.prof"); s.sort_stats("cumulative").print_callers("_register_to_dispatcher"); s.sort_stats("tottime").print_stats(12)
PY
  head -40 "$OUT/startup.txt"
fi
if has gemm_build; then  # the Hopper GEMM extension (sm_90a), its own build
  s=$(date +%s)
  python -c "from bertaccel.ops import build; assert build.load_gemm(verbose=True), build.gemm_reason()" > "$OUT/gemm_build.log" 2>&1
  echo "gemm build rc=$? in $(( $(date +%s) - s ))s"; grep -iE "error|warning.*(wgmma|C75)" "$OUT/gemm_build.log" | head -20
  grep -E "registers|spill" "$OUT/gemm_build.log" > "$OUT/gemm_registers.txt"
fi
if has gemm_tests; then
  BERTACCEL_FAILURE_LOG="$OUT/gemm_test_failures.log" timeout ${GEMM_TEST_TIMEOUT:-240} python -u -m pytest -m cuda ${GEMM_TEST_FILES:-tests/ops/test_gemm.py} -q -p no:cacheprovider ${GEMM_TEST_K:+-k "$GEMM_TEST_K"} > "$OUT/gemm_tests.log" 2>&1
  echo "gemm tests rc=$?"; grep -E "^FAILED|^E  |passed|failed|Error" "$OUT/gemm_tests.log" | head -30
fi
if has ffn_tests; then  # the fused feed-forward block (ffn family): its cuda tests (needs the GEMM build)
  BERTACCEL_FAILURE_LOG="$OUT/ffn_test_failures.log" timeout ${FFN_TEST_TIMEOUT:-240} python -u -m pytest -m cuda tests/ops/test_ffn.py -q -p no:cacheprovider > "$OUT/ffn_tests.log" 2>&1
  echo "ffn tests rc=$?"; grep -E "^FAILED|^E  |passed|failed|Error" "$OUT/ffn_tests.log" | head -30
fi
if has ffn; then  # the feed-forward block: HF, compile, the default swap, our GEMM, the ffn family (FFN_ARGS=)
  timeout ${FFN_TIMEOUT:-300} python -u -m benchmarks.bench_ffn ${FFN_ARGS:-} --out "$OUT/ffn.json" > "$OUT/ffn.log" 2>&1
  echo "ffn rc=$?"; grep -vE "Warning|warn|^ +|^$|^KERNELS" "$OUT/ffn.log" | tail -20; grep "^KERNELS" "$OUT/ffn.log" | cut -c1-150 | head -${FFN_KERNEL_LINES:-70}
fi
if has gemm_variants; then  # kernel variants the GEMM sources select with #if, built side by side and timed in turn:
  # GEMM_VARIANTS="name:MACRO=1,MACRO2 other:MACRO=0" (BERTACCEL_GEMM_DEFINES per variant), VARIANT_ROUNDS (2),
  # VARIANT_GEMM_ARGS (bench_gemm, default --gelu-only), VARIANT_FFN_ARGS (bench_ffn, first round only; "skip"),
  # VARIANT_TESTS_K (pytest -k over test_gemm.py + test_ffn.py per variant; "skip"). Results: variant_<name>_*.json.
  variant_defines() { echo "${1#*:}" | tr , ' '; }  # name:A=1,B -> "A=1 B"
  s=$(date +%s); pids=()
  for v in ${GEMM_VARIANTS:?GEMM_VARIANTS=name:DEFINES ...}; do
    ( BERTACCEL_GEMM_DEFINES="$(variant_defines "$v")" python -c "from bertaccel.ops import build; assert build.load(), build.unavailable_reason(); assert build.load_gemm(verbose=True), build.gemm_reason()" > "$OUT/gemm_build_${v%%:*}.log" 2>&1
      echo "variant ${v%%:*} build rc=$?" ) &
    pids+=($!); sleep 2
  done
  wait "${pids[@]}"; echo "variant builds in $(( $(date +%s) - s ))s"
  for v in ${GEMM_VARIANTS}; do grep -E "spill stores" "$OUT/gemm_build_${v%%:*}.log" | grep -v " 0 bytes spill" | sed "s/^/${v%%:*}: /" | head -4; done
  for r in $(seq ${VARIANT_ROUNDS:-2}); do
    for v in ${GEMM_VARIANTS}; do
      n=${v%%:*}; export BERTACCEL_GEMM_DEFINES="$(variant_defines "$v")"
      timeout ${VARIANT_TIMEOUT:-120} python -u -m benchmarks.bench_gemm ${VARIANT_GEMM_ARGS:---gelu-only} --out "$OUT/variant_${n}_gemm_r$r.json" > "$OUT/variant_${n}_gemm_r$r.log" 2>&1
      echo "variant $n round $r gemm rc=$?"
      if [ "$r" = 1 ] && [ "${VARIANT_FFN_ARGS:-}" != skip ]; then
        timeout ${VARIANT_TIMEOUT:-120} python -u -m benchmarks.bench_ffn ${VARIANT_FFN_ARGS:---impls fused ffn ffn-dgelu-epilogue} --out "$OUT/variant_${n}_ffn.json" > "$OUT/variant_${n}_ffn.log" 2>&1
        echo "variant $n ffn rc=$?"
      fi
      unset BERTACCEL_GEMM_DEFINES
    done
  done
  python scripts/gemm_variants_table.py "$OUT" ${GEMM_VARIANTS} || true
  if [ "${VARIANT_TESTS_K:-}" != skip ]; then
    for v in ${GEMM_VARIANTS}; do
      n=${v%%:*}
      BERTACCEL_GEMM_DEFINES="$(variant_defines "$v")" timeout ${VARIANT_TESTS_TIMEOUT:-150} python -u -m pytest -m cuda tests/ops/test_gemm.py tests/ops/test_ffn.py -q -p no:cacheprovider -k "${VARIANT_TESTS_K:-epilogue or gelu or ffn or linear_gradients}" > "$OUT/variant_${n}_tests.log" 2>&1
      echo "variant $n tests rc=$?"; grep -E "^FAILED|passed|failed" "$OUT/variant_${n}_tests.log" | tail -4
    done
  fi
fi
if has gemm_epilogue_sweep; then  # every schedule / tile width with and without each epilogue (scripts/gemm_epilogue_sweep.py; EPI_SWEEP_ARGS=)
  timeout ${EPI_SWEEP_TIMEOUT:-300} python -u scripts/gemm_epilogue_sweep.py ${EPI_SWEEP_ARGS:-} --out "$OUT/gemm_epilogue_sweep.json" > "$OUT/gemm_epilogue_sweep.log" 2>&1
  echo "gemm epilogue sweep rc=$?"; grep -E "^EPI|Error" "$OUT/gemm_epilogue_sweep.log"
fi
if has step_gemms; then  # one BERT step's GEMM calls timed alone, warm and cold, beside cuBLAS (scripts/step_gemms.py; STEP_GEMMS_ARGS=)
  timeout ${STEP_GEMMS_TIMEOUT:-240} python -u scripts/step_gemms.py ${STEP_GEMMS_ARGS:-} --out "$OUT/step_gemms.json" > "$OUT/step_gemms.log" 2>&1
  echo "step gemms rc=$?"; grep -E "^STEP|GEMM calls|Error" "$OUT/step_gemms.log"
fi
if has gemm_kernels; then  # per-kernel times of chosen GEMM schedules (GEMM_KERNELS_ARGS="--shapes 2048x768x3072 --schedules 1 3")
  timeout ${GEMM_KERNELS_TIMEOUT:-240} python -u scripts/gemm_kernels.py ${GEMM_KERNELS_ARGS:-} > "$OUT/gemm_kernels.log" 2>&1
  echo "gemm kernels rc=$?"; grep -E "^KERNELS|Error" "$OUT/gemm_kernels.log"
fi
if has gemm; then  # our GEMM against cuBLAS at BERT's GEMM shapes (GEMM_ARGS=--sweep for every tile / split)
  timeout ${GEMM_TIMEOUT:-300} python -u -m benchmarks.bench_gemm ${GEMM_ARGS:-} --out "$OUT/gemm.json" > "$OUT/gemm.log" 2>&1
  echo "gemm rc=$?"; tail -${GEMM_TAIL:-40} "$OUT/gemm.log"
fi
if has presets; then  # the preset comparison (BERT-base MLM from scratch, PRESET_STEPS each; split PRESETS over calls: ~1-2 min per preset)
  # PRESET_ARGS: more options (e.g. "--block-size 512 --batch-size 16"); PRESET_NAME: the JSON's name
  timeout ${PRESET_TIMEOUT:-560} python -m benchmarks.presets --train-files ${PRESET_TRAIN:-.carry/imdb/train.jsonl.gz} \
    --tokenizer .carry/minilm --steps ${PRESET_STEPS:-1000} ${PRESET_ARGS:-} --fit-args "${PRESET_FIT_ARGS:-}" \
    --presets ${PRESETS:-baseline bf16 fused recommended recommended-muon recommended-normuon full} \
    --runs /tmp/preset_runs --out "$OUT/${PRESET_NAME:-presets}.json" > "$OUT/presets.log" 2>&1
  echo "presets rc=$?"; grep -E "^[a-z-]+: \{" "$OUT/presets.log" | cut -c1-400; tail -12 "$OUT/presets.log"
  cp -r /tmp/preset_runs/*.log "$OUT/" 2>/dev/null
fi
if has mlm; then  # a short BERT-base masked-LM fit from scratch on local text: loss going down, tokens/s
  python -m bertaccel fit -c configs/mlm_local.yaml --data.init_args.train_files '[.carry/imdb/train.jsonl.gz]' \
    --data.init_args.val_files null --data.init_args.exclude_files null --data.init_args.tokenizer .carry/minilm \
    --trainer.max_steps ${MLM_STEPS:-400} --trainer.val_check_interval 100 --trainer.limit_val_batches 20 \
    --throughput.enabled true --trainer.log_every_n_steps 25 \
    --trainer.logger lightning.pytorch.loggers.CSVLogger --trainer.logger.init_args.save_dir runs \
    --trainer.logger.init_args.name mlm_gpu ${MLM_ARGS:-} > "$OUT/mlm.log" 2>&1
  echo "mlm rc=$?"
  cp runs/mlm_gpu/version_0/metrics.csv "$OUT/mlm_metrics.csv" 2>/dev/null
  grep -E "throughput \(train|Error" "$OUT/mlm.log" | cut -c1-400
fi
if has multi_gpu; then  # issue 12 (nvidia-h200-x2): MiniLM IMDB fit + test on 1 and 2 GPUs (DDP), global samples/s, then FSDP BERT-base
  for run in ${MULTI_RUNS:-ddp1 ddp2 ddp2-fused-graphs}; do
    n=${run:3:1}; extra=(); [[ $run == *fused-graphs ]] && extra=(-c configs/presets/graphs.yaml -c configs/presets/fused.yaml)
    strategy=ddp; [ "$n" = 1 ] && strategy=auto  # the 1-GPU baseline runs as a user would, without DDP
    timeout ${MULTI_TIMEOUT:-240} python -m bertaccel fit -c configs/imdb_minilm.yaml "${extra[@]}" "${MINILM_IMDB[@]}" --trainer.devices $n \
      --trainer.strategy $strategy --trainer.logger.init_args.name $run ${MULTI_ARGS:-} > "$OUT/$run.log" 2>&1
    echo "$run rc=$?"; cp runs/$run/version_0/benchmark_stats.json "$OUT/${run}_stats.json" 2>/dev/null
    grep -E "test/acc|throughput \(|CUDA graphs|eager|Error" "$OUT/$run.log" | cut -c1-300 | head -6
    train_stats "$OUT/${run}_stats.json" world_size samples_per_s tokens_per_s step_ms_p50 gpu_step_fraction
  done
  if [ "${MULTI_FSDP:-1}" = 1 ]; then timeout ${MULTI_TIMEOUT:-240} python -m bertaccel fit -c configs/imdb_minilm.yaml --data.init_args.dataset .carry/imdb \
    --data.init_args.tokenizer .carry/minilm --data.init_args.val_size 500 --model.init_args.pretrained null \
    --model.init_args.config '{}' --data.init_args.max_length 128 --trainer.devices 2 --trainer.strategy fsdp \
    --trainer.limit_train_batches 100 --trainer.limit_val_batches 10 --trainer.limit_test_batches 10 \
    --throughput.enabled true --trainer.logger.init_args.name fsdp_base > "$OUT/fsdp_base.log" 2>&1
  echo "fsdp bert-base rc=$?"; grep -E "test/acc|throughput \(|Error" "$OUT/fsdp_base.log" | cut -c1-300 | head -5; fi
fi
if has ddp_tests; then  # 2 GPUs: the NCCL cuda tests of tests/test_ddp.py (graphed DDP vs eager DDP; the overlapped sync)
  BERTACCEL_FAILURE_LOG="$OUT/ddp_test_failures.log" timeout ${DDP_TESTS_TIMEOUT:-420} python -u -m pytest -m cuda tests/test_ddp.py tests/modules/test_embedding_row_sync.py -q -p no:cacheprovider --durations=4 > "$OUT/ddp_tests.log" 2>&1
  echo "ddp tests rc=$?"; grep -E "^FAILED|^E  |passed|failed|s call" "$OUT/ddp_tests.log" | head -20
fi
if has ddp_step; then  # 2 GPUs: the graphed step with no sync / the sync after the backward / the overlapped sync (benchmarks/bench_ddp_step.py)
  timeout ${DDP_STEP_TIMEOUT:-300} python -m benchmarks.bench_ddp_step ${DDP_STEP_ARGS:-} --out "$OUT/ddp_step.json" > "$OUT/ddp_step.log" 2>&1
  echo "ddp step rc=$?"; grep -E "^(model|minilm|base)" "$OUT/ddp_step.log"
fi
if has ddp_scaling; then  # 2 GPUs: recommended.yaml on 1 GPU and on 2 (DDP), MiniLM IMDB one epoch and BERT-base (random init, 512,
  # grouped by length) 300 batches; SCALING_RUNS= picks (minilm1 minilm2 base1 base2), SCALING_ENV= e.g. "BERTACCEL_GRAD_SYNC_OVERLAP=1"
  # or "BERTACCEL_EMBEDDING_ROW_SYNC=1", SCALING_TAG= a suffix for the runs' names (else a rerun replaces the first's files)
  MI=(-c configs/imdb_minilm.yaml -c configs/presets/recommended.yaml --data.init_args.dataset .carry/imdb
      --model.init_args.pretrained .carry/minilm --data.init_args.tokenizer .carry/minilm --data.init_args.val_size 500
      --throughput.enabled true --trainer.max_epochs 1)
  BB=(-c configs/imdb.yaml -c configs/presets/recommended.yaml --data.init_args.dataset .carry/imdb --data.init_args.tokenizer .carry/minilm
      --model.init_args.pretrained null --model.init_args.config '{}' --data.init_args.val_size 500 --throughput.enabled true
      --trainer.max_epochs 1 --trainer.limit_train_batches 300 --trainer.limit_val_batches 4 --test_after_fit false)
  for run in ${SCALING_RUNS:-minilm1 minilm2 base1 base2}; do
    n=${run: -1}; strategy=ddp; [ "$n" = 1 ] && strategy=auto
    if [[ $run == minilm* ]]; then args=("${MI[@]}"); else args=("${BB[@]}"); fi
    name=scaling_$run${SCALING_TAG:+_$SCALING_TAG}  # SCALING_TAG= names a second set of runs (e.g. one under SCALING_ENV)
    rm -rf runs/$name  # this run's stats, not an earlier run's of the same name (version_0 would be the first one's)
    env ${SCALING_ENV:-} timeout ${MULTI_TIMEOUT:-200} python -m bertaccel fit "${args[@]}" --trainer.devices $n --trainer.strategy $strategy \
      --trainer.logger.init_args.name $name > "$OUT/$name.log" 2>&1
    echo "$run ${SCALING_ENV:-} rc=$?"; cp runs/$name/version_0/benchmark_stats.json "$OUT/${name}_stats.json" 2>/dev/null
    grep -E "test/acc|CUDA graphs off|Error|summed over the ranks" "$OUT/$name.log" | cut -c1-200 | head -4
    train_stats "$OUT/${name}_stats.json" world_size samples_per_s step_ms_p50 step_ms_mean padding_fraction gpu_step_fraction data_wait_ms_mean
  done
fi
if has grad_sync; then  # issue 12 (2+ GPUs): the graphed DDP step's gradient all-reduce, eager / graphed / NCCL floor
  timeout 300 python -m benchmarks.bench_grad_sync ${GRAD_SYNC_ARGS:-} --out "$OUT/grad_sync.json" > "$OUT/grad_sync.log" 2>&1
  echo "grad_sync rc=$?"; tail -4 "$OUT/grad_sync.log"
fi
if has fsdp_test; then  # issue 12 (nvidia-h200-x2): an FSDP fit's checkpoint tested in a new process; predict under DDP
  FS=(-c configs/imdb_minilm.yaml --data.init_args.dataset .carry/imdb --data.init_args.tokenizer .carry/minilm
      --data.init_args.val_size 500 --model.init_args.pretrained null --model.init_args.config '{}'
      --data.init_args.max_length 128 --trainer.devices 2 --trainer.strategy fsdp --trainer.logger.init_args.name fsdp_t)
  if [ -z "${FSDP_SKIP_FIT:-}" ]; then
    timeout ${MULTI_TIMEOUT:-240} python -m bertaccel fit "${FS[@]}" --trainer.limit_train_batches 30 --trainer.limit_val_batches 5 \
      > "$OUT/fsdp_fit.log" 2>&1
    echo "fsdp fit rc=$?"; grep -E "test after fit|test/acc|test/loss|Error" "$OUT/fsdp_fit.log" | cut -c1-300 | head -6
  fi
  ls -la runs/fsdp_t/checkpoints 2>&1 | tail -4
  ckpt=$(ls runs/fsdp_t/checkpoints/last.ckpt 2>/dev/null || ls -d runs/fsdp_t/checkpoints/*.ckpt | head -1)
  echo "testing $ckpt"
  timeout ${MULTI_TIMEOUT:-240} python -m bertaccel test "${FS[@]}" --trainer.limit_test_batches 10 --ckpt_path "$ckpt" \
    > "$OUT/fsdp_test.log" 2>&1
  echo "fsdp test rc=$?"; grep -vE "Warning|warn\(|^\s*$" "$OUT/fsdp_test.log" | tail -${FSDP_TAIL:-25} | cut -c1-400
  [ -z "${FSDP_SKIP_PREDICT:-}" ] && timeout ${MULTI_TIMEOUT:-240} python -m bertaccel predict -c configs/imdb_minilm.yaml --data.init_args.dataset .carry/imdb \
    --model.init_args.pretrained .carry/minilm --data.init_args.tokenizer .carry/minilm --trainer.devices 2 \
    --trainer.strategy ddp --trainer.logger.init_args.name ddp_predict > "$OUT/ddp_predict.log" 2>&1
  echo "ddp predict rc=$?"; grep -E "predictions written|Error|rows" "$OUT/ddp_predict.log" | cut -c1-300 | head -5
  f=$(ls runs/ddp_predict/version_*/predictions.jsonl 2>/dev/null | head -1)
  [ -n "$f" ] && python - "$f" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
idx = [r.get("index") for r in rows]
print(f"predict rows {len(rows)}, unique indices {len(set(idx))}, first keys {sorted(rows[0])}")
PY
fi
if has step_switches; then  # session 47's step changes (on by default since session 48): their cuda tests, then the BERT-base step with each off
  timeout ${TESTS_TIMEOUT:-400} python -u -m pytest -m cuda tests/ops/test_adamw.py tests/ops/test_layer_norm.py \
    tests/ops/test_ffn.py tests/modules/test_graphs_cuda.py -q -p no:cacheprovider -k "adamw or bwd2 or fanout" > "$OUT/step_switch_tests.log" 2>&1
  echo "step switch cuda tests rc=$?"; grep -E "^FAILED|passed|failed" "$OUT/step_switch_tests.log" | tail -6
  # and every cuda test of the row ops whose kernels session 47 changed (the forward ring's dropout draws ran only
  # the dropout / mask tests on a GPU) and of the FFN block
  timeout ${TESTS_TIMEOUT:-400} python -u -m pytest -m cuda tests/ops/test_layer_norm.py tests/ops/test_rms_norm.py \
    tests/ops/test_embeddings.py tests/ops/test_ffn.py tests/ops/test_op_library.py -q -p no:cacheprovider > "$OUT/row_op_tests.log" 2>&1
  echo "row op cuda tests rc=$?"; grep -E "^FAILED|passed|failed" "$OUT/row_op_tests.log" | tail -6
  timeout 120 python scripts/ln_bwd2_bench.py > "$OUT/ln_bwd2_bench.log" 2>&1
  echo "ln_bwd2_bench rc=$?"; grep LN_BWD2 "$OUT/ln_bwd2_bench.log"
  timeout ${E2E_TIMEOUT:-500} python -m benchmarks.e2e --models bert-base --shapes ${E2E_SHAPES:-32x512} --workloads train \
    --variants attn-fused-graphs attn-fused-graphs-adamw-pytorch attn-fused-graphs-no-fanout attn-ffn-gemm-fused-graphs \
    attn-ffn-gemm-fused-graphs-no-fanout --warmup 10 --steps 30 \
    --rounds ${E2E_ROUNDS:-2} --out "$OUT/e2e_step_switches.json" > "$OUT/e2e_step_switches.log" 2>&1
  echo "e2e step switches rc=$?"; grep -E "^bert" "$OUT/e2e_step_switches.log" | tail -5
fi
if has dropout; then  # the dropouts (session 46): exact-mask cuda tests, attention kernel sums and the LayerNorm forward sweep with p = 0.1
  timeout 200 python -u -m pytest -m cuda tests/ops/test_attention.py tests/ops/test_layer_norm.py tests/ops/test_embeddings.py \
    tests/modules/test_graphs_cuda.py tests/modules/test_unpadded.py -q -p no:cacheprovider -k "dropout or philox or keep" > "$OUT/dropout_tests.log" 2>&1
  echo "dropout cuda tests rc=$?"; grep -E "^FAILED|passed|failed" "$OUT/dropout_tests.log" | tail -5
  timeout 90 python scripts/attention_calls.py --kernels --dropout 0.1 --cell 32x512x12x64 32x512x12x32 > "$OUT/attention_dropout_kernels.log" 2>&1
  echo "attention dropout kernels rc=$?"; grep -E "\(sum\)" "$OUT/attention_dropout_kernels.log"
  timeout 90 python scripts/ln_fwd_sweep.py > "$OUT/ln_fwd_sweep.log" 2>&1
  echo "ln_fwd_sweep rc=$?"; grep 16384 "$OUT/ln_fwd_sweep.log"
fi
if has residual_dgrad; then  # issue 10: the residual gradient's add folded into the input-gradient GEMM (cuBLAS addmm), measured first
  timeout 120 python -m benchmarks.bench_residual_dgrad --out "$OUT/residual_dgrad.json" > "$OUT/residual_dgrad.log" 2>&1
  echo "residual_dgrad rc=$?"; tail -8 "$OUT/residual_dgrad.log"
fi
if has sigterm; then  # 2 GPUs (needs .carry/imdb, .carry/minilm): modules/sigterm_check.py measured
  timeout 120 python -m benchmarks.bench_sigterm_check --out "$OUT/sigterm_check.json" > "$OUT/sigterm_check.log" 2>&1
  echo "bench_sigterm_check rc=$?"; tail -1 "$OUT/sigterm_check.log"
  ST=(-c configs/imdb_minilm.yaml "${MINILM_IMDB[@]}" --data.init_args.max_length 256 -c configs/presets/recommended.yaml
      --trainer.devices 2 --trainer.strategy ddp --trainer.max_epochs 1 --test_after_fit false)
  for round in $(seq ${SIGTERM_ROUNDS:-2}); do
    for lagged in 0 1; do
      name=sigterm_lagged${lagged}_r$round
      BERTACCEL_LAGGED_SIGTERM=$lagged timeout ${MULTI_TIMEOUT:-240} python -m bertaccel fit "${ST[@]}" \
        --trainer.logger.init_args.name $name > "$OUT/$name.log" 2>&1
      echo "$name rc=$?"; cp runs/$name/version_0/benchmark_stats.json "$OUT/${name}_stats.json" 2>/dev/null
      train_stats "$OUT/${name}_stats.json" samples_per_s step_ms_p50 data_wait_ms_mean gpu_step_fraction
    done
  done
fi
if has ddp_rows; then  # nvidia-h200-x2: DDP fit (+ test after fit), then predict from its last checkpoint: every row once
  DR=(-c configs/imdb_minilm.yaml --data.init_args.dataset .carry/imdb --data.init_args.tokenizer .carry/minilm
      --model.init_args.pretrained .carry/minilm --data.init_args.val_size 500 --data.init_args.max_length 128
      --data.init_args.test_subset 1001 --trainer.devices 2 --trainer.strategy ddp
      ${DDP_ROWS_ARGS:-})  # e.g. DDP_ROWS_ARGS="-c configs/presets/recommended.yaml"
  timeout ${MULTI_TIMEOUT:-240} python -m bertaccel fit "${DR[@]}" --trainer.limit_train_batches 40 --trainer.limit_val_batches 5 \
    --trainer.logger.init_args.name ddp_rows > "$OUT/ddp_fit.log" 2>&1
  echo "ddp fit+test rc=$?"; grep -E "test/acc|test/loss|Error|worker" "$OUT/ddp_fit.log" | cut -c1-200 | head -6
  timeout ${MULTI_TIMEOUT:-240} python -m bertaccel predict "${DR[@]}" --ckpt_path runs/ddp_rows/checkpoints/last.ckpt \
    --trainer.logger.init_args.name ddp_rows_predict > "$OUT/ddp_rows_predict.log" 2>&1
  echo "ddp predict rc=$?"; grep -E "Error" "$OUT/ddp_rows_predict.log" | cut -c1-300 | head -3
  # the same checkpoint tested on 2 GPUs and on 1: the 1,001 test rows counted once each -> the same metrics
  for n in 2 1; do
    strategy=ddp; [ $n = 1 ] && strategy=auto
    timeout ${MULTI_TIMEOUT:-240} python -m bertaccel test "${DR[@]}" --trainer.devices $n --trainer.strategy $strategy \
      --ckpt_path runs/ddp_rows/checkpoints/last.ckpt --trainer.logger.init_args.name ddp_rows_test$n > "$OUT/ddp_rows_test$n.log" 2>&1
    echo "test on $n GPU(s) rc=$?: $(grep -oE "test/(acc|loss|f1)\W+[0-9.]+" "$OUT/ddp_rows_test$n.log" | tr -s ' │|' ' ' | tr '\n' ' ')"
  done
  f=$(ls runs/ddp_rows_predict/version_*/predictions.jsonl 2>/dev/null | head -1)
  [ -n "$f" ] && python - "$f" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
idx = [r["index"] for r in rows]
print(f"predict rows {len(rows)}, unique indices {len(set(idx))}, no filler written: {min(idx) >= 0}")
PY
fi
(cd "$OUT" && tar czf results.tgz --exclude results.tgz *.json *.log sweep 2>/dev/null)
if has ncu_attn; then  # Nsight Compute on the attention kernels (NCU_ATTN_CELL=32x512x12x64; NCU_ATTN_FWD="wg2 mma"; NCU_ATTN_KERNEL=attn_bwd_kernel for the backward; NCU_ATTN_IMPL=cudnn NCU_ATTN_KERNEL=bprop for cuDNN's)
  kernel=${NCU_ATTN_KERNEL:-attn_fwd}
  back=(); [[ $kernel == *bwd* ]] && back=(--backward)
  for fwd in ${NCU_ATTN_FWD:-wg2}; do
    BERTACCEL_ATTENTION_FWD=$fwd timeout ${NCU_TIMEOUT:-300} ncu --clock-control none --kernel-name regex:$kernel --launch-skip 1 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section ComputeWorkloadAnalysis --section LaunchStats \
      --section MemoryWorkloadAnalysis --section InstructionStats \
      python scripts/attention_calls.py --cell ${NCU_ATTN_CELL:-32x512x12x64} --impl ${NCU_ATTN_IMPL:-ours} "${back[@]}" > "$OUT/ncu_attn_${kernel}_$fwd.txt" 2>&1
    echo "ncu attention $kernel $fwd rc=$?"
    grep -E "attn_|Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issue Slots Busy|Executed Ipc A|Stall|No Eligible|Theoretical Occ|Block Limit|Shared Memory|Bank|Executed Instructions  " "$OUT/ncu_attn_${kernel}_$fwd.txt" | cut -c1-120 | head -${NCU_LINES:-50}
  done
fi
if has ncu_gemm; then  # Nsight Compute on our GEMM and cuBLAS's at chosen cells (NCU_GEMM_SHAPES=, NCU_GEMM_GEMMS=)
  timeout ${NCU_TIMEOUT:-300} ncu --profile-from-start off --clock-control none --section SpeedOfLight --section LaunchStats \
    --section MemoryWorkloadAnalysis --section Occupancy --metrics \
    sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_bytes.sum.per_second,lts__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,launch__cluster_dim_x,launch__cluster_dim_y \
    python scripts/gemm_calls.py --shapes ${NCU_GEMM_SHAPES:-2048x768x768 16384x768x3072} --gemms ${NCU_GEMM_GEMMS:-fwd wgrad} > "$OUT/ncu_gemm.txt" 2>&1
  echo "ncu gemm rc=$?"
  grep -E "^CALLS|^  [a-zA-Z_0-9:<>, ]+\(|Duration|gmma|lts__t_bytes|lts__throughput|sm__throughput|Registers Per|cluster_dim|Grid Size|L2 Hit|Memory Throughput" "$OUT/ncu_gemm.txt" | cut -c1-150 | head -${NCU_LINES:-160}
fi
if has ncu_gemm_stalls; then  # where our GEMM's warps wait, per SASS instruction (NCU_GEMM_SHAPES=, NCU_GEMM_GEMMS=; scripts/ncu_stalls.py)
  timeout ${NCU_TIMEOUT:-300} ncu --profile-from-start off --clock-control none --import-source no --section WarpStateStats --section SourceCounters \
    --section SpeedOfLight -o "$OUT/gemm_stalls" -f python scripts/gemm_calls.py --shapes ${NCU_GEMM_SHAPES:-16384x3072x768} \
    --gemms ${NCU_GEMM_GEMMS:-fwd} --epilogue ${NCU_GEMM_EPILOGUE:-none} > "$OUT/ncu_gemm_stalls.log" 2>&1
  echo "ncu gemm stalls rc=$?"
  ncu -i "$OUT/gemm_stalls.ncu-rep" --page details --section WarpStateStats --section SpeedOfLight > "$OUT/gemm_warp_states.txt" 2>&1
  grep -E "^  [a-zA-Z_0-9:<>, ]+\(|Duration|Stall|Warp Cycles|Issued Warp|Active Warps" "$OUT/gemm_warp_states.txt" | cut -c1-140 | head -40
  ncu -i "$OUT/gemm_stalls.ncu-rep" --page source --csv --print-source sass -k regex:gemm_kernel > "$OUT/gemm_sass.csv" 2> "$OUT/gemm_sass.err"
  rc=$?; if [ $rc -ne 0 ]; then  # older ncu: no kernel filter on import (our kernel is the report's first)
    ncu -i "$OUT/gemm_stalls.ncu-rep" --page source --csv --print-source sass > "$OUT/gemm_sass.csv" 2>> "$OUT/gemm_sass.err"; rc=$?; fi
  echo "sass csv rc=$rc ($(wc -l < "$OUT/gemm_sass.csv") lines)"; head -3 "$OUT/gemm_sass.err"
  python scripts/ncu_stalls.py "$OUT/gemm_sass.csv" --top ${NCU_TOP:-40} 2>&1 | cut -c1-200
  # cuBLAS's kernel of the same call: its samples and the code it ran (FOOTPRINT), beside ours
  ncu -i "$OUT/gemm_stalls.ncu-rep" --page source --csv --print-source sass -k regex:nvjet > "$OUT/cublas_sass.csv" 2>> "$OUT/gemm_sass.err" \
    && python scripts/ncu_stalls.py "$OUT/cublas_sass.csv" --top 5 2>&1 | grep -E "samples over|FOOTPRINT" | sed 's/^/cuBLAS /'
fi
if has ncu_gemm_states; then  # stall reasons per kernel (cycles per issued instruction), caches flushed before each kernel and not (NCU_GEMM_SHAPES=, NCU_GEMM_GEMMS=)
  for cache in all none; do
    timeout ${NCU_TIMEOUT:-300} ncu --profile-from-start off --clock-control none --cache-control $cache --section WarpStateStats \
      --metrics gpu__time_duration.sum -o "$OUT/gemm_states_$cache" -f python scripts/gemm_calls.py \
      --shapes ${NCU_GEMM_SHAPES:-2048x3072x768 2048x768x3072} --gemms ${NCU_GEMM_GEMMS:-fwd dgrad wgrad} > "$OUT/ncu_gemm_states_$cache.log" 2>&1
    echo "ncu gemm states (cache-control $cache) rc=$?"
    ncu -i "$OUT/gemm_states_$cache.ncu-rep" --page raw --csv > "$OUT/gemm_states_$cache.csv" 2>&1
    python scripts/ncu_stall_reasons.py "$OUT/gemm_states_$cache.csv" --label "$cache" --top ${NCU_TOP:-6} 2>&1 | cut -c1-260
  done
fi
if has ncu_rows; then  # hardware counters of the LayerNorm-family kernels (Nsight Compute; NCU_OPS=, NCU_SHAPES=)
  timeout ${NCU_TIMEOUT:-300} ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --metrics \
    smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_lg_throttle_per_warp_active.pct,smsp__warp_issue_stalled_barrier_per_warp_active.pct,smsp__warp_issue_stalled_short_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_wait_per_warp_active.pct,smsp__warp_issue_stalled_drain_per_warp_active.pct,smsp__warp_issue_stalled_membar_per_warp_active.pct \
    python scripts/row_op_calls.py --ops ${NCU_OPS:-layer_norm} --shapes ${NCU_SHAPES:-16384x384 16384x768 16384x1024} > "$OUT/ncu_rows.txt" 2>&1
  echo "ncu rows rc=$?"
  grep -E "^  [a-z_:]+.*\(|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Stall Long|Warp Cycles Per Issued|Duration|L2 Hit|Block Limit Reg|stalled" "$OUT/ncu_rows.txt" | cut -c1-110 | head -${NCU_LINES:-120}
fi
if has ln_sweep; then  # the LayerNorm-family forward kernels (issue 9): the default against each of LN_SWEEP_SETTINGS
  # (space-separated, each one or more A=1,B=0; default the one-row kernel, BERTACCEL_LN_RING=0), alternated for LN_SWEEP_ROUNDS
  for round in $(seq ${LN_SWEEP_ROUNDS:-1}); do for setting in "" ${LN_SWEEP_SETTINGS:-BERTACCEL_LN_RING=0}; do
    env ${setting//,/ } python scripts/ln_fwd_sweep.py; done; done > "$OUT/ln_sweep.log" 2>&1
  echo "ln sweep rc=$?"; grep SWEEP "$OUT/ln_sweep.log" | sed 's/SWEEP //' | cut -c1-150
fi
if has softmax_sweep; then  # the attention softmax forward kernel beside a clone (scripts/softmax_fwd_sweep.py), bf16 and float32
  for dt in bfloat16 float32; do python scripts/softmax_fwd_sweep.py --dtype $dt; done > "$OUT/softmax_sweep.log" 2>&1
  echo "softmax sweep rc=$?"; sed 's/SOFTMAX //' "$OUT/softmax_sweep.log" | cut -c1-150
fi
if has ln_bwd_sweep; then  # the LayerNorm-family backward against the row count: fixed cost and rate, per setting (LN_BWD_SETTINGS,
  # alternated for LN_BWD_ROUNDS rounds), then one table of every cell, a column per setting (scripts/sweep_table.py)
  for round in $(seq ${LN_BWD_ROUNDS:-1}); do for setting in "" ${LN_BWD_SETTINGS:-BERTACCEL_LN_BWD_PREFETCH=0}; do
    env ${setting//,/ } python scripts/ln_bwd_sweep.py ${LN_BWD_ARGS:-}; done; done > "$OUT/ln_bwd_sweep.log" 2>&1
  echo "ln bwd sweep rc=$?"; grep -E "^(FIT|  kernels)" "$OUT/ln_bwd_sweep.log" | cut -c1-200
  python scripts/sweep_table.py "$OUT/ln_bwd_sweep.log"
fi
if has colsum_shapes; then  # the partial-row sums' block shapes (BERTACCEL_COLSUM; built in session 80 for this sweep):
  # column_sum at its ten shapes, alternated, COLSUM_ROUNDS rounds, then the LayerNorm-family backward at 2,048 and 16,384
  # rows under each shape (one round), one table a column per shape
  shapes=${COLSUM_SHAPES:-"narrow wide 16x32 16x64 32x16 32x8 8x32"}
  for round in $(seq ${COLSUM_ROUNDS:-2}); do for sh in default $shapes; do
    if [ "$sh" = default ]; then BERTACCEL_AB=r$round python scripts/colsum_sweep.py
    else BERTACCEL_COLSUM=$sh BERTACCEL_AB=r$round python scripts/colsum_sweep.py; fi; done; done > "$OUT/colsum_shapes_sweep.log" 2>&1
  echo "colsum shapes rc=$?"; grep COLSUM "$OUT/colsum_shapes_sweep.log" | sed 's/BERTACCEL_//' | cut -c1-100
  for sh in default $shapes; do
    if [ "$sh" = default ]; then python scripts/ln_bwd_sweep.py --rows 2048 16384 --ops layer_norm rms_norm residual_layer_norm2
    else BERTACCEL_COLSUM=$sh python scripts/ln_bwd_sweep.py --rows 2048 16384 --ops layer_norm rms_norm residual_layer_norm2; fi
  done > "$OUT/colsum_shapes_ln_bwd.log" 2>&1
  echo "ln bwd under each shape rc=$?"; python scripts/sweep_table.py "$OUT/colsum_shapes_ln_bwd.log"
fi
if has norm_forms; then  # LayerNorm / RMSNorm: the saving and the output-only forward form, same inputs
  for setting in "" BERTACCEL_LN_RING=0; do env $setting python scripts/norm_forms.py; done > "$OUT/norm_forms.log" 2>&1
  echo "norm forms rc=$?"; grep FORMS "$OUT/norm_forms.log"
fi
if has e2e_eager_base; then  # eager BERT-base 16x128 train step: the swap against HF SDPA (issue 9)
  python -m benchmarks.e2e --models bert-base --shapes 16x128 --variants hf-sdpa-bf16 fused --warmup 10 --steps 30 \
    --out "$OUT/e2e_eager_base.json" > "$OUT/e2e_eager_base.log" 2>&1
  echo "e2e eager base rc=$?"; grep -E "^bert" "$OUT/e2e_eager_base.log"
fi
if has eager_overhead; then  # host time per eager call of the row ops against PyTorch's (issue 9; EAGER_ARGS=, e.g. --shapes 16x128x768)
  python scripts/eager_overhead.py ${EAGER_ARGS:-} > "$OUT/eager_overhead.log" 2>&1
  echo "eager overhead rc=$?"; grep -vi warn "$OUT/eager_overhead.log" | tail -n 60
fi
if has gelu_sweep; then  # bias+GELU forward: vectors per thread 1/2/4 against the default choice (csrc/gelu.cu fwd_unroll)
  for setting in "" BERTACCEL_GELU_UNROLL=1 BERTACCEL_GELU_UNROLL=2 BERTACCEL_GELU_UNROLL=4; do env $setting python scripts/elementwise_sweep.py; done > "$OUT/gelu_sweep.log" 2>&1
  echo "gelu sweep rc=$?"; grep GELU "$OUT/gelu_sweep.log"
fi
if has op_kernels; then  # per-kernel GPU time of the norm / GELU ops' forward and backward (scripts/op_kernels.py)
  for h in ${OPK_HIDDEN:-384 768}; do python scripts/op_kernels.py --hidden $h; done > "$OUT/op_kernels.log" 2>&1
  echo "op kernels rc=$?"; grep KERNELS "$OUT/op_kernels.log" | cut -c1-400
fi
