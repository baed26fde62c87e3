#!/usr/bin/env bash
# Same-machine A/B of versions of the package: runs COMMAND alternately with this checkout's src/ (A) and
# other src/ trees (B, C, ... in the order given, comma-separated) first on PYTHONPATH, ROUNDS times each
# (A B C A B C ...), so that every version's kernels are timed on the same GPU in one call (METHOD: compare
# versions in one run). Each version builds its own extensions (the build cache is keyed by the sources'
# hash); `--build attention|ops|all` builds every tree's first, in parallel (a build is mostly nvcc on
# its own cores), logs in $AB_LOG_DIR (default .) as build_<tree>.log, and stops if one fails. @TAG@ in
# COMMAND becomes A1, B1, ..., A2, ... (e.g. an output file name); every run's output is prefixed with
# "== <tag> (<src>)". pytest puts the project's `pythonpath` (pyproject: src, .) ahead of PYTHONPATH: to
# test tree B, run pytest with `-o pythonpath="OTHER_SRC ."` instead.
#
#   git archive pending/some-branch src | tar -x -C .carry/ab_b     # B: another commit's src/
#   bash scripts/ab_runs.sh --build attention .carry/ab_b/src,.carry/ab_c/src 2 -- \
#     python scripts/attention_calls.py --kernels --cell 32x512x12x64
set -euo pipefail
usage() { echo "usage: $0 [--build attention|ops|all] OTHER_SRC[,OTHER_SRC...] ROUNDS -- COMMAND..." >&2; exit 2; }
build=""
if [ "${1:-}" = "--build" ]; then
  case "${2:-}" in attention|ops|all) build=$2 ;; *) usage ;; esac
  shift 2
fi
if [ $# -lt 4 ] || [ "$3" != "--" ]; then usage; fi
here="$(cd "$(dirname "$0")/.." && pwd)"
IFS=, read -r -a others <<< "$1"
srcs=("$here/src")
for o in "${others[@]}"; do srcs+=("$(cd "$o" && pwd)"); done
names=(A B C D E F G H)
[ ${#srcs[@]} -le ${#names[@]} ] || { echo "at most $(( ${#names[@]} - 1 )) other trees" >&2; exit 2; }
rounds=$2
shift 3
if [ -n "$build" ]; then
  case $build in
    attention) what="assert build.load_attention(verbose=True), build.attention_reason()" ;;
    ops) what="assert build.load(verbose=True), build.unavailable_reason()" ;;
    all) what="assert build.load(verbose=True), build.unavailable_reason(); assert build.load_attention(verbose=True), build.attention_reason()" ;;
  esac
  log_dir=${AB_LOG_DIR:-.}
  mkdir -p "$log_dir"
  pids=()
  for i in "${!srcs[@]}"; do
    PYTHONPATH="${srcs[$i]}:$here${PYTHONPATH:+:$PYTHONPATH}" python -c "from bertaccel.ops import build; $what" \
      > "$log_dir/build_${names[$i]}.log" 2>&1 &
    pids+=($!)
  done
  failed=0
  for i in "${!pids[@]}"; do
    if wait "${pids[$i]}"; then echo "built ${names[$i]} (${srcs[$i]})"; else echo "build ${names[$i]} failed: $log_dir/build_${names[$i]}.log" >&2; failed=1; fi
  done
  [ $failed = 0 ] || exit 1
fi
for ((r = 1; r <= rounds; r++)); do
  for i in "${!srcs[@]}"; do
    tag="${names[$i]}$r"
    echo "== $tag (${srcs[$i]})"
    cmd=("${@//@TAG@/$tag}")
    PYTHONPATH="${srcs[$i]}:$here${PYTHONPATH:+:$PYTHONPATH}" BERTACCEL_AB="$tag" "${cmd[@]}"
  done
done
