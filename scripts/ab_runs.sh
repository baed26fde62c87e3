#!/usr/bin/env bash
# Same-machine A/B of two versions of the package: runs COMMAND alternately with this checkout's src/ (A)
# and another src/ tree (B) first on PYTHONPATH, ROUNDS times each (A B A B ...), so that both versions'
# kernels are timed on the same GPU in one call (METHOD: compare versions in one run). Each version builds
# its own extensions (the build cache is keyed by the sources' hash). @TAG@ in COMMAND becomes A1, B1,
# A2, ... (e.g. an output file name); every run's output is prefixed with "== <tag> (<src>)".
# pytest puts the project's `pythonpath` (pyproject: src, .) ahead of PYTHONPATH: to test tree B, run
# pytest with `-o pythonpath="OTHER_SRC ."` instead.
#
#   git archive pending/some-branch src | tar -x -C .carry/ab_b     # B: another commit's src/
#   bash scripts/ab_runs.sh .carry/ab_b/src 2 -- python -m benchmarks.bench_attention --no-variants --out $OUT/att_@TAG@.json
set -euo pipefail
if [ $# -lt 4 ] || [ "$3" != "--" ]; then
  echo "usage: $0 OTHER_SRC ROUNDS -- COMMAND..." >&2
  exit 2
fi
other=$(cd "$1" && pwd)
rounds=$2
shift 3
here="$(cd "$(dirname "$0")/.." && pwd)"
for ((i = 1; i <= rounds; i++)); do
  for side in A B; do
    if [ $side = A ]; then src="$here/src"; else src="$other"; fi
    tag="$side$i"
    echo "== $tag ($src)"
    cmd=("${@//@TAG@/$tag}")
    PYTHONPATH="$src:$here${PYTHONPATH:+:$PYTHONPATH}" BERTACCEL_AB="$tag" "${cmd[@]}"
  done
done
